//! The wire format of the store's statements: a batch of takes as the statements' parameter
//! arrays, and the rows they return as decisions.

use std::collections::HashMap;
use std::str::FromStr;
use std::time::{Duration, SystemTime};

use tokio_postgres::Row;
use tokio_postgres::types::{ToSql, Type};

use super::lean;
use crate::bucket::Tokens;
use crate::clock::timestamp_from_system_time;
use crate::store::{AcquireRequest, Acquired, HeldLease, StoreError, nanos as nanos_duration};

pub(super) fn tokens(row: &Row, idx: usize) -> Result<Tokens, StoreError> {
    let text: &str = row.try_get(idx).map_err(StoreError::from)?;
    Tokens::from_str(text).map_err(|e| StoreError::Protocol(e.to_string()))
}

/// A column of microseconds since the Unix epoch, as a time.
pub(super) fn micros(row: &Row, idx: usize) -> Result<SystemTime, StoreError> {
    let us: i64 = row.try_get(idx).map_err(StoreError::from)?;
    let us = u64::try_from(us)
        .map_err(|_| StoreError::Protocol(format!("a time before 1970: {us} µs")))?;
    Ok(SystemTime::UNIX_EPOCH + Duration::from_micros(us))
}

/// Nanotokens in one token, and attotokens in one nanotoken.
pub(super) const NANO: u128 = 1_000_000_000;

/// The largest capacity the table holds: 8 × 10¹⁸ nanotokens (migration 0007's domain), the
/// bucket's own bound ([`BucketConfig::MAX_CAPACITY`](crate::bucket::BucketConfig::MAX_CAPACITY)).
pub(super) const MAX_CAPACITY_NANOS: i64 =
    crate::bucket::BucketConfig::MAX_CAPACITY.as_nanos() as i64;

// The bucket's bound is the table's domain (`tokenlease_capacity`, at most 8 × 10¹⁸).
const _: () = assert!(MAX_CAPACITY_NANOS == 8_000_000_000_000_000_000);

/// An amount in whole nanotokens, rounded down (a `want`: never more than asked for).
pub(super) fn nanos_down(t: Tokens) -> i64 {
    i64::try_from(t.as_atto() / NANO).unwrap_or(i64::MAX)
}

/// An amount in whole nanotokens, rounded up (a `min`, a `step`: never less than asked for).
pub(super) fn nanos_up(t: Tokens) -> i64 {
    i64::try_from(t.as_atto().div_ceil(NANO)).unwrap_or(i64::MAX)
}

/// The bucket's capacity and rate in nanotokens, or an error naming the key when the capacity is
/// beyond what the table holds.
pub(super) fn shape(
    key: &str,
    bucket: &crate::bucket::BucketConfig,
) -> Result<(i64, i64), StoreError> {
    let capacity = nanos_down(bucket.capacity());
    if capacity > MAX_CAPACITY_NANOS {
        return Err(StoreError::Protocol(format!(
            "key {key:?}: capacity {} is above the 8000000000 tokens PostgresStore holds",
            bucket.capacity()
        )));
    }
    let rate = i64::try_from(bucket.rate().as_nanos_per_second()).unwrap_or(i64::MAX);
    Ok((capacity.max(1), rate))
}

/// The bigint arrays of a batch of takes, in the statements' parameter order.
pub(super) struct Takes<'a> {
    pub(super) keys: Vec<&'a str>,
    pub(super) capacities: Vec<i64>,
    pub(super) rates: Vec<i64>,
    pub(super) mins: Vec<i64>,
    pub(super) wants: Vec<i64>,
    pub(super) steps: Vec<i64>,
}

