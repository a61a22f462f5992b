//! Models without a database: the pure token bucket's properties against an exact reference
//! (A1–A3, proptest) and the lease core model-checked by loom in every interleaving (A4). One
//! module per former test binary; they keep a core busy for seconds, so nextest runs them in
//! its `serial` group. Beside them, `arrows` reads the crate's source and checks that its
//! modules depend on each other one way (L1; a fraction of a second), `clock_reads` that
//! the library reads time only through its clock (L2), `file_lengths` that each source
//! file of the library states its role and none is past a 2,000-line net (L3), and `test_sleeps` that every sleep in the tests is
//! the shared poll helper's or says why it is there (L4); `readme` that the README's and the
//! docs' Rust blocks hide no lines and that the README opens with a whole program.
//!
//! `loom_lease_word`, `loom_lease_words` and `loom_lease_credit` each compile `src/lease/sync.rs`
//! and `src/lease/word.rs` (`loom_lease_credit` also `src/lease/credit.rs`) as modules of their
//! own (hence `clippy::duplicate_mod` allowed there): each model is self-contained, as when they
//! were separate binaries.

mod arrows;
mod bucket_props;
mod clock_reads;
mod doc_paths;
mod file_lengths;
mod loom_lease_credit;
mod loom_lease_word;
mod loom_lease_words;
mod readme;
mod test_sleeps;
