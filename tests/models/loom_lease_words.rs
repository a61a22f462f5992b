//! A4 (docs/testing.md): model-check the lease core as a whole with loom: a key's lease spread over
//! several words (`src/lease/words.rs`), refunds against takes and closes, and the slab's
//! recycling of records (`src/lease/slab.rs`).
//!
//! `word.rs`, `slab.rs` and `words.rs` are compiled into this test a second time, with
//! `super::sync` resolving to the `model` half of the lease core's shim (`src/lease/sync.rs`):
//! loom's atomics, a loom mutex and loom's thread-locals. Loom then runs each model in every
//! interleaving of its threads (up to the preemption bound) and under the orderings the code
//! uses, so a weakened ordering that lets a thread read a stale value fails a model.
//!
//! What loom cannot see, and the models stand in for (docs/design/memory-orderings.md):
//!
//! - the `OnceLock`s (the slab's chunks, a hot key's extra words, a table bucket): std's in the
//!   models, as loom has none. A table bucket is modelled as the acquire/release pair a
//!   `OnceLock`'s `set` and `get` are (a loom atomic holding the record's index).
//! - the table's epoch-based reclamation (`papaya`/`seize`, not loom-aware): what it guarantees
//!   the slab is that an array, and the `Arc<Slot>` its entry holds, is freed only after every
//!   reader that could have found the record through it has left. A reader's pin is modelled as
//!   a clone of that `Arc`, dropped when the reader is done.
//!
//! The preemption bound is 2 (crossbeam's CI value), 1 for the largest model, unless
//! `LOOM_MAX_PREEMPTIONS` says otherwise. No `cfg(loom)` is needed: this is a normal test
//! binary.

use std::sync::Arc as StdArc;
use std::sync::atomic::AtomicUsize as StdAtomicUsize;
use std::sync::atomic::Ordering as StdOrdering;

use loom::sync::Arc;
use loom::sync::atomic::{AtomicBool, AtomicU32};
use loom::thread;

/// The lease core's synchronisation shim; its `model` half is what the files below import as
/// `super::sync`.
#[path = "../../src/lease/sync.rs"]
#[allow(dead_code, unused_imports, clippy::duplicate_mod)]
mod shim;
use shim::model as sync;

/// The production lease word, compiled against loom's atomics.
#[path = "../../src/lease/word.rs"]
#[allow(dead_code, clippy::duplicate_mod)]
mod word;

/// The production slab of records, compiled against loom's atomics and mutex.
#[path = "../../src/lease/slab.rs"]
#[allow(dead_code)]
mod slab;

/// The production spread words, compiled against loom's atomics and thread-locals.
#[path = "../../src/lease/words.rs"]
#[allow(dead_code)]
mod words;

use slab::{Hot, NO_PLAN, Slab};
use sync::Ordering;
use word::{CLOSED, PENDING, TOKENS, Take};
use words::{Extra, LeaseWords};

/// Runs `model` in every interleaving with at most `preemptions` preemptions (unless
/// `LOOM_MAX_PREEMPTIONS` says otherwise), and prints how many there were and how long they
/// took.
fn check(name: &str, preemptions: usize, model: impl Fn() + Sync + Send + 'static) {
    // One model at a time in a process (`cargo test` runs tests on parallel threads; nextest
    // runs each in its own process): the word assignment's counter and `RUNS` are global.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    static RUNS: StdAtomicUsize = StdAtomicUsize::new(0);
    RUNS.store(0, StdOrdering::Relaxed);
    let started = std::time::Instant::now();
    let mut builder = loom::model::Builder::new();
    if std::env::var_os("LOOM_MAX_PREEMPTIONS").is_none() {
        builder.preemption_bound = Some(preemptions);
    }
    builder.check(move || {
        RUNS.fetch_add(1, StdOrdering::Relaxed);
        // Which thread gets which extra word must depend on the interleaving alone.
        words::restart_word_assignment();
        model();
    });
    eprintln!(
        "A4 {name}: {} interleavings in {:?}",
        RUNS.load(StdOrdering::Relaxed),
        started.elapsed()
    );
}

