//! `tokenlease chart`: README's chart of database calls and overshoot against lease size.
//!
//! Reads the JSON lines that `scripts/loadtest-sweep.sh` collects (one `tokenlease loadtest
//! --json` report per line), keeps the hot-key runs (`keys == 1`), and draws two panels against
//! the largest lease (`lease_fraction × capacity`, in tokens):
//!
//! - database calls per 1,000 requests of the leased runs (log scale), with the direct-mode run
//!   as a horizontal reference line;
//! - the measured `overshoot_tokens` of the leased runs, with `overshoot_bound` (docs/design/leases.md)
//!   dashed.
//!
//! With `--bands FILE` instead of `--input`, it draws the chart of `scripts/loadtest-sweep.sh
//! bands` instead: statements per 1,000 requests and p99 latency against the per-key request
//! rate (module `bands`).
//!
//! Text needs a font: plotters is built without system font lookup, so the chart loads DejaVu
//! Sans (Debian package `fonts-dejavu-core`) from disk at run time, or the file `--font` names.

use std::error::Error;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};
use serde::Deserialize;
use serde::de::DeserializeOwned;

mod bands;

/// Where Debian's `fonts-dejavu-core` installs DejaVu Sans.
const DEFAULT_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Arguments of `tokenlease chart`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["input", "bands"])))]
pub(crate) struct Args {
    /// JSON lines, one `tokenlease loadtest --json` report per line (the sweep writes
    /// `target/loadtest/results.jsonl`): draws the lease-size chart.
    #[arg(long)]
    input: Option<PathBuf>,
    /// Instead of --input: the JSON lines of `scripts/loadtest-sweep.sh bands`
    /// (`target/loadtest/bands.jsonl`): draws cost and p99 latency against the per-key rate.
    #[arg(long)]
    bands: Option<PathBuf>,
    /// The PNG file to write.
    #[arg(long)]
    output: PathBuf,
    /// The TrueType font for the text (DejaVu Sans, Debian package fonts-dejavu-core).
    #[arg(long, default_value = DEFAULT_FONT)]
    font: PathBuf,
    /// Width of the image in pixels.
    #[arg(long, default_value_t = 1200)]
    width: u32,
    /// Height of the image in pixels.
    #[arg(long, default_value_t = 1000)]
    height: u32,
}

/// The fields of a loadtest report that the chart reads; the others are ignored.
#[derive(Debug, Clone, Deserialize)]
struct Run {
    mode: String,
    instances: usize,
    tasks: usize,
    keys: u32,
    capacity: u64,
    refill_per_second: f64,
    lease_fraction: Option<f64>,
    duration_s: f64,
    db_calls_per_1k: f64,
    overshoot_tokens: f64,
    overshoot_bound: f64,
    /// `steady` or `lull-burst`; absent in reports from before `--pattern`.
    #[serde(default)]
    pattern: Option<String>,
    /// `relaxed` or `strict` in leased mode; absent before `--accounting`.
    #[serde(default)]
    accounting: Option<String>,
}

/// One leased hot-key run, placed on the x axis by its largest lease.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Point {
    lease_tokens: f64,
    db_calls_per_1k: f64,
    overshoot: f64,
    bound: f64,
}

/// What the chart draws.
#[derive(Debug)]
struct Chart {
    leased: Vec<Point>,
    direct_per_1k: Option<f64>,
    subtitle: String,
}

/// Runs the subcommand.
pub(crate) fn run(args: Args) -> super::CmdResult {
    let is_png = args
        .output
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("png"));
    if !is_png {
        return Err(format!("--output {} must end in .png", args.output.display()).into());
    }
    if args.width < 400 || args.height < 400 {
        return Err("--width and --height must be at least 400 pixels".into());
    }
    if let Some(path) = &args.bands {
        let runs = read_lines(path)?;
        let chart = bands::select(path, &runs)?;
        load_font(&args.font)?;
        create_parent(&args.output)?;
        let root = BitMapBackend::new(&args.output, (args.width, args.height)).into_drawing_area();
        bands::draw(&chart, &root)?;
        root.present()?;
        let marked = chart.direct.iter().chain(&chart.leased);
        eprintln!(
            "wrote {} ({} direct and {} leased band runs, {} of them hollow: did not keep up)",
            args.output.display(),
            chart.direct.len(),
            chart.leased.len(),
            marked.filter(|p| !p.kept_up()).count()
        );
        return Ok(ExitCode::SUCCESS);
    }
    let Some(input) = args.input.as_deref() else {
        return Err("give --input FILE or --bands FILE".into());
    };
    let runs: Vec<Run> = read_lines(input)?.into_iter().map(|(_, r)| r).collect();
    let chart = select(&runs).map_err(|e| format!("{}: {e}", input.display()))?;
    load_font(&args.font)?;
    create_parent(&args.output)?;
    draw(&chart, &args.output, (args.width, args.height))?;
    eprintln!(
        "wrote {} ({} leased hot-key runs{})",
        args.output.display(),
        chart.leased.len(),
        if chart.direct_per_1k.is_some() {
            ", 1 direct"
        } else {
            ", no direct run"
        }
    );
    Ok(ExitCode::SUCCESS)
}

