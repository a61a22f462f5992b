//! The statements the store sends for plain takes and for returns, written out from one
//! definition of the refill and the grant.
//!
//! The table holds integers (migration 0007): tokens in whole nanotokens plus the femtotokens
//! below one (`frac`), rates in nanotokens per second, the database's clock in microseconds. PostgreSQL evaluates an expression as often as it is written and does not
//! share a common subexpression, and a helper function the planner cannot inline is run by the
//! SQL-function executor on every call (much slower than the expression). So each statement
//! spells the refill out, built here from the one definition below, and computes `now()` in
//! microseconds once for the refill (into `EXCLUDED`, from a parameter-free subquery that runs
//! once per execution), not once per use. The takes read the table only through their insert's
//! conflict check, the primary key's index, so no plan can scan it whatever the planner
//! believes of its size.
//! docs/design/statements.md has the measurements behind each choice.
//!
//! The refill of a row `(tokens, frac, updated_us)` at `now_us`, capacity `C`, rate `R`, is the
//! pure bucket's (`BucketState::refill`) to the femtotoken: with `e = max(0, now_us −
//! updated_us)` microseconds, the bucket gains `e × R` femtotokens, computed as one exact
//! `numeric` product `e × R + frac` and capped at the femtotokens that fill the bucket, `(C −
//! tokens) × 10⁶`; the capped sum's whole millions are the nanotokens added, its remainder the
//! new `frac` (zero once the bucket is full, since the cap is a whole number of nanotokens).
//! One multiplication in `numeric` makes a smaller expression than the same sum split into
//! `bigint` parts that cannot overflow, and the executor builds every expression of a statement
//! afresh each time it runs: the smaller tree cost the server less per statement (DESIGN.md
//! section 5). For the same reason the takes compute the capped sum once per row, in a
//! subquery of the `SET` ([`refill_and_take`]), instead of once for each column that needs it.

use std::sync::LazyLock;

use tokio_postgres::types::Type;

/// The femtotokens the bucket holds below its whole nanotokens plus what the refill since
/// `updated_us` adds (`max(0, now − updated_us) × rate`), as an exact `numeric`: one
/// multiplication, with no overflow whatever the elapsed time. `now` names the column with the
/// database's clock in microseconds.
fn femtotokens(row: &str, rate: &str, now: &str) -> String {
    format!("(greatest(0, {now} - {row}.updated_us)::numeric * {rate} + {row}.frac)")
}

/// [`femtotokens`] capped at the femtotokens that fill the bucket, `(capacity − tokens) ×
/// 10⁶`: the whole refill of the row in one exact `numeric`. Its whole millions (at most
/// `capacity − tokens`, negative when a row holds more than the capacity, its plan's capacity
/// lowered) are the nanotokens the refill adds, and its remainder the femtotokens left over,
/// zero once the bucket is full.
pub(super) fn capped_femtotokens(row: &str, capacity: &str, rate: &str, now: &str) -> String {
    let femto = femtotokens(row, rate, now);
    format!("least(({capacity} - {row}.tokens)::numeric * 1000000, {femto})")
}

/// The refilled whole nanotokens from the capped femtotokens `capped`: `tokens + capped /
/// 10⁶`, which is the capacity when the refill fills the bucket or the row holds more, and
/// never leaves bigint (the sum is capped in `numeric` before the cast).
pub(super) fn available_from(row: &str, capped: &str) -> String {
    format!("({row}.tokens + div({capped}, 1000000)::bigint)")
}

/// The femtotokens left over by the refill, from the capped femtotokens: zero once the bucket
/// is full.
pub(super) fn frac_from(capped: &str) -> String {
    format!("mod({capped}, 1000000)::integer")
}

/// The refilled whole nanotokens, capped at the capacity, written out in one expression (for
/// the returns, which are rare; the takes use [`refill_and_take`]).
pub(super) fn available(row: &str, capacity: &str, rate: &str, now: &str) -> String {
    available_from(row, &capped_femtotokens(row, capacity, rate, now))
}

