//! `tokenlease chart --bands`: statements per 1,000 requests and p99 latency against the
//! per-key request rate, from the JSON lines of `scripts/loadtest-sweep.sh bands`.
//!
//! Each line is a `tokenlease loadtest --json` report with `band_per_key_rate` added (the
//! requests/s per key that the sweep aimed at); lines without it are not band rows and are
//! skipped. Two panels share a log x axis of that rate, one line per mode (direct, leased):
//!
//! - statements per 1,000 requests (`db_calls_per_1k`, log scale);
//! - p99 latency of a request (`p99_us`, log scale).
//!
//! A run that did not keep up is drawn as a hollow marker, and its counts follow its value in
//! the first panel: one with fallback decisions, or with more than 1% of its scheduled requests
//! not sent or still in flight at the end. A handful unsent is the schedule's edge, not a limiter
//! falling behind: a slot due in the last millisecond wakes after the end and is counted unsent
//! (2 of 6,000 in each run of a 3 s sweep at 2,000 requests/s), so it is not marked.
//! A value of 0 is drawn on the axis floor; a missing or null value leaves its point out.

use std::collections::BTreeMap;
use std::error::Error;
use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::Deserialize;

use super::{BOUND, DIRECT, LEASED, label};

/// The fields of a band report that the chart reads; the others are ignored.
#[derive(Debug, Clone, Deserialize)]
pub(super) struct BandRun {
    /// Added by the sweep; a report without it is not a band row.
    #[serde(default)]
    band_per_key_rate: Option<f64>,
    mode: String,
    keys: u32,
    instances: usize,
    tasks: usize,
    capacity: u64,
    refill_per_second: f64,
    duration_s: f64,
    /// `--rate`, requests/s in total; absent in reports from before it was added.
    #[serde(default)]
    rate_per_s: Option<f64>,
    /// `null` when the run had no request (serde_json writes a non-finite number as `null`).
    #[serde(default)]
    db_calls_per_1k: Option<f64>,
    #[serde(default)]
    p99_us: Option<f64>,
    #[serde(default)]
    fallback_decisions: u64,
    /// Requests sent.
    #[serde(default)]
    requests: u64,
    #[serde(default)]
    unsent: u64,
    #[serde(default)]
    in_flight_at_end: u64,
}

/// One run, placed on the x axis by its band.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct BandPoint {
    band: f64,
    per_1k: Option<f64>,
    p99_us: Option<f64>,
    fallback: u64,
    /// Requests due by the schedule: sent and not sent.
    scheduled: u64,
    unsent: u64,
    in_flight: u64,
}

impl BandPoint {
    /// Whether the run kept up: no fallback decision, and at most 1% of the scheduled requests
    /// unsent or unanswered at the end.
    pub(super) fn kept_up(&self) -> bool {
        self.fallback == 0 && (self.unsent + self.in_flight) * 100 <= self.scheduled
    }

    /// Why the run did not keep up, for its label: `" · 40 fallback · 1.2k unsent"`; empty when
    /// it did.
    fn trouble(&self) -> String {
        if self.kept_up() {
            return String::new();
        }
        [
            (self.fallback, "fallback"),
            (self.unsent, "unsent"),
            (self.in_flight, "in flight"),
        ]
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, what)| format!(" · {} {what}", count(*n)))
        .collect()
    }
}

/// What the band chart draws: each mode's runs sorted by band, one per band.
#[derive(Debug)]
pub(super) struct BandChart {
    pub(super) direct: Vec<BandPoint>,
    pub(super) leased: Vec<BandPoint>,
    subtitle: String,
}

