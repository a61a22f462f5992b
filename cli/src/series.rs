//! The demo's metrics recorder: the Prometheus exporter's (`metrics-exporter-prometheus`), but
//! for the series labelled by `plan` or `route`, which it keeps itself so that it can forget
//! those of the plans and routes a reload removed.
//!
//! The `metrics` facade cannot unregister a series, and the exporter forgets a series only by
//! its idle timeout, which would also forget the quiet series of plans in force whose handles
//! the library keeps (their later counts would go to a handle no render reads). The library
//! instead lets go of its handles to the series of a plan or route once a reload has removed it
//! (docs/metrics.md), so a series of these labels that only this recorder still holds belongs to
//! a plan or route no longer in force: [`Handle::forget_unheld`] drops them, and the demo calls
//! it after each reload it applies (`reload.rs`). Every other series, and every histogram, is
//! the exporter's; `/metrics` renders the exporter's text, then these series in the same format.

use std::collections::HashMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, SharedString, Unit};
use metrics_exporter_prometheus::formatting::{
    sanitize_label_key, sanitize_label_value, write_help_line, write_type_line,
};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};

/// The labels whose series this recorder keeps itself.
const OWN_LABELS: [&str; 2] = ["plan", "route"];

/// Installs the demo's recorder as the process's: the exporter's with its default settings
/// (summaries for histograms), and the series of plans and routes kept here.
pub(crate) fn install() -> Result<Handle, metrics::SetRecorderError<Recorder>> {
    let prometheus = PrometheusBuilder::new().build_recorder();
    let own = Arc::new(Own::default());
    let handle = Handle {
        prometheus: prometheus.handle(),
        own: Arc::clone(&own),
    };
    metrics::set_global_recorder(Recorder { prometheus, own })?;
    Ok(handle)
}

/// The recorder [`install`] installs.
#[derive(Debug)]
pub(crate) struct Recorder {
    prometheus: PrometheusRecorder,
    own: Arc<Own>,
}

/// The series of plans and routes: each one's value, which the library's handles share.
#[derive(Debug, Default)]
struct Own {
    counters: Mutex<HashMap<Key, Arc<AtomicU64>>>,
    /// A gauge's `f64`, as its bits (how `metrics` implements a gauge on an `AtomicU64`).
    gauges: Mutex<HashMap<Key, Arc<AtomicU64>>>,
    /// Help texts, by name.
    described: Mutex<HashMap<String, SharedString>>,
}

/// `mutex`, locked (a panic elsewhere while it was held left nothing half done: each use is one
/// map operation).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What `/metrics` and the dashboard render, and what forgets the series of removed plans.
#[derive(Clone, Debug)]
pub(crate) struct Handle {
    prometheus: PrometheusHandle,
    own: Arc<Own>,
}

fn own(key: &Key) -> bool {
    key.labels().any(|l| OWN_LABELS.contains(&l.key()))
}

impl Recorder {
    fn describe(&self, key: &KeyName, description: &SharedString) {
        lock(&self.own.described).insert(key.as_str().to_owned(), description.clone());
    }
}

impl metrics::Recorder for Recorder {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.describe(&key, &description);
        self.prometheus.describe_counter(key, unit, description);
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.describe(&key, &description);
        self.prometheus.describe_gauge(key, unit, description);
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.prometheus.describe_histogram(key, unit, description);
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        if !own(key) {
            return self.prometheus.register_counter(key, metadata);
        }
        let mut counters = lock(&self.own.counters);
        Counter::from_arc(Arc::clone(counters.entry(key.clone()).or_default()))
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        if !own(key) {
            return self.prometheus.register_gauge(key, metadata);
        }
        let mut gauges = lock(&self.own.gauges);
        Gauge::from_arc(Arc::clone(gauges.entry(key.clone()).or_default()))
    }

    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        self.prometheus.register_histogram(key, metadata)
    }
}

