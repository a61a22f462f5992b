//! A4 (docs/testing.md): model-check the lock-free lease word (`src/lease/word.rs`) with loom.
//!
//! `word.rs` is compiled into this test a second time, with `super::sync` resolving to the
//! `model` half of the lease core's shim (`src/lease/sync.rs`), which re-exports loom's atomics
//! instead of std's. Loom then runs the
//! model in every interleaving of its threads (up to the preemption bound) and under the
//! weaker memory orderings the word uses.
//!
//! The model: a lease of 3 tokens (a new word, then the actor's first top-up), two caller threads
//! spending 1 token at a time (2 attempts each), and one actor thread that tops the lease up by 2
//! and then closes it (expiry: it takes every unspent token back). In every interleaving:
//!
//! - conservation: `admitted + returned == leased`, exactly;
//! - `admitted <= leased`, and no take ever leaves more than was leased (no underflow, which
//!   would wrap the token field to about 2⁵⁶);
//! - no token spent twice: each successful CAS consumes one distinct token, which together
//!   with conservation means no token is both admitted and returned, or admitted twice;
//! - flags: a caller that knows the lease is closed (it saw the actor's "closed" mark) is
//!   refused with `closed: true`; after the model, the word is closed, empty, and any take is
//!   refused; `PENDING` is only ever set by a caller's nudge (never by the actor), at most once
//!   per top-up, and cleared by the top-up.
//!
//! The preemption bound is 2 (crossbeam's CI value), unless `LOOM_MAX_PREEMPTIONS` says
//! otherwise. It runs in about a second in the debug test profile; no `cfg(loom)` is needed.

use std::sync::atomic::AtomicUsize as StdAtomicUsize;
use std::sync::atomic::Ordering as StdOrdering;

use loom::sync::Arc;
use loom::sync::atomic::AtomicBool;
use loom::thread;

/// The lease core's synchronisation shim; its `model` half (loom's atomics) is what `word.rs`
/// imports as `super::sync` here.
#[path = "../../src/lease/sync.rs"]
#[allow(dead_code, unused_imports, clippy::duplicate_mod)]
mod shim;
use shim::model as sync;

/// The production lease word, compiled against loom's atomics.
#[path = "../../src/lease/word.rs"]
#[allow(dead_code, clippy::duplicate_mod)]
mod word;

use word::{CLOSED, LeaseWord, PENDING, TOKENS, Take};

/// Tokens in the first lease.
const FIRST_LEASE: u64 = 3;
/// Tokens the actor adds while callers spend.
const TOP_UP: u64 = 2;
/// Attempts per caller thread.
const ATTEMPTS: usize = 2;
/// Low-water mark: a take that leaves fewer than this asks for a refill.
const LOW_WATER: u64 = 2;

/// A loom builder with the A4 preemption bound (2) unless the environment sets one.
fn builder() -> loom::model::Builder {
    let mut builder = loom::model::Builder::new();
    if std::env::var_os("LOOM_MAX_PREEMPTIONS").is_none() {
        builder.preemption_bound = Some(2);
    }
    builder
}

/// What one caller thread saw.
#[derive(Debug, Default)]
struct CallerLog {
    /// Successful takes.
    admitted: u64,
    /// Takes that set `PENDING` (asked the actor for a refill).
    nudges: u64,
}

/// One caller: `ATTEMPTS` takes of 1 token. `closed_mark` is set by the actor right after it
/// closed the lease; a caller that sees it must be refused.
fn caller(word: &LeaseWord, closed_mark: &AtomicBool) -> CallerLog {
    let mut log = CallerLog::default();
    for _ in 0..ATTEMPTS {
        let known_closed = closed_mark.load(sync::Ordering::Acquire);
        match word.try_take(1, LOW_WATER) {
            Take::Taken { left, nudge } => {
                assert!(
                    !known_closed,
                    "a take succeeded after the caller saw the lease closed"
                );
                // Underflow would wrap the token field; more than was ever leased means a
                // token appeared from nowhere.
                assert!(
                    left < FIRST_LEASE + TOP_UP,
                    "left {left} after a take: more than leased"
                );
                if nudge {
                    assert!(left < LOW_WATER, "nudged with {left} left");
                }
                log.admitted += 1;
                log.nudges += u64::from(nudge);
            }
            Take::Short { closed, .. } => {
                if known_closed {
                    assert!(closed, "refused after close, but not as closed");
                }
                // Refused while open: the callers' takes emptied the word before the top-up
                // (possible: 3 takes, then the 4th attempt). Conservation checks the count.
            }
        }
    }
    log
}

