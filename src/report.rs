//! Text about errors and connection strings that is safe to print: a connection string with
//! its password hidden, and an error with every cause. Used by the library's own messages;
//! public as [`crate::error::redact`] and [`crate::error::chain`] (the `tokenlease` binary's
//! messages use them too).

use std::error::Error;

/// The most characters of a connection string or address quoted in a message.
const MAX_QUOTED: usize = 200;

/// `conn` with any password replaced by `***`, cut to `MAX_QUOTED` characters (plus a note of
/// the full length): safe to print.
///
/// Both forms libpq accepts are handled: a URL (`postgres://user:secret@host/db`, and a
/// `password=` query parameter) and `key=value` pairs (`password=secret`, quoted or not).
pub fn redact(conn: &str) -> String {
    let hidden = if conn.contains("://") {
        redact_url(conn)
    } else {
        redact_pairs(conn)
    };
    let count = hidden.chars().count();
    if count <= MAX_QUOTED {
        hidden
    } else {
        let cut: String = hidden.chars().take(MAX_QUOTED).collect();
        format!("{cut}… ({count} characters)")
    }
}

fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    // The authority ends at the first '/', '?' or '#'; its user info at its last '@'.
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let authority = match authority.rsplit_once('@') {
        Some((user_info, hosts)) => match user_info.split_once(':') {
            Some((user, _password)) => format!("{user}:***@{hosts}"),
            None => authority.to_owned(),
        },
        None => authority.to_owned(),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => tail.to_owned(),
    };
    format!("{scheme}://{authority}{tail}")
}

fn redact_pairs(conn: &str) -> String {
    let mut out = String::with_capacity(conn.len());
    let mut rest = conn;
    while let Some(at) = find_password_key(rest) {
        out.push_str(&rest[..at]);
        let after_key = &rest[at..];
        let eq = after_key.find('=').map_or(after_key.len(), |e| e + 1);
        out.push_str(&after_key[..eq]);
        out.push_str("***");
        let value = after_key[eq..].trim_start();
        // A quoted value runs to the closing quote (backslash escapes), a bare one to a space.
        let skip = if let Some(quoted) = value.strip_prefix('\'') {
            let mut escaped = false;
            let close = quoted
                .char_indices()
                .find(|&(_, c)| {
                    let end = c == '\'' && !escaped;
                    escaped = c == '\\' && !escaped;
                    end
                })
                .map_or(quoted.len(), |(i, _)| i + 1);
            1 + close
        } else {
            value.find(char::is_whitespace).unwrap_or(value.len())
        };
        rest = &value[skip..];
    }
    out.push_str(rest);
    out
}

/// Where a `password` key (followed by optional spaces and `=`) starts in `s`, at a word start.
fn find_password_key(s: &str) -> Option<usize> {
    let lower = s.to_ascii_lowercase();
    let mut from = 0;
    while let Some(i) = lower[from..].find("password") {
        let at = from + i;
        let word_start = at == 0 || lower.as_bytes()[at - 1].is_ascii_whitespace();
        let after = lower[at + "password".len()..].trim_start();
        if word_start && after.starts_with('=') {
            return Some(at);
        }
        from = at + 1;
    }
    None
}

/// `err` and each of its causes, `: `-separated, skipping a cause whose text its parent already
/// shows (some errors repeat their source in their own message).
pub fn chain(err: &(dyn Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let part = cause.to_string();
        if !part.is_empty() && !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use std::fmt;

    use super::*;

    #[test]
    fn passwords_are_hidden() {
        assert_eq!(
            redact("postgres://app:s3cret@db:5432/app?sslmode=disable"),
            "postgres://app:***@db:5432/app?sslmode=disable"
        );
        assert_eq!(
            redact("postgresql://app@db/app?password=s3cret&x=1"),
            "postgresql://app@db/app?password=***&x=1"
        );
        assert_eq!(
            redact("postgres://postgres@127.0.0.1:5432/postgres"),
            "postgres://postgres@127.0.0.1:5432/postgres"
        );
        assert_eq!(
            redact("host=db user=app password=s3cret dbname=app"),
            "host=db user=app password=*** dbname=app"
        );
        assert_eq!(
            redact("host=db password = 'a b\\' c' dbname=app"),
            "host=db password =*** dbname=app"
        );
        assert!(!redact("postgres://a:p@ss@h/d").contains("p@ss"));
        let long = format!("host={}", "h".repeat(500));
        assert!(redact(&long).ends_with("(505 characters)"));
    }

    #[test]
    fn chains_keep_every_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl fmt::Display for Outer {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("connection failed")
            }
        }
        impl Error for Outer {
            fn source(&self) -> Option<&(dyn Error + 'static)> {
                Some(&self.0)
            }
        }
        assert_eq!(chain(&Outer(io)), "connection failed: refused");
    }
}