/// Creates the directory that will hold `output`, if it names one.
fn create_parent(output: &Path) -> std::io::Result<()> {
    match output.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(dir) => std::fs::create_dir_all(dir),
        None => Ok(()),
    }
}

/// Parses every non-empty line as a report, with its line number (from 1), naming the line of
/// the first that is not one.
fn read_lines<T: DeserializeOwned>(path: &Path) -> Result<Vec<(usize, T)>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut runs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let run: T = serde_json::from_str(line).map_err(|e| {
            format!(
                "{}:{}: not a `tokenlease loadtest --json` report: {e}",
                path.display(),
                i + 1
            )
        })?;
        runs.push((i + 1, run));
    }
    Ok(runs)
}

/// Keeps the steady hot-key runs: the relaxed leased ones sorted by lease size, and the last
/// direct one. Strict and lull-burst runs answer other questions (README's table has them).
fn select(runs: &[Run]) -> Result<Chart, String> {
    let hot = || {
        runs.iter()
            .filter(|r| r.keys == 1 && r.pattern.as_deref().is_none_or(|p| p == "steady"))
    };
    let mut leased: Vec<Point> = hot()
        .filter(|r| r.mode == "leased" && r.accounting.as_deref().is_none_or(|a| a == "relaxed"))
        .filter_map(|r| {
            r.lease_fraction.map(|f| Point {
                lease_tokens: f * r.capacity as f64,
                db_calls_per_1k: r.db_calls_per_1k,
                overshoot: r.overshoot_tokens,
                bound: r.overshoot_bound,
            })
        })
        .filter(|p| {
            [p.lease_tokens, p.db_calls_per_1k, p.overshoot, p.bound]
                .iter()
                .all(|v| v.is_finite())
        })
        .collect();
    if leased.is_empty() {
        return Err("no hot-key leased run (keys 1, mode leased) to chart".into());
    }
    leased.sort_by(|a, b| a.lease_tokens.total_cmp(&b.lease_tokens));
    let direct_per_1k = hot()
        .filter(|r| r.mode == "direct" && r.db_calls_per_1k.is_finite())
        .map(|r| r.db_calls_per_1k)
        .next_back();
    let first = hot().find(|r| r.mode == "leased").expect("a leased run");
    let subtitle = format!(
        "one hot key · {} instances × {} tasks · capacity {}, refill {}/s · {:.0} s per run",
        first.instances, first.tasks, first.capacity, first.refill_per_second, first.duration_s
    );
    Ok(Chart {
        leased,
        direct_per_1k,
        subtitle,
    })
}

/// Reads the font file and registers it as plotters' `sans-serif`, the family every label uses.
fn load_font(path: &Path) -> Result<(), String> {
    let bytes = std::fs::read(path).map_err(|e| {
        format!(
            "cannot read the chart's font {}: {e}; install DejaVu Sans (Debian/Ubuntu: \
             `apt-get install fonts-dejavu-core`) or pass --font FILE.ttf",
            path.display()
        )
    })?;
    // plotters keeps registered fonts for the life of the process, by `'static` reference.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| format!("{} is not a TrueType or OpenType font", path.display()))
}

/// A number for a label: three significant digits at most, no trailing zeros.
fn label(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return "0".into();
    }
    let decimals = (2 - v.abs().log10().floor() as i32).clamp(0, 4) as usize;
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

const LEASED: RGBColor = RGBColor(31, 119, 180);
const DIRECT: RGBColor = RGBColor(214, 39, 40);
const BOUND: RGBColor = RGBColor(90, 90, 90);

