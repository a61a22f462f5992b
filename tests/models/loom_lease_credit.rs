//! A4 (docs/testing.md): model-check credit (`src/lease/credit.rs`) beside the lease word
//! (`src/lease/word.rs`) with loom: callers that find a new key's lease empty are admitted on
//! credit while the actor applies the key's grant.
//!
//! Both files are compiled into this test a second time, with `super::sync` resolving to the
//! `model` half of the lease core's shim (loom's atomics and mutex). The slot's bookkeeping
//! lock and its `credited` count are modelled by a loom mutex over a number: callers give
//! credit holding it, and the actor pays credit and adds the grant to the count holding it, as
//! `Leases::credit` and `actor/refill.rs::apply` do.
//!
//! The model: a new key's word (closed, a refill pending), a largest lease `B` of 2 tokens, two
//! callers taking 1 token twice each (a take the word refuses asks for credit), and an actor
//! that applies a grant of 2 (it pays the credit owed, puts the rest into the word), then closes
//! the lease (expiry). In every interleaving:
//!
//! - conservation: `taken + credit + returned == granted + owed`, exactly (a credit is paid by
//!   the grant or still owed; a granted token is taken, pays credit, or goes back);
//! - the bound: what the word held right after the grant and all credit given after it add up
//!   to at most `B`, and so does all credit given before it: the tokens no grant in a window
//!   paid for are at most `B` per key, whatever window (`docs/design/leases.md`).
//!
//! Preemption bound 2 unless `LOOM_MAX_PREEMPTIONS` says otherwise.

use loom::sync::Arc;
use loom::thread;

#[path = "../../src/lease/sync.rs"]
#[allow(dead_code, unused_imports, clippy::duplicate_mod)]
mod shim;
use shim::model as sync;

#[path = "../../src/lease/word.rs"]
#[allow(dead_code, clippy::duplicate_mod)]
mod word;

#[path = "../../src/lease/credit.rs"]
#[allow(dead_code, clippy::duplicate_mod)]
mod credit;

use credit::Credit;
use sync::Mutex;
use word::{LeaseWord, Take};

/// The slot's largest lease.
const B: u64 = 2;
/// The grant the actor applies.
const GRANT: u64 = 2;
/// The slot's record index.
const SLOT: u32 = 7;

fn builder() -> loom::model::Builder {
    let mut builder = loom::model::Builder::new();
    if std::env::var_os("LOOM_MAX_PREEMPTIONS").is_none() {
        builder.preemption_bound = Some(2);
    }
    builder
}

/// The slot's bookkeeping: tokens its grants brought (`Book::credited`), and what the word held
/// right after the grant (a ghost for the check; `None` before it).
#[derive(Default)]
struct Book {
    credited: u64,
    held_after_grant: Option<u64>,
}

/// What one caller did: (taken from the word, credit before the grant, credit after it).
fn caller(word: &LeaseWord, book: &Mutex<Book>, ledger: &Credit) -> (u64, u64, u64) {
    let mut did = (0, 0, 0);
    for _ in 0..2 {
        match word.try_take(1, 0) {
            Take::Taken { .. } => did.0 += 1,
            Take::Short { .. } => {
                let book = book.lock();
                if ledger.give(SLOT, book.credited, 1, B) {
                    if book.held_after_grant.is_some() {
                        did.2 += 1;
                    } else {
                        did.1 += 1;
                    }
                }
            }
        }
    }
    did
}

#[test]
fn credit_is_paid_or_owed_and_stays_within_the_bound_in_every_interleaving() {
    builder().check(|| {
        let word = Arc::new(LeaseWord::new_pending());
        let book = Arc::new(Mutex::new(Book::default()));
        let ledger = Arc::new(Credit::new());
        let callers: Vec<_> = (0..2)
            .map(|_| {
                let (word, book, ledger) =
                    (Arc::clone(&word), Arc::clone(&book), Arc::clone(&ledger));
                thread::spawn(move || caller(&word, &book, &ledger))
            })
            .collect();
        let actor = {
            let (word, book, ledger) = (Arc::clone(&word), Arc::clone(&book), Arc::clone(&ledger));
            thread::spawn(move || {
                let paid = {
                    let mut book = book.lock();
                    let paid = ledger.pay(SLOT, GRANT);
                    book.credited += GRANT;
                    assert_eq!(word.top_up(GRANT - paid), 0);
                    book.held_after_grant = Some(GRANT - paid);
                    paid
                };
                (paid, word.close())
            })
        };
        let did: Vec<(u64, u64, u64)> = callers
            .into_iter()
            .map(|h| h.join().expect("caller"))
            .collect();
        let (paid, returned) = actor.join().expect("actor");
        let returned = returned + word.close();
        let taken: u64 = did.iter().map(|d| d.0).sum();
        let before: u64 = did.iter().map(|d| d.1).sum();
        let after: u64 = did.iter().map(|d| d.2).sum();
        let owed = ledger.owed(SLOT);
        assert!(paid <= before + after, "paid {paid} of {before} + {after}");
        assert_eq!(
            taken + before + after + returned,
            GRANT + owed,
            "taken {taken}, credit {before} + {after}, returned {returned}, owed {owed}"
        );
        assert_eq!(before + after, paid + owed, "credit is paid or owed");
        let held = book.lock().held_after_grant.expect("granted");
        assert!(
            held + after <= B,
            "the lease held {held} after the grant and {after} more was credited"
        );
        assert!(before <= B, "{before} credited before the grant");
    });
}
