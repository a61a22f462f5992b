//! The lease word: one atomic `u64` holding a lease's unspent tokens and two flags.
//!
//! ```text
//! bit 63..59  unused (zero)
//! bit 58      CONTENDED a caller's CAS lost a race since the last top-up (the key is hot)
//! bit 57      CLOSED   no live lease: nothing may be spent (new, expired, evicted, shut down)
//! bit 56      PENDING  a refill has been asked for and not yet answered
//! bit 55..0   unspent tokens of the lease, in nanotokens (at most 2⁵⁶ − 1, about 7.2 × 10⁷ tokens)
//! ```
//!
//! Callers spend with one compare-and-swap ([`LeaseWord::try_take`]); the lease actor alone
//! adds tokens ([`LeaseWord::top_up`]) and takes them all back ([`LeaseWord::close`]). Every
//! change is a CAS on the whole word, so a token is either spent by exactly one caller or
//! returned by the actor, never both: `admitted + returned = leased` holds exactly.
//!
//! This file uses nothing but the atomics of `super::sync`, so the loom models in
//! `tests/models/loom_lease_word.rs` and `tests/models/loom_lease_words.rs` can compile it against loom's.
//!
//! # Memory orderings
//!
//! Conservation needs no ordering at all: every change is a read-modify-write of the one word,
//! and the read-modify-writes of one atomic form a single total order, whatever their ordering.
//! What the orderings are for is the fields *beside* the word, published with it:
//!
//! - the actor's answer to a refill is released with it and acquired by callers' loads of the
//!   word ([`LeaseWord::try_take`]): a grant's `store_remaining` (the record's, stored before
//!   the grant) by [`LeaseWord::top_up`], a refusal's or a failure's `deny_until`,
//!   `fallback_until` and `dry` (the slot's, stored before) by [`LeaseWord::clear_pending`]. A
//!   caller that finds the refill answered also finds the answer;
//! - a caller's request (the slot's `needed` and `waiting`, recorded before it asks) is
//!   released by [`LeaseWord::request_refill`] and acquired by the actor's [`LeaseWord::load`]
//!   when it looks for `PENDING` words after a dropped nudge.
//!
//! Everything else is `Relaxed`: a take publishes nothing (no one reads anything a caller wrote
//! before it), and `close`, `drain`, `refund` and `available` move or count tokens, which the
//! read-modify-write already makes exact. docs/design/memory-orderings.md lists them all.

use super::sync::{AtomicU64, Ordering};

/// Mask of the token count.
pub(crate) const TOKENS: u64 = (1 << 56) - 1;
/// A refill has been asked for.
pub(crate) const PENDING: u64 = 1 << 56;
/// No live lease.
pub(crate) const CLOSED: u64 = 1 << 57;
/// A caller's CAS lost a race since the last top-up: several threads spend from this word at
/// once. Set by the winning retry itself (no extra atomic operation); cleared by `top_up`.
pub(crate) const CONTENDED: u64 = 1 << 58;

/// What [`LeaseWord::try_take`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Take {
    /// The cost was spent. `nudge` is true when this call set `PENDING` because the lease fell
    /// below its low-water mark: the caller must wake the actor.
    Taken {
        /// Tokens left in the lease.
        left: u64,
        /// Whether this call asked for a refill.
        nudge: bool,
    },
    /// Not enough tokens (or no live lease); nothing was spent.
    Short {
        /// No live lease.
        closed: bool,
        /// A refill is already asked for.
        pending: bool,
    },
}

/// One lease's tokens and flags. See the [module docs](self).
#[derive(Debug)]
pub(crate) struct LeaseWord {
    word: AtomicU64,
}

impl LeaseWord {
    /// A word with no live lease and a refill already asked for: what a new slot starts as.
    pub(crate) fn new_pending() -> Self {
        LeaseWord {
            word: AtomicU64::new(CLOSED | PENDING),
        }
    }

    /// Spends `cost` nanotokens if the lease is live and holds that many. When what is left
    /// falls below `low_water` and no refill is asked for yet, asks for one (sets `PENDING`).
    ///
    /// Lock-free: a CAS loop that retries only when another caller changed the word.
    #[inline]
    pub(crate) fn try_take(&self, cost: u64, low_water: u64) -> Take {
        // Acquire: a caller that finds the lease short or closed, or the refill answered
        // (`PENDING` clear), also sees what the actor stored before answering (pairs with the
        // release of `top_up` and `clear_pending`).
        let mut current = self.word.load(Ordering::Acquire);
        let mut contended = 0;
        loop {
            let tokens = current & TOKENS;
            if current & CLOSED != 0 || tokens < cost {
                return Take::Short {
                    closed: current & CLOSED != 0,
                    pending: current & PENDING != 0,
                };
            }
            let left = tokens - cost;
            let nudge = left < low_water && current & PENDING == 0;
            let next = (current - cost) | if nudge { PENDING } else { 0 } | contended;
            // Success: Acquire, so the `store_remaining` the caller reads next is at least the
            // one of the top-up whose tokens it spent (pairs with `top_up`'s release; every
            // later change of the word is a read-modify-write, so it carries that release on).
            // The load above already acquired, but the CAS can succeed on a later change that
            // happens to leave the same value (a top-up and then a take). No Release: a take
            // publishes nothing, and its nudge reaches the actor through the nudge queue,
            // which orders itself. Failure: Acquire, as the first load (the value may end the
            // loop in `Short`).
            match self.word.compare_exchange_weak(
                current,
                next,
                Ordering::Acquire,
                Ordering::Acquire,
            ) {
                Ok(_) => return Take::Taken { left, nudge },
                Err(actual) => {
                    current = actual;
                    contended = CONTENDED;
                }
            }
        }
    }

