//! The statements the store sends for plain takes and for returns, each written out whole in
//! its file of `sql/` (`acquire_one.sql`, `acquire_many.sql`, `give_back.sql`,
//! `acquire_held.sql`) and sent as [`super::sql::Form::OneLine`] joins it.
//!
//! The table holds integers (migration 0007): tokens in whole nanotokens plus the femtotokens
//! below one (`frac`), rates in nanotokens per second, the database's clock in microseconds.
//! PostgreSQL evaluates an expression as often as it is written and does not share a common
//! subexpression, and a helper function the planner cannot inline is run by the SQL-function
//! executor on every call (much slower than the expression). So each statement spells the
//! refill out, and computes `now()` in microseconds once for the refill (into `EXCLUDED`, from
//! a parameter-free subquery that runs once per execution), not once per use. The takes read
//! the table only through their insert's conflict check, the primary key's index, so no plan
//! can scan it whatever the planner believes of its size. docs/design/statements.md has the
//! measurements behind each choice.
//!
//! The refill of a row `(tokens, frac, updated_us)` at `now_us`, capacity `C`, rate `R`, is the
//! pure bucket's (`BucketState::refill`) to the femtotoken: with `e = max(0, now_us −
//! updated_us)` microseconds, the bucket gains `e × R` femtotokens, computed as one exact
//! `numeric` product, `greatest(0, now_us - b.updated_us)::numeric * rate + b.frac`, and capped
//! at the femtotokens that fill the bucket, `least((capacity - b.tokens)::numeric * 1000000,
//! ...)`; the capped sum's whole millions (`div(.., 1000000)`) are the nanotokens added, its
//! remainder (`mod(.., 1000000)`) the new `frac` (zero once the bucket is full, since the cap is
//! a whole number of nanotokens). One multiplication in `numeric` makes a smaller expression
//! than the same sum split into `bigint` parts that cannot overflow, and the executor builds
//! every expression of a statement afresh each time it runs: the smaller tree cost the server
//! less per statement. For the same reason the takes compute the capped sum once per row, in a
//! subquery of the `SET` (`(tokens, frac, refilled) = (SELECT ... FROM (SELECT <available>,
//! <frac> FROM (SELECT <capped sum> AS femto OFFSET 0) AS f OFFSET 0) AS refill)`: the
//! `OFFSET 0`s keep the planner from copying the expressions back into each use), instead of
//! once for each column that needs it.
//!
//! The grant from `available` whole nanotokens is `CASE WHEN available >= min AND want >= min
//! THEN least(want, available / step * step) ELSE 0 END`: the largest multiple of `step` up to
//! `want` and `available`, if it reaches `min`; else 0 (as `AcquireRequest::grantable`). It is
//! written with `available` twice rather than the candidate twice: with `min` a multiple of
//! `step` (the store makes it one), the candidate reaches `min` exactly when `available` and
//! `want` both do.

use std::sync::LazyLock;

use tokio_postgres::types::Type;

use super::sql;

/// Refill and take for one key, in one statement: an upsert. A key without a row is inserted
/// as a full bucket less its grant; a key whose row exists and holds no strict lease is refilled
/// and taken from in `ON CONFLICT DO UPDATE`, which reads the request's capacity, rate and the
/// clock from `EXCLUDED` (so the clock is computed once) and `min`, `want`, `step` from the
/// parameters. A key whose row holds strict leases comes back without a row (the update's
/// `WHERE` fails), and `tokenlease_acquire_held` decides it. The refill and the take are one
/// `SET` item (above). The row keeps the refilled amount before the take in
/// `refilled`, and the grant comes back as `refilled - tokens`: the grant's expression is
/// written once, not once for `tokens` and again for the answer.
///
/// `$1` text key, `$2` capacity, `$3` rate, `$4` min, `$5` want, `$6` step (bigint
/// nanotokens). Returns key, tokens, frac, the grant, updated_us and now_us.
pub(super) static ACQUIRE_ONE: LazyLock<String> = LazyLock::new(|| sql::ACQUIRE_ONE.render([]));

/// Refill and take for many distinct keys, in one statement: an upsert of every key, in key
/// order. A key without a row is inserted as a full bucket less its grant; a key whose row
/// exists and holds no strict lease is refilled and taken from in `ON CONFLICT DO UPDATE`, as in
/// [`ACQUIRE_ONE`]: capacity, rate and the clock from `EXCLUDED`, and `min`, `want`, `step` from
/// the parameter arrays at the key's position (`array_position` on the keys, once per row: the
/// proposed row holds only the table's columns). A key whose row holds strict leases comes back
/// without a row (locked, not updated), and `tokenlease_acquire_held` decides it.
///
/// Every row is reached through the primary key's unique index, by the conflict check of the
/// insert: the statement reads the table nowhere else, so no plan can scan it, whatever the
/// planner believes of its size (a generic plan made on an empty table is kept by the session
/// as the table grows). The clock is an uncorrelated subquery, computed once per execution.
///
/// Deadlock-free: the rows are inserted or locked one at a time in key order (the `ORDER BY`
/// below the insert), and a statement waits only on the key it has reached, holding only
/// smaller ones, so no two statements wait on each other in a cycle. (An earlier form locked
/// the existing rows in key order and inserted the new keys after, also in key order, and
/// deadlocked: a statement whose snapshot predated another's insert of a key K locked K as an
/// existing row, then waited to insert a smaller key M that the other had inserted before it
/// waited on K. One pass in one order has no second phase to wait in.) A row another caller
/// committed after this statement's snapshot is updated as it now stands, as the upsert of
/// one key is. Keys must be distinct: a key twice in one call fails the statement (PostgreSQL
/// refuses to update a row twice in one command).
///
/// `$1` text[] keys, `$2`..`$6` bigint[] as [`ACQUIRE_ONE`]'s. Returns key, tokens, frac, the
/// grant, updated_us and now_us.
pub(super) static ACQUIRE_MANY: LazyLock<String> =
    LazyLock::new(|| sql::ACQUIRE_MANY.render(["tokenlease_buckets"]));

