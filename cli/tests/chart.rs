//! `tokenlease chart` end to end: the built binary turns the sweep's JSON lines into a PNG.
//!
//! The lease-size fixture is a real `DURATION=2 bash scripts/loadtest-sweep.sh` run. The band
//! fixture (`bands.jsonl`) is written by hand in the format of `scripts/loadtest-sweep.sh bands`
//! (loadtest reports with `band_per_key_rate`): bands 0.1 to 100 requests/s per key at 2,000
//! requests/s, direct and leased, a leased run with fallback decisions and a direct one with
//! unsent requests. The chart's text needs
//! DejaVu Sans (Debian package `fonts-dejavu-core`); without it the command fails, and so does
//! this test, with the command's message.

use std::path::Path;
use std::process::Command;

const PNG_MAGIC: &[u8] = b"\x89PNG\r\n\x1a\n";

fn fixture() -> &'static Path {
    Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/loadtest/results.jsonl"
    ))
}

fn bands_fixture() -> &'static Path {
    Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/loadtest/bands.jsonl"
    ))
}

/// Width and height from a PNG's header (the IHDR chunk comes first).
fn png_size(png: &[u8]) -> (u32, u32) {
    assert!(png.starts_with(PNG_MAGIC), "not a PNG");
    assert_eq!(&png[12..16], b"IHDR", "no IHDR chunk first");
    let be = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap());
    (be(16), be(20))
}

/// Runs `tokenlease chart --bands INPUT --output DIR/bands.png EXTRA…`.
fn chart_bands(input: &Path, dir: &Path, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tokenlease"))
        .arg("chart")
        .arg("--bands")
        .arg(input)
        .arg("--output")
        .arg(dir.join("bands.png"))
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn draws_a_png_from_the_sweep_results() {
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("chart.png");
    let run = Command::new(env!("CARGO_BIN_EXE_tokenlease"))
        .arg("chart")
        .arg("--input")
        .arg(fixture())
        .arg("--output")
        .arg(&output)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "tokenlease chart failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let png = std::fs::read(&output).unwrap();
    assert!(png.starts_with(PNG_MAGIC), "not a PNG");
    // A 1200 × 1000 chart with text and lines compresses to tens of kilobytes, never a few bytes.
    assert!(
        png.len() > 10_000,
        "suspiciously small PNG: {} bytes",
        png.len()
    );
}

#[test]
fn a_missing_font_names_the_package() {
    let dir = tempfile::tempdir().unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_tokenlease"))
        .arg("chart")
        .arg("--input")
        .arg(fixture())
        .arg("--output")
        .arg(dir.path().join("chart.png"))
        .arg("--font")
        .arg(dir.path().join("no-such-font.ttf"))
        .output()
        .unwrap();
    assert!(!run.status.success());
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("fonts-dejavu-core"), "{stderr}");
    assert!(!dir.path().join("chart.png").exists());
}

#[test]
fn input_without_a_leased_hot_key_run_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("results.jsonl");
    let direct: String = std::fs::read_to_string(fixture())
        .unwrap()
        .lines()
        .filter(|l| !l.contains(r#""mode":"leased""#))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&input, direct).unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_tokenlease"))
        .args(["chart", "--input"])
        .arg(&input)
        .arg("--output")
        .arg(dir.path().join("chart.png"))
        .output()
        .unwrap();
    assert!(!run.status.success());
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("no hot-key leased run"), "{stderr}");
}

#[test]
fn draws_the_band_chart() {
    let dir = tempfile::tempdir().unwrap();
    let run = chart_bands(
        bands_fixture(),
        dir.path(),
        &["--width", "1000", "--height", "800"],
    );
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "tokenlease chart --bands failed: {stderr}"
    );
    assert!(
        stderr.contains("5 direct and 5 leased band runs, 2 of them hollow"),
        "{stderr}"
    );
    let png = std::fs::read(dir.path().join("bands.png")).unwrap();
    assert_eq!(png_size(&png), (1000, 800));
    // Two panels of text, lines and markers compress to tens of kilobytes; a blank image of
    // this size is well under 10 kB.
    assert!(
        png.len() > 20_000,
        "suspiciously small PNG: {} bytes",
        png.len()
    );
}