    /// Puts the word back into the state of [`LeaseWord::new_pending`]: a recycled record, which
    /// no one else can reach while this runs.
    pub(crate) fn reset_pending(&self) {
        // Relaxed: the record is published to its next users by the slab's mutex and the
        // table's bucket (an acquire/release `OnceLock`), not by this store.
        self.word.store(CLOSED | PENDING, Ordering::Relaxed);
    }

    /// A word with no live lease and no refill asked for: an extra word joining a closed lease.
    pub(crate) fn new_closed() -> Self {
        LeaseWord {
            word: AtomicU64::new(CLOSED),
        }
    }

    /// Sets `PENDING` unless it is set. Returns whether this call set it (and so must wake the
    /// actor).
    pub(crate) fn request_refill(&self) -> bool {
        // Release: what the caller recorded before asking (`Slot::want`) is visible to an actor
        // that finds `PENDING` with an acquire `load` (the scan after a dropped nudge). No
        // Acquire: the caller reads nothing the flag could have published.
        self.word.fetch_or(PENDING, Ordering::Release) & PENDING == 0
    }

    /// The actor adds `amount` nanotokens, opens the lease (clears `CLOSED`) and clears
    /// `PENDING` and `CONTENDED`. Returns what did not fit under [`TOKENS`] (to be given back).
    pub(crate) fn top_up(&self, amount: u64) -> u64 {
        // Relaxed load and failure: only a guess for the CAS, which checks it.
        let mut current = self.word.load(Ordering::Relaxed);
        loop {
            let tokens = current & TOKENS;
            let fits = amount.min(TOKENS - tokens);
            let next = tokens + fits;
            // Success: Release, publishing the refill's answer stored before it (the record's
            // `store_remaining`) to callers that acquire the word. No Acquire: the actor reads
            // nothing callers wrote before their takes.
            match self.word.compare_exchange_weak(
                current,
                next,
                Ordering::Release,
                Ordering::Relaxed,
            ) {
                Ok(_) => return amount - fits,
                Err(actual) => current = actual,
            }
        }
    }

    /// A caller puts back `amount` nanotokens it spent (a request refused further on). Only into
    /// a live lease, and only what fits under [`TOKENS`]; returns whether it went in. When it
    /// did not, the caller gives the tokens back to the store instead.
    pub(crate) fn refund(&self, amount: u64) -> bool {
        // Relaxed throughout: a refund publishes nothing and reads nothing but the word, and
        // the CAS alone decides (atomically with every take and `close`) whether the lease was
        // live when the tokens went in.
        let mut current = self.word.load(Ordering::Relaxed);
        loop {
            if current & CLOSED != 0 || TOKENS - (current & TOKENS) < amount {
                return false;
            }
            match self.word.compare_exchange_weak(
                current,
                current + amount,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(actual) => current = actual,
            }
        }
    }

    /// The actor clears `PENDING` without adding tokens (the refill granted nothing or failed).
    pub(crate) fn clear_pending(&self) {
        // Release: the failed or empty answer (`deny_until`, `fallback_until`, `dry`, stored
        // before) is visible to a caller that acquires the word and finds `PENDING` clear.
        self.word.fetch_and(!PENDING, Ordering::Release);
    }

    /// The actor ends the lease: sets `CLOSED` and takes every unspent token, keeping `PENDING`
    /// as it is (a caller may have asked for a new lease meanwhile). Returns the tokens (to be
    /// given back to the store).
    pub(crate) fn close(&self) -> u64 {
        // Relaxed throughout: the CAS takes exactly the tokens no take got (one total order on
        // the word), and closing publishes nothing: callers read no field the actor writes
        // before a close.
        let mut current = self.word.load(Ordering::Relaxed);
        loop {
            let next = CLOSED | (current & PENDING);
            match self.word.compare_exchange_weak(
                current,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return current & TOKENS,
                Err(actual) => current = actual,
            }
        }
    }

    /// The actor takes every unspent token and leaves the flags as they are: tokens moving to
    /// another word of the same lease. Returns them.
    pub(crate) fn drain(&self) -> u64 {
        // Relaxed throughout, as `close`: tokens moving between the words of one lease, by the
        // actor, which then tops the other words up (their release publishes what is needed).
        let mut current = self.word.load(Ordering::Relaxed);
        loop {
            match self.word.compare_exchange_weak(
                current,
                current & !TOKENS,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return current & TOKENS,
                Err(actual) => current = actual,
            }
        }
    }

    /// Unspent tokens now (a snapshot).
    pub(crate) fn available(&self) -> u64 {
        // Relaxed: a count. Callers' takes only lower it, and what must not be missed (the
        // actor's own top-ups, seen by a refund) is ordered by the slot's bookkeeping lock.
        self.word.load(Ordering::Relaxed) & TOKENS
    }

    /// The whole word now (a snapshot), for the actor's bookkeeping.
    pub(crate) fn load(&self) -> u64 {
        // Acquire: the actor finding `PENDING` also sees what the caller recorded before asking
        // (pairs with `request_refill`'s release).
        self.word.load(Ordering::Acquire)
    }
}
