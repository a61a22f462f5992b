//! What keeps one bad request from failing its neighbours: the checks a request passes before it
//! is sent (the database's encoding, the table's bounds), rounds of distinct keys for a call that
//! names a key more than once, and the containment of a data error that no check caught.
//!
//! A many-key statement is atomic: when the server refuses it, nothing of it took effect. A
//! refusal about the values sent (a data error, [`StoreError::is_data_error`]) belongs to one
//! request or a few, so the requests are sent again in two halves, and each half that fails is
//! halved again, until the bad requests fail alone and every other one has its real answer: with
//! `b` bad requests among `n`, at most about `2·b·log₂ n` statements more, all within the call's
//! deadline. Takes can be sent again because the failed statement took nothing; returns because
//! their ids make them idempotent. A timeout or a connection error is not retried: it fails every
//! request not yet answered, and the limiter's fallback and the circuit breaker deal with it.

use std::collections::{HashMap, HashSet};

use super::PostgresStore;
use super::rows::{MAX_CAPACITY_NANOS, NANO, nanos_down};
use crate::bucket::{BucketConfig, Tokens};
use crate::store::{AcquireRequest, Acquired, GiveBack, StoreError, Unstorable};

/// The largest refill rate the table holds, in nanotokens per second (migration 0007).
const MAX_RATE_NANOS: u64 = 1_000_000_000_000_000_000;

/// What of a key the database can store, by its `server_encoding` (read when the store
/// connects). Keys come as UTF-8 and the server converts them to its own encoding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ServerEncoding {
    /// `UTF8` or `SQL_ASCII`: any UTF-8 without NUL.
    Unicode,
    /// `LATIN1`: the code points U+0001 to U+00FF.
    Latin1,
    /// Any other server encoding, by name: ASCII is stored as it is (every server encoding
    /// holds it); other characters are sent, and a key the server cannot convert fails alone
    /// by containment.
    Other(String),
}

impl ServerEncoding {
    /// The encoding named by `SHOW server_encoding`.
    pub(crate) fn from_name(name: &str) -> ServerEncoding {
        match name.to_ascii_uppercase().as_str() {
            "UTF8" | "UTF-8" | "SQL_ASCII" => ServerEncoding::Unicode,
            "LATIN1" | "ISO_8859_1" | "ISO-8859-1" => ServerEncoding::Latin1,
            _ => ServerEncoding::Other(name.to_owned()),
        }
    }

    /// Why the database cannot store `key`, if it cannot.
    pub(crate) fn check(&self, key: &str) -> Result<(), Unstorable> {
        if let Some(offset) = key.bytes().position(|b| b == 0) {
            return Err(Unstorable::Nul { offset });
        }
        if let ServerEncoding::Latin1 = self
            && let Some((offset, ch)) = key.char_indices().find(|&(_, c)| u32::from(c) > 0xFF)
        {
            return Err(Unstorable::Character {
                ch,
                offset,
                encoding: "LATIN1".into(),
            });
        }
        Ok(())
    }
}

/// Why the table cannot hold `bucket`, if it cannot.
fn check_shape(bucket: &BucketConfig) -> Result<(), Unstorable> {
    let max = Tokens::from_atto(MAX_CAPACITY_NANOS as u128 * NANO);
    if bucket.capacity() > max {
        return Err(Unstorable::Capacity {
            capacity: bucket.capacity(),
            max,
        });
    }
    let rate = bucket.rate().as_nanos_per_second();
    if rate > MAX_RATE_NANOS {
        return Err(Unstorable::Rate {
            rate: Tokens::from_atto(u128::from(rate) * NANO),
            max: Tokens::from_atto(u128::from(MAX_RATE_NANOS) * NANO),
        });
    }
    Ok(())
}

/// Whether `request` can be sent to a database of `encoding`.
pub(super) fn check_take(
    request: &AcquireRequest<'_>,
    encoding: &ServerEncoding,
) -> Result<(), StoreError> {
    encoding
        .check(request.key)
        .and_then(|()| check_shape(&request.bucket))
        .map_err(|why| unstorable(request.key, why))
}

