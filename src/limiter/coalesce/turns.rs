//! Parts take turns: a part's statement waits, for a bounded time, while another part's is in
//! flight.
//!
//! One store's statement in flight gathers every caller that comes back meanwhile: 16 callers
//! of one call each fill it with nearly all of them. Split over two parts, each with its own
//! statement in flight, each part's statement gathers only the callers of that part that came
//! back during its own flight: about a third of them. Held back while the other part's
//! statement runs, a part's statement carries its callers of both flights; with the parts
//! going one after the other, a statement carries about two thirds of the callers (`x = 16 −
//! x / 2`: the callers its part's last statement did not carry, and half of those it did),
//! not a third.
//!
//! The hold is bounded, so that it costs a caller little and a slow or failing part holds up
//! the others no longer than that: at most two of the held part's statement times from when
//! the other part's statement started, never more than [`MAX_TURN`], and ending two statement
//! times before the first deadline of its waiting callers. A part is not held when it has a
//! statement in flight, [`TARGET_BATCH`] keys ready (it fills statements alone), an adaptive
//! limit above one (its load fills statements anyway), no statement time measured yet, or no
//! caller expected within the hold; nor with a fixed number of statements in flight.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{Batch, Coalescer, State, TARGET_BATCH};
use crate::store::Store;

/// The longest a part is held back for another part's statement: where statements take longer
/// (a slow store), the parts no longer take turns. A busy store's statements take a few
/// milliseconds (the cores shared with the other parts and the callers), and its parts gain
/// the most from taking turns: so this is several such statement times, well within a
/// caller's deadline (which also bounds the hold).
pub(super) const MAX_TURN: Duration = Duration::from_millis(16);

impl Coalescer {
    /// Until when `part`, with a slot free and keys ready, holds its statement back at `now`
    /// for another part's statement in flight (or gathering): see the module's rules.
    pub(super) fn held_until(&self, state: &State, part: usize, now: Instant) -> Option<Instant> {
        if !self.settings.adaptive {
            return None;
        }
        let p = state.parts.get(&part)?;
        if p.in_flight > 0
            || p.limit > 1
            || (p.ready.len() as f64) >= TARGET_BATCH
            || p.load.statement <= 0.0
        {
            return None;
        }
        let took = Duration::from_secs_f64(p.load.statement);
        let hold = (took * 3).min(MAX_TURN);
        // Worth holding only when another caller of the part is expected meanwhile.
        if p.load.rate * hold.as_secs_f64() < 1.0 {
            return None;
        }
        let end = state
            .parts
            .iter()
            .filter(|(q, o)| **q != part && (o.in_flight > 0 || o.gathering))
            .filter_map(|(_, o)| o.started)
            .map(|started| started + hold)
            .filter(|&end| end > now)
            .max()?;
        // Every caller keeps its deadline, with two statement times to spare.
        let first = p
            .ready
            .iter()
            .filter_map(|key| state.keys.get(key))
            .flat_map(|entry| entry.waiters.iter())
            .map(|waiter| waiter.deadline)
            .min()?;
        let end = end.min(first.checked_sub(took * 2)?);
        (end > now).then_some(end)
    }

    /// The statement of the part gathering for its turn, once the callers of the answer that
    /// let it go have come back (or as many others have arrived): it need not wait out its
    /// window.
    pub(super) fn turn_ends(&self, state: &mut State, now: Instant) -> Option<Batch> {
        let (part, from, callers) = state.turn?;
        if state.arrivals.wrapping_sub(from) < callers {
            return None;
        }
        state.turn = None;
        let (total, all) = (self.total_cap(), state.in_flight);
        let p = state.parts.get_mut(&part)?;
        if !std::mem::replace(&mut p.gathering, false) || p.in_flight >= self.cap(p) || all >= total
        {
            return None;
        }
        state.next_batch(&self.settings, part, now)
    }

    /// Lets `part` go at `until` if it is still held then (no other part's answer let it go
    /// first): it sends what is ready at once, without a gather window.
    pub(super) fn hold(self: &Arc<Self>, store: &Arc<dyn Store>, part: usize, until: Instant) {
        let (this, store) = (Arc::clone(self), Arc::clone(store));
        let wait = until.saturating_duration_since(crate::clock::instant());
        tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            let batch = {
                let mut state = this.state.lock();
                let total = this.total_cap();
                let all_in_flight = state.in_flight;
                let free = state.parts.get_mut(&part).is_some_and(|p| {
                    // Let go already, or held again since (another timer lets it go).
                    if p.held != Some(until) {
                        return false;
                    }
                    p.held = None;
                    !p.gathering && p.in_flight < this.cap(p) && all_in_flight < total
                });
                if free {
                    state.next_batch(&this.settings, part, crate::clock::instant())
                } else {
                    None
                }
            };
            if let Some(batch) = batch {
                this.spawn(&store, batch);
            }
        });
    }
}