/// Keeps the band rows of `runs` (numbered lines of `path`), the last run of each band and mode.
pub(super) fn select(path: &Path, runs: &[(usize, BandRun)]) -> Result<BandChart, String> {
    let mut modes: [BTreeMap<u64, BandPoint>; 2] = Default::default();
    let mut first = None;
    let mut keys = (u32::MAX, 0);
    for (line, run) in runs {
        let Some(band) = run.band_per_key_rate else {
            continue;
        };
        if !(band.is_finite() && band > 0.0) {
            return Err(format!(
                "{}:{line}: band_per_key_rate {band} is not a positive number of requests/s",
                path.display()
            ));
        }
        let slot = match run.mode.as_str() {
            "direct" => 0,
            "leased" => 1,
            other => {
                return Err(format!(
                    "{}:{line}: mode `{other}` is neither `direct` nor `leased`",
                    path.display()
                ));
            }
        };
        let usable = |v: Option<f64>| v.filter(|v| v.is_finite() && *v >= 0.0);
        // Positive finite floats order as their bits do; a later run of a band replaces it.
        modes[slot].insert(
            band.to_bits(),
            BandPoint {
                band,
                per_1k: usable(run.db_calls_per_1k),
                p99_us: usable(run.p99_us),
                fallback: run.fallback_decisions,
                scheduled: run.requests + run.unsent,
                unsent: run.unsent,
                in_flight: run.in_flight_at_end,
            },
        );
        first.get_or_insert(run);
        keys = (keys.0.min(run.keys), keys.1.max(run.keys));
    }
    let Some(first) = first else {
        return Err(format!(
            "{}: no band rows (loadtest reports with `band_per_key_rate`, as \
             `scripts/loadtest-sweep.sh bands` writes to target/loadtest/bands.jsonl)",
            path.display()
        ));
    };
    let rate = first
        .rate_per_s
        .map(|r| format!("{} requests/s in total · ", label(r)))
        .unwrap_or_default();
    let keys = match keys {
        (1, 1) => "one key".to_string(),
        (lo, hi) if lo == hi => format!("{lo} keys"),
        (lo, hi) => format!("{lo} to {hi} keys"),
    };
    let subtitle = format!(
        "{} instances × {} tasks · {rate}{keys} · capacity {}, refill {}/s · {:.0} s per run",
        first.instances, first.tasks, first.capacity, first.refill_per_second, first.duration_s
    );
    let [direct, leased]: [Vec<BandPoint>; 2] = modes.map(|m| m.into_values().collect());
    Ok(BandChart {
        direct,
        leased,
        subtitle,
    })
}

/// A count for a label: `950`, `12k`, `1.2M`.
fn count(n: u64) -> String {
    match n {
        0..10_000 => n.to_string(),
        10_000..10_000_000 => format!("{}k", label(n as f64 / 1e3)),
        _ => format!("{}M", label(n as f64 / 1e6)),
    }
}

/// A latency in microseconds for an axis or a point: `850 µs`, `2.5 ms`, `1.2 s`.
fn micros(v: f64) -> String {
    if v >= 1e6 {
        format!("{} s", label(v / 1e6))
    } else if v >= 1e3 {
        format!("{} ms", label(v / 1e3))
    } else {
        format!("{} µs", label(v))
    }
}

/// A log range of whole decades holding every positive value with room for a label above and
/// below; 0.1..10 if there is none.
fn decades(values: impl Iterator<Item = f64>) -> std::ops::Range<f64> {
    let (lo, hi) = values
        .filter(|v| *v > 0.0)
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if lo.is_finite() {
        let lo = 10f64.powf((lo / 2.0).log10().floor());
        let hi = 10f64.powf((hi * 1.5).log10().ceil());
        lo..hi.max(lo * 10.0)
    } else {
        0.1..10.0
    }
}