/// Whether `ret` can be sent to a database of `encoding`: as a take, and an amount the table
/// holds (no bucket holds more than the largest capacity, so a larger return could credit
/// nothing more than that one does).
pub(super) fn check_return(
    ret: &GiveBack<'_>,
    encoding: &ServerEncoding,
) -> Result<(), StoreError> {
    let max = Tokens::from_atto(MAX_CAPACITY_NANOS as u128 * NANO);
    encoding
        .check(ret.key)
        .and_then(|()| check_shape(&ret.bucket))
        .and_then(|()| {
            if nanos_down(ret.amount) > MAX_CAPACITY_NANOS {
                Err(Unstorable::Amount {
                    amount: ret.amount,
                    max,
                })
            } else {
                Ok(())
            }
        })
        .map_err(|why| unstorable(ret.key, why))
}

fn unstorable(key: &str, why: Unstorable) -> StoreError {
    StoreError::Unstorable {
        key: key.to_owned(),
        why,
    }
}

/// The positions `which` in rounds of distinct keys, in order: the k-th request naming a key
/// goes in round k. Sent one round after another, the requests of a key are decided as
/// consecutive calls in request order; a call whose keys are distinct is one round.
pub(super) fn rounds<'k>(which: Vec<usize>, key: impl Fn(usize) -> &'k str) -> Vec<Vec<usize>> {
    if which.len() < 2 {
        return vec![which];
    }
    let mut seen: HashMap<&str, usize> = HashMap::with_capacity(which.len());
    let mut rounds: Vec<Vec<usize>> = vec![Vec::with_capacity(which.len())];
    for i in which {
        let n = seen.entry(key(i)).or_insert(0);
        if *n == rounds.len() {
            rounds.push(Vec::new());
        }
        rounds[*n].push(i);
        *n += 1;
    }
    rounds
}

/// The error of a request that was sent and got no row back.
pub(super) fn no_row(key: &str) -> StoreError {
    StoreError::Protocol(format!("no row returned for key {key:?}"))
}

/// Where a lane's statements go: plain PostgreSQL, or a Citus node (its keys' shards by the
/// shard map).
#[derive(Clone, Copy, Debug)]
pub(super) enum Path<'a> {
    Plain,
    Citus(&'a dyn ShardOf),
}

/// Where a key's shard is, for a lane on a Citus node (the Citus store's shard map).
pub(super) trait ShardOf: Sync + std::fmt::Debug {
    /// The shard holding `key`: its id and its table.
    fn shard_of(&self, key: &str) -> (i64, &str);
}