#[test]
fn the_lease_sweep_results_are_not_band_rows() {
    let dir = tempfile::tempdir().unwrap();
    let run = chart_bands(fixture(), dir.path(), &[]);
    assert!(!run.status.success());
    let stderr = String::from_utf8_lossy(&run.stderr);
    let expected = format!("{}: no band rows", fixture().display());
    assert!(stderr.contains(&expected), "{stderr}");
    assert!(!dir.path().join("bands.png").exists());
}

#[test]
fn a_malformed_band_line_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("bands.jsonl");
    let good = std::fs::read_to_string(bands_fixture()).unwrap();
    let first = good.lines().next().unwrap();
    std::fs::write(&input, format!("{first}\n\n{{\"mode\":\"leased\",\n")).unwrap();
    let run = chart_bands(&input, dir.path(), &[]);
    assert!(!run.status.success());
    let stderr = String::from_utf8_lossy(&run.stderr);
    let expected = format!(
        "{}:3: not a `tokenlease loadtest --json` report",
        input.display()
    );
    assert!(stderr.contains(&expected), "{stderr}");
    assert!(!dir.path().join("bands.png").exists());

    // A line that parses but has a band the log axis cannot place is named too.
    let zero = first.replace(r#""band_per_key_rate":0.1"#, r#""band_per_key_rate":0"#);
    assert_ne!(zero, first);
    std::fs::write(&input, format!("{first}\n{zero}\n")).unwrap();
    let run = chart_bands(&input, dir.path(), &[]);
    assert!(!run.status.success());
    let stderr = String::from_utf8_lossy(&run.stderr);
    let expected = format!(
        "{}:2: band_per_key_rate 0 is not a positive",
        input.display()
    );
    assert!(stderr.contains(&expected), "{stderr}");
}

#[test]
fn odd_band_values_still_draw() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("bands.jsonl");
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(bands_fixture())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut odd = String::new();
    for (i, mut row) in rows.into_iter().enumerate() {
        let row = row.as_object_mut().unwrap();
        match i {
            // No statement at all, and no latency: a run with no request.
            0 => {
                row.insert("db_calls_per_1k".into(), 0.into());
                row.insert("p99_us".into(), serde_json::Value::Null);
            }
            // A p99 left out of the report, and one of 0.
            1 => drop(row.remove("p99_us")),
            2 => drop(row.insert("p99_us".into(), 0.into())),
            _ => {}
        }
        odd.push_str(&serde_json::to_string(row).unwrap());
        odd.push('\n');
    }
    // A lone band with only a leased run, every value zero or missing.
    odd.push_str(
        r#"{"band_per_key_rate":1000,"mode":"leased","keys":2,"instances":2,"tasks":16,"capacity":100,"refill_per_second":50.0,"duration_s":0.0}"#,
    );
    odd.push('\n');
    std::fs::write(&input, odd).unwrap();
    let run = chart_bands(&input, dir.path(), &[]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "tokenlease chart --bands failed: {stderr}"
    );
    assert!(
        stderr.contains("5 direct and 6 leased band runs"),
        "{stderr}"
    );
    let png = std::fs::read(dir.path().join("bands.png")).unwrap();
    assert_eq!(png_size(&png), (1200, 1000));

    // Every value zero or missing: still a chart, of empty axes.
    let line = r#"{"band_per_key_rate":3,"mode":"direct","keys":1,"instances":1,"tasks":1,"capacity":1,"refill_per_second":1.0,"duration_s":1.0,"db_calls_per_1k":0}"#;
    std::fs::write(&input, format!("{line}\n")).unwrap();
    let run = chart_bands(&input, dir.path(), &[]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "tokenlease chart --bands failed: {stderr}"
    );
}

#[test]
fn input_and_bands_are_one_or_the_other() {
    let dir = tempfile::tempdir().unwrap();
    let run = chart_bands(
        bands_fixture(),
        dir.path(),
        &["--input", fixture().to_str().unwrap()],
    );
    assert!(!run.status.success());
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("cannot be used with"), "{stderr}");
    let run = Command::new(env!("CARGO_BIN_EXE_tokenlease"))
        .args(["chart", "--output"])
        .arg(dir.path().join("chart.png"))
        .output()
        .unwrap();
    assert!(!run.status.success());
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        stderr.contains("--input") && stderr.contains("--bands"),
        "{stderr}"
    );
}
