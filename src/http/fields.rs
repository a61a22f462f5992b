//! Writing the header fields of a route's limits on a response: `RateLimit-Policy`,
//! `RateLimit` and, when asked for, `X-RateLimit-{Name}-Remaining`, after those an inner layer
//! wrote.

use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::http::header::{Entry, HeaderName, HeaderValue};

use super::headers::{RATELIMIT, RATELIMIT_POLICY, Report};
use super::route::RouteLimits;
use smallvec::SmallVec;

/// Writes `RateLimit-Policy`, `RateLimit` and, when `remaining`, the `X-RateLimit-*-Remaining`
/// fields of `limits` and `reports`. The two lists go after those an inner layer already
/// wrote: stacked layers add their limits, never overwrite each other's.
pub(crate) fn write(
    headers: &mut HeaderMap,
    limits: &RouteLimits,
    reports: &[Report],
    remaining: bool,
) {
    // Room for every field at once, rather than growing the map field by field.
    headers.reserve(if remaining { 2 + reports.len() } else { 2 });
    append(headers, RATELIMIT_POLICY, || limits.policy.clone());
    // Written into a buffer on the stack (a route's items rarely need more); each remaining
    // count is written once, and where its digits are in the items is kept.
    let mut items = Buf::default();
    let mut counts: SmallVec<[(&HeaderName, u64, usize); 4]> = SmallVec::new();
    let write_remaining = remaining;
    for r in reports {
        let Some(limit) = limits.limits.get(r.limit) else {
            continue;
        };
        let (Some(remaining), t) = r.numbers(&limit.plan, limit.scale) else {
            continue;
        };
        if items.len > 0 {
            items.push(b", ");
        }
        items.push(&limit.item);
        if write_remaining {
            counts.push((&limit.remaining, remaining, items.len));
        }
        items.number(remaining);
        items.push(b";t=");
        items.number(t);
    }
    if items.len == 0 {
        return;
    }
    if counts.iter().all(|&(_, n, _)| n < SMALL_NUMBERS) {
        // Every count a value made once (or none written): one allocation, for `RateLimit`.
        for &(name, n, _) in &counts {
            headers.insert(name.clone(), number_value(n));
        }
        if let Ok(v) = HeaderValue::from_bytes(items.bytes()) {
            append(headers, RATELIMIT, || v);
        }
        return;
    }
    // A larger count is a slice of `RateLimit`'s bytes: one allocation for all the values.
    let shared = items.into_bytes();
    for &(name, n, at) in &counts {
        let value = if n < SMALL_NUMBERS {
            Some(number_value(n))
        } else {
            HeaderValue::from_maybe_shared(shared.slice(at..at + decimal_len(n))).ok()
        };
        if let Some(value) = value {
            headers.insert(name.clone(), value);
        }
    }
    if let Ok(v) = HeaderValue::from_maybe_shared(shared) {
        append(headers, RATELIMIT, || v);
    }
}

/// Bytes of [`Buf`] kept on the stack: `RateLimit`'s items for a few limits (two limits with
/// ten-digit counts take about 50).
const STACK: usize = 128;

/// A header value's bytes, on the stack up to [`STACK`] bytes, then on the heap.
struct Buf {
    stack: [u8; STACK],
    len: usize,
    heap: Vec<u8>,
}

impl Default for Buf {
    fn default() -> Self {
        Buf {
            stack: [0; STACK],
            len: 0,
            heap: Vec::new(),
        }
    }
}

impl Buf {
    #[inline]
    fn push(&mut self, bytes: &[u8]) {
        self.room(bytes.len()).copy_from_slice(bytes);
    }

    /// `n` in decimal, its digits written in place (not through a scratch buffer, whose
    /// copy would wait on the stores just made).
    #[inline]
    fn number(&mut self, n: u64) {
        write_digits(n, self.room(decimal_len(n)));
    }

    /// The next `len` bytes, counted as written.
    #[inline]
    fn room(&mut self, len: usize) -> &mut [u8] {
        let at = self.len;
        if self.heap.is_empty() && at + len <= STACK {
            self.len = at + len;
            return &mut self.stack[at..at + len];
        }
        self.spill(len)
    }

    /// [`room`](Self::room) past the stack's bytes: on the heap.
    #[cold]
    #[inline(never)]
    fn spill(&mut self, len: usize) -> &mut [u8] {
        let at = self.len;
        self.len += len;
        if self.heap.is_empty() {
            self.heap.reserve(self.len.max(2 * STACK));
            self.heap.extend_from_slice(&self.stack[..at]);
        }
        self.heap.resize(self.len, 0);
        &mut self.heap[at..]
    }

