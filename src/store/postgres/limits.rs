//! The statements for buckets of several limits ("10 a second and 10,000 a day" on one key),
//! written in `sql/acquire_limits.sql` and `sql/give_back_limits.sql` with the refill of
//! `lean.rs`'s statements.
//!
//! A key keeps one row. Its first limit (the one of the smallest capacity) is in the columns
//! every row has, so a row written by a plan of one limit is a bucket of one limit and the
//! statements of `lean.rs` are unchanged; the other limits are in the arrays of migration 0010:
//! `more_tokens` and `more_frac` (each limit's whole nanotokens and femtotokens, as of the row's
//! `updated_us`), `more_capacity` and `more_rate` (as the request last gave them). A limit the
//! row does not hold (`NULL`, a row written before the limit was added) is full, as an absent
//! row is.
//!
//! One statement decides a batch of keys: an upsert, in key order, as [`super::lean::ACQUIRE_MANY`]
//! is. Its `ON CONFLICT DO UPDATE` refills every limit of the row to the same `now()`, grants
//! from the least of them (as `lean.rs`'s grant: a multiple of the step, between `min` and `want`)
//! and takes the grant from each: one row lock, so the take is atomic across the limits, and
//! two callers never both take the last token of any limit. The other limits' refill is the
//! first's, element by element (`generate_subscripts` over the request's capacities).

use std::sync::LazyLock;

use tokio_postgres::Row;
use tokio_postgres::types::{ToSql, Type};

use super::rows::{NANO, micros, nanos_down, shape};
use super::sql;
use crate::bucket::Tokens;
use crate::clock::timestamp_from_system_time;
use crate::store::{AcquireRequest, Acquired, GiveBack, StoreError, nanos as nanos_duration};

/// Refill and take for many distinct keys of several limits, in one statement.
///
/// `$1` text[] keys, `$2` first capacities, `$3` first rates, `$4` mins, `$5` wants, `$6`
/// steps (bigint[] nanotokens, as [`super::lean::ACQUIRE_MANY`]), `$7` bigint[] the other limits'
/// capacities and `$8` their rates, every request's after the other's, `$9` integer[] where
/// each request's start in `$7` (1-based) and `$10` how many it has. Returns key, tokens, frac,
/// the grant, updated_us, now_us (as the plain take), then the other limits' tokens and fracs.
pub(super) static ACQUIRE_LIMITS: LazyLock<String> =
    LazyLock::new(|| sql::ACQUIRE_LIMITS.render([]));

/// Returns of unused lease tokens to buckets of several limits, idempotent by return id, for
/// many distinct keys in one statement: as [`super::lean::GIVE_BACK`] without strict leases (a plan
/// of several limits holds none), each limit refilled and credited the amount, capped at its
/// capacity.
///
/// `$1` bigint[] ids, `$2` text[] keys, `$3` bigint[] amounts, `$4` first capacities, `$5`
/// first rates, `$6` the other capacities and `$7` rates (flat, as [`ACQUIRE_LIMITS`]'s `$7`
/// and `$8`), `$8` integer[] starts and `$9` counts. Returns the credited keys.
pub(super) static GIVE_BACK_LIMITS: LazyLock<String> =
    LazyLock::new(|| sql::GIVE_BACK_LIMITS.render([]));

/// The call of a Citus node's `tokenlease_citus_take_limits` (created by `citus/sql.rs`):
/// `$1` the route (a key of the node), then [`ACQUIRE_LIMITS`]'s parameters; its rows as
/// that statement's.
pub(super) static CITUS_TAKE_LIMITS: LazyLock<String> =
    LazyLock::new(|| sql::CITUS_TAKE_LIMITS.render([]));

/// The call of a Citus node's `tokenlease_citus_give_back_limits`: `$1` the route, then
/// [`GIVE_BACK_LIMITS`]'s parameters; the keys credited.
pub(super) static CITUS_GIVE_BACK_LIMITS: LazyLock<String> =
    LazyLock::new(|| sql::CITUS_GIVE_BACK_LIMITS.render([]));

/// The parameter types of [`ACQUIRE_LIMITS`].
pub(super) const LIMITS_TYPES: [Type; 10] = [
    Type::TEXT_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT4_ARRAY,
    Type::INT4_ARRAY,
];

/// The parameter types of [`GIVE_BACK_LIMITS`].
pub(super) const GIVE_BACK_LIMITS_TYPES: [Type; 9] = [
    Type::INT8_ARRAY,
    Type::TEXT_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT8_ARRAY,
    Type::INT4_ARRAY,
    Type::INT4_ARRAY,
];

/// The other limits of a batch as flat arrays: capacities, rates, each bucket's start
/// (1-based) and count.
#[derive(Default)]
pub(super) struct MoreLimits {
    caps: Vec<i64>,
    rates: Vec<i64>,
    first: Vec<i32>,
    count: Vec<i32>,
}