/// The femtotokens left over by the refill, written out in one expression.
pub(super) fn refilled_frac(row: &str, capacity: &str, rate: &str, now: &str) -> String {
    frac_from(&capped_femtotokens(row, capacity, rate, now))
}

/// The grant from `available` whole nanotokens: the largest multiple of `step` up to `want`
/// and `available`, if it reaches `min`; else 0 (as `AcquireRequest::grantable`). Written with
/// `available` twice rather than the candidate twice: with `min` a multiple of `step` (the
/// store makes it one), the candidate `least(want, available / step × step)` reaches `min`
/// exactly when `available` and `want` both do, and a candidate of 0 grants 0 either way.
pub(super) fn grant(available: &str, min: &str, want: &str, step: &str) -> String {
    format!(
        "CASE WHEN {available} >= {min} AND {want} >= {min} \
         THEN least({want}, ({available}) / {step} * {step}) ELSE 0 END"
    )
}

/// Where a take's `min`, `want` and `step` come from: expressions the statement has at hand
/// ([`ACQUIRE_ONE`]'s parameters), or the elements at the request's position in the arrays of
/// [`ACQUIRE_MANY`], the position found once per row.
enum Amounts<'a> {
    /// `min`, `want`, `step` as they are.
    Given(&'a str, &'a str, &'a str),
    /// `position` (an expression giving the request's index), then the arrays of `min`, `want`
    /// and `step`.
    At(&'a str, (&'a str, &'a str, &'a str)),
}

/// The refill and the take of a row as one `SET` item: `(tokens, frac, refilled) = (SELECT
/// ...)`, a subquery that computes the capped femtotokens once (behind `OFFSET 0`, so the
/// planner does not copy the expression into each use), then the available nanotokens and the
/// new `frac` from it once (likewise), then the tokens left after the grant and the refilled
/// amount. Written out flat, the refill appeared four times for `tokens` and `refilled` and
/// twice more for `frac`; the executor initialises and evaluates every copy on each run, and
/// the subquery's two plan nodes cost less than the copies (docs/design/statements.md). With
/// [`Amounts::At`] the inner level also finds the request's position and the middle one reads
/// the amounts at it, each once per row.
fn refill_and_take(
    row: &str,
    (capacity, rate, now): (&str, &str, &str),
    amounts: Amounts<'_>,
) -> String {
    let capped = capped_femtotokens(row, capacity, rate, now);
    let available = available_from(row, "f.femto");
    let frac = frac_from("f.femto");
    let (position, picked, (min, want, step)) = match amounts {
        Amounts::Given(min, want, step) => (String::new(), String::new(), (min, want, step)),
        Amounts::At(position, (mins, wants, steps)) => (
            format!(", {position} AS n"),
            format!(", ({mins})[f.n] AS min_take, ({wants})[f.n] AS want, ({steps})[f.n] AS step"),
            ("refill.min_take", "refill.want", "refill.step"),
        ),
    };
    let granted = grant("refill.available", min, want, step);
    format!(
        "(tokens, frac, refilled) = ( \
             SELECT refill.available - ({granted}), refill.frac, refill.available \
             FROM (SELECT {available} AS available, {frac} AS frac{picked} \
                   FROM (SELECT {capped} AS femto{position} OFFSET 0) AS f \
                   OFFSET 0) AS refill)"
    )
}

/// The database's clock in whole microseconds since the Unix epoch.
pub(super) const NOW_US: &str = "(extract(epoch FROM now()) * 1000000)::bigint";

