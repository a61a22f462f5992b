//! A part's load, and the adaptive limit on its statements in flight chosen from it.

use std::time::Duration;

use tokio::time::Instant;

use super::{Coalescer, Part, TARGET_BATCH};

/// The load a part's adaptive limit is chosen from: moving averages (about 8 samples) of its
/// callers' arrival rate and of its statements' time, both measured as its statements finish.
#[derive(Default)]
pub(super) struct Load {
    /// When the part's last statement finished, and its `arrivals` then.
    pub(super) last: Option<(Instant, u64)>,
    /// Callers per second.
    pub(super) rate: f64,
    /// A statement's time, in seconds.
    pub(super) statement: f64,
}

impl Load {
    /// The callers that arrive while one statement runs (λ·S).
    pub(super) fn per_statement(&self) -> f64 {
        self.rate * self.statement
    }
}

impl Coalescer {
    /// The part's adaptive limit after a statement that took `took` finished at `now`.
    ///
    /// Callers arriving at rate λ while each statement takes S leave λ·S callers for the next
    /// statements; with L statements in flight each carries about λ·S / L of them. So
    /// L = λ·S / [`TARGET_BATCH`] (at least 1) makes every statement carry about
    /// [`TARGET_BATCH`] keys when that many callers wait, which is where the server's cost per
    /// decision levels off; a lone caller finds a slot free and its statement leaves at once.
    /// Measured per part: a part sees only its own keys' callers, and the limit of a store of
    /// two parts taken as a whole would give each part half the keys a statement should carry.
    pub(super) fn adapt(part: &mut Part, took: Duration, now: Instant) {
        let smooth = |old: f64, sample: f64| {
            if old == 0.0 {
                sample
            } else {
                old + (sample - old) / 8.0
            }
        };
        let load = &mut part.load;
        load.statement = smooth(load.statement, took.as_secs_f64());
        if let Some((at, before)) = load.last {
            let dt = now.saturating_duration_since(at).as_secs_f64();
            if dt > 0.0 {
                let arrived = part.arrivals.wrapping_sub(before) as f64;
                load.rate = smooth(load.rate, arrived / dt);
            }
        }
        load.last = Some((now, part.arrivals));
        let limit = (load.per_statement() / TARGET_BATCH).round() as usize;
        part.limit = limit.clamp(1, part.calls);
    }
}