impl MoreLimits {
    /// Adds `bucket`'s limits beyond the first.
    fn push(&mut self, key: &str, bucket: &crate::bucket::BucketConfig) -> Result<(), StoreError> {
        self.first
            .push(i32::try_from(self.caps.len() + 1).unwrap_or(i32::MAX));
        let mut n = 0;
        for limit in bucket.limits().skip(1) {
            let (capacity, rate) = shape(key, &limit)?;
            self.caps.push(capacity);
            self.rates.push(rate);
            n += 1;
        }
        self.count.push(n);
        Ok(())
    }
}

/// The parameters of [`ACQUIRE_LIMITS`] for the requests at `which`.
pub(super) struct LimitTakes<'a> {
    takes: super::rows::Takes<'a>,
    more: MoreLimits,
}

impl<'a> LimitTakes<'a> {
    pub(super) fn new(
        requests: &[AcquireRequest<'a>],
        which: &[usize],
    ) -> Result<Self, StoreError> {
        let takes = super::rows::Takes::new(requests, which)?;
        let mut more = MoreLimits::default();
        for &i in which {
            more.push(requests[i].key, &requests[i].bucket)?;
        }
        Ok(LimitTakes { takes, more })
    }

    pub(super) fn params(&self) -> Vec<(&(dyn ToSql + Sync), Type)> {
        let mut params = self.takes.params();
        let values: [&(dyn ToSql + Sync); 4] = [
            &self.more.caps,
            &self.more.rates,
            &self.more.first,
            &self.more.count,
        ];
        params.extend(values.into_iter().zip(LIMITS_TYPES[6..].iter().cloned()));
        params
    }
}

/// The parameters of [`GIVE_BACK_LIMITS`] for the returns at `which`.
pub(super) struct LimitReturns<'a> {
    ids: Vec<i64>,
    keys: Vec<&'a str>,
    amounts: Vec<i64>,
    capacities: Vec<i64>,
    rates: Vec<i64>,
    more: MoreLimits,
}