    /// The bytes as one shared buffer: the stack's moved into a single allocation (with its
    /// count), not copied into one and shared through a second.
    fn into_bytes(self) -> Bytes {
        if self.heap.is_empty() {
            Bytes::from_owner(Stack {
                bytes: self.stack,
                len: self.len,
            })
        } else {
            Bytes::from(self.heap)
        }
    }

    fn bytes(&self) -> &[u8] {
        if self.heap.is_empty() {
            &self.stack[..self.len]
        } else {
            &self.heap
        }
    }
}

/// [`Buf`]'s stack bytes, owned by a [`Bytes`].
struct Stack {
    bytes: [u8; STACK],
    len: usize,
}

impl AsRef<[u8]> for Stack {
    fn as_ref(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// How many decimal digits `n` has.
fn decimal_len(n: u64) -> usize {
    n.checked_ilog10().map_or(1, |l| l as usize + 1)
}

/// `n` in decimal, filling `out` (exactly [`decimal_len`] bytes) from its end, two digits at
/// a time.
fn write_digits(mut n: u64, out: &mut [u8]) {
    const PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
        2021222324252627282930313233343536373839404142434445464748495051525354555657585960\
        6162636465666768697071727374757677787980818283848586878889909192939495969798\
        99";
    let mut at = out.len();
    while n >= 10 && at >= 2 {
        let pair = (n % 100) as usize * 2;
        n /= 100;
        at -= 2;
        out[at..at + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
    }
    if at > 0 {
        out[at - 1] = b'0' + (n % 10) as u8;
    }
}

/// `n` in decimal, written at the end of `buf`.
fn digits(n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let at = buf.len() - decimal_len(n);
    write_digits(n, &mut buf[at..]);
    &buf[at..]
}

/// The values of small numbers, made once: a remaining count below this is a clone of a
/// static value, not an allocation.
const SMALL_NUMBERS: u64 = 4096;

/// `n` as a header value.
fn number_value(n: u64) -> HeaderValue {
    static SMALL: std::sync::OnceLock<Vec<HeaderValue>> = std::sync::OnceLock::new();
    if n >= SMALL_NUMBERS {
        // Written here and copied once, rather than through `fmt`.
        let mut buf = [0u8; 20];
        return HeaderValue::from_bytes(digits(n, &mut buf))
            .unwrap_or_else(|_| HeaderValue::from(n));
    }
    let small = SMALL.get_or_init(|| {
        // One string of every number, kept for the life of the process (about 16 KiB).
        let all: &'static str = Box::leak(
            (0..SMALL_NUMBERS)
                .map(|i| i.to_string())
                .collect::<String>()
                .into_boxed_str(),
        );
        let mut at = 0;
        (0..SMALL_NUMBERS)
            .map(|i| {
                let len = i.to_string().len();
                let v = HeaderValue::from_static(&all[at..at + len]);
                at += len;
                v
            })
            .collect()
    });
    small[n as usize].clone()
}

/// Sets `name` to `value`, or to its value, `, ` and `value` when it has one: one look-up of
/// the name (hashing a custom name is most of an insertion's cost).
fn append(headers: &mut HeaderMap, name: HeaderName, value: impl FnOnce() -> HeaderValue) {
    match headers.entry(name) {
        Entry::Occupied(mut old) if !old.get().is_empty() => {
            let value = value();
            let old_value = old.get();
            let mut joined = Vec::with_capacity(old_value.len() + 2 + value.len());
            joined.extend_from_slice(old_value.as_bytes());
            joined.extend_from_slice(b", ");
            joined.extend_from_slice(value.as_bytes());
            if let Ok(v) = HeaderValue::from_bytes(&joined) {
                old.insert(v);
            }
        }
        Entry::Occupied(mut old) => {
            old.insert(value());
        }
        Entry::Vacant(slot) => {
            slot.insert(value());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::bucket::{BucketConfig, Rate, Tokens};
    use crate::http::{X_RATELIMIT_API_REMAINING, X_RATELIMIT_ENTITY_REMAINING};
    use crate::policy::Plan;

    fn plan(capacity: u64, per_second: f64) -> Plan {
        Plan::new(
            "p",
            BucketConfig::new(Tokens::whole(capacity), Rate::from_f64(per_second).unwrap())
                .unwrap(),
        )
    }

    /// A lease's estimate (its own tokens plus the bucket's count at its last refill) can
    /// exceed the capacity: the fields never report more than the limit.
    #[test]
    fn remaining_is_never_reported_above_the_limit() {
        let p = std::sync::Arc::new(plan(200, 100.0));
        let limits = two_limits(&p);
        let mut h = HeaderMap::new();
        let reports = [
            Report::allowed(0, &p, Some(Tokens::whole(208)), None),
            Report::denied(1, &p, Some(Tokens::whole(201)), Duration::from_millis(1500)),
        ];
        write(&mut h, &limits, &reports, true);
        assert_eq!(
            h[RATELIMIT_POLICY],
            "\"api\";q=200;w=2, \"entity\";q=200;w=2"
        );
        assert_eq!(h[RATELIMIT], "\"api\";r=200;t=0, \"entity\";r=200;t=2");
        assert_eq!(h[X_RATELIMIT_API_REMAINING], "200");
        assert_eq!(h[X_RATELIMIT_ENTITY_REMAINING], "200");
    }

    /// Counts past the table of small numbers: every field as with small ones, the
    /// remaining counts sliced out of `RateLimit`'s bytes.
    #[test]
    fn large_counts_are_written_as_small_ones() {
        let p = std::sync::Arc::new(plan(8_000_000_000, 1_000_000_000.0));
        let limits = two_limits(&p);
        let mut h = HeaderMap::new();
        let reports = [
            Report::allowed(0, &p, Some(Tokens::whole(7_999_999_999)), None),
            Report::allowed(1, &p, Some(Tokens::whole(4096)), None),
        ];
        write(&mut h, &limits, &reports, true);
        // One token short at a billion a second is full within the rounding slack: t=0.
        assert_eq!(
            h[RATELIMIT],
            "\"api\";r=7999999999;t=0, \"entity\";r=4096;t=8"
        );
        assert_eq!(h[X_RATELIMIT_API_REMAINING], "7999999999");
        assert_eq!(h[X_RATELIMIT_ENTITY_REMAINING], "4096");
        for n in [0, 1, 9, 10, 99, 100, 101, 4095, 1_000_000, u64::MAX] {
            assert_eq!(digits(n, &mut [0; 20]), n.to_string().as_bytes());
            assert_eq!(number_value(n), n.to_string().as_str());
        }
        // Items past the stack's bytes go on in the heap, in order.
        let mut items = Buf::default();
        let mut expected = String::new();
        for n in [u64::MAX, 7, 4096, 1_000_000_007]
            .into_iter()
            .cycle()
            .take(40)
        {
            items.push(b", ");
            items.number(n);
            expected.push_str(&format!(", {n}"));
        }
        assert!(expected.len() > STACK);
        assert_eq!(items.bytes(), expected.as_bytes());
        assert_eq!(items.into_bytes(), expected.as_bytes());
    }

    /// A second layer's fields go after the first's: neither overwrites the other.
    #[test]
    fn a_second_layer_appends_its_items() {
        let p = std::sync::Arc::new(plan(200, 100.0));
        let limits = two_limits(&p);
        let mut h = HeaderMap::new();
        h.insert(
            RATELIMIT_POLICY,
            HeaderValue::from_static("\"customer\";q=30;w=60"),
        );
        h.insert(RATELIMIT, HeaderValue::from_static("\"customer\";r=0;t=2"));
        write(
            &mut h,
            &limits,
            &[Report::allowed(0, &p, Some(Tokens::whole(5)), None)],
            false,
        );
        assert_eq!(
            h[RATELIMIT_POLICY],
            "\"customer\";q=30;w=60, \"api\";q=200;w=2, \"entity\";q=200;w=2"
        );
        assert_eq!(h[RATELIMIT], "\"customer\";r=0;t=2, \"api\";r=5;t=2");
    }

    /// A route with the limits `api` (whole route) and `entity`, both under `p`.
    fn two_limits(p: &std::sync::Arc<Plan>) -> RouteLimits {
        use super::super::route::LimitSpec;
        let limiter = crate::Limiter::builder(crate::store::MemoryStore::new()).build();
        let spec = |name: &str, entity: bool| LimitSpec {
            name: name.to_owned(),
            plan: std::sync::Arc::clone(p),
            entity: entity.then(|| super::super::EntityKey::path_param("id")),
            budget: None,
            shadow: false,
        };
        RouteLimits::new(
            vec![spec("api", false), spec("entity", true)],
            Some("/x/{id}".to_owned()),
            None,
            &limiter,
            &std::sync::Arc::default(),
        )
    }
}
