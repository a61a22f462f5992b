//! A cache of what a layer built in code ([`RouteLimitLayer`](super::RouteLimitLayer)) makes
//! for each method and router pattern its requests come with (`route::CodeRoute`): made at the
//! first request of each, then shared by the later ones.
//!
//! Before, each request of such a layer copied the pattern, formatted its endpoint and each
//! limit's key, and split the request into parts to read a path parameter from axum's: six
//! allocations and two copies of the request's head that a policy file's route never paid.

use std::fmt;
use std::sync::Arc;

/// The method strings of a code-built layer's keys (`check::key_method`), one map each.
pub(crate) const METHODS: [&str; 9] = [
    "GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT", "OTHER",
];

/// Patterns kept per method: a router has as many as it has routes; past this many (a pattern
/// made per request), what a request needs is made for it alone.
const MAX_PATTERNS: usize = 1024;

/// What was made for each method (one of [`METHODS`]) and pattern. A clone starts empty: what
/// it belongs to was changed.
pub(crate) struct PerPattern<T> {
    by_method: [papaya::HashMap<Box<str>, Arc<T>, foldhash::fast::RandomState>; METHODS.len()],
}

impl<T> Default for PerPattern<T> {
    fn default() -> Self {
        PerPattern {
            by_method: std::array::from_fn(|_| papaya::HashMap::default()),
        }
    }
}

impl<T> Clone for PerPattern<T> {
    fn clone(&self) -> Self {
        PerPattern::default()
    }
}

impl<T> fmt::Debug for PerPattern<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PerPattern").finish_non_exhaustive()
    }
}

impl<T> PerPattern<T> {
    /// What is kept for `method` (one of [`METHODS`], else as `OTHER`) and `pattern`, or
    /// `make(method)`'s, kept while there is room.
    pub(crate) fn get(
        &self,
        method: &str,
        pattern: &str,
        make: impl FnOnce(&'static str) -> T,
    ) -> Arc<T> {
        let other = METHODS.len() - 1;
        let slot = METHODS.iter().position(|m| *m == method).unwrap_or(other);
        let map = self.by_method[slot].pin();
        if let Some(found) = map.get(pattern) {
            return Arc::clone(found);
        }
        let made = Arc::new(make(METHODS[slot]));
        if map.len() < MAX_PATTERNS {
            // A racing request may have put its own: either is the same.
            return Arc::clone(map.get_or_insert(Box::from(pattern), made));
        }
        made
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One value per method and pattern, made once; an unknown method is `OTHER`'s; past the
    /// bound a value is made each time and not kept; a clone starts empty.
    #[test]
    fn one_value_per_method_and_pattern_within_the_bound() {
        let cache: PerPattern<String> = PerPattern::default();
        let made = std::cell::Cell::new(0);
        let make = |m: &'static str, p: &str| {
            made.set(made.get() + 1);
            format!("{m}:{p}")
        };
        let a = cache.get("GET", "/a", |m| make(m, "/a"));
        let again = cache.get("GET", "/a", |m| make(m, "/a"));
        assert!(Arc::ptr_eq(&a, &again) && made.get() == 1);
        assert_eq!(*cache.get("POST", "/a", |m| make(m, "/a")), "POST:/a");
        assert_eq!(*cache.get("PURGE", "/a", |m| make(m, "/a")), "OTHER:/a");
        assert_eq!(made.get(), 3);
        for i in 0..MAX_PATTERNS {
            let p = format!("/p{i}");
            cache.get("PUT", &p, |m| make(m, &p));
        }
        let before = made.get();
        let p = "/one-too-many";
        let x = cache.get("PUT", p, |m| make(m, p));
        let y = cache.get("PUT", p, |m| make(m, p));
        assert!(!Arc::ptr_eq(&x, &y) && made.get() == before + 2);
        let fresh = cache.clone();
        fresh.get("GET", "/a", |m| make(m, "/a"));
        assert_eq!(made.get(), before + 3);
    }
}