impl<'a> LimitReturns<'a> {
    pub(super) fn new(returns: &[GiveBack<'a>], which: &[usize]) -> Result<Self, StoreError> {
        let mut out = LimitReturns {
            ids: Vec::with_capacity(which.len()),
            keys: Vec::with_capacity(which.len()),
            amounts: Vec::with_capacity(which.len()),
            capacities: Vec::with_capacity(which.len()),
            rates: Vec::with_capacity(which.len()),
            more: MoreLimits::default(),
        };
        for &i in which {
            let ret = &returns[i];
            let (capacity, rate) = shape(ret.key, &ret.bucket)?;
            out.ids.push(ret.id);
            out.keys.push(ret.key);
            // Rounded down: a return never credits more than it holds.
            out.amounts.push(nanos_down(ret.amount));
            out.capacities.push(capacity);
            out.rates.push(rate);
            out.more.push(ret.key, &ret.bucket)?;
        }
        Ok(out)
    }

    pub(super) fn params(&self) -> Vec<(&(dyn ToSql + Sync), Type)> {
        let values: [&(dyn ToSql + Sync); 9] = [
            &self.ids,
            &self.keys,
            &self.amounts,
            &self.capacities,
            &self.rates,
            &self.more.caps,
            &self.more.rates,
            &self.more.first,
            &self.more.count,
        ];
        values.into_iter().zip(GIVE_BACK_LIMITS_TYPES).collect()
    }
}

impl super::PostgresStore {
    /// The takes of several limits among `pending` (keys of one Citus node): one call of the
    /// node's `tokenlease_citus_take_limits`, which runs `citus/sql/take_limits_shard.sql` on
    /// each of the node's shards the keys are in. What it decides leaves `pending`; a strict lease among
    /// them, or a row holding strict leases, is an error, as on plain PostgreSQL.
    pub(super) async fn citus_take_limits(
        &self,
        deadline: tokio::time::Instant,
        requests: &[AcquireRequest<'_>],
        pending: &mut Vec<usize>,
        out: &mut [Option<Acquired>],
    ) -> Result<(), StoreError> {
        let multi = split_off(requests, pending)?;
        let Some(&first) = multi.first() else {
            return Ok(());
        };
        let route = requests[first].key;
        let t = LimitTakes::new(requests, &multi)?;
        let mut params: Vec<(&(dyn ToSql + Sync), Type)> = vec![(&route, Type::TEXT)];
        params.extend(t.params());
        let rows = self
            .query_by(deadline, CITUS_TAKE_LIMITS.as_str(), &params)
            .await?;
        file_all(&rows, requests, multi, out)
    }

    /// The returns of several limits among `group` (keys of one Citus node), through the
    /// node's `tokenlease_citus_give_back_limits`; `group` keeps the others. The keys
    /// credited.
    pub(super) async fn citus_give_back_limits(
        &self,
        deadline: tokio::time::Instant,
        returns: &[GiveBack<'_>],
        group: &mut Vec<usize>,
    ) -> Result<std::collections::HashSet<String>, StoreError> {
        let (multi, single): (Vec<usize>, Vec<usize>) =
            group.iter().partition(|&&i| returns[i].bucket.is_multi());
        *group = single;
        let mut credited = std::collections::HashSet::new();
        let Some(&first) = multi.first() else {
            return Ok(credited);
        };
        let route = returns[first].key;
        let r = LimitReturns::new(returns, &multi)?;
        let mut params: Vec<(&(dyn ToSql + Sync), Type)> = vec![(&route, Type::TEXT)];
        params.extend(r.params());
        for row in self
            .query_by(deadline, CITUS_GIVE_BACK_LIMITS.as_str(), &params)
            .await?
        {
            credited.insert(row.try_get::<_, String>(0).map_err(StoreError::from)?);
        }
        Ok(credited)
    }
}

/// Moves the takes of several limits at `pending` into the list it returns; `pending` keeps
/// the others. A strict lease among them is an error: such plans hold none (the policy refuses
/// them).
pub(super) fn split_off(
    requests: &[AcquireRequest<'_>],
    pending: &mut Vec<usize>,
) -> Result<Vec<usize>, StoreError> {
    let (multi, single): (Vec<usize>, Vec<usize>) = pending
        .iter()
        .partition(|&&i| requests[i].bucket.is_multi());
    *pending = single;
    match multi.iter().find(|&&i| requests[i].hold.is_some()) {
        Some(&i) => Err(strict_refused(requests[i].key)),
        None => Ok(multi),
    }
}

/// Files the rows of a take of several limits under `multi`'s requests, as `rows::file_rows`
/// does; a request left without a row is on a row that holds strict leases (written by a plan
/// of one limit): not decided, an error.
pub(super) fn file_all(
    rows: &[Row],
    requests: &[AcquireRequest<'_>],
    mut multi: Vec<usize>,
    out: &mut [Option<Acquired>],
) -> Result<(), StoreError> {
    super::rows::file_rows_by(rows, requests, &mut multi, out, acquired)?;
    match multi.first() {
        Some(&i) => Err(strict_row(requests[i].key)),
        None => Ok(()),
    }
}

/// The error of a strict lease asked of a bucket of several limits.
pub(super) fn strict_refused(key: &str) -> StoreError {
    StoreError::Protocol(format!(
        "key {key:?}: strict leases on a bucket of several limits are not supported"
    ))
}

/// The error of a take of several limits on a row that holds strict leases (written by a plan
/// of one limit): not decided.
pub(super) fn strict_row(key: &str) -> StoreError {
    StoreError::Protocol(format!(
        "key {key:?}: its row holds strict leases, which a bucket of several limits does not keep"
    ))
}

/// What the store did with `request` (a bucket of several limits), from a row of
/// [`ACQUIRE_LIMITS`]: the grant, the tokens of the limit that holds fewest, and the wait until
/// every limit holds `min` (the longest of the limits' waits).
pub(super) fn acquired(request: &AcquireRequest<'_>, row: &Row) -> Result<Acquired, StoreError> {
    let get =
        |idx: usize| -> Result<i64, StoreError> { row.try_get(idx).map_err(StoreError::from) };
    let amount = |nanos: i64, femto: i32| {
        Tokens::from_atto(
            u128::try_from(nanos).unwrap_or(0) * NANO + u128::try_from(femto).unwrap_or(0) * 1_000,
        )
    };
    let frac: i32 = row.try_get(2).map_err(StoreError::from)?;
    let mut remaining = vec![amount(get(1)?, frac)];
    let more_tokens: Option<Vec<i64>> = row.try_get(6).map_err(StoreError::from)?;
    let more_frac: Option<Vec<i32>> = row.try_get(7).map_err(StoreError::from)?;
    let (more_tokens, more_frac) = (
        more_tokens.unwrap_or_default(),
        more_frac.unwrap_or_default(),
    );
    for (i, &t) in more_tokens.iter().enumerate() {
        remaining.push(amount(t, more_frac.get(i).copied().unwrap_or(0)));
    }
    let granted = Tokens::from_atto(u128::try_from(get(3)?).unwrap_or(0) * NANO);
    let updated_at = timestamp_from_system_time(micros(row, 4)?);
    let store_now = micros(row, 5)?;
    let now = timestamp_from_system_time(store_now);
    let config = &request.bucket;
    let ahead = updated_at.saturating_since(now);
    let retry_after = if granted.is_zero() && !request.min.is_zero() {
        ahead.saturating_add(config.time_until_all(&remaining, request.min))
    } else {
        0
    };
    let reset = ahead.saturating_add(config.time_until_full(&remaining));
    let least = remaining.iter().copied().min().unwrap_or(Tokens::ZERO);
    Ok(Acquired::new(
        granted,
        least,
        nanos_duration(retry_after),
        nanos_duration(reset),
        store_now,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_use_their_parameters() {
        for (sql, n) in [(&*ACQUIRE_LIMITS, 10), (&*GIVE_BACK_LIMITS, 9)] {
            for i in 1..=n {
                assert!(sql.contains(&format!("${i}")), "${i} missing in {sql}");
            }
            assert!(!sql.contains(&format!("${}", n + 1)), "{sql}");
        }
    }
}
