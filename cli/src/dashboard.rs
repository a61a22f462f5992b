//! The demo's live dashboard: `GET /dashboard` and the data it polls, `GET /dashboard/data`.
//!
//! The page (`dashboard.html`, built into the binary) is one self-contained file: inline CSS
//! and JS, nothing fetched from anywhere but the demo itself (its content security policy
//! says so to the browser). It asks `/dashboard/data` for the demo's metrics about once a
//! second and draws them: decision rates per route and layer, database statements and the
//! statements leases saved, lease tokens outstanding, the fallback, the outage debt.
//!
//! `/dashboard/data` renders the same Prometheus handle as `/metrics` and answers its
//! `tokenlease_` samples as JSON, stamped with the demo's own clock:
//!
//! ```json
//! {"t": 12.503, "samples": [{"name": "tokenlease_http_denied_total",
//!   "labels": {"layer": "entity", "method": "GET", "route": "/bookings/{bookingId}"}, "value": 41}]}
//! ```
//!
//! Why JSON from the demo rather than `/metrics` parsed in the browser: the page computes each
//! rate as a counter's change between two polls divided by the time between them, and `t` is
//! that time as the demo measured it, not as the browser's timers happened to fire (a
//! background tab's timers are throttled; a headless browser's clock can be virtual). With
//! `?after=T` (the `t` of the previous answer) the demo answers no sooner than one second after
//! `T`, so the page paces itself by the demo's clock and simply asks again after each answer.
//! The page's script stays small: no parser for the text format in it.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::extract::Query;
use axum::http::header;
use axum::response::IntoResponse;
use tokio::time::Instant;

/// The page, built in.
const PAGE: &str = include_str!("dashboard.html");

/// The time between two answers to one page.
const PERIOD: Duration = Duration::from_secs(1);

/// What the page may load and where it may connect: only inline script and style of its own
/// and the demo it came from.
const POLICY: &str = "default-src 'none'; script-src 'unsafe-inline'; \
                      style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:";

/// `GET /dashboard`: the page.
pub(crate) async fn page() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
            (header::CONTENT_SECURITY_POLICY, POLICY),
        ],
        PAGE,
    )
}

/// The query of `GET /dashboard/data`.
#[derive(Debug, serde::Deserialize)]
pub(crate) struct DataQuery {
    /// The `t` of the page's previous answer: this one comes no sooner than [`PERIOD`] later.
    after: Option<f64>,
}

/// `GET /dashboard/data`: the `tokenlease_` samples of `prometheus` as JSON, with the seconds
/// since `started`; with `after`, no sooner than one [`PERIOD`] after it (and never more than
/// one period from now).
pub(crate) async fn data(
    prometheus: super::series::Handle,
    started: Instant,
    Query(query): Query<DataQuery>,
) -> impl IntoResponse {
    if let Some(after) = query.after {
        let now = started.elapsed().as_secs_f64();
        let wait = after + PERIOD.as_secs_f64() - now;
        if wait.is_finite() && wait > 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(wait.min(PERIOD.as_secs_f64()))).await;
        }
    }
    let t = started.elapsed().as_secs_f64();
    let samples = parse(&prometheus.render());
    (
        [(header::CACHE_CONTROL, "no-store")],
        axum::Json(serde_json::json!({ "t": t, "samples": samples })),
    )
}

/// One sample of the Prometheus text format.
#[derive(Debug, PartialEq, serde::Serialize)]
struct Sample {
    /// The series name (with `_sum`, `_count` for a summary's parts).
    name: String,
    /// Its labels.
    labels: BTreeMap<String, String>,
    /// Its value; `None` (JSON `null`) for NaN and the infinities, which JSON cannot hold.
    value: Option<f64>,
}

/// The `tokenlease_` samples of `text` (the exporter's rendering); lines it cannot read are
/// left out.
fn parse(text: &str) -> Vec<Sample> {
    text.lines()
        .filter_map(parse_line)
        .filter(|s| s.name.starts_with("tokenlease_"))
        .collect()
}