/// Refill and take for one key, in one statement: an upsert. A key without a row is inserted
/// as a full bucket less its grant; a key whose row exists and holds no strict lease is refilled
/// and taken from in `ON CONFLICT DO UPDATE`, which reads the request's capacity, rate and the
/// clock from `EXCLUDED` (so the clock is computed once) and `min`, `want`, `step` from the
/// parameters. A key whose row holds strict leases comes back without a row (the update's
/// `WHERE` fails), and `tokenlease_acquire_held` decides it. The refill and the take are one
/// `SET` item ([`refill_and_take`]). The row keeps the refilled amount before the take in
/// `refilled`, and the grant comes back as `refilled - tokens`: the grant's expression is
/// written once, not once for `tokens` and again for the answer.
///
/// `$1` text key, `$2` capacity, `$3` rate, `$4` min, `$5` want, `$6` step (bigint
/// nanotokens). Returns key, tokens, frac, the grant, updated_us and now_us.
pub(super) static ACQUIRE_ONE: LazyLock<String> = LazyLock::new(|| {
    let (capacity, rate, now) = (
        "excluded.capacity",
        "excluded.refill_per_second",
        "excluded.updated_us",
    );
    let take = refill_and_take("b", (capacity, rate, now), Amounts::Given("$4", "$5", "$6"));
    let granted_new = grant("$2", "$4", "$5", "$6");
    format!(
        "-- tokenlease: refill and take, one key (src/store/postgres/lean.rs)\n\
         INSERT INTO tokenlease_buckets AS b \
             (key, tokens, frac, capacity, refill_per_second, updated_us, refilled) \
         VALUES ($1, $2 - ({granted_new}), 0, $2, $3, {NOW_US}, $2) \
         ON CONFLICT (key) DO UPDATE \
         SET {take}, capacity = {capacity}, refill_per_second = {rate}, \
             updated_us = greatest(b.updated_us, {now}) \
         WHERE cardinality(b.leases) = 0 \
         RETURNING b.key, b.tokens, b.frac, b.refilled - b.tokens, b.updated_us, {NOW_US}"
    )
});

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
pub(super) static ACQUIRE_MANY: LazyLock<String> = LazyLock::new(|| {
    let (capacity, rate, now) = (
        "excluded.capacity",
        "excluded.refill_per_second",
        "excluded.updated_us",
    );
    let take = refill_and_take(
        "b",
        (capacity, rate, now),
        Amounts::At(
            "array_position($1::text[], excluded.key)",
            ("$4::bigint[]", "$5::bigint[]", "$6::bigint[]"),
        ),
    );
    let granted_new = grant("r.capacity", "r.min_take", "r.want", "r.step");
    format!(
        "-- tokenlease: refill and take, many keys (src/store/postgres/lean.rs)\n\
         INSERT INTO tokenlease_buckets AS b \
             (key, tokens, frac, capacity, refill_per_second, updated_us, refilled) \
         SELECT r.key, r.capacity - ({granted_new}), 0, r.capacity, r.rate, (SELECT {NOW_US}), \
                r.capacity \
         FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::bigint[], $5::bigint[], \
                     $6::bigint[]) AS r(key, capacity, rate, min_take, want, step) \
         ORDER BY r.key \
         ON CONFLICT (key) DO UPDATE \
         SET {take}, capacity = {capacity}, refill_per_second = {rate}, \
             updated_us = greatest(b.updated_us, {now}) \
         WHERE cardinality(b.leases) = 0 \
         RETURNING b.key, b.tokens, b.frac, b.refilled - b.tokens, b.updated_us, (SELECT {NOW_US})"
    )
});

