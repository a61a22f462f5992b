//! Giving back what earlier limits took when a later one refuses.
//!
//! A token that came from a lease goes back into this process's lease ([`Limiter::refund_now`]:
//! no statement at all). Any other (a direct-mode plan, a strict lease, a lease already gone)
//! goes to the store, in batches: [`GiveBacks`] queues it and one task sends what queued up
//! while its previous statement ran, as one statement. A refusal never waits for its
//! give-backs.

use crate::store::metered::{Metered, Purpose};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::Limiter;
use crate::bucket::{BucketConfig, Tokens};
use crate::metrics::HTTP_REFUNDS;
use crate::policy::Plan;
use crate::store::{GiveBack, Store};

/// Registers `tokenlease_http_refunds_total` of every `result` at zero.
pub(crate) fn register_at_zero() {
    for result in ["credited", "failed", "skipped"] {
        metrics::counter!(HTTP_REFUNDS, "result" => result).increment(0);
    }
}

/// The most give-backs one statement carries.
const MAX_BATCH: usize = 512;

/// The most give-backs queued; past it a give-back is dropped (counted `failed`: its token
/// counts as spent, which under-admits and never over-admits).
const MAX_QUEUED: usize = 65_536;

/// One queued give-back: the key, its bucket, one token.
#[derive(Debug)]
struct Queued {
    key: String,
    bucket: BucketConfig,
    /// Told whether the statement carrying it was credited, when a caller waits.
    done: Option<tokio::sync::oneshot::Sender<bool>>,
}

/// The queue of [`GiveBacks`].
#[derive(Debug, Default)]
struct Queue {
    items: Vec<Queued>,
    /// Whether a caller or task is sending the queue.
    sending: bool,
}

/// Give-backs for the store, sent in batches: the first caller to find nobody sending sends
/// what is queued (its own and what queued up meanwhile) as one statement, and the others
/// wait until a statement carried theirs.
#[derive(Debug, Default)]
pub(crate) struct GiveBacks {
    queue: Mutex<Queue>,
}

impl GiveBacks {
    /// Queues one token of `key` under `plan`: whether the caller is to send the queue.
    /// `None` when the queue is full (the token counts as spent).
    fn push(
        &self,
        plan: &Plan,
        key: &str,
        done: Option<tokio::sync::oneshot::Sender<bool>>,
    ) -> Option<bool> {
        let mut queue = self.queue.lock();
        if queue.items.len() >= MAX_QUEUED {
            metrics::counter!(HTTP_REFUNDS, "result" => "failed").increment(1);
            return None;
        }
        queue.items.push(Queued {
            key: plan.store_key(key).into_owned(),
            bucket: *plan.bucket(),
            done,
        });
        Some(!std::mem::replace(&mut queue.sending, true))
    }

    /// Gives one token back to the store and waits until a statement carried it: whether it
    /// was credited.
    async fn give_back(self: &Arc<Self>, store: &Arc<dyn Store>, plan: &Plan, key: &str) -> bool {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if !self.give_back_with(store, plan, key, Some(tx)) {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    /// Gives one token back to the store without waiting: a task sends the queue, so a caller
    /// dropped while it waits leaves nothing half sent. Without a tokio runtime nothing can
    /// send it: dropped, counted `failed`. Whether it was queued; `done` hears the result.
    fn give_back_with(
        self: &Arc<Self>,
        store: &Arc<dyn Store>,
        plan: &Plan,
        key: &str,
        done: Option<tokio::sync::oneshot::Sender<bool>>,
    ) -> bool {
        let Some(lead) = self.push(plan, key, done) else {
            return false;
        };
        if !lead {
            return true;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            let mut queue = self.queue.lock();
            let dropped = std::mem::take(&mut queue.items).len();
            queue.sending = false;
            drop(queue);
            metrics::counter!(HTTP_REFUNDS, "result" => "failed").increment(dropped as u64);
            return false;
        };
        let (this, store) = (Arc::clone(self), Arc::clone(store));
        runtime.spawn(async move { this.send(&store).await });
        true
    }

    /// Sends the queue in statements of at most [`MAX_BATCH`] until it is empty.
    async fn send(&self, store: &Arc<dyn Store>) {
        loop {
            let mut batch: Vec<Queued> = {
                let mut queue = self.queue.lock();
                if queue.items.is_empty() {
                    // Under the queue's lock: a give-back queued after this starts a task.
                    queue.sending = false;
                    return;
                }
                let n = queue.items.len().min(MAX_BATCH);
                queue.items.drain(..n).collect()
            };
            let gives: Vec<GiveBack<'_>> = batch
                .iter()
                .map(|q| GiveBack {
                    id: give_back_id(&q.key),
                    key: &q.key,
                    bucket: q.bucket,
                    amount: Tokens::whole(1),
                    lease: None,
                })
                .collect();
            let credited = Metered::new(&**store, Purpose::Return)
                .give_back(&gives)
                .await
                .is_ok();
            let result = if credited { "credited" } else { "failed" };
            metrics::counter!(HTTP_REFUNDS, "result" => result).increment(gives.len() as u64);
            drop(gives);
            for q in &mut batch {
                if let Some(done) = q.done.take() {
                    let _ = done.send(credited);
                }
            }
        }
    }
}

/// A return id of its own for each give-back (the store credits an id once).
fn give_back_id(key: &str) -> i64 {
    use std::hash::BuildHasher;
    (std::hash::RandomState::new().hash_one(key) >> 1) as i64
}

/// Counts a give-back skipped: the token came from a fallback (`givable` false).
fn skipped(givable: bool) -> bool {
    if !givable {
        metrics::counter!(HTTP_REFUNDS, "result" => "skipped").increment(1);
    }
    !givable
}

/// Gives back the token taken from `key` under `plan` (when `givable`: not a fallback's
/// grant): into the lease when it can, else to the store in a batch, waited for. Whether it
/// was credited.
pub(crate) async fn give_back(
    limiter: &Limiter,
    give_backs: &Arc<GiveBacks>,
    plan: &Plan,
    key: &str,
    givable: bool,
) -> bool {
    if let Some(credited) = settled_here(limiter, plan, key, givable) {
        return credited;
    }
    give_backs.give_back(limiter.store(), plan, key).await
}

/// [`give_back`] without waiting: a task sends what the lease cannot take. Whether it is back
/// in the lease.
pub(crate) fn give_back_detached(
    limiter: &Limiter,
    give_backs: &Arc<GiveBacks>,
    plan: &Plan,
    key: &str,
    givable: bool,
) -> bool {
    if let Some(credited) = settled_here(limiter, plan, key, givable) {
        return credited;
    }
    give_backs.give_back_with(limiter.store(), plan, key, None);
    false
}

/// What both give-backs settle without the store: `Some(false)` for a token not to be given
/// back, `Some(true)` once it is back in the lease; `None` when it must go to the store.
fn settled_here(limiter: &Limiter, plan: &Plan, key: &str, givable: bool) -> Option<bool> {
    if skipped(givable) {
        return Some(false);
    }
    if limiter.refund_now(plan, key) {
        metrics::counter!(HTTP_REFUNDS, "result" => "credited").increment(1);
        return Some(true);
    }
    None
}
