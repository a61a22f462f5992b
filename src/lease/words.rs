//! A lease's tokens spread over one or more [`LeaseWord`]s, so that a hot key scales across
//! cores.
//!
//! Every key starts with one word. When callers of a key start losing CAS races on it (the
//! winning retry sets `CONTENDED`, at no extra cost), the actor adds one word per core, each on
//! its own cache line, and from then on splits each top-up over them. A caller spends from the word its thread is assigned to and
//! moves on to the others only when that one is short, so two threads hammering one key mostly
//! touch different cache lines. Quiet keys never get the extra words, which keeps the table at
//! about 300 bytes per key.
//!
//! Each word keeps the conservation of `word.rs` on its own, so the sum does too. The lease is
//! live or closed as a whole: the actor opens every word on a top-up and closes every word on
//! expiry; `CLOSED` is read from the first word.
//!
//! The first word lives in the key's fixed-position record (`slab.rs`), the extra words in the
//! slot; [`LeaseWords`] is a view of both. The record's `spread` flag says whether there are
//! extra words, so a quiet key's call reads the record alone.
//!
//! The atomics, the `OnceLock` and the thread-local come from `super::sync`, so that
//! `tests/models/loom_lease_words.rs` can model-check this file against loom's. Each word's orderings
//! are `word.rs`'s; the ones added here are the `spread` flag's and the round-robin counter's,
//! explained where they are used.

use std::cell::Cell;

use super::slab::Hot;
use once_cell::race::OnceBox;

use super::sync::{OnceLock, Ordering, thread_local};
use super::word::{CLOSED, CONTENDED, LeaseWord, PENDING, TOKENS, Take};

/// A word on a cache line of its own.
#[derive(Debug)]
#[repr(align(64))]
pub(super) struct Padded(pub(super) LeaseWord);

/// A hot key's extra words, one per core (a power of two), each on its own cache line; set once
/// by the actor, never removed. Part of the slot, where it takes 8 bytes: the words' slice
/// pointer (16 bytes itself) sits behind one atomic pointer (`once_cell`'s `OnceBox`, where
/// std's `OnceLock` adds a state word and takes 16), since every key has the field and few keys
/// are hot. A spread key's call pays one more load, of a line no one writes.
#[derive(Debug, Default)]
pub(crate) struct Extra(OnceBox<ExtraWords>);

/// The extra words themselves.
#[derive(Debug)]
pub(crate) struct ExtraWords(Box<[Padded]>);

/// The words of one lease: the record's first word and the slot's extra words. See the
/// [module docs](self).
#[derive(Debug, Clone, Copy)]
pub(crate) struct LeaseWords<'a> {
    /// The record: the lease of a quiet key, and the flags of every lease. Once the key is
    /// spread, callers spend from the extra words and touch this one only when all of those are
    /// short, so the cache line it shares with the fields beside it is no longer written on
    /// every call.
    hot: &'a Hot,
    extra: &'a Extra,
}

/// How many words a hot key's lease is spread over: the cores rounded down to a power of two,
/// at most 8 (a power of two so a thread finds its word with a mask).
fn spread() -> usize {
    static SPREAD: OnceLock<usize> = OnceLock::new();
    *SPREAD.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
        1 << cores.ilog2()
    })
}