/// Returns of unused lease tokens, idempotent by return id, for many distinct keys, in one
/// statement (a call naming a key twice sends it in rounds: `contain.rs`).
///
/// The ids are recorded first (`ON CONFLICT DO NOTHING`); only returns whose id this statement
/// recorded credit their bucket, so a retried return credits nothing. Then every such return's
/// key is upserted in key order, as the takes are ([`ACQUIRE_MANY`]): the rows are reached only
/// through the primary key's index, by the insert's conflict check, so no plan can scan the
/// table whatever the planner believes of its size (a generic plan made on an empty table is
/// kept by the session as the table grows). An existing row is refilled and credited, capped at
/// the capacity ([`credit_values`], its amount, holder and lease id read at the key's position
/// in the arrays, found once per row). A row with strict leases is refilled and capped by
/// migration 0003's functions (in tokens), less the tokens still out on its live leases, and a
/// strict return settles its lease: credited at most what the entry held, nothing once the entry
/// is gone. A key without a row is a full bucket: it is inserted as one (what an absent row
/// means), credited nothing, and idle cleanup removes it again. A credited row leaves `refilled`
/// at 0 and an inserted one at its capacity (at least one nanotoken), which tells them apart in
/// the answer.
///
/// `$1` bigint[] ids, `$2` text[] keys, `$3` bigint[] amounts, `$4` capacities, `$5` rates
/// (nanotokens), `$6` bigint[] holders (NULL: a relaxed lease), `$7` bigint[] lease ids.
/// Returns the credited keys.
pub(super) static GIVE_BACK: LazyLock<String> = LazyLock::new(|| {
    let values = credit_values().join(", ");
    format!(
        "-- tokenlease: return of unused lease tokens (src/store/postgres/lean.rs)\n\
         WITH fresh AS ( \
             INSERT INTO tokenlease_returns AS t (id, key, amount) \
             SELECT f.id, f.key, f.amount \
             FROM unnest($1::bigint[], $2::text[], $3::bigint[]) AS f(id, key, amount) \
             ORDER BY f.id \
             ON CONFLICT (id) DO NOTHING \
             RETURNING t.id), \
         upserted AS ( \
             INSERT INTO tokenlease_buckets AS b \
                 (key, tokens, frac, capacity, refill_per_second, updated_us, refilled) \
             SELECT q.key, q.capacity, 0, q.capacity, q.rate, (SELECT {NOW_US}), q.capacity \
             FROM unnest($1::bigint[], $2::text[], $4::bigint[], $5::bigint[]) \
                 AS q(id, key, capacity, rate) \
             WHERE q.id IN (SELECT fresh.id FROM fresh) \
             ORDER BY q.key \
             ON CONFLICT (key) DO UPDATE \
             SET (tokens, frac, capacity, refill_per_second, updated_us, refilled, leases) = ( \
                 SELECT {values} \
                 FROM (SELECT ($3::bigint[])[p.n] AS amount, excluded.capacity AS capacity, \
                              excluded.refill_per_second AS rate, \
                              excluded.updated_us AS now_us, ($6::bigint[])[p.n] AS holder, \
                              ($7::bigint[])[p.n] AS lease_id \
                       FROM (SELECT array_position($2::text[], excluded.key) AS n OFFSET 0) \
                           AS p \
                       OFFSET 0) AS r) \
             RETURNING b.key, b.refilled) \
         SELECT upserted.key FROM upserted WHERE upserted.refilled = 0"
    )
});