fn draw(chart: &Chart, output: &Path, size: (u32, u32)) -> Result<(), Box<dyn Error>> {
    let root = BitMapBackend::new(output, size).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(
        "Database calls and overshoot against lease size",
        ("sans-serif", 28),
    )?;
    let (subtitle, body) = root.split_vertically(30);
    subtitle.draw(&Text::new(
        chart.subtitle.as_str(),
        (60, 4),
        ("sans-serif", 17).into_font().color(&BOUND),
    ))?;
    let panels = body.split_evenly((2, 1));
    let max_lease = chart.leased.last().map_or(1.0, |p| p.lease_tokens);
    let x_range = 0.0..max_lease * 1.15;
    draw_calls(chart, &panels[0], x_range.clone())?;
    draw_overshoot(chart, &panels[1], x_range)?;
    root.present()?;
    Ok(())
}

/// The style of a point's value, drawn above it and shifted left so the last one fits.
fn point_text() -> TextStyle<'static> {
    ("sans-serif", 14).into_font().color(&LEASED)
}

/// Where a point's value is drawn, in pixels from the point.
const TEXT_AT: (i32, i32) = (-30, -24);

fn draw_calls(
    chart: &Chart,
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
    x_range: std::ops::Range<f64>,
) -> Result<(), Box<dyn Error>> {
    let values = chart
        .leased
        .iter()
        .map(|p| p.db_calls_per_1k)
        .chain(chart.direct_per_1k)
        .filter(|v| *v > 0.0);
    let (lo, hi) = values.fold((f64::INFINITY, 0.0f64), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    let (lo, hi) = if lo.is_finite() {
        (
            10f64.powf(lo.log10().floor()),
            10f64.powf((hi * 1.5).log10().ceil()),
        )
    } else {
        (0.1, 10.0)
    };
    let mut ctx = ChartBuilder::on(area)
        .caption(
            "Database calls per 1,000 requests (log scale)",
            ("sans-serif", 20),
        )
        .margin(12)
        .margin_right(30)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(x_range.clone(), (lo..hi).log_scale())?;
    ctx.configure_mesh()
        .x_desc("largest lease: lease_fraction × capacity (tokens)")
        .y_desc("db calls / 1,000 requests")
        .x_label_formatter(&|v| label(*v))
        .y_label_formatter(&|v| label(*v))
        .light_line_style(RGBColor(238, 238, 238))
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 16))
        .draw()?;
    if let Some(direct) = chart.direct_per_1k {
        ctx.draw_series(LineSeries::new(
            [(x_range.start, direct), (x_range.end, direct)],
            DIRECT.stroke_width(2),
        ))?
        .label(format!("direct mode: {} per 1,000", label(direct)))
        .legend(|(x, y)| PathElement::new([(x, y), (x + 24, y)], DIRECT.stroke_width(2)));
    }
    let points: Vec<(f64, f64)> = chart
        .leased
        .iter()
        .map(|p| (p.lease_tokens, p.db_calls_per_1k.max(lo)))
        .collect();
    ctx.draw_series(LineSeries::new(points.clone(), LEASED.stroke_width(2)))?
        .label("leased mode")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 24, y)], LEASED.stroke_width(2)));
    ctx.draw_series(chart.leased.iter().zip(&points).map(|(p, &at)| {
        let mut text = label(p.db_calls_per_1k);
        if let Some(direct) = chart.direct_per_1k.filter(|_| p.db_calls_per_1k > 0.0) {
            text = format!("{text} ({}× fewer)", label(direct / p.db_calls_per_1k));
        }
        EmptyElement::at(at)
            + Circle::new((0, 0), 5, LEASED.filled())
            + Text::new(text, TEXT_AT, point_text())
    }))?;
    ctx.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.9))
        .border_style(BOUND)
        .draw()?;
    Ok(())
}

