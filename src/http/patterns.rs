//! A cache of what a layer built in code ([`RouteLimitLayer`](super::RouteLimitLayer)) makes
//! for each method and router pattern its requests come with (`route::CodeRoute`): made at the
//! first request of each, then shared by the later ones.
//!
//! Before, each request of such a layer copied the pattern, formatted its endpoint and each
//! limit's key, and split the request into parts to read a path parameter from axum's: six
//! allocations and two copies of the request's head that a policy file's route never paid.

use std::fmt;
use std::sync::{Arc, OnceLock};

use axum::extract::MatchedPath;

use super::memo::same;

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
    /// Per method, the first pattern's, apart ([`First`]).
    first: [OnceLock<First<T>>; METHODS.len()],
}

/// What was made for the first pattern a method's requests came with, found again by the
/// router's pattern itself (its address) or, for a layer given its pattern, by that pattern's
/// text: one load and a comparison, where the maps pin and hash. A layer on one route
/// (`route_layer`, the usual way) has one pattern, so all its requests find theirs here; one on
/// a whole router finds its other patterns in the maps.
struct First<T> {
    pattern: FirstPattern,
    found: Arc<T>,
}

/// The pattern a [`First`] answers for.
enum FirstPattern {
    /// The router's, kept so that its address is not reused.
    Router(MatchedPath),
    /// A layer's own.
    Given(Box<str>),
}

impl<T> First<T> {
    fn is_for(&self, from: Option<&MatchedPath>, pattern: &str) -> bool {
        match (&self.pattern, from) {
            (FirstPattern::Router(kept), Some(path)) => same(kept, path),
            (FirstPattern::Given(kept), None) => **kept == *pattern,
            _ => false,
        }
    }
}

impl<T> Default for PerPattern<T> {
    fn default() -> Self {
        PerPattern {
            by_method: std::array::from_fn(|_| papaya::HashMap::default()),
            first: std::array::from_fn(|_| OnceLock::new()),
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
    /// `make(method)`'s, kept while there is room. `from` is the router's pattern that
    /// `pattern` was read from (`None` for a layer given its pattern): the method's first
    /// pattern is found by it, or by its text ([`First`]).
    pub(crate) fn get(
        &self,
        method: &str,
        from: Option<&MatchedPath>,
        pattern: &str,
        make: impl FnOnce(&'static str) -> T,
    ) -> Arc<T> {
        let other = METHODS.len() - 1;
        let slot = METHODS.iter().position(|m| *m == method).unwrap_or(other);
        let first = &self.first[slot];
        if let Some(first) = first.get()
            && first.is_for(from, pattern)
        {
            return Arc::clone(&first.found);
        }
        let found = self.in_map(slot, pattern, make);
        if first.get().is_none() {
            // A racing request may have set it: either is the same pattern's.
            let pattern = match from {
                Some(path) => FirstPattern::Router(path.clone()),
                None => FirstPattern::Given(Box::from(pattern)),
            };
            let _ = first.set(First {
                pattern,
                found: Arc::clone(&found),
            });
        }
        found
    }

    fn in_map(&self, slot: usize, pattern: &str, make: impl FnOnce(&'static str) -> T) -> Arc<T> {
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
        let a = cache.get("GET", None, "/a", |m| make(m, "/a"));
        let again = cache.get("GET", None, "/a", |m| make(m, "/a"));
        assert!(Arc::ptr_eq(&a, &again) && made.get() == 1);
        assert_eq!(*cache.get("POST", None, "/a", |m| make(m, "/a")), "POST:/a");
        assert_eq!(
            *cache.get("PURGE", None, "/a", |m| make(m, "/a")),
            "OTHER:/a"
        );
        assert_eq!(made.get(), 3);
        for i in 0..MAX_PATTERNS {
            let p = format!("/p{i}");
            cache.get("PUT", None, &p, |m| make(m, &p));
        }
        let before = made.get();
        let p = "/one-too-many";
        let x = cache.get("PUT", None, p, |m| make(m, p));
        let y = cache.get("PUT", None, p, |m| make(m, p));
        assert!(!Arc::ptr_eq(&x, &y) && made.get() == before + 2);
        let fresh = cache.clone();
        fresh.get("GET", None, "/a", |m| make(m, "/a"));
        assert_eq!(made.get(), before + 3);
    }

    /// A method's first pattern is found again by the router's pattern itself, and never
    /// answers another pattern or the same text from another router (found in the map by its
    /// text, as before); a given pattern's first is found by its text.
    #[tokio::test]
    async fn the_first_pattern_of_a_method_answers_for_itself_alone() {
        use crate::http::memo::tests::{matched, router};
        let app = router();
        let (b1, b2) = (
            matched(&app, "/bookings/1").await,
            matched(&app, "/bookings/2").await,
        );
        let customers = matched(&app, "/customers/1").await;
        let elsewhere = matched(&router(), "/bookings/1").await;
        let cache: PerPattern<String> = PerPattern::default();
        let made = std::cell::Cell::new(0);
        let make = |m: &'static str, p: &str| {
            made.set(made.get() + 1);
            format!("{m}:{p}")
        };
        let first = cache.get("GET", Some(&b1), b1.as_str(), |m| make(m, b1.as_str()));
        let again = cache.get("GET", Some(&b2), b2.as_str(), |_| unreachable!());
        assert!(Arc::ptr_eq(&first, &again));
        let other = cache.get("GET", Some(&customers), customers.as_str(), |m| {
            make(m, customers.as_str())
        });
        assert_eq!(*other, "GET:/customers/{id}");
        let same_text = cache.get(
            "GET",
            Some(&elsewhere),
            elsewhere.as_str(),
            |_| unreachable!(),
        );
        assert!(Arc::ptr_eq(&first, &same_text));
        assert_eq!(
            *cache.get("POST", Some(&b1), b1.as_str(), |m| make(m, b1.as_str())),
            "POST:/bookings/{id}"
        );
        assert_eq!(made.get(), 3);

        let given: PerPattern<String> = PerPattern::default();
        let a = given.get("PUT", None, "/given", |m| make(m, "/given"));
        assert!(Arc::ptr_eq(
            &a,
            &given.get("PUT", None, "/given", |_| unreachable!())
        ));
        // A router's pattern is not a given one's, nor the other way round.
        let matched_first: PerPattern<String> = PerPattern::default();
        let m = matched_first.get("GET", Some(&b1), "/x", |m| make(m, "/x"));
        let g = matched_first.get("GET", None, "/y", |m| make(m, "/y"));
        assert!(!Arc::ptr_eq(&m, &g) && *g == "GET:/y");
    }
}