/// One key's lease: its record and its extra words, as the slot holds them.
#[derive(Debug)]
struct Lease {
    hot: Hot,
    extra: Extra,
}

impl Lease {
    fn new() -> Arc<Lease> {
        Arc::new(Lease {
            hot: Hot::new_pending(),
            extra: Extra::default(),
        })
    }

    fn words(&self) -> LeaseWords<'_> {
        LeaseWords::new(&self.hot, &self.extra)
    }
}

/// Extra words of the spread key in the models.
const SPREAD: usize = 2;
/// Cost of every take.
const COST: u64 = 1;
/// The lease's low-water mark (each extra word asks below half of it).
const LOW_WATER: u64 = 2;

/// What one spender thread saw.
#[derive(Debug, Default)]
struct Spent {
    /// Tokens admitted.
    admitted: u64,
    /// Takes that set `PENDING`.
    nudges: u64,
}

/// `attempts` takes of [`COST`] from `lease`. `closed_mark` is set by the actor once its close
/// returned: a spender that saw it must be refused as closed. `most` is the most the lease can
/// ever hold: a take that leaves more means a token appeared from nowhere, or the token field
/// wrapped (an underflow).
fn spend(lease: &Lease, closed_mark: &AtomicBool, attempts: usize, most: u64) -> Spent {
    let mut spent = Spent::default();
    for _ in 0..attempts {
        let known_closed = closed_mark.load(Ordering::Acquire);
        match lease.words().try_take(COST, LOW_WATER) {
            Take::Taken { left, nudge } => {
                assert!(!known_closed, "a take succeeded after the lease was closed");
                assert!(
                    left < most,
                    "left {left} after a take: more than the lease held"
                );
                spent.admitted += COST;
                spent.nudges += u64::from(nudge);
            }
            Take::Short { closed, .. } => {
                if known_closed {
                    assert!(closed, "refused after close, but not as closed");
                }
            }
        }
    }
    spent
}

/// Every word of `lease` is closed and empty, and no bit outside the encoding is set.
fn assert_closed_and_empty(lease: &Lease) {
    let words = lease.words();
    assert_ne!(words.load() & CLOSED, 0, "the lease is closed");
    assert_eq!(words.available(), 0, "a closed lease holds no tokens");
    let mut each = vec![lease.hot.word.load()];
    if let Some(extra) = words.extra() {
        each.extend(extra.iter().map(|w| w.0.load()));
    }
    for w in each {
        assert_ne!(w & CLOSED, 0, "every word is closed: {w:#x}");
        assert_eq!(w & TOKENS, 0, "every word is empty: {w:#x}");
    }
    assert!(matches!(
        words.try_take(COST, LOW_WATER),
        Take::Short { closed: true, .. }
    ));
}

/// What the actor does in a spread-key model while the spenders spend.
#[derive(Debug, Clone, Copy)]
enum Actor {
    /// Tops the lease up (the water fill, the first word's drain and pour), then closes it.
    TopUpThenClose,
    /// Tops it up; the close comes after the threads.
    TopUp,
    /// Closes it (expiry), after a top-up before the threads.
    Close,
}