/// Draws the band chart on `root`, which the caller presents.
pub(super) fn draw(
    chart: &BandChart,
    root: &DrawingArea<BitMapBackend<'_>, Shift>,
) -> Result<(), Box<dyn Error>> {
    root.fill(&WHITE)?;
    let root = root.titled(
        "Cost and latency by per-key request rate: direct and leased mode",
        ("sans-serif", 28),
    )?;
    let (subtitle, body) = root.split_vertically(30);
    subtitle.draw(&Text::new(
        chart.subtitle.as_str(),
        (60, 4),
        ("sans-serif", 17).into_font().color(&BOUND),
    ))?;
    let bands = chart.direct.iter().chain(&chart.leased).map(|p| p.band);
    let mut bands: Vec<f64> = bands.collect();
    bands.sort_by(f64::total_cmp);
    bands.dedup();
    // Room on each side for a centred label of the first and last band.
    let x_range = bands[0] / 3.0..bands[bands.len() - 1] * 3.0;
    let panels = body.split_evenly((2, 1));
    let per_1k = Panel {
        caption: "Statements per 1,000 requests (log scale)",
        y_desc: "statements / 1,000 requests",
        value: |p| p.per_1k,
        text: |p| format!("{}{}", label(p.per_1k.unwrap_or(0.0)), p.trouble()),
        y_label: |v| label(*v),
        legend: true,
    };
    let p99 = Panel {
        caption: "p99 latency of a request (log scale)",
        y_desc: "p99 latency",
        value: |p| p.p99_us,
        text: |p| micros(p.p99_us.unwrap_or(0.0)),
        y_label: |v| micros(*v),
        legend: false,
    };
    draw_panel(chart, &panels[0], (x_range.clone(), &bands), &per_1k)?;
    draw_panel(chart, &panels[1], (x_range, &bands), &p99)?;
    Ok(())
}

/// One panel: which value it draws and how it writes it.
struct Panel {
    caption: &'static str,
    y_desc: &'static str,
    value: fn(&BandPoint) -> Option<f64>,
    text: fn(&BandPoint) -> String,
    y_label: fn(&f64) -> String,
    legend: bool,
}

