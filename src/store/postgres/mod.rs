//! [`PostgresStore`]: buckets shared through PostgreSQL, one atomic statement per call.
//!
//! A take is one plain SQL statement over the integer columns of migration 0007 (`lean.rs`: one
//! key, or many keys locked in key order), which refills by the database's clock, takes, and
//! inserts the keys that have no row yet; a return of lease tokens is one statement too, made
//! idempotent by its id. Strict leases go through the PL/pgSQL function
//! `tokenlease_acquire_held`. Each pooled session prepares the statements when it opens
//! ([`PostgresStoreBuilder::prepared_statements`], on by default), so a call is only bound and
//! run. Every call is bounded by a client-side timeout, and the server stops abandoned
//! statements itself with `statement_timeout` and `lock_timeout`, set on every connection.
//!
//! One bad request fails alone (`contain.rs`): a request the database cannot store is refused
//! before sending, a key named twice in one call goes in a second statement after the first,
//! and a data error of a many-key statement is narrowed down to the requests it belongs to.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bb8::Pool;
use tokio_postgres::Row;
use tokio_postgres::types::{ToSql, Type};

use super::{AcquireRequest, Acquired, BucketRow, GiveBack, Store, StoreError, TimeoutKind};

mod builder;
mod call;
mod citus;
mod contain;
mod functions;
mod lean;
mod limits;
mod manager;
pub(crate) mod migrate;
mod rows;
mod schema;
mod sql;

pub use self::builder::PostgresStoreBuilder;
use self::builder::pool_error;
use self::call::{InFlight, refused_by_pooler, stale_plan};
use self::contain::{Path, ServerEncoding, check_return, check_take, no_row, rounds};
use self::rows::{Holds, Takes, file_rows, held_leases, micros, nanos_down, shape, tokens};

use self::manager::{ConnectionManager, PgConnection};

/// Idle cleanup (`sql/delete_idle.sql`) on the store's tables.
static DELETE_IDLE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    sql::DELETE_IDLE.render(["tokenlease_buckets", "tokenlease_returns"])
});

/// The inspection of one key (`sql/inspect.sql`) on the store's table.
static INSPECT: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| sql::INSPECT.render(["tokenlease_buckets"]));

/// The SQL text of the one-key take the store sends (`$1` text key, `$2` capacity, `$3` rate,
/// `$4` min, `$5` want, `$6` step, all bigint nanotokens): for running it yourself, e.g.
/// through `EXPLAIN` or pgbench when sizing a database (`tokenlease loadtest
/// --print-statement one` prints it).
///
/// The text is what this version of the library sends; it may change in any release, with the
/// schema (`MIGRATIONS`) it reads.
pub fn acquire_one_sql() -> &'static str {
    lean::ACQUIRE_ONE.as_str()
}

/// The SQL text of the many-key take (`$1` text[] keys, `$2`..`$6` bigint[] as
/// [`acquire_one_sql`]'s): for `EXPLAIN` or pgbench, as [`acquire_one_sql`] (`tokenlease
/// loadtest --print-statement many` prints it). May change in any release.
pub fn acquire_many_sql() -> &'static str {
    lean::ACQUIRE_MANY.as_str()
}

/// The SQL text of the take through `tokenlease_acquire_held` (strict leases; `$1`..`$6` as
/// [`acquire_many_sql`]'s, `$7` holders, `$8` lease ids, `$9` kept nanotokens, `$10` lifetimes
/// in microseconds), for tests of its commit.
#[cfg(test)]
pub(crate) fn acquire_held_sql() -> &'static str {
    lean::ACQUIRE_HELD.as_str()
}

type Manager = ConnectionManager;