/// A spread key (the first word and 2 extra words): two spenders take from their own word, the
/// other and the first, while the actor tops the lease up (a water fill of the new tokens into
/// the extra words, then the first word drained and poured after them) and closes it (expiry).
/// In every interleaving: `admitted + unplaced + returned == credited` exactly, no take leaves
/// more than was ever credited (no underflow), a spender that knows the lease is closed is
/// refused, and the lease ends closed and empty in every word.
///
/// The top-up and the close together, with one take per spender, at one preemption; each alone
/// with three takes at two. (Both together at two preemptions: 278,541 interleavings, three
/// minutes on a busy 2-core machine.)
fn spread_model(name: &str, actor: Actor, attempts: [usize; 2], preemptions: usize) {
    /// What the first word held before the key was spread.
    const HELD: u64 = 2;
    /// The top-up the actor pours while spenders spend: 2 per extra word.
    const TOP_UP: u64 = 4;
    check(name, preemptions, move || {
        let lease = Lease::new();
        assert_eq!(lease.hot.word.top_up(HELD), 0);
        lease.words().spread_out_over(SPREAD);
        assert_eq!(lease.words().extra().map(<[_]>::len), Some(SPREAD));
        let mut unplaced = 0;
        if let Actor::Close = actor {
            // Split (4 / 2 words >= 1): the fill, then the first word's drain and pour.
            unplaced += lease.words().top_up(TOP_UP, 1);
        }
        let credited = HELD + TOP_UP;
        let closed_mark = Arc::new(AtomicBool::new(false));

        let spenders: Vec<_> = attempts
            .into_iter()
            .map(|attempts| {
                let (lease, closed_mark) = (Arc::clone(&lease), Arc::clone(&closed_mark));
                thread::spawn(move || spend(&lease, &closed_mark, attempts, credited))
            })
            .collect();
        let actor_thread = {
            let (lease, closed_mark) = (Arc::clone(&lease), Arc::clone(&closed_mark));
            thread::spawn(move || {
                let mut unplaced = 0;
                let mut returned = 0;
                if let Actor::TopUpThenClose | Actor::TopUp = actor {
                    unplaced += lease.words().top_up(TOP_UP, 1);
                }
                if let Actor::TopUpThenClose | Actor::Close = actor {
                    returned += lease.words().close();
                    closed_mark.store(true, Ordering::Release);
                }
                (unplaced, returned)
            })
        };
        let spent: Vec<Spent> = spenders
            .into_iter()
            .map(|h| h.join().expect("spender"))
            .collect();
        let (more_unplaced, mut returned) = actor_thread.join().expect("actor");
        unplaced += more_unplaced;

        let admitted: u64 = spent.iter().map(|s| s.admitted).sum();
        let left = lease.words().close();
        if let Actor::TopUp = actor {
            returned += left;
        } else {
            // The actor's close took every word's tokens, and only the actor puts tokens in.
            assert_eq!(left, 0, "tokens in a word after the close");
        }
        assert_eq!(
            admitted + unplaced + returned,
            credited,
            "conservation: admitted {admitted} + unplaced {unplaced} + returned {returned}"
        );
        assert!(
            admitted <= attempts.iter().sum::<usize>() as u64,
            "more admitted than attempted"
        );
        assert_closed_and_empty(&lease);
    });
}

/// [`spread_model`]: the top-up and the close racing one take in each spender.
#[test]
fn a_spread_key_conserves_tokens_through_fill_drain_and_close() {
    spread_model(
        "spread key: top-up and close",
        Actor::TopUpThenClose,
        [1, 1],
        1,
    );
}

/// [`spread_model`]: the top-up (fill, drain, pour) racing two takes and one.
#[test]
fn a_spread_key_conserves_tokens_through_fill_and_drain() {
    spread_model("spread key: top-up", Actor::TopUp, [2, 1], 2);
}

/// [`spread_model`]: the close racing two takes and one, over every word.
#[test]
fn a_spread_key_conserves_tokens_through_close() {
    spread_model("spread key: close", Actor::Close, [2, 1], 2);
}

/// A key being spread while callers spend: the actor adds the extra words (a flag and a
/// `OnceLock`), tops the lease up over them, and closes it. A spender that sees the flag and
/// not yet the words spends from the first word; in every interleaving the tokens add up.
#[test]
fn spreading_a_key_under_its_callers_conserves_tokens() {
    const HELD: u64 = 1;
    const TOP_UP: u64 = 2;
    check("spreading under callers", 2, || {
        let lease = Lease::new();
        assert_eq!(lease.hot.word.top_up(HELD), 0);
        let credited = HELD + TOP_UP;
        let closed_mark = Arc::new(AtomicBool::new(false));
        let spender = {
            let (lease, closed_mark) = (Arc::clone(&lease), Arc::clone(&closed_mark));
            thread::spawn(move || spend(&lease, &closed_mark, 2, credited))
        };
        let actor = {
            let (lease, closed_mark) = (Arc::clone(&lease), Arc::clone(&closed_mark));
            thread::spawn(move || {
                lease.words().spread_out_over(SPREAD);
                let unplaced = lease.words().top_up(TOP_UP, 1);
                let returned = lease.words().close();
                closed_mark.store(true, Ordering::Release);
                (unplaced, returned)
            })
        };
        let spent = spender.join().expect("spender");
        let (unplaced, returned) = actor.join().expect("actor");
        assert_eq!(spent.admitted + unplaced + returned, credited);
        assert_closed_and_empty(&lease);
    });
}