impl Handle {
    /// The exporter's text, then the series of plans and routes, in the Prometheus text format.
    pub(crate) fn render(&self) -> String {
        let mut out = self.prometheus.render();
        let described = lock(&self.own.described).clone();
        let counters = snapshot(&self.own.counters, |v| v.to_string());
        let gauges = snapshot(&self.own.gauges, |v| f64::from_bits(v).to_string());
        for (kind, families) in [("counter", counters), ("gauge", gauges)] {
            for (name, lines) in families {
                // As the exporter by default: no unit suffix on the name.
                if let Some(help) = described.get(&name) {
                    write_help_line(&mut out, &name, None, None, help);
                }
                write_type_line(&mut out, &name, None, None, kind);
                for (labels, value) in lines {
                    let _ = writeln!(out, "{name}{labels} {value}");
                }
                out.push('\n');
            }
        }
        out
    }

    /// Forgets every series of a plan or a route that nothing but this recorder holds a handle
    /// to any more: the library has let go of it, its plan or route being no longer in force.
    /// Returns how many it forgot.
    pub(crate) fn forget_unheld(&self) -> usize {
        let mut forgot = 0;
        for map in [&self.own.counters, &self.own.gauges] {
            let mut map = lock(map);
            let before = map.len();
            map.retain(|_, value| Arc::strong_count(value) > 1);
            forgot += before - map.len();
            map.shrink_to_fit();
        }
        forgot
    }
}

/// The series of `map` by name, sorted, each as its label text and its value.
fn snapshot(
    map: &Mutex<HashMap<Key, Arc<AtomicU64>>>,
    value: impl Fn(u64) -> String,
) -> Vec<(String, Vec<(String, String)>)> {
    let mut by_name: HashMap<String, Vec<(String, String)>> = HashMap::new();
    for (key, atomic) in lock(map).iter() {
        let mut labels = String::new();
        for (i, label) in key.labels().enumerate() {
            labels.push(if i == 0 { '{' } else { ',' });
            let _ = write!(
                labels,
                "{}=\"{}\"",
                sanitize_label_key(label.key()),
                sanitize_label_value(label.value())
            );
        }
        if !labels.is_empty() {
            labels.push('}');
        }
        by_name
            .entry(key.name().to_owned())
            .or_default()
            .push((labels, value(atomic.load(Ordering::Acquire))));
    }
    let mut families: Vec<_> = by_name.into_iter().collect();
    families.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    for (_, lines) in &mut families {
        lines.sort_unstable();
    }
    families
}

#[cfg(test)]
mod tests {
    use metrics::Recorder as _;

    use super::*;

    fn recorder() -> (Recorder, Handle) {
        let prometheus = PrometheusBuilder::new().build_recorder();
        let own = Arc::new(Own::default());
        let handle = Handle {
            prometheus: prometheus.handle(),
            own: Arc::clone(&own),
        };
        (Recorder { prometheus, own }, handle)
    }

    /// A series of a plan is rendered while a handle holds it, with its help text, and
    /// forgotten once none does; a series without a plan or route label is the exporter's and
    /// stays.
    #[test]
    fn series_of_plans_nobody_holds_are_forgotten() {
        let (recorder, handle) = recorder();
        let meta = metrics::Metadata::new("test", metrics::Level::INFO, None);
        recorder.describe_counter("t_total".into(), None, "help \"text\"".into());
        let held = recorder.register_counter(
            &Key::from_parts("t_total", vec![metrics::Label::new("plan", "a\"b")]),
            &meta,
        );
        held.increment(3);
        let gone = recorder.register_gauge(
            &Key::from_parts("g", vec![metrics::Label::new("route", "/x")]),
            &meta,
        );
        gone.increment(1.5);
        recorder
            .register_counter(&Key::from_name("other_total"), &meta)
            .increment(2);
        let text = handle.render();
        assert!(text.contains("# HELP t_total help \"text\""), "{text}");
        assert!(text.contains("# TYPE t_total counter"), "{text}");
        assert!(text.contains("t_total{plan=\"a\\\"b\"} 3"), "{text}");
        assert!(text.contains("g{route=\"/x\"} 1.5"), "{text}");
        assert!(text.contains("other_total 2"), "{text}");
        drop(gone);
        assert_eq!(handle.forget_unheld(), 1);
        let text = handle.render();
        assert!(!text.contains("g{"), "{text}");
        assert!(text.contains("t_total{plan=\"a\\\"b\"} 3"), "{text}");
        assert!(text.contains("other_total 2"), "{text}");
    }
}