/// Buckets in PostgreSQL, shared by every instance that connects to the same database.
///
/// A take is one plain SQL statement over integer columns (nanotokens), prepared once per
/// session by default; a return of lease tokens is one statement, idempotent by its id; strict
/// leases go through the function `tokenlease_acquire_held`. Every call is bounded by a
/// client-side timeout, and the server stops abandoned statements itself with
/// `statement_timeout` and `lock_timeout`, set on every connection. docs/design/statements.md has the
/// statements and what each costs the server.
///
/// Cheap to clone: clones share one pool.
#[derive(Clone)]
pub struct PostgresStore {
    pool: Pool<Manager>,
    pool_size: u32,
    call_timeout: Duration,
    pool_wait_timeout: Duration,
    /// Bounds each of the two steps of abandoning a statement (the cancel request, then the
    /// wait for the session to be idle): the connect timeout.
    cancel_timeout: Duration,
    /// Statements are prepared once per session
    /// ([`PostgresStoreBuilder::prepared_statements`]); cleared for good when the server
    /// refuses a prepared statement as only a transaction pooler makes it do.
    prepare: Arc<AtomicBool>,
    /// The shard map and a pool per node when the database is a Citus coordinator with the
    /// tables distributed: every call then goes straight to the node holding its keys
    /// ([`citus`]).
    citus: Option<Arc<citus::Citus>>,
    /// Says once when the database's schema does not fit the statements (`schema.rs`).
    schema: Arc<schema::SchemaWatch>,
    /// The database's `server_encoding`, read when the store connects: a key it cannot hold
    /// is refused before it is sent ([`contain`]).
    encoding: ServerEncoding,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("pool", &self.pool.state())
            .field("call_timeout", &self.call_timeout)
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// The connection pool: for the crate's own tests, never in the API (bb8's version would
    /// become part of ours).
    #[cfg(test)]
    pub(crate) fn pool(&self) -> &Pool<Manager> {
        &self.pool
    }

    /// Runs one statement with a pooled connection, inside the call timeout.
    ///
    /// A statement the call gives up on (the call timed out, or its future was dropped) is
    /// abandoned: see [`InFlight`].
    async fn query(
        &self,
        statement: &'static str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, StoreError> {
        let deadline = crate::clock::instant() + self.call_timeout;
        self.query_by(deadline, statement, params).await
    }

    /// [`query`](Self::query) by `deadline`: the statements of one call share its timeout.
    async fn query_by(
        &self,
        deadline: tokio::time::Instant,
        statement: &'static str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, StoreError> {
        let timed_out = || StoreError::Timeout {
            kind: TimeoutKind::Call,
            after: self.call_timeout,
        };
        let conn = self.checkout(deadline, timed_out).await?;
        let in_flight = InFlight {
            conn: Some(conn),
            cancel_timeout: self.cancel_timeout,
        };
        let outcome =
            tokio::time::timeout_at(deadline, self.send(in_flight.conn(), statement, params)).await;
        match outcome {
            Ok(result) => {
                in_flight.done();
                match result {
                    Ok(rows) => {
                        self.schema.answered();
                        Ok(rows)
                    }
                    Err(e) => {
                        if schema::is_schema_mismatch(&e) {
                            self.schema.refused(&e);
                        }
                        Err(StoreError::from(e))
                    }
                }
            }
            // `in_flight` drops with the statement still running: it is abandoned.
            Err(_) => Err(timed_out()),
        }
    }