/// Refunds racing takes, a top-up and a close, as `Leases::refund` does them: the refund and
/// the actor's top-up and expiry hold the slot's bookkeeping lock (`book` here), takes do not.
/// In every interleaving:
///
/// - a refund never lifts the lease above its bound (nor does the top-up, capped the same
///   way): checked right after each, under the lock, since only takes run beside them and
///   those only lower the lease;
/// - a refund into a closed lease is refused (the caller then gives the tokens to the store);
/// - conservation: admitted + given to the store + returned at close == credited.
///
/// Once on a quiet key (one word), once on a spread key (the refund goes into the refunder's
/// own word).
#[test]
fn a_refund_stays_within_the_bound_and_never_enters_a_closed_lease() {
    refund_model("refund, quiet key", false, 2);
}

/// [`a_refund_stays_within_the_bound_and_never_enters_a_closed_lease`] on a spread key, at one
/// preemption (at two: 87,841 interleavings, over a minute on a busy 2-core machine).
#[test]
fn a_refund_into_a_spread_key_stays_within_the_bound() {
    refund_model("refund, spread key", true, 1);
}

fn refund_model(name: &str, spread: bool, preemptions: usize) {
    /// The lease's bound (`B`).
    const BOUND: u64 = 4;
    /// What the lease holds when the model starts.
    const HELD: u64 = 3;
    /// What the store grants the actor's refill.
    const GRANT: u64 = 2;
    check(name, preemptions, move || {
        let lease = Lease::new();
        let book = Arc::new(sync::Mutex::new(()));
        if spread {
            lease.words().spread_out_over(SPREAD);
            assert_eq!(lease.words().top_up(HELD, 1), 0);
        } else {
            assert_eq!(lease.hot.word.top_up(HELD), 0);
        }
        let closed_mark = Arc::new(AtomicBool::new(false));

        // A caller whose request was refused further on: it spends a token, then puts it back.
        let refunder = {
            let (lease, book, closed_mark) = (
                Arc::clone(&lease),
                Arc::clone(&book),
                Arc::clone(&closed_mark),
            );
            thread::spawn(move || {
                let mut to_store = 0;
                if let Take::Taken { .. } = lease.words().try_take(COST, 0) {
                    let _book = book.lock();
                    let known_closed = closed_mark.load(Ordering::Acquire);
                    if lease.words().refund_within(COST, BOUND) {
                        assert!(!known_closed, "a refund went into a closed lease");
                        let now = lease.words().available();
                        assert!(now <= BOUND, "a refund lifted the lease to {now} > {BOUND}");
                    } else {
                        to_store += COST;
                    }
                }
                to_store
            })
        };
        let spender = {
            let (lease, closed_mark) = (Arc::clone(&lease), Arc::clone(&closed_mark));
            thread::spawn(move || spend(&lease, &closed_mark, 1, HELD + GRANT + 1))
        };
        let actor = {
            let (lease, book, closed_mark) = (
                Arc::clone(&lease),
                Arc::clone(&book),
                Arc::clone(&closed_mark),
            );
            thread::spawn(move || {
                let credited = {
                    // The refill's answer, capped as `actor::apply` caps it.
                    let _book = book.lock();
                    let words = lease.words();
                    let room = BOUND.saturating_sub(words.available());
                    let placed = GRANT.min(room);
                    let unplaced = (GRANT - placed) + words.top_up(placed, 1);
                    let now = words.available();
                    assert!(now <= BOUND, "a top-up lifted the lease to {now} > {BOUND}");
                    GRANT - unplaced
                };
                let returned = {
                    // Expiry, under the lock as in the actor's due-queue round.
                    let _book = book.lock();
                    let returned = lease.words().close();
                    closed_mark.store(true, Ordering::Release);
                    returned
                };
                (credited, returned)
            })
        };
        let to_store = refunder.join().expect("refunder");
        let spent = spender.join().expect("spender");
        let (credited, returned) = actor.join().expect("actor");
        assert_eq!(lease.words().close(), 0, "tokens in a word after the close");
        assert_eq!(
            spent.admitted + to_store + returned,
            HELD + credited,
            "conservation: admitted {} + to the store {to_store} + returned {returned}",
            spent.admitted
        );
        // After the close, a refund is refused.
        assert!(!lease.words().refund_within(COST, BOUND));
        assert_closed_and_empty(&lease);
    });
}

