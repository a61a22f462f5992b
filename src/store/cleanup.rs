//! The background task that deletes idle buckets.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use super::Store;

/// Deletes buckets that have refilled to full, in the background, until dropped.
///
/// Every `every`, the task calls [`Store::delete_idle`] with `batch` until a round deletes
/// fewer than `batch` rows (at most 100 rounds per tick), so a large backlog drains in small
/// transactions that never hold many row locks. Errors are counted
/// (`tokenlease_idle_cleanup_errors_total`) and retried on the next tick. Deleting a full bucket
/// changes no decision: an absent row is a full bucket.
#[derive(Debug)]
pub struct IdleCleanup {
    handle: JoinHandle<()>,
}

impl IdleCleanup {
    /// Starts the task on the current tokio runtime.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime.
    pub fn spawn(store: Arc<dyn Store>, every: Duration, batch: u32) -> IdleCleanup {
        let batch = batch.max(1);
        // Both counters at zero from the start, with the recorder installed now.
        metrics::counter!(crate::metrics::IDLE_ROWS_DELETED).increment(0);
        metrics::counter!(crate::metrics::IDLE_CLEANUP_ERRORS).increment(0);
        let handle = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                for _ in 0..100 {
                    match store.delete_idle(batch).await {
                        Ok(n) => {
                            metrics::counter!(crate::metrics::IDLE_ROWS_DELETED).increment(n);
                            if n < u64::from(batch) {
                                break;
                            }
                        }
                        Err(_) => {
                            metrics::counter!(crate::metrics::IDLE_CLEANUP_ERRORS).increment(1);
                            break;
                        }
                    }
                }
            }
        });
        IdleCleanup { handle }
    }
}

impl Drop for IdleCleanup {
    fn drop(&mut self) {
        self.handle.abort();
    }
}
