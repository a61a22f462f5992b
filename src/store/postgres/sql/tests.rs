//! Unit tests of the statement files' forms and placeholders; the tests of the statements the
//! store sends from them are in `statement_tests.rs`.

use super::{Form, SqlFile};

/// B15: the forms. A file sent as one line loses its line breaks and indentation but the one
/// after a comment line; placeholders are filled once, a value is not searched for more.
#[test]
fn a_file_becomes_its_statement() {
    const FILE: SqlFile<2> = SqlFile::new(
        "x.sql",
        "-- head\nSELECT a\n    FROM {t}\n\n    WHERE x = '{}' AND {u} = 1\n",
        ["t", "u"],
        Form::OneLine,
    );
    assert_eq!(
        FILE.render(["{u}", "b"]),
        "-- head\nSELECT a FROM {u} WHERE x = '{}' AND b = 1"
    );
    assert_eq!(
        FILE.render_escaped(["%1$s", "c"], |s| s.replace('a', "A")),
        "-- heAd\nSELECT A FROM %1$s WHERE x = '{}' AND c = 1"
    );
    const WRITTEN: SqlFile<0> = SqlFile::new("y.sql", "SELECT 1\n  FROM t\n", [], Form::AsWritten);
    assert_eq!(WRITTEN.render([]), "SELECT 1\n  FROM t\n");
}
