//! `tokenlease chart` end to end: the built binary turns the sweep's JSON lines into a PNG.
//!
//! The fixture is a real `DURATION=2 bash scripts/loadtest-sweep.sh` run. The chart's text needs
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