/// Returns of unused lease tokens, idempotent by return id, for many distinct keys, in one
/// statement (a call naming a key twice sends it in rounds: `contain.rs`).
///
/// The ids are recorded first (`ON CONFLICT DO NOTHING`); only returns whose id this statement
/// recorded credit their bucket, so a retried return credits nothing. Then every such return's
/// key is upserted in key order, as the takes are ([`ACQUIRE_MANY`]): the rows are reached only
/// through the primary key's index, by the insert's conflict check, so no plan can scan the
/// table whatever the planner believes of its size (a generic plan made on an empty table is
/// kept by the session as the table grows). An existing row is refilled and credited, capped at
/// the capacity (the credit capped at the room left, `capacity − available`, before it is
/// added, so the sum never leaves bigint, whatever the amount; its amount, holder and lease id
/// read at the key's position in the arrays, found once per row). A row with strict leases is
/// refilled and capped by migration 0003's functions (in tokens), less the tokens still out on its live leases, and a
/// strict return settles its lease: credited at most what the entry held, nothing once the entry
/// is gone. A key without a row is a full bucket: it is inserted as one (what an absent row
/// means), credited nothing, and idle cleanup removes it again. A credited row leaves `refilled`
/// at 0 and an inserted one at its capacity (at least one nanotoken), which tells them apart in
/// the answer.
///
/// `$1` bigint[] ids, `$2` text[] keys, `$3` bigint[] amounts, `$4` capacities, `$5` rates
/// (nanotokens), `$6` bigint[] holders (NULL: a relaxed lease), `$7` bigint[] lease ids.
/// Returns the credited keys.
pub(super) static GIVE_BACK: LazyLock<String> = LazyLock::new(|| sql::GIVE_BACK.render([]));

/// Refill and take through `tokenlease_acquire_held` (migration 0007): strict leases, and
/// takes on rows that hold strict leases. Parameters as [`ACQUIRE_MANY`], then `$7` holders,
/// `$8` lease ids, `$9` kept nanotokens, `$10` lifetimes in microseconds. Its commit is durable
/// whatever the session's `synchronous_commit`: a strict lease that a crash forgot would let its
/// holder spend tokens the bucket no longer counts. The statement's first `FROM` item, `durable`,
/// sets `synchronous_commit` to `on` for the rest of the transaction (`set_config(..., true)`),
/// its commit included, when the session has it `off`, and leaves any other setting as it is;
/// the call names `durable.setting` in its first argument (`CASE WHEN durable.setting IS NOT
/// NULL THEN $1 END`, always `$1`), so it cannot run before the setting is made: a `LATERAL`
/// reference is evaluated first.
pub(super) static ACQUIRE_HELD: LazyLock<String> = LazyLock::new(|| sql::ACQUIRE_HELD.render([]));

/// The parameter types of [`ACQUIRE_ONE`]: the key, then capacity, rate, min, want, step.
pub(super) const ONE_TYPES: [Type; 6] = [
    Type::TEXT,
    Type::INT8,
    Type::INT8,
    Type::INT8,
    Type::INT8,
    Type::INT8,
];

/// The parameter types of [`ACQUIRE_MANY`] (and of `tokenlease_acquire_held`'s first six).
pub(super) const MANY_TYPES: [Type; 6] = [
    Type::TEXT_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
];

/// The parameter types of [`GIVE_BACK`]: ids, keys, amounts, capacities, rates, holders,
/// lease ids.
pub(super) const GIVE_BACK_TYPES: [Type; 7] = [
    Type::INT8_ARRAY,
    Type::TEXT_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
];

/// The statements of every decision with their parameter types, as the store sends them: what
/// a new session prepares before it serves a call.
pub(super) fn warm_statements() -> [(&'static str, &'static [Type]); 3] {
    [
        (ACQUIRE_ONE.as_str(), &ONE_TYPES),
        (ACQUIRE_MANY.as_str(), &MANY_TYPES),
        (GIVE_BACK.as_str(), &GIVE_BACK_TYPES),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every statement names each parameter it is sent (a missing `$n` would make the server
    /// infer a type, or refuse the statement).
    #[test]
    fn statements_use_their_parameters() {
        for (sql, n) in [
            (&*ACQUIRE_ONE, 6),
            (&*ACQUIRE_MANY, 6),
            (&*GIVE_BACK, 7),
            (&*ACQUIRE_HELD, 10),
        ] {
            for i in 1..=n {
                assert!(sql.contains(&format!("${i}")), "${i} missing in {sql}");
            }
            assert!(!sql.contains(&format!("${}", n + 1)), "{sql}");
        }
    }
}