/// One line: `name{label="value",...} number`; `None` for comments, blank and unreadable lines.
fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let end = line.find(['{', ' ', '\t'])?;
    let (name, mut rest) = line.split_at(end);
    if name.is_empty() {
        return None;
    }
    let mut labels = BTreeMap::new();
    if let Some(inside) = rest.strip_prefix('{') {
        let (parsed, after) = parse_labels(inside)?;
        labels = parsed;
        rest = after;
    }
    // The value, then an optional timestamp, which the page does not need.
    let number: f64 = rest.split_whitespace().next()?.parse().ok()?;
    Some(Sample {
        name: name.to_owned(),
        labels,
        value: number.is_finite().then_some(number),
    })
}

/// The labels after a `{`, up to and including its `}`; and what follows it.
fn parse_labels(mut s: &str) -> Option<(BTreeMap<String, String>, &str)> {
    let mut labels = BTreeMap::new();
    loop {
        s = s.trim_start_matches([' ', ',']);
        if let Some(rest) = s.strip_prefix('}') {
            return Some((labels, rest));
        }
        let (key, rest) = s.split_once('=')?;
        let rest = rest.strip_prefix('"')?;
        // The value: up to the first quote that is not escaped.
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let close = loop {
            match chars.next()? {
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                (i, '"') => break i,
                (_, c) => value.push(c),
            }
        };
        labels.insert(key.trim().to_owned(), value);
        s = &rest[close + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn reads_the_exporters_lines() {
        let text = "\
# TYPE tokenlease_http_denied_total counter
tokenlease_http_denied_total{layer=\"entity\",method=\"GET\",route=\"/bookings/{bookingId}\"} 41
tokenlease_db_calls_saved_total 1280

tokenlease_lease_refill_seconds{quantile=\"0.99\"} 0.0021
tokenlease_lease_refill_seconds_sum 0.5
tokenlease_lease_outstanding_tokens 12.5 1700000000000
tokenlease_circuit_state{store=\"a \\\"q\\\" \\\\ b\"} NaN
process_cpu_seconds_total 3
";
        let got = parse(text);
        assert_eq!(
            got[0],
            Sample {
                name: "tokenlease_http_denied_total".into(),
                labels: labels(&[
                    ("layer", "entity"),
                    ("method", "GET"),
                    ("route", "/bookings/{bookingId}")
                ]),
                value: Some(41.0),
            }
        );
        assert_eq!(got[1].name, "tokenlease_db_calls_saved_total");
        assert_eq!(got[1].value, Some(1280.0));
        assert!(got[1].labels.is_empty());
        assert_eq!(got[2].labels, labels(&[("quantile", "0.99")]));
        assert_eq!(got[3].value, Some(0.5));
        assert_eq!(got[4].value, Some(12.5), "a timestamp after the value");
        assert_eq!(got[5].labels, labels(&[("store", "a \"q\" \\ b")]));
        assert_eq!(got[5].value, None, "NaN has no JSON number");
        assert_eq!(got.len(), 6, "only tokenlease_ series: {got:?}");
    }

    #[test]
    fn unreadable_lines_are_left_out_without_a_panic() {
        for line in [
            "tokenlease_x",
            "tokenlease_x{",
            "tokenlease_x{a=\"b} 1",
            "tokenlease_x{a=b} 1",
            "tokenlease_x{a=\"b\\",
            "tokenlease_x{a=\"b\"} one",
            "tokenlease_x{a=\"é\"} ",
            "{} 1",
            "\u{0}",
        ] {
            assert_eq!(parse_line(line), None, "{line:?}");
        }
        assert_eq!(
            parse_line("tokenlease_x{a=\"é\",} +Inf").map(|s| (s.labels, s.value)),
            Some((labels(&[("a", "é")]), None))
        );
    }
}