impl PostgresStore {
    /// Decides the takes at `which` (distinct keys), containing data errors (see the module's
    /// doc): one answer per position of `which`, in its order.
    pub(super) async fn take_contained(
        &self,
        deadline: tokio::time::Instant,
        requests: &[AcquireRequest<'_>],
        which: &[usize],
        path: Path<'_>,
    ) -> Vec<Result<Acquired, StoreError>> {
        let mut decided: Vec<Option<Acquired>> = vec![None; requests.len()];
        let mut failed: Vec<Option<StoreError>> = vec![None; requests.len()];
        let mut parts = vec![which.to_vec()];
        while let Some(mut pending) = parts.pop() {
            let sent = match path {
                Path::Plain => {
                    self.decide(deadline, requests, &mut pending, &mut decided)
                        .await
                }
                Path::Citus(map) => {
                    self.citus_decide(map, deadline, requests, &mut pending, &mut decided)
                        .await
                }
            };
            let Err(err) = sent else {
                for i in pending {
                    failed[i] = Some(no_row(requests[i].key));
                }
                continue;
            };
            contain(err, pending, &mut parts, &mut failed);
        }
        which
            .iter()
            .map(|&i| match decided[i].take() {
                Some(acquired) => Ok(acquired),
                None => Err(failed[i].take().unwrap_or_else(|| no_row(requests[i].key))),
            })
            .collect()
    }

    /// Credits the returns at `which` (distinct keys), containing data errors: for each
    /// position of `which`, in its order, whether it credited.
    pub(super) async fn give_contained(
        &self,
        deadline: tokio::time::Instant,
        returns: &[GiveBack<'_>],
        which: &[usize],
        path: Path<'_>,
    ) -> Vec<Result<bool, StoreError>> {
        let mut credited: HashSet<String> = HashSet::new();
        let mut failed: Vec<Option<StoreError>> = vec![None; returns.len()];
        let mut parts = vec![which.to_vec()];
        while let Some(pending) = parts.pop() {
            let sent = match path {
                Path::Plain => self.give_once(deadline, returns, &pending).await,
                Path::Citus(_) => self.citus_give_back(deadline, returns, &pending).await,
            };
            match sent {
                Ok(keys) => credited.extend(keys),
                Err(err) => contain(err, pending, &mut parts, &mut failed),
            }
        }
        which
            .iter()
            .map(|&i| match failed[i].take() {
                Some(err) => Err(err),
                None => Ok(credited.contains(returns[i].key)),
            })
            .collect()
    }
}

/// What a failed statement for `pending` leaves: a data error for several requests splits them
/// into two halves to send again (`parts` is a stack: the first half goes next); a data error
/// for one request is that request's; any other error fails `pending` and every part not yet
/// sent, which are not sent.
fn contain(
    err: StoreError,
    mut pending: Vec<usize>,
    parts: &mut Vec<Vec<usize>>,
    failed: &mut [Option<StoreError>],
) {
    if err.is_data_error() && pending.len() > 1 {
        let second = pending.split_off(pending.len() / 2);
        parts.push(second);
        parts.push(pending);
        return;
    }
    if !err.is_data_error() {
        pending.extend(parts.drain(..).flatten());
    }
    for i in pending {
        failed[i] = Some(err.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_put_the_kth_request_of_a_key_in_round_k() {
        let keys = ["a", "b", "a", "a", "c", "b"];
        let r = rounds((0..keys.len()).collect(), |i| keys[i]);
        assert_eq!(r, vec![vec![0, 1, 4], vec![2, 5], vec![3]]);
        let distinct = rounds(vec![0, 1, 4], |i| keys[i]);
        assert_eq!(distinct, vec![vec![0, 1, 4]]);
        assert_eq!(rounds(vec![], |i| keys[i]), vec![Vec::<usize>::new()]);
    }

    #[test]
    fn encodings_refuse_what_they_lack() {
        let latin1 = ServerEncoding::from_name("LATIN1");
        assert_eq!(latin1.check("café-ÿ"), Ok(()));
        assert_eq!(
            latin1.check("ab€"),
            Err(Unstorable::Character {
                ch: '€',
                offset: 2,
                encoding: "LATIN1".into()
            })
        );
        let utf8 = ServerEncoding::from_name("UTF8");
        assert_eq!(utf8.check("ab€日本"), Ok(()));
        assert_eq!(utf8.check("a\0"), Err(Unstorable::Nul { offset: 1 }));
        assert_eq!(
            ServerEncoding::from_name("SQL_ASCII"),
            ServerEncoding::Unicode
        );
        let other = ServerEncoding::from_name("WIN1252");
        assert_eq!(other.check("ab€"), Ok(()), "left to containment");
    }

    #[test]
    fn a_data_error_splits_and_anything_else_fails_the_rest() {
        let data = StoreError::Database {
            code: "22P05".into(),
            message: "untranslatable".into(),
        };
        let mut parts = vec![vec![9]];
        let mut failed = vec![None; 10];
        contain(data.clone(), vec![0, 1, 2], &mut parts, &mut failed);
        assert_eq!(parts, vec![vec![9], vec![1, 2], vec![0]]);
        contain(data, parts.pop().unwrap(), &mut parts, &mut failed);
        assert!(failed[0].is_some() && failed[1].is_none());
        let timeout = StoreError::Timeout {
            kind: crate::store::TimeoutKind::Call,
            after: std::time::Duration::from_millis(50),
        };
        contain(timeout, vec![1, 2], &mut parts, &mut failed);
        assert!(parts.is_empty());
        assert!(failed[1].is_some() && failed[2].is_some() && failed[9].is_some());
    }
}