/// The A4 model: 2 callers × 2 takes, and an actor that tops up then closes.
#[test]
fn lease_word_conserves_tokens_in_every_interleaving() {
    static RUNS: StdAtomicUsize = StdAtomicUsize::new(0);
    let started = std::time::Instant::now();
    builder().check(|| {
        RUNS.fetch_add(1, StdOrdering::Relaxed);
        let word = Arc::new(LeaseWord::new_pending());
        assert_eq!(
            word.load(),
            CLOSED | PENDING,
            "a new word is closed and pending"
        );
        assert!(
            matches!(
                word.try_take(1, LOW_WATER),
                Take::Short {
                    closed: true,
                    pending: true
                }
            ),
            "a new word refuses every take"
        );
        assert_eq!(word.top_up(FIRST_LEASE), 0, "the first lease fits");
        assert_eq!(
            word.load(),
            FIRST_LEASE,
            "the first top-up opens the lease and clears PENDING"
        );
        let closed_mark = Arc::new(AtomicBool::new(false));

        let callers: Vec<_> = (0..2)
            .map(|_| {
                let (word, closed_mark) = (Arc::clone(&word), Arc::clone(&closed_mark));
                thread::spawn(move || caller(&word, &closed_mark))
            })
            .collect();
        let actor = {
            let (word, closed_mark) = (Arc::clone(&word), Arc::clone(&closed_mark));
            thread::spawn(move || {
                let unplaced = word.top_up(TOP_UP);
                assert_eq!(unplaced, 0, "a small top-up always fits");
                let returned = word.close();
                closed_mark.store(true, sync::Ordering::Release);
                returned
            })
        };

        let logs: Vec<CallerLog> = callers
            .into_iter()
            .map(|h| h.join().expect("caller"))
            .collect();
        let returned_at_expiry = actor.join().expect("actor");

        let leased = FIRST_LEASE + TOP_UP;
        let admitted: u64 = logs.iter().map(|l| l.admitted).sum();
        let nudges: u64 = logs.iter().map(|l| l.nudges).sum();
        let after = word.load();
        // Whatever is still in the word would go back at the next close.
        let returned = returned_at_expiry + word.close();

        assert!(admitted <= leased, "admitted {admitted} > leased {leased}");
        assert_eq!(
            admitted + returned,
            leased,
            "conservation: admitted {admitted} + returned {returned} != leased {leased}"
        );
        assert!(returned_at_expiry <= leased, "returned more than leased");
        // Callers take at most 4 of the 5 leased: something always goes back.
        assert!(returned >= leased - (2 * ATTEMPTS) as u64);
        assert!(
            admitted <= (2 * ATTEMPTS) as u64,
            "more takes than attempts"
        );

        // Flags after the model: closed, empty, and it stays so.
        assert_ne!(after & CLOSED, 0, "the actor's close sticks");
        assert_eq!(after & TOKENS, 0, "a closed word holds no tokens");
        assert_eq!(
            after & !(CLOSED | PENDING | TOKENS),
            0,
            "no bit outside the encoding is set"
        );
        // PENDING is set only by a nudge; the top-up clears it. So there are at most two
        // nudges (one before the top-up, one after), and a PENDING word means someone nudged.
        assert!(nudges <= 2, "{nudges} nudges for one top-up");
        if after & PENDING != 0 {
            assert!(nudges >= 1, "PENDING set without a nudge");
        }
        assert!(
            matches!(
                word.try_take(1, LOW_WATER),
                Take::Short { closed: true, .. }
            ),
            "a closed word refuses every take"
        );
        assert_eq!(word.available(), 0);
    });
    eprintln!(
        "A4 lease word: {} interleavings in {:?}",
        RUNS.load(StdOrdering::Relaxed),
        started.elapsed()
    );
}

/// The other order of the actor's work: the lease expires (close) while callers spend, then a
/// new lease is granted (top-up reopens the word). Tokens taken back at close are never spent;
/// a caller spends only from the new lease afterwards; conservation is exact.
#[test]
fn close_then_reopen_conserves_tokens() {
    builder().check(|| {
        let word = Arc::new(LeaseWord::new_pending());
        word.top_up(FIRST_LEASE);
        let callers: Vec<_> = (0..2)
            .map(|_| {
                let word = Arc::clone(&word);
                thread::spawn(move || {
                    let mut admitted = 0u64;
                    let mut asked = 0u64;
                    for _ in 0..ATTEMPTS {
                        match word.try_take(1, LOW_WATER) {
                            Take::Taken { nudge, .. } => {
                                admitted += 1;
                                asked += u64::from(nudge);
                            }
                            Take::Short { pending, .. } => {
                                // A caller that found no lease asks for one, as the fast path
                                // does.
                                if !pending && word.request_refill() {
                                    asked += 1;
                                }
                            }
                        }
                    }
                    (admitted, asked)
                })
            })
            .collect();
        let actor = {
            let word = Arc::clone(&word);
            thread::spawn(move || {
                let returned = word.close();
                let word_after_close = word.load();
                assert_ne!(word_after_close & CLOSED, 0);
                assert_eq!(word_after_close & TOKENS, 0);
                assert_eq!(word.top_up(TOP_UP), 0);
                returned
            })
        };
        let results: Vec<(u64, u64)> = callers
            .into_iter()
            .map(|h| h.join().expect("caller"))
            .collect();
        let returned_at_expiry = actor.join().expect("actor");
        let admitted: u64 = results.iter().map(|r| r.0).sum();
        let left = word.close();
        let leased = FIRST_LEASE + TOP_UP;
        assert_eq!(
            admitted + returned_at_expiry + left,
            leased,
            "conservation across close and reopen"
        );
        assert!(admitted <= leased);
    });
}