    /// A pooled connection for one call, by `deadline`.
    ///
    /// The pool does not test a connection when it hands it out (that would be a round trip a
    /// call). But a connection whose session the server ended while it sat idle in the pool (a
    /// terminated backend, a restart, a cut link) is already known to the client as closed,
    /// without a round trip: it is dropped here, which makes the pool discard it, and another is
    /// taken, so that a call does not fail on it long after the fault (test D4). At most one try
    /// more than the pool holds; the last connection is used even if closed, and then fails as
    /// it would have.
    async fn checkout(
        &self,
        deadline: tokio::time::Instant,
        timed_out: impl Fn() -> StoreError,
    ) -> Result<bb8::PooledConnection<'static, Manager>, StoreError> {
        let mut tries = 0u32;
        loop {
            let conn = match tokio::time::timeout_at(deadline, self.pool.get_owned()).await {
                Ok(conn) => conn.map_err(pool_error(self.pool_wait_timeout))?,
                Err(_) => return Err(timed_out()),
            };
            tries += 1;
            if !conn.is_closed() || tries > self.pool_size {
                return Ok(conn);
            }
            // Dropped: `has_broken` finds it closed, and the pool discards it.
        }
    }

    /// Sends `statement` on `conn`: bound to the session's prepared statement when the store
    /// prepares them (preparing it first on the session's first call of it), else as an
    /// unnamed statement.
    async fn send(
        &self,
        conn: &PgConnection,
        statement: &'static str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        if self.prepare.load(Ordering::Relaxed) {
            let prepared = match conn.prepared(statement) {
                Some(prepared) => Ok(prepared),
                None => {
                    let types: Vec<Type> = params.iter().map(|(_, t)| t.clone()).collect();
                    conn.prepare_typed(statement, &types)
                        .await
                        .inspect(|prepared| {
                            conn.remember(statement, prepared.clone());
                        })
                }
            };
            let result = match prepared {
                Ok(prepared) => {
                    let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
                    conn.query(&prepared, &values).await
                }
                Err(e) => Err(e),
            };
            match result {
                Err(e) if refused_by_pooler(&e) => {
                    // The session that prepared is not the one that ran (a transaction pooler):
                    // nothing ran; from now on every call goes unprepared.
                    self.prepare.store(false, Ordering::Relaxed);
                    conn.forget_prepared();
                    metrics::counter!(crate::metrics::STORE_UNPREPARED).increment(1);
                }
                Err(e) if stale_plan(&e) => {
                    // A migration changed what the statement returns: prepare it again next
                    // time, and send this call unprepared.
                    conn.forget_prepared();
                }
                other => return other,
            }
        }
        conn.query_typed(statement, params).await
    }
}