/// The slab's recycling of records (`slab.rs`), with the table's parts that loom cannot run
/// modelled by what they guarantee (module docs): a key's record is in use (tokens, a
/// low-water mark, a plan, spread); a reader that found it through the table's old array holds
/// the array's `Arc<Slot>` until it is done; the actor drops its own; meanwhile a new key takes
/// a record (the recycled one, once both are gone, or a fresh one) and publishes it in a bucket
/// (a release store standing for the bucket's `OnceLock`), and a reader of the new key loads
/// the bucket (acquire). In every interleaving:
///
/// - the old reader sees the record as its key left it, never reset, however the others run;
/// - the new key gets the old record only after the old reader is done (the hand-over orders
///   the reader's writes before the reset), and finds it reset;
/// - the new key's reader sees the record reset (and the new key's plan), never half-reset and
///   never the old key's fields, although `Hot::reset` stores `Relaxed`.
#[test]
fn a_recycled_record_is_never_seen_half_reset() {
    check("slab recycling", 2, || {
        // std's `Arc`: the slab's own (`sync.rs`); it only keeps the slab alive.
        let slab: StdArc<Slab> = Slab::new(1);
        let old = slab.alloc().expect("room");
        assert_eq!(old.index(), 0);
        assert_eq!(old.word.top_up(5), 0);
        old.low_water.store(7, Ordering::Relaxed);
        old.store_remaining.store(9, Ordering::Relaxed);
        old.spread.store(true, Ordering::Relaxed);
        old.plan.store(3, Ordering::Relaxed);
        // The slot's claim on its record, shared by the table's entry and the actor.
        let slot = Arc::new(old);
        let done = Arc::new(AtomicBool::new(false));
        let bucket = Arc::new(AtomicU32::new(u32::MAX));

        let old_reader = {
            // The array this reader pinned holds the entry's `Arc<Slot>`: freed only after the
            // reader left.
            let (pinned, slab, done) = (Arc::clone(&slot), StdArc::clone(&slab), Arc::clone(&done));
            thread::spawn(move || {
                let hot = slab.get(pinned.index()).expect("handed out");
                assert!(
                    matches!(hot.word.try_take(1, 0), Take::Taken { .. }),
                    "the old key's lease was reset under its reader"
                );
                assert_eq!(hot.low_water.load(Ordering::Relaxed), 7);
                assert_eq!(hot.store_remaining.load(Ordering::Relaxed), 9);
                assert!(hot.spread.load(Ordering::Relaxed));
                assert_eq!(hot.plan.load(Ordering::Relaxed), 3);
                // Relaxed: the hand-over, not this flag, must order it before a reuse.
                done.store(true, Ordering::Relaxed);
                drop(pinned);
            })
        };
        let new_key = {
            let (slab, done, bucket) =
                (StdArc::clone(&slab), Arc::clone(&done), Arc::clone(&bucket));
            thread::spawn(move || {
                let hot = slab.alloc().expect("room");
                if hot.index() == 0 {
                    assert!(
                        done.load(Ordering::Relaxed),
                        "a record was recycled while a reader could still reach it"
                    );
                }
                assert_reset(&hot, NO_PLAN);
                // As `TableRef::get_or_insert_with` does: the plan, then the bucket.
                hot.plan.store(5, Ordering::Relaxed);
                bucket.store(hot.index(), Ordering::Release);
                hot
            })
        };
        let new_reader = {
            let (slab, bucket) = (StdArc::clone(&slab), Arc::clone(&bucket));
            thread::spawn(move || {
                let index = bucket.load(Ordering::Acquire);
                if index != u32::MAX {
                    assert_reset(slab.get(index).expect("handed out"), 5);
                }
            })
        };
        // The actor drops the slot it evicted.
        drop(slot);
        old_reader.join().expect("old reader");
        new_reader.join().expect("new reader");
        let held = new_key.join().expect("new key");
        drop(held);
    });
}