/// What a return sets on row `b` from request `r` (`r.amount`, `r.capacity`, `r.rate`,
/// `r.now_us`, `r.holder`, `r.lease_id`), in the order of [`CREDITED_COLUMNS`]: the refill and
/// the credit, capped at the capacity (the amount at the room left, so the sum never leaves
/// bigint), for a row without strict leases; migration 0003's functions (in tokens) for a row
/// with them, less the tokens still out on its live leases, a strict return settling its lease.
/// One definition for the plain store's statement and the Citus shards'.
fn credit_values() -> [String; 7] {
    let avail = available("b", "r.capacity", "r.rate", "r.now_us");
    // The credit is capped at the room left, `capacity − available` (at least 0: the refill
    // never leaves more than the capacity), before it is added: the sum is at most the
    // capacity, so no return overflows bigint, whatever its amount.
    let full = format!("r.amount >= r.capacity - ({avail})");
    let credited = format!("({avail}) + least(r.amount, r.capacity - ({avail}))");
    let frac = refilled_frac("b", "r.capacity", "r.rate", "r.now_us");
    // Rows with strict leases, in tokens: the leases after this return, what it credits, and
    // the new amount.
    let leases = "CASE WHEN r.holder IS NULL THEN tokenlease_hold(b.leases, now(), NULL, NULL, 0, 0) \
                  ELSE tokenlease_release(b.leases, now(), r.holder, r.lease_id) END";
    let held = format!(
        "least(greatest(0, r.capacity / 1000000000.0 - tokenlease_outstanding({leases}, now())), \
               tokenlease_refill_held(tokenlease_amount(b.tokens, b.frac), \
                                      r.capacity / 1000000000.0, r.rate / 1000000000.0, \
                                      timestamptz 'epoch' + b.updated_us * interval '1 microsecond', \
                                      b.leases, now()) \
               + CASE WHEN r.holder IS NULL THEN r.amount / 1000000000.0 \
                      ELSE tokenlease_release_credit(b.leases, now(), r.holder, r.lease_id, \
                                                     r.amount / 1000000000.0) END)"
    );
    [
        format!(
            "CASE WHEN cardinality(b.leases) = 0 THEN {credited} \
                  ELSE floor({held} * 1000000000)::bigint END"
        ),
        format!(
            "CASE WHEN cardinality(b.leases) = 0 \
                  THEN CASE WHEN {full} THEN 0 ELSE {frac} END \
                  ELSE (floor({held} * 1000000000000000) % 1000000)::integer END"
        ),
        "r.capacity".to_owned(),
        "r.rate".to_owned(),
        "greatest(b.updated_us, r.now_us)".to_owned(),
        "0".to_owned(),
        format!("CASE WHEN cardinality(b.leases) = 0 THEN b.leases ELSE {leases} END"),
    ]
}

/// The columns a return sets, in the order of [`credit_values`].
const CREDITED_COLUMNS: [&str; 7] = [
    "tokens",
    "frac",
    "capacity",
    "refill_per_second",
    "updated_us",
    "refilled",
    "leases",
];

/// [`credit_values`] as a `SET` list (`tokens = …, frac = …`), for a statement that joins the
/// request `r` to the row `b` itself (the Citus shards' return).
pub(super) fn credit_set() -> String {
    CREDITED_COLUMNS
        .iter()
        .zip(credit_values())
        .map(|(column, value)| format!("{column} = {value}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The first item of a statement's `FROM` that makes its transaction commit durably: it sets
/// `synchronous_commit` to `on` for the rest of the transaction (`set_config(..., true)`), its
/// commit included, when the session has it `off` (the store's default, docs/design/statements.md),
/// and leaves any other setting as it is. The call that follows names `durable.setting` in its first
/// argument (`CASE WHEN durable.setting IS NOT NULL THEN $1 END`, always `$1`), so it cannot run
/// before the setting is made: a `LATERAL` reference is evaluated first.
pub(super) const DURABLE: &str = "\
(SELECT set_config('synchronous_commit', \
                   CASE current_setting('synchronous_commit') WHEN 'off' THEN 'on' \
                        ELSE current_setting('synchronous_commit') END, true) AS setting) AS durable";

/// Refill and take through `tokenlease_acquire_held` (migration 0007): strict leases, and
/// takes on rows that hold strict leases. Parameters as [`ACQUIRE_MANY`], then `$7` holders,
/// `$8` lease ids, `$9` kept nanotokens, `$10` lifetimes in microseconds. Its commit is durable
/// whatever the session's `synchronous_commit` ([`DURABLE`]): a strict lease that a crash
/// forgot would let its holder spend tokens the bucket no longer counts.
pub(super) static ACQUIRE_HELD: LazyLock<String> = LazyLock::new(|| {
    format!(
        "-- tokenlease: refill and take with strict leases (src/store/postgres/lean.rs)\n\
         SELECT h.key, h.tokens, h.frac, h.granted, h.updated_us, h.now_us \
         FROM {DURABLE} \
         CROSS JOIN LATERAL tokenlease_acquire_held( \
             CASE WHEN durable.setting IS NOT NULL THEN $1::text[] END, $2::bigint[], $3::bigint[], \
             $4::bigint[], $5::bigint[], $6::bigint[], $7::bigint[], $8::bigint[], \
             $9::bigint[], $10::bigint[]) AS h"
    )
});

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
