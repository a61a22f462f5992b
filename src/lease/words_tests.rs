//! Unit tests of `words.rs`, apart from it so that the loom models, which compile `words.rs`
//! against loom's atomics, do not compile them too (they run real threads).

use super::slab::Hot;
use super::word::{CLOSED, Take};
use super::words::{Extra, LeaseWords, Padded, level};

/// A spread lease keeps every nanotoken: what threads take plus what `close` returns is what
/// was topped up, and a caller finds tokens in any word, the first included.
#[test]
fn a_spread_lease_conserves_tokens_across_threads() {
    let (hot, extra) = (Hot::new_pending(), Extra::default());
    let words = LeaseWords::new(&hot, &extra);
    hot.word.top_up(3); // held before the key turned hot
    words.spread_out();
    let n = words.extra().map_or(0, <[Padded]>::len) as u64;
    let topped = 10_000 * n.max(1);
    assert_eq!(words.top_up(topped, 1), 0);
    assert_eq!(words.available(), topped + 3);
    let taken: u64 = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    let mut taken = 0;
                    while let Take::Taken { .. } = words.try_take(7, 0) {
                        taken += 7;
                    }
                    taken
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(0)).sum()
    });
    let returned = words.close();
    assert_eq!(taken + returned, topped + 3);
    assert!(matches!(
        words.try_take(1, 0),
        Take::Short { closed: true, .. }
    ));
}

/// The water fill: the emptiest words are raised together, a fuller one gets nothing, and
/// the parts never add up to more than the amount.
#[test]
fn level_fills_the_emptiest_words_first() {
    let gifts = level([10, 100].into_iter(), 50);
    assert_eq!(&gifts[..2], &[50, 0]);
    let gifts = level([10, 100].into_iter(), 190);
    assert_eq!(&gifts[..2], &[140, 50]);
    let gifts = level([7, 7, 7, 7].into_iter(), 10);
    assert_eq!(&gifts[..4], &[2, 2, 2, 2]);
    let gifts = level([0, 30, 5, 1000].into_iter(), 40);
    assert_eq!(&gifts[..4], &[22, 0, 17, 0]);
    // Near the word's limit: no overflow, and the line is rounded down.
    let gifts = level([1 << 55, 3].into_iter(), 1 << 55);
    assert_eq!(&gifts[..2], &[1, (1 << 55) - 2]);
    for amount in [0, 1, 99, 12_345] {
        let gifts = level([3, 900, 41, 41, 0, 17, 2, 8].into_iter(), amount);
        assert!(gifts.iter().sum::<u64>() <= amount);
        assert!(
            amount - gifts.iter().sum::<u64>() < 8,
            "rounding loses under one per word"
        );
    }
}

/// A spread key spent by one thread alone: every top-up refills the word that thread
/// drained, so the words end level and the drained one is back above its low-water share.
#[test]
fn a_top_up_refills_the_word_that_was_drained() {
    let (hot, extra) = (Hot::new_pending(), Extra::default());
    let words = LeaseWords::new(&hot, &extra);
    words.spread_out();
    let Some(n) = words.extra().map(<[Padded]>::len) else {
        return; // one core: nothing is spread
    };
    assert_eq!(words.top_up(1000 * n as u64, 1), 0);
    let own = &words.extra().expect("spread")[0].0;
    for _ in 0..600 {
        assert!(matches!(own.try_take(1, 0), Take::Taken { .. }));
    }
    assert_eq!(words.top_up(600, 1), 0);
    let each: Vec<u64> = words
        .extra()
        .expect("spread")
        .iter()
        .map(|w| w.0.available())
        .collect();
    assert!(each.iter().all(|&a| a == 1000), "{each:?}");
    assert_eq!(words.available(), 1000 * n as u64);
}

/// A top-up too small to split goes to the first word whole, and still opens every word.
#[test]
fn a_small_top_up_goes_to_the_first_word() {
    let (hot, extra) = (Hot::new_pending(), Extra::default());
    let words = LeaseWords::new(&hot, &extra);
    words.spread_out();
    assert_eq!(words.top_up(5, 100), 0);
    assert_eq!(hot.word.available(), 5);
    assert_eq!(words.load() & CLOSED, 0);
    assert!(matches!(words.try_take(5, 0), Take::Taken { left: 0, .. }));
}
