//! Answers from a statement's grant: the callers it carried, and those queued behind it that
//! its answer already decides.

use std::collections::VecDeque;

use super::{Item, Reply, Unanswered, Waiter};
use crate::bucket::{BucketConfig, BucketState, Outcome, Tokens};
use crate::clock::timestamp_from_system_time;
use crate::store::{Acquired, nanos};

/// The bucket as a statement left it: `remaining` tokens, refilled up to the store's time plus
/// however far the row's refill time was ahead of it (another writer's clock). The `ahead` part
/// is recovered exactly from `reset_after = ahead + time_to_refill(capacity − remaining)`.
fn state_after(acquired: &Acquired, bucket: &BucketConfig) -> BucketState {
    let now = timestamp_from_system_time(acquired.store_now);
    let to_full = bucket.time_to_refill(bucket.capacity().saturating_sub(acquired.remaining));
    let reset = u64::try_from(acquired.reset_after.as_nanos()).unwrap_or(u64::MAX);
    BucketState {
        tokens: acquired.remaining,
        last_refill: now.saturating_add(reset.saturating_sub(to_full)),
    }
}

/// The pure bucket's denial of `cost` from `state` at `acquired`'s store time, or `None` when
/// it would allow it.
fn denial(
    state: BucketState,
    acquired: &Acquired,
    bucket: &BucketConfig,
    cost: Tokens,
) -> Option<Acquired> {
    let now = timestamp_from_system_time(acquired.store_now);
    match state.take(bucket, now, cost) {
        Ok((
            _,
            Outcome::Denied {
                remaining,
                retry_after,
            },
        )) => Some(Acquired {
            granted: Tokens::ZERO,
            remaining,
            retry_after: nanos(retry_after),
            ..*acquired
        }),
        _ => None,
    }
}

/// Hands a grant of `k × cost` to the item's first `k` callers, each with what it would have
/// seen had the takes after it not happened yet; the rest are denied as the pure bucket denies
/// them at the statement's store time.
///
/// A bucket of several limits is not modelled here (the answer holds the least limit's tokens,
/// not each limit's, so the pure bucket cannot say how long the next caller waits): when the
/// store granted nothing, every caller gets its answer, whose wait is the store's for this
/// cost; after a partial grant the callers it did not reach are returned, to go first in the
/// key's next statement, which decides them exactly.
pub(super) fn share_out(
    item: Item,
    acquired: &Acquired,
    answers: &mut Vec<(Reply, Result<Acquired, Unanswered>)>,
) -> Vec<Waiter> {
    let cost = item.cost.as_atto().max(1);
    let admitted = (acquired.granted.as_atto() / cost) as usize;
    if item.bucket.is_multi() {
        let mut left = Vec::new();
        for (i, waiter) in item.waiters.into_iter().enumerate() {
            if i < admitted {
                let later = (admitted - 1 - i) as u128 * cost;
                let answer = Acquired {
                    granted: waiter.cost,
                    remaining: acquired.remaining.saturating_add(Tokens::from_atto(later)),
                    retry_after: std::time::Duration::ZERO,
                    ..*acquired
                };
                answers.push((waiter.reply, Ok(answer)));
            } else if admitted == 0 {
                answers.push((waiter.reply, Ok(*acquired)));
            } else {
                left.push(waiter);
            }
        }
        return left;
    }
    let state = state_after(acquired, &item.bucket);
    let ahead = state
        .last_refill
        .saturating_since(timestamp_from_system_time(acquired.store_now));
    let denied = denial(state, acquired, &item.bucket, item.cost).unwrap_or(Acquired {
        granted: Tokens::ZERO,
        ..*acquired
    });
    for (i, waiter) in item.waiters.into_iter().enumerate() {
        let answer = if i < admitted {
            let later = (admitted - 1 - i) as u128 * cost;
            let remaining = acquired.remaining.saturating_add(Tokens::from_atto(later));
            let to_full = item
                .bucket
                .time_to_refill(item.bucket.capacity().saturating_sub(remaining));
            Acquired {
                granted: waiter.cost,
                remaining,
                retry_after: std::time::Duration::ZERO,
                reset_after: nanos(ahead.saturating_add(to_full)),
                store_now: acquired.store_now,
            }
        } else {
            denied
        };
        answers.push((waiter.reply, Ok(answer)));
    }
    Vec::new()
}

/// Denies, from a statement's answer for their key, the callers queued behind it that ask for
/// more than the bucket had left: the pure bucket at the statement's store time denies them,
/// and a denial changes nothing in the bucket, so no other decision moves. They queued while
/// the statement was in flight, so that store time falls within their wait or just before it.
/// Callers whose cost the bucket still holds, or under another bucket shape, stay queued.
pub(super) fn deny_from(
    acquired: &Acquired,
    bucket: &BucketConfig,
    waiters: &mut VecDeque<Waiter>,
    answers: &mut Vec<(Reply, Result<Acquired, Unanswered>)>,
) {
    // A bucket of several limits is not modelled here (see `share_out`): its callers wait for
    // the key's next statement.
    if bucket.is_multi() || waiters.iter().all(|w| w.cost <= acquired.remaining) {
        return;
    }
    let state = state_after(acquired, bucket);
    let mut rest = VecDeque::with_capacity(waiters.len());
    for waiter in waiters.drain(..) {
        let denied = (waiter.bucket == *bucket && waiter.cost > acquired.remaining)
            .then(|| denial(state, acquired, bucket, waiter.cost))
            .flatten();
        match denied {
            Some(answer) => answers.push((waiter.reply, Ok(answer))),
            None => rest.push_back(waiter),
        }
    }
    *waiters = rest;
}