impl<'a> Takes<'a> {
    /// The takes of `requests` at `which` indices. Amounts go to whole nanotokens: `min` and
    /// `step` rounded up, `want` down, so a grant is never more than
    /// asked for; the limiter's costs and leases are whole nanotokens already.
    pub(super) fn new(
        requests: &[AcquireRequest<'a>],
        which: &[usize],
    ) -> Result<Self, StoreError> {
        let mut t = Takes {
            keys: Vec::with_capacity(which.len()),
            capacities: Vec::with_capacity(which.len()),
            rates: Vec::with_capacity(which.len()),
            mins: Vec::with_capacity(which.len()),
            wants: Vec::with_capacity(which.len()),
            steps: Vec::with_capacity(which.len()),
        };
        for &i in which {
            let r = &requests[i];
            let (capacity, rate) = shape(r.key, &r.bucket)?;
            let min = nanos_up(r.min);
            t.keys.push(r.key);
            t.capacities.push(capacity);
            t.rates.push(rate);
            t.mins.push(min);
            t.wants.push(nanos_down(r.want));
            t.steps.push(nanos_up(r.step).max(1));
        }
        Ok(t)
    }

    pub(super) fn params(&self) -> Vec<(&(dyn ToSql + Sync), Type)> {
        let values: [&(dyn ToSql + Sync); 6] = [
            &self.keys,
            &self.capacities,
            &self.rates,
            &self.mins,
            &self.wants,
            &self.steps,
        ];
        values.into_iter().zip(lean::MANY_TYPES).collect()
    }

    /// The parameters of the one-key take for the first (only) request.
    pub(super) fn one_params(&self) -> Vec<(&(dyn ToSql + Sync), Type)> {
        let values: [&(dyn ToSql + Sync); 6] = [
            &self.keys[0],
            &self.capacities[0],
            &self.rates[0],
            &self.mins[0],
            &self.wants[0],
            &self.steps[0],
        ];
        values.into_iter().zip(lean::ONE_TYPES).collect()
    }
}

/// What the store did with `request`, from a row of the take statements: key, tokens left
/// (whole nanotokens), femtotokens, nanotokens granted, refill time and now (microseconds).
pub(super) fn acquired(request: &AcquireRequest<'_>, row: &Row) -> Result<Acquired, StoreError> {
    let get =
        |idx: usize| -> Result<i64, StoreError> { row.try_get(idx).map_err(StoreError::from) };
    let nanos = |n: i64| u128::try_from(n).unwrap_or(0) * NANO;
    let frac: i32 = row.try_get(2).map_err(StoreError::from)?;
    let femto = u128::try_from(frac).unwrap_or(0) * 1_000;
    let remaining = Tokens::from_atto(nanos(get(1)?) + femto);
    let granted = Tokens::from_atto(nanos(get(3)?));
    let updated_at = timestamp_from_system_time(micros(row, 4)?);
    let store_now = micros(row, 5)?;
    let now = timestamp_from_system_time(store_now);
    let config = &request.bucket;
    // The refill time may be ahead of now() when another writer's clock ran ahead.
    let ahead = updated_at.saturating_since(now);
    let retry_after = if granted.is_zero() && !request.min.is_zero() {
        ahead.saturating_add(config.time_to_refill(request.min.saturating_sub(remaining)))
    } else {
        0
    };
    let reset =
        ahead.saturating_add(config.time_to_refill(config.capacity().saturating_sub(remaining)));
    Ok(Acquired {
        granted,
        remaining,
        retry_after: nanos_duration(retry_after),
        reset_after: nanos_duration(reset),
        store_now,
    })
}

/// The strict leases of `inspect.sql`'s JSON column.
pub(super) fn held_leases(json: &str) -> Result<Vec<HeldLease>, StoreError> {
    #[derive(serde::Deserialize)]
    struct Raw {
        holder: i64,
        lease_id: i64,
        amount: String,
        expires_us: i64,
    }
    let raw: Vec<Raw> = serde_json::from_str(json)
        .map_err(|e| StoreError::Protocol(format!("leases column: {e}")))?;
    raw.into_iter()
        .map(|l| {
            let amount = Tokens::from_str(&l.amount)
                .map_err(|e| StoreError::Protocol(format!("lease amount {:?}: {e}", l.amount)))?;
            let micros = u64::try_from(l.expires_us).unwrap_or(0);
            Ok(HeldLease {
                holder: l.holder,
                lease_id: l.lease_id,
                amount,
                expires_at: SystemTime::UNIX_EPOCH + Duration::from_micros(micros),
            })
        })
        .collect()
}

/// The strict-lease arrays of `tokenlease_acquire_held` beside a batch's [`Takes`]: each
/// request's holder and lease id (NULL for a plain take), the tokens it keeps and its lifetime.
pub(super) struct Holds {
    pub(super) holders: Vec<Option<i64>>,
    pub(super) lease_ids: Vec<Option<i64>>,
    pub(super) kept: Vec<i64>,
    pub(super) lifetimes: Vec<i64>,
}

impl Holds {
    /// The holds of `requests` at `which` indices.
    pub(super) fn new(requests: &[AcquireRequest<'_>], which: &[usize]) -> Self {
        let holds = which.iter().map(|&i| requests[i].hold);
        Holds {
            holders: holds.clone().map(|h| h.map(|h| h.holder)).collect(),
            lease_ids: holds.clone().map(|h| h.map(|h| h.lease_id)).collect(),
            kept: holds
                .clone()
                .map(|h| h.map_or(0, |h| nanos_up(h.kept)))
                .collect(),
            lifetimes: holds
                .map(|h| {
                    h.map_or(0, |h| {
                        i64::try_from(h.lifetime.as_micros()).unwrap_or(i64::MAX)
                    })
                })
                .collect(),
        }
    }

    pub(super) fn params(&self) -> [(&(dyn ToSql + Sync), Type); 4] {
        [
            (&self.holders, Type::INT8_ARRAY),
            (&self.lease_ids, Type::INT8_ARRAY),
            (&self.kept, Type::INT8_ARRAY),
            (&self.lifetimes, Type::INT8_ARRAY),
        ]
    }
}

/// Files each row (key first) under its request among `pending`, and keeps in `pending`
/// the requests that got none.
pub(super) fn file_rows(
    rows: &[Row],
    requests: &[AcquireRequest<'_>],
    pending: &mut Vec<usize>,
    out: &mut [Option<Acquired>],
) -> Result<(), StoreError> {
    file_rows_by(rows, requests, pending, out, acquired)
}

/// [`file_rows`] with the statement's own reading of a row (`decode`).
pub(super) fn file_rows_by(
    rows: &[Row],
    requests: &[AcquireRequest<'_>],
    pending: &mut Vec<usize>,
    out: &mut [Option<Acquired>],
    decode: impl Fn(&AcquireRequest<'_>, &Row) -> Result<Acquired, StoreError>,
) -> Result<(), StoreError> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut by_key: HashMap<&str, &Row> = HashMap::with_capacity(rows.len());
    for row in rows {
        let key: &str = row.try_get(0).map_err(StoreError::from)?;
        by_key.insert(key, row);
    }
    let mut left = Vec::new();
    for &i in pending.iter() {
        match by_key.get(requests[i].key) {
            Some(row) => out[i] = Some(decode(&requests[i], row)?),
            None => left.push(i),
        }
    }
    *pending = left;
    Ok(())
}