impl PostgresStore {
    /// Sends the plain take for the requests at `pending` (the one-key statement for one, the
    /// many-key one for more) and files each row it returns under its request; `pending` keeps
    /// the requests that got no row.
    async fn take_round(
        &self,
        deadline: tokio::time::Instant,
        requests: &[AcquireRequest<'_>],
        pending: &mut Vec<usize>,
        out: &mut [Option<Acquired>],
    ) -> Result<(), StoreError> {
        let t = Takes::new(requests, pending)?;
        let rows = if pending.len() == 1 {
            let statement = lean::ACQUIRE_ONE.as_str();
            self.query_by(deadline, statement, &t.one_params()).await?
        } else {
            let statement = lean::ACQUIRE_MANY.as_str();
            self.query_by(deadline, statement, &t.params()).await?
        };
        file_rows(&rows, requests, pending, out)
    }

    /// Takes through `tokenlease_acquire_held`: strict leases, rows that hold them, and rows
    /// another caller inserted while a plain statement ran.
    async fn take_held(
        &self,
        deadline: tokio::time::Instant,
        requests: &[AcquireRequest<'_>],
        pending: &mut Vec<usize>,
        out: &mut [Option<Acquired>],
    ) -> Result<(), StoreError> {
        let t = Takes::new(requests, pending)?;
        let holds = Holds::new(requests, pending);
        let mut params = t.params();
        params.extend(holds.params());
        let rows = self
            .query_by(deadline, lean::ACQUIRE_HELD.as_str(), &params)
            .await?;
        file_rows(&rows, requests, pending, out)
    }

    /// Takes on buckets of several limits among `pending` (`limits.rs`): one statement for
    /// all of them, prepared or not. A strict lease on such a bucket, or a row that holds
    /// strict leases, gets an error: such plans hold none (the policy refuses them).
    async fn take_limits(
        &self,
        deadline: tokio::time::Instant,
        requests: &[AcquireRequest<'_>],
        pending: &mut Vec<usize>,
        out: &mut [Option<Acquired>],
    ) -> Result<(), StoreError> {
        let multi = limits::split_off(requests, pending)?;
        let t = limits::LimitTakes::new(requests, &multi)?;
        let rows = self
            .query_by(deadline, limits::ACQUIRE_LIMITS.as_str(), &t.params())
            .await?;
        limits::file_all(&rows, requests, multi, out)
    }

    /// Decides the takes at `pending` (distinct keys) on plain PostgreSQL: the one-key or
    /// many-key take (`lean.rs`), which update the rows that exist and insert the keys that
    /// have none; what they leave (strict leases, rows holding strict leases, rows another
    /// caller inserted meanwhile) goes through `tokenlease_acquire_held`. A batch with a strict
    /// lease, and every batch when the store does not prepare its statements, goes there
    /// directly. Each answer is filed in `out`; `pending` keeps what is not decided, also when
    /// a statement fails.
    async fn decide(
        &self,
        deadline: tokio::time::Instant,
        requests: &[AcquireRequest<'_>],
        pending: &mut Vec<usize>,
        out: &mut [Option<Acquired>],
    ) -> Result<(), StoreError> {
        // Sent unnamed, the plain statements would be parsed and planned on every call, and
        // their written-out arithmetic makes that cost more than the function's call (whose
        // statements PL/pgSQL plans once per session): without prepared statements every take
        // goes through the function, which decides plain takes exactly as they do.
        let plain = self.prepare.load(Ordering::Relaxed);
        if pending.iter().any(|&i| requests[i].bucket.is_multi()) {
            self.take_limits(deadline, requests, pending, out).await?;
        }
        if pending.is_empty() {
            return Ok(());
        }
        if plain && !pending.iter().any(|&i| requests[i].hold.is_some()) {
            self.take_round(deadline, requests, pending, out).await?;
        }
        if !pending.is_empty() {
            self.take_held(deadline, requests, pending, out).await?;
        }
        Ok(())
    }

    /// One statement of returns for the positions `which` of `returns` (distinct keys): the
    /// keys it credited.
    async fn give_once(
        &self,
        deadline: tokio::time::Instant,
        returns: &[GiveBack<'_>],
        which: &[usize],
    ) -> Result<std::collections::HashSet<String>, StoreError> {
        let (multi, which): (Vec<usize>, Vec<usize>) =
            which.iter().partition(|&&i| returns[i].bucket.is_multi());
        let mut credited = std::collections::HashSet::new();
        if !multi.is_empty() {
            let r = limits::LimitReturns::new(returns, &multi)?;
            let rows = self
                .query_by(deadline, limits::GIVE_BACK_LIMITS.as_str(), &r.params())
                .await?;
            for row in &rows {
                credited.insert(row.try_get::<_, String>(0).map_err(StoreError::from)?);
            }
        }
        if which.is_empty() {
            return Ok(credited);
        }
        let which = &which[..];
        let ids: Vec<i64> = which.iter().map(|&i| returns[i].id).collect();
        let keys: Vec<&str> = which.iter().map(|&i| returns[i].key).collect();
        // An amount is what a lease did not spend: whole nanotokens; rounded down, a return
        // never credits more than it holds.
        let amounts: Vec<i64> = which
            .iter()
            .map(|&i| nanos_down(returns[i].amount))
            .collect();
        let mut capacities = Vec::with_capacity(which.len());
        let mut rates = Vec::with_capacity(which.len());
        for &i in which {
            let (capacity, rate) = shape(returns[i].key, &returns[i].bucket)?;
            capacities.push(capacity);
            rates.push(rate);
        }
        let holders: Vec<Option<i64>> = which
            .iter()
            .map(|&i| returns[i].lease.map(|l| l.holder))
            .collect();
        let lease_ids: Vec<Option<i64>> = which
            .iter()
            .map(|&i| returns[i].lease.map(|l| l.lease_id))
            .collect();
        let rows = self
            .query_by(
                deadline,
                lean::GIVE_BACK.as_str(),
                &[
                    &ids as &(dyn ToSql + Sync),
                    &keys,
                    &amounts,
                    &capacities,
                    &rates,
                    &holders,
                    &lease_ids,
                ]
                .into_iter()
                .zip(lean::GIVE_BACK_TYPES)
                .collect::<Vec<_>>(),
            )
            .await?;
        for row in &rows {
            credited.insert(row.try_get::<_, String>(0).map_err(StoreError::from)?);
        }
        Ok(credited)
    }

    /// Every return's outcome, in order: whether it credited, or why it did not reach the
    /// store. See [`Store::give_back_each`].
    async fn give_back_counted(&self, returns: &[GiveBack<'_>]) -> Vec<Result<bool, StoreError>> {
        let deadline = crate::clock::instant() + self.call_timeout;
        let mut out: Vec<Option<Result<bool, StoreError>>> = vec![None; returns.len()];
        let mut sendable = Vec::with_capacity(returns.len());
        for (i, ret) in returns.iter().enumerate() {
            match check_return(ret, &self.encoding) {
                Ok(()) => sendable.push(i),
                Err(err) => out[i] = Some(Err(err)),
            }
        }
        for round in rounds(sendable, |i| returns[i].key) {
            if round.is_empty() {
                continue;
            }
            let answers = match &self.citus {
                Some(citus) => citus.give_back_each(deadline, returns, &round).await,
                None => {
                    self.give_contained(deadline, returns, &round, Path::Plain)
                        .await
                }
            };
            for (&i, answer) in round.iter().zip(answers) {
                out[i] = Some(answer);
            }
        }
        out.into_iter()
            .map(|got| {
                got.unwrap_or_else(|| Err(StoreError::Protocol("a return unanswered".into())))
            })
            .collect()
    }
}

#[async_trait]
impl Store for PostgresStore {
    async fn acquire(&self, request: AcquireRequest<'_>) -> Result<Acquired, StoreError> {
        let mut out = self.acquire_many(std::slice::from_ref(&request)).await?;
        out.pop()
            .ok_or_else(|| StoreError::Protocol("acquire returned no row".into()))
    }

    /// Every answer, or the first request's error (see [`acquire_each`](Self::acquire_each)).
    async fn acquire_many(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Result<Vec<Acquired>, StoreError> {
        self.acquire_each(requests).await.into_iter().collect()
    }

    /// One statement for a batch of distinct keys, within the call timeout (`decide`;
    /// on Citus one per worker). A request the database cannot store is refused before
    /// sending; a key named again goes in the next round, sent after the first; a data error
    /// is contained to the requests it belongs to (`contain.rs`).
    async fn acquire_each(
        &self,
        requests: &[AcquireRequest<'_>],
    ) -> Vec<Result<Acquired, StoreError>> {
        let deadline = crate::clock::instant() + self.call_timeout;
        let mut out: Vec<Option<Result<Acquired, StoreError>>> = vec![None; requests.len()];
        let mut sendable = Vec::with_capacity(requests.len());
        for (i, request) in requests.iter().enumerate() {
            match check_take(request, &self.encoding) {
                Ok(()) => sendable.push(i),
                Err(err) => out[i] = Some(Err(err)),
            }
        }
        for round in rounds(sendable, |i| requests[i].key) {
            if round.is_empty() {
                continue;
            }
            let answers = match &self.citus {
                Some(citus) => citus.acquire_each(deadline, requests, &round).await,
                None => {
                    self.take_contained(deadline, requests, &round, Path::Plain)
                        .await
                }
            };
            for (&i, answer) in round.iter().zip(answers) {
                out[i] = Some(answer);
            }
        }
        out.into_iter()
            .zip(requests)
            .map(|(got, request)| got.unwrap_or_else(|| Err(no_row(request.key))))
            .collect()
    }

    /// As [`give_back`](Self::give_back), one outcome per return.
    async fn give_back_each(&self, returns: &[GiveBack<'_>]) -> Vec<Result<(), StoreError>> {
        let answers = self.give_back_counted(returns).await;
        answers.into_iter().map(|r| r.map(|_| ())).collect()
    }

    /// One statement for returns to distinct keys (on Citus one per worker); a key named again
    /// goes in the next round. How many credited, or the first return's error: the others
    /// were sent, and a retry with the same ids credits them nothing more.
    async fn give_back(&self, returns: &[GiveBack<'_>]) -> Result<u64, StoreError> {
        if returns.is_empty() {
            return Ok(0);
        }
        let mut credited = 0u64;
        for answer in self.give_back_counted(returns).await {
            credited += u64::from(answer?);
        }
        Ok(credited)
    }

    async fn delete_idle(&self, limit: u32) -> Result<u64, StoreError> {
        if let Some(citus) = &self.citus {
            return citus.delete_idle(limit).await;
        }
        let limit = i64::from(limit);
        let rows = self
            .query(DELETE_IDLE.as_str(), &[(&limit, Type::INT8)])
            .await?;
        Ok(rows.len() as u64)
    }

    async fn inspect(&self, key: &str) -> Result<Option<BucketRow>, StoreError> {
        // On Citus, on the node holding the key, from its shard's table, not through the
        // coordinator.
        let rows = match &self.citus {
            Some(citus) => {
                let (lane, statement) = citus.inspect_route(key);
                lane.query(statement, &[(&key, Type::TEXT)]).await?
            }
            None => self.query(INSPECT.as_str(), &[(&key, Type::TEXT)]).await?,
        };
        rows.first()
            .map(|row| {
                Ok(BucketRow {
                    key: row.try_get::<_, String>(0).map_err(StoreError::from)?,
                    tokens: tokens(row, 1)?,
                    capacity: tokens(row, 2)?,
                    refill_per_second: tokens(row, 3)?,
                    updated_at: micros(row, 4)?,
                    store_now: micros(row, 5)?,
                    tokens_now: tokens(row, 6)?,
                    leases: held_leases(row.try_get(7).map_err(StoreError::from)?)?,
                })
            })
            .transpose()
    }

    fn call_timeout(&self) -> Option<Duration> {
        Some(self.call_timeout)
    }

    /// The pool's size; on Citus, the sum of the nodes' pools.
    fn max_concurrent_calls(&self) -> Option<usize> {
        let lanes = self.citus.as_ref().map_or(1, |citus| citus.nodes());
        Some(self.pool_size as usize * lanes)
    }

    /// The pool's size: on Citus, one worker's pool.
    fn partition_calls(&self, _part: usize) -> Option<usize> {
        Some(self.pool_size as usize)
    }

    /// On Citus, the node holding the key's shard (its `pg_dist_node` id, stable across
    /// reloads of the map): a stalled node then delays only its own keys' callers. `0` on
    /// plain PostgreSQL.
    fn partition(&self, key: &str) -> usize {
        self.citus.as_ref().map_or(0, |citus| citus.partition(key))
    }
}

#[cfg(test)]
mod session_tests;
#[cfg(test)]
mod statement_tests;

#[cfg(test)]
mod tests {
    use super::*;

    /// A store that cannot connect says why, with every cause, and never the password.
    #[tokio::test]
    async fn a_refused_connection_names_its_cause_and_hides_the_password() {
        // Port 1 on the loopback: nothing listens there, so the connection is refused at once.
        let err = PostgresStore::builder("postgres://app:s3cret@127.0.0.1:1/app")
            .expect("a valid connection string")
            .connect_timeout(Duration::from_secs(5))
            .build()
            .await
            .expect_err("nothing listens on port 1");
        let text = err.to_string();
        assert!(matches!(err, StoreError::Connection(_)), "{err:?}");
        assert!(
            text.starts_with("connection to the store failed: "),
            "{text}"
        );
        assert!(text.to_lowercase().contains("refused"), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
        // The driver's error stays reachable for inspection.
        assert!(std::error::Error::source(&err).is_some());
    }

    /// A connection string that does not parse is quoted with its password hidden.
    #[test]
    fn an_invalid_connection_string_is_quoted_without_its_password() {
        for bad in [
            "postgres://app:s3cret@db:notaport/app",
            "host=db user=app password=s3cret port=notaport",
        ] {
            let text = PostgresStore::builder(bad).expect_err(bad).to_string();
            assert!(text.starts_with("invalid connection string "), "{text}");
            assert!(text.contains("***"), "{text}");
            assert!(!text.contains("s3cret"), "{text}");
        }
    }
}