thread_local! {
    /// This thread's preferred word, assigned round-robin the first time it spends.
    static PREFERRED: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// The next thread's preferred word. Std's atomic even in the models (a `static` needs a
/// `const` constructor, which loom's lacks); the models reset it at the start of every execution
/// (`restart_word_assignment`), so which thread gets which word depends only on the
/// interleaving, as loom requires.
static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn preferred() -> usize {
    PREFERRED.with(|p| {
        let mut i = p.get();
        if i == usize::MAX {
            // Relaxed: a ticket; it only has to differ between threads, which any ordering of a
            // read-modify-write gives. Nothing is published through it.
            i = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            p.set(i);
        }
        i
    })
}

/// Starts the round-robin assignment of words to threads again from the first: for the loom
/// models, whose every execution must assign the same way.
#[cfg(test)]
#[allow(dead_code)]
pub(crate) fn restart_word_assignment() {
    NEXT.store(0, std::sync::atomic::Ordering::Relaxed);
}

/// How much of `amount` each of (at most 8) words holding `held` gets so that the emptiest end
/// level: a water fill. The parts sum to `amount` or (by rounding down) a little less.
pub(super) fn level(held: impl Iterator<Item = u64>, amount: u64) -> [u64; 8] {
    let mut held_each = [0u64; 8];
    let mut n = 0;
    for (slot, h) in held_each.iter_mut().zip(held) {
        *slot = h;
        n += 1;
    }
    let mut sorted = held_each;
    sorted[..n].sort_unstable();
    // The water line: raise the k emptiest words together until the next one is reached or the
    // amount is used up.
    let mut sum: u128 = 0;
    let mut line = 0u64;
    for k in 0..n {
        sum += u128::from(sorted[k]);
        let candidate = (u128::from(amount) + sum) / (k as u128 + 1);
        line = u64::try_from(candidate).unwrap_or(u64::MAX);
        if k + 1 == n || u128::from(sorted[k + 1]) >= candidate {
            break;
        }
    }
    let mut gifts = [0u64; 8];
    for (gift, &h) in gifts.iter_mut().zip(&held_each[..n]) {
        *gift = line.saturating_sub(h);
    }
    gifts
}

/// Pours `amount` into `words` with [`level`]; returns what they did not take. Opens every one.
fn fill(words: &[Padded], amount: u64) -> u64 {
    let gifts = level(words.iter().map(|w| w.0.available()), amount);
    let mut placed = 0;
    for (word, gift) in words.iter().zip(gifts) {
        placed += gift - word.0.top_up(gift);
    }
    amount - placed
}

impl<'a> LeaseWords<'a> {
    /// The lease of `hot` with the extra words `extra`.
    #[inline]
    pub(crate) fn new(hot: &'a Hot, extra: &'a Extra) -> Self {
        LeaseWords { hot, extra }
    }

    /// The extra words, if the key is spread; reads the slot only when the record says so.
    #[inline]
    pub(super) fn extra(&self) -> Option<&'a [Padded]> {
        // Acquire, pairing with `spread_out`'s release: a caller that sees the flag sees the
        // extra words initialised. (The `OnceBox`'s `get` is an acquire load of its own, so in
        // the library this only repeats it; but loom cannot see into `OnceBox`'s std atomic, and with
        // a relaxed flag the model of spreading under callers finds a word read before its
        // creation is ordered. On x86 the two loads compile to the same instruction.)
        if self.hot.spread.load(Ordering::Acquire) {
            self.extra.0.get().map(|e| &e.0[..])
        } else {
            None
        }
    }

    fn first(&self) -> &'a LeaseWord {
        &self.hot.word
    }

    fn each(&self) -> impl Iterator<Item = &'a LeaseWord> {
        std::iter::once(self.first()).chain(
            self.extra()
                .into_iter()
                .flat_map(|e| e.iter().map(|p| &p.0)),
        )
    }

    /// Spends `cost` nanotokens: from the first word for a quiet key; for a hot key from the
    /// thread's own word, then the other extra words, then the first. `low_water` is for the
    /// whole lease; each extra word asks for a refill below its share of it.
    #[inline]
    pub(crate) fn try_take(&self, cost: u64, low_water: u64) -> Take {
        let Some(extra) = self.extra() else {
            return self.first().try_take(cost, low_water);
        };
        let n = extra.len();
        // `n` is a power of two: a shift, where a division costs as much as the rest of the call.
        let share = low_water >> n.trailing_zeros();
        let start = preferred();
        let mut pending = false;
        for i in 0..n {
            match extra[(start + i) & (n - 1)].0.try_take(cost, share) {
                taken @ Take::Taken { .. } => return taken,
                Take::Short { pending: p, .. } => pending |= p,
            }
        }
        match self.first().try_take(cost, 0) {
            taken @ Take::Taken { .. } => taken,
            Take::Short { closed, pending: p } => Take::Short {
                closed,
                pending: pending || p,
            },
        }
    }

    /// Whether a caller lost a CAS race on the first word since its last top-up: a hot key.
    pub(crate) fn contended(&self) -> bool {
        self.first().load() & CONTENDED != 0
    }

    /// Asks for a refill on the first word; `true` when this call set the flag.
    pub(crate) fn request_refill(&self) -> bool {
        self.first().request_refill()
    }

    /// Spreads the lease over one word per core, unless already spread or there is one core.
    /// Actor only.
    pub(crate) fn spread_out(&self) {
        self.spread_out_over(spread());
    }

    /// [`LeaseWords::spread_out`] over `n` extra words (a power of two, at most 8), whatever the
    /// machine's cores: the loom models spread over 2. Actor only.
    pub(crate) fn spread_out_over(&self, n: usize) {
        debug_assert!(n.is_power_of_two() && n <= 8, "{n} words");
        if n > 1 && self.extra.0.get().is_none() {
            // New words start closed, like the lease they join; the next top-up opens them all.
            let words = (0..n).map(|_| Padded(LeaseWord::new_closed())).collect();
            let _ = self.extra.0.set(Box::new(ExtraWords(words)));
            // Release, after the words are in place: a caller that sees the flag finds them
            // initialised (see `extra`).
            self.hot.spread.store(true, Ordering::Release);
        }
    }

    /// Adds `amount` nanotokens and opens every word. A hot key's top-up goes to its extra
    /// words, the emptiest first, so that they end as level as it allows, and then what the
    /// first word holds follows it the same way; the top-up goes to the first word instead when
    /// an even split would leave a part under `split_min` (and always for a quiet key). Returns
    /// what did not fit (which, by the first word's tokens, can exceed `amount`). Actor only.
    ///
    /// Levelling matters when threads spend unevenly, one thread alone on a spread key the
    /// extreme: an even split gave the drained word only half of what it had spent, so it stayed
    /// under its low-water share and asked for a refill every few calls. The first word is
    /// emptied because callers spend from it only once every extra word is short: tokens left
    /// there keep the lease looking full while the words callers spend from run low.
    pub(crate) fn top_up(&self, amount: u64, split_min: u64) -> u64 {
        let Some(extra) = self.extra() else {
            return self.first().top_up(amount);
        };
        let n = extra.len();
        if amount / n as u64 >= split_min.max(1) {
            // The new tokens first, so callers find them in their own words while the first
            // word's move; what the fill left (rounding, or full words) opens the first word.
            let mut left = self.first().top_up(fill(extra, amount));
            let moved = self.first().drain();
            let back = fill(extra, moved);
            if back > 0 && !self.first().refund(back) {
                left += back;
            }
            return left;
        }
        let left = self.first().top_up(amount);
        for word in extra.iter() {
            word.0.top_up(0);
        }
        left
    }

    /// Clears every word's `PENDING`. Actor only.
    pub(crate) fn clear_pending(&self) {
        for word in self.each() {
            word.clear_pending();
        }
    }

    /// Closes every word and returns all their unspent tokens. Actor only.
    pub(crate) fn close(&self) -> u64 {
        self.each().map(LeaseWord::close).sum()
    }

    /// Unspent tokens over all words (a snapshot).
    pub(crate) fn available(&self) -> u64 {
        self.each().map(LeaseWord::available).sum()
    }

    /// A combined snapshot: the tokens of all words, `CLOSED` from the first, `PENDING` from any.
    pub(crate) fn load(&self) -> u64 {
        let mut tokens = 0u64;
        let mut pending = 0;
        for word in self.each() {
            let w = word.load();
            tokens = tokens.saturating_add(w & TOKENS);
            pending |= w & PENDING;
        }
        tokens.min(TOKENS) | pending | (self.first().load() & CLOSED)
    }

    /// Puts `amount` back into the thread's word (or the first); `false` when the lease is closed
    /// or the word is full.
    pub(crate) fn refund(&self, amount: u64) -> bool {
        let own = self
            .extra()
            .is_some_and(|e| e[preferred() & (e.len() - 1)].0.refund(amount));
        own || self.first().refund(amount)
    }

    /// [`LeaseWords::refund`], only if the lease then holds at most `bound` nanotokens (the `B`
    /// of the overshoot bound); `false` when it would not, or is closed, or the word is full.
    /// The caller holds the slot's bookkeeping lock, which the actor's top-ups also take: with
    /// them excluded, nothing but a refund raises the lease, and callers' takes running beside
    /// it only lower it, so the lease stays within `bound` (`tests/models/loom_lease_words.rs`).
    pub(crate) fn refund_within(&self, amount: u64, bound: u64) -> bool {
        self.available().saturating_add(amount) <= bound && self.refund(amount)
    }
}