fn draw_overshoot(
    chart: &Chart,
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
    x_range: std::ops::Range<f64>,
) -> Result<(), Box<dyn Error>> {
    let top = chart
        .leased
        .iter()
        .flat_map(|p| [p.overshoot, p.bound])
        .fold(0.0f64, f64::max);
    let top = if top > 0.0 { top * 1.2 } else { 1.0 };
    let mut ctx = ChartBuilder::on(area)
        .caption(
            "Overshoot: worst window's admissions over capacity + refill × window",
            ("sans-serif", 20),
        )
        .margin(12)
        .margin_right(30)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(x_range, 0.0..top)?;
    ctx.configure_mesh()
        .x_desc("largest lease: lease_fraction × capacity (tokens)")
        .y_desc("tokens")
        .x_label_formatter(&|v| label(*v))
        .y_label_formatter(&|v| label(*v))
        .light_line_style(RGBColor(238, 238, 238))
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 16))
        .draw()?;
    let bound: Vec<(f64, f64)> = chart
        .leased
        .iter()
        .map(|p| (p.lease_tokens, p.bound))
        .collect();
    ctx.draw_series(DashedLineSeries::new(
        bound.clone(),
        10,
        6,
        BOUND.stroke_width(2),
    ))?
    .label("overshoot_bound: instances × lease (docs/design/leases.md)")
    .legend(|(x, y)| DashedPathElement::new([(x, y), (x + 24, y)], 6, 4, BOUND.stroke_width(2)));
    ctx.draw_series(
        bound
            .iter()
            .map(|&p| Cross::new(p, 5, BOUND.stroke_width(2))),
    )?;
    let measured: Vec<(f64, f64)> = chart
        .leased
        .iter()
        .map(|p| (p.lease_tokens, p.overshoot))
        .collect();
    ctx.draw_series(LineSeries::new(measured.clone(), LEASED.stroke_width(2)))?
        .label("overshoot_tokens (measured)")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 24, y)], LEASED.stroke_width(2)));
    ctx.draw_series(chart.leased.iter().zip(&measured).map(|(p, &at)| {
        let text = format!("{} of {}", label(p.overshoot), label(p.bound));
        EmptyElement::at(at)
            + Circle::new((0, 0), 5, LEASED.filled())
            + Text::new(text, TEXT_AT, point_text())
    }))?;
    ctx.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.9))
        .border_style(BOUND)
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(mode: &str, keys: u32, fraction: Option<f64>, per_1k: f64) -> Run {
        Run {
            mode: mode.into(),
            instances: 2,
            tasks: 16,
            keys,
            capacity: 100,
            refill_per_second: 50.0,
            lease_fraction: fraction,
            duration_s: 2.0,
            db_calls_per_1k: per_1k,
            overshoot_tokens: 1.0,
            overshoot_bound: fraction.map_or(1.0, |f| 2.0 * f * 100.0),
            pattern: None,
            accounting: None,
        }
    }

    #[test]
    fn leaves_out_strict_and_lull_burst_runs() {
        let strict = Run {
            accounting: Some("strict".into()),
            ..run("leased", 1, Some(0.1), 0.6)
        };
        let lull = Run {
            pattern: Some("lull-burst".into()),
            ..run("leased", 1, Some(0.1), 3.8)
        };
        let lull_direct = Run {
            pattern: Some("lull-burst".into()),
            ..run("direct", 1, None, 120.0)
        };
        let runs = [
            run("direct", 1, None, 40.0),
            run("leased", 1, Some(0.1), 0.7),
            strict,
            lull,
            lull_direct,
        ];
        let chart = select(&runs).expect("chart");
        assert_eq!(chart.leased.len(), 1);
        assert_eq!(chart.leased[0].db_calls_per_1k, 0.7);
        assert_eq!(chart.direct_per_1k, Some(40.0));
    }

    #[test]
    fn keeps_hot_key_runs_sorted_by_lease_size() {
        let runs = [
            run("direct", 1, None, 40.0),
            run("leased", 1, Some(0.2), 0.5),
            run("leased", 1, Some(0.05), 2.0),
            run("leased", 10_000, Some(0.1), 9.0),
            run("direct", 10_000, None, 90.0),
        ];
        let chart = select(&runs).unwrap();
        let sizes: Vec<f64> = chart.leased.iter().map(|p| p.lease_tokens).collect();
        assert_eq!(sizes, [5.0, 20.0]);
        assert_eq!(chart.direct_per_1k, Some(40.0));
        assert_eq!(chart.leased[1].bound, 40.0);
    }

    #[test]
    fn no_leased_hot_key_run_is_an_error() {
        let runs = [run("direct", 1, None, 40.0)];
        assert!(select(&runs).unwrap_err().contains("no hot-key leased run"));
    }

    #[test]
    fn labels_are_short() {
        assert_eq!(label(0.30000000000000004), "0.3");
        assert_eq!(label(4.7251), "4.73");
        assert_eq!(label(1000.0), "1000");
        assert_eq!(label(0.0125), "0.0125");
        assert_eq!(label(0.0), "0");
    }
}