fn draw_panel(
    chart: &BandChart,
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
    (x_range, bands): (std::ops::Range<f64>, &[f64]),
    panel: &Panel,
) -> Result<(), Box<dyn Error>> {
    let all = chart.direct.iter().chain(&chart.leased);
    let y_range = decades(all.filter_map(panel.value));
    let floor = y_range.start;
    let mut ctx = ChartBuilder::on(area)
        .caption(panel.caption, ("sans-serif", 20))
        .margin(12)
        .margin_right(30)
        .x_label_area_size(50)
        .y_label_area_size(90)
        .build_cartesian_2d(
            x_range.log_scale().with_key_points(bands.to_vec()),
            y_range.log_scale(),
        )?;
    ctx.configure_mesh()
        .x_desc("requests/s per key, band_per_key_rate (log scale)")
        .y_desc(panel.y_desc)
        .x_label_formatter(&|v| label(*v))
        .y_label_formatter(&panel.y_label)
        .light_line_style(RGBColor(238, 238, 238))
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 16))
        .draw()?;
    for (points, other, colour, name) in [
        (&chart.direct, &chart.leased, DIRECT, "direct mode"),
        (&chart.leased, &chart.direct, LEASED, "leased mode"),
    ] {
        let drawn: Vec<(&BandPoint, (f64, f64))> = points
            .iter()
            .filter_map(|p| (panel.value)(p).map(|v| (p, (p.band, v.max(floor)))))
            .collect();
        ctx.draw_series(LineSeries::new(
            drawn.iter().map(|(_, at)| *at),
            colour.stroke_width(2),
        ))?
        .label(name)
        .legend(move |(x, y)| {
            EmptyElement::at((x + 12, y))
                + PathElement::new([(-12, 0), (12, 0)], colour.stroke_width(2))
                + Circle::new((0, 0), 5, colour.filled())
        });
        ctx.draw_series(drawn.iter().map(|&(p, at)| {
            // The higher of the two modes at a band writes its value above, the other below;
            // a value on the floor writes it above.
            let below = at.1 > floor
                && other
                    .iter()
                    .find(|o| o.band == p.band)
                    .and_then(panel.value)
                    .is_some_and(|o| o > at.1);
            let (dy, v) = if below {
                (10, VPos::Top)
            } else {
                (-10, VPos::Bottom)
            };
            let style = ("sans-serif", 14)
                .into_font()
                .color(&colour)
                .pos(Pos::new(HPos::Center, v));
            let marker = if p.kept_up() {
                Circle::new((0, 0), 5, colour.filled())
            } else {
                Circle::new((0, 0), 6, colour.stroke_width(2))
            };
            EmptyElement::at(at) + marker + Text::new((panel.text)(p), (0, dy), style)
        }))?;
    }
    if panel.legend {
        ctx.draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())?
            .label(
                "hollow: did not keep up (fallback decisions, or over 1% of the requests unsent)",
            )
            .legend(|(x, y)| Circle::new((x + 12, y), 6, BOUND.stroke_width(2)));
        ctx.configure_series_labels()
            .position(SeriesLabelPosition::LowerLeft)
            .label_font(("sans-serif", 15))
            .background_style(WHITE.mix(0.9))
            .border_style(BOUND)
            .draw()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(band: Option<f64>, mode: &str, per_1k: Option<f64>, fallback: u64) -> (usize, BandRun) {
        let run = BandRun {
            band_per_key_rate: band,
            mode: mode.into(),
            keys: band.map_or(1, |b| (2000.0 / b) as u32),
            instances: 2,
            tasks: 16,
            capacity: 100,
            refill_per_second: 50.0,
            duration_s: 3.0,
            rate_per_s: Some(2000.0),
            db_calls_per_1k: per_1k,
            p99_us: Some(if mode == "direct" { 4000.0 } else { 1500.0 }),
            fallback_decisions: fallback,
            requests: 6000,
            unsent: 0,
            in_flight_at_end: 0,
        };
        (1, run)
    }

    fn numbered(runs: Vec<(usize, BandRun)>) -> Vec<(usize, BandRun)> {
        runs.into_iter()
            .enumerate()
            .map(|(i, (_, r))| (i + 1, r))
            .collect()
    }

    #[test]
    fn keeps_band_rows_sorted_the_last_run_of_a_band_winning() {
        let runs = numbered(vec![
            run(Some(10.0), "leased", Some(20.0), 0),
            run(None, "leased", Some(1.0), 0),
            run(Some(1.0), "leased", Some(900.0), 0),
            run(Some(1.0), "direct", Some(1000.0), 0),
            run(Some(10.0), "leased", Some(25.0), 7),
        ]);
        let chart = select(Path::new("b.jsonl"), &runs).unwrap();
        let leased: Vec<(f64, Option<f64>, u64)> = chart
            .leased
            .iter()
            .map(|p| (p.band, p.per_1k, p.fallback))
            .collect();
        assert_eq!(leased, [(1.0, Some(900.0), 0), (10.0, Some(25.0), 7)]);
        assert_eq!(chart.direct.len(), 1);
        assert!(
            chart
                .subtitle
                .contains("2000 requests/s in total · 200 to 2000 keys"),
            "{}",
            chart.subtitle
        );
    }

    #[test]
    fn bad_bands_and_modes_name_the_line() {
        let runs = numbered(vec![
            run(Some(1.0), "direct", Some(1.0), 0),
            run(Some(0.0), "direct", Some(1.0), 0),
        ]);
        let err = select(Path::new("b.jsonl"), &runs).unwrap_err();
        assert!(err.starts_with("b.jsonl:2: band_per_key_rate 0"), "{err}");
        let runs = numbered(vec![run(Some(1.0), "strict", Some(1.0), 0)]);
        let err = select(Path::new("b.jsonl"), &runs).unwrap_err();
        assert!(err.starts_with("b.jsonl:1: mode `strict`"), "{err}");
        let err = select(Path::new("b.jsonl"), &[run(None, "direct", None, 0)]).unwrap_err();
        assert!(err.starts_with("b.jsonl: no band rows"), "{err}");
    }

    #[test]
    fn labels_name_what_went_wrong() {
        let (_, r) = run(Some(1.0), "leased", Some(1.0), 40);
        let chart = select(
            Path::new("b"),
            &[(
                1,
                BandRun {
                    unsent: 12_345,
                    ..r
                },
            )],
        )
        .unwrap();
        assert_eq!(chart.leased[0].trouble(), " · 40 fallback · 12.3k unsent");
        assert!(!chart.leased[0].kept_up());
        // Of 6,000 scheduled requests (sent + unsent), 60 unsent is 1%: still keeping up, and
        // the label says nothing; 61, or 59 and 2 in flight, is falling behind.
        let (_, r) = run(Some(1.0), "leased", Some(1.0), 0);
        let point = |unsent: u64, in_flight_at_end: u64| {
            let r = BandRun {
                requests: 6000 - unsent,
                unsent,
                in_flight_at_end,
                ..r.clone()
            };
            select(Path::new("b"), &[(1, r)]).unwrap().leased.remove(0)
        };
        assert!(point(60, 0).kept_up());
        assert_eq!(point(60, 0).trouble(), "");
        assert!(!point(61, 0).kept_up());
        assert_eq!(point(59, 2).trouble(), " · 59 unsent · 2 in flight");
        assert_eq!(micros(850.0), "850 µs");
        assert_eq!(micros(2500.0), "2.5 ms");
        assert_eq!(micros(1.2e6), "1.2 s");
        assert_eq!(decades([0.0, 3.0, 40.0].into_iter()), 1.0..100.0);
        assert_eq!(decades([1.5, 40.0].into_iter()), 0.1..100.0);
        assert_eq!(decades([0.0].into_iter()), 0.1..10.0);
    }

    /// Pixels of `colour` in rows `rows` of an RGB buffer `width` pixels wide.
    fn pixels(buf: &[u8], width: usize, rows: std::ops::Range<usize>, colour: RGBColor) -> usize {
        buf[rows.start * width * 3..rows.end * width * 3]
            .chunks_exact(3)
            .filter(|p| *p == [colour.0, colour.1, colour.2])
            .count()
    }

    #[test]
    fn both_panels_draw_both_modes() {
        super::super::load_font(Path::new(super::super::DEFAULT_FONT)).unwrap();
        let runs = numbered(vec![
            run(Some(0.1), "direct", Some(1000.0), 0),
            run(Some(0.1), "leased", Some(2000.0), 12),
            run(Some(10.0), "direct", Some(0.0), 0),
            run(Some(10.0), "leased", None, 0),
            run(Some(100.0), "direct", Some(300.0), 0),
            run(Some(100.0), "leased", Some(5.0), 0),
        ]);
        let chart = select(Path::new("b.jsonl"), &runs).unwrap();
        let (w, h) = (800usize, 600usize);
        let mut buf = vec![0u8; w * h * 3];
        {
            let root =
                BitMapBackend::with_buffer(&mut buf, (w as u32, h as u32)).into_drawing_area();
            draw(&chart, &root).unwrap();
            root.present().unwrap();
        }
        // Title and subtitle take the top 70 rows or so; the panels split the rest.
        let middle = 70 + (h - 70) / 2;
        for (rows, panel) in [(70..middle, "statements"), (middle..h, "p99")] {
            for (colour, mode) in [(DIRECT, "direct"), (LEASED, "leased")] {
                let n = pixels(&buf, w, rows.clone(), colour);
                assert!(n > 100, "{panel} panel: {n} pixels of the {mode} colour");
            }
        }
        let white = pixels(&buf, w, 0..h, WHITE);
        assert!(
            white < w * h * 98 / 100,
            "nearly blank: {white} white pixels"
        );
    }
}