/// `hot` is as `Hot::new_pending` makes it, but for its plan.
fn assert_reset(hot: &Hot, plan: u16) {
    assert_eq!(
        hot.word.load(),
        CLOSED | PENDING,
        "the word is closed and pending"
    );
    assert_eq!(hot.low_water.load(Ordering::Relaxed), 0, "low-water mark");
    assert_eq!(
        hot.store_remaining.load(Ordering::Relaxed),
        0,
        "store remaining"
    );
    assert!(!hot.spread.load(Ordering::Relaxed), "spread");
    assert!(!hot.queued.load(Ordering::Relaxed), "queued");
    assert_eq!(hot.plan.load(Ordering::Relaxed), plan, "plan");
}

/// The orderings `word.rs` keeps: a refill's answer is published with it. The actor stores
/// the store's remaining count (the record's `store_remaining`, `Relaxed`) and tops the lease
/// up; or, for a refusal, stores "denied until" (the slot's `deny_until`, a release store here
/// as in the actor) and clears `PENDING`. A caller whose take spends the new tokens reads the
/// new remaining count; a caller that finds `PENDING` clear reads the new "denied until". Both
/// hold only because `top_up` and `clear_pending` release and the caller's take acquires.
#[test]
fn a_refills_answer_is_published_with_it() {
    check("answer published with the refill", 2, || {
        let lease = Lease::new();
        // A live lease, empty, with a refill asked for.
        assert_eq!(lease.hot.word.top_up(0), 0);
        assert!(lease.hot.word.request_refill());
        let deny_until = Arc::new(loom::sync::atomic::AtomicU64::new(0));
        let granted = {
            let lease = Arc::clone(&lease);
            thread::spawn(move || {
                lease.hot.store_remaining.store(9, Ordering::Relaxed);
                assert_eq!(lease.hot.word.top_up(1), 0);
            })
        };
        let caller = {
            let lease = Arc::clone(&lease);
            thread::spawn(move || match lease.hot.word.try_take(1, 0) {
                Take::Taken { .. } => {
                    assert_eq!(
                        lease.hot.store_remaining.load(Ordering::Relaxed),
                        9,
                        "spent the refill's tokens, but read an older remaining count"
                    );
                }
                Take::Short { .. } => {}
            })
        };
        granted.join().expect("actor");
        caller.join().expect("caller");

        // Then a refusal: "denied until", then `PENDING` cleared.
        assert!(lease.hot.word.request_refill());
        let refused = {
            let (lease, deny_until) = (Arc::clone(&lease), Arc::clone(&deny_until));
            thread::spawn(move || {
                deny_until.store(7, Ordering::Release);
                lease.hot.word.clear_pending();
            })
        };
        let caller = {
            let (lease, deny_until) = (Arc::clone(&lease), Arc::clone(&deny_until));
            thread::spawn(move || {
                if let Take::Short { pending: false, .. } = lease.hot.word.try_take(1, 0) {
                    assert_eq!(
                        deny_until.load(Ordering::Acquire),
                        7,
                        "found the refill answered, but not its answer"
                    );
                }
            })
        };
        refused.join().expect("actor");
        caller.join().expect("caller");
    });
}
