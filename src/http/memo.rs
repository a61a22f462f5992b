//! A thread's memo of the routes its requests were found under lately (`route.rs` keeps one per
//! thread): a request on the same route of the same layer, under the same table, finds its
//! limits by comparing an address, without pinning the layer's map of matched patterns or
//! hashing the pattern.
//!
//! The router hands every request of one route a clone of the same `MatchedPath` (one shared
//! string per route): an entry keeps such a clone, so the string's address cannot be reused by
//! another pattern while the entry lives, and an equal address and length is the same pattern.
//! An entry names its layer's table by a number never given to another (not by address, which a
//! dropped layer's successor could reuse), and the table's generation, so a reload is never
//! answered from the memo. It holds the route's limits weakly: a layer dropped is not kept alive
//! by the threads that served it, and its entries then miss.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use axum::extract::MatchedPath;

/// Entries per thread: a thread serving more routes than this at once misses more often, and
/// looks its routes up in the layer's map.
const ENTRIES: usize = 4;

/// A number for a new table cell, never given to another.
pub(crate) fn next_cell_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// One route as found.
struct Entry<T> {
    /// The table cell's number.
    cell: u64,
    /// The table's generation it was found under.
    generation: u64,
    /// The method's slot (`route::method_slot`).
    slot: usize,
    /// The router's pattern, kept so that its address stays this pattern's.
    path: MatchedPath,
    found: Weak<T>,
}

/// A thread's entries, and where the next one goes: what a thread-local cell holds
/// (`route.rs` keeps one of `RouteLimits`).
pub(crate) struct Memo<T> {
    entries: [Option<Entry<T>>; ENTRIES],
    next: usize,
}

/// Whether `a` is the very string `b` (same address and length).
pub(crate) fn same(a: &MatchedPath, b: &MatchedPath) -> bool {
    let (a, b) = (a.as_str(), b.as_str());
    std::ptr::eq(a.as_ptr(), b.as_ptr()) && a.len() == b.len()
}

impl<T> Memo<T> {
    /// No entries.
    pub(crate) const fn new() -> Self {
        Memo {
            entries: [None, None, None, None],
            next: 0,
        }
    }

    /// The route found for `path` and the method's `slot` in table cell `cell` under
    /// `generation`, while its layer lives.
    pub(crate) fn get(
        &self,
        cell: u64,
        generation: u64,
        slot: usize,
        path: &MatchedPath,
    ) -> Option<Arc<T>> {
        self.entries.iter().flatten().find_map(|e| {
            (e.cell == cell && e.generation == generation && e.slot == slot && same(&e.path, path))
                .then(|| e.found.upgrade())
                .flatten()
        })
    }

    /// Notes that `found` is the route for `path` and the method's `slot` in table cell `cell`
    /// under `generation`, in place of the entry of the same route, else of the oldest. Nothing
    /// is noted when an entry of this generation holds the same pattern at another address: the
    /// router made the pattern for the request (a nested router does), and this one would never
    /// be found either.
    pub(crate) fn put(
        &mut self,
        cell: u64,
        generation: u64,
        slot: usize,
        path: &MatchedPath,
        found: &Arc<T>,
    ) {
        let mut at = None;
        for (i, e) in self.entries.iter().enumerate() {
            let Some(e) = e else { continue };
            if e.cell != cell || e.slot != slot || e.path.as_str() != path.as_str() {
                continue;
            }
            if !same(&e.path, path) && e.generation == generation {
                return;
            }
            at = Some(i);
        }
        let at = at.unwrap_or_else(|| {
            let at = self.next;
            self.next = (at + 1) % ENTRIES;
            at
        });
        self.entries[at] = Some(Entry {
            cell,
            generation,
            slot,
            path: path.clone(),
            found: Arc::downgrade(found),
        });
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use axum::Router;
    use axum::body::Body;
    use axum::http::Request;
    use axum::routing::get as route_get;
    use tower::ServiceExt;

    /// The `MatchedPath` the router gives a request to `uri` on `app`.
    pub(in crate::http) async fn matched(app: &Router, uri: &str) -> MatchedPath {
        let (tx, rx) = std::sync::mpsc::channel();
        let app = app.clone().layer(axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| {
                let tx = tx.clone();
                async move {
                    let path = req.extensions().get::<MatchedPath>().cloned();
                    tx.send(path).expect("the test waits");
                    next.run(req).await
                }
            },
        ));
        let request = Request::get(uri).body(Body::empty()).expect("request");
        app.oneshot(request).await.expect("infallible");
        rx.recv().expect("sent").expect("a matched path")
    }

    /// `/bookings/{id}` and `/customers/{id}`.
    pub(in crate::http) fn router() -> Router {
        Router::new()
            .route("/bookings/{id}", route_get(|| async { "b" }))
            .route("/customers/{id}", route_get(|| async { "c" }))
    }

    /// An entry answers the same route (same address) of the same cell, generation and method
    /// only; a reload's new generation, another cell, another method or another pattern miss.
    #[tokio::test]
    async fn an_entry_answers_only_its_route_cell_generation_and_method() {
        let app = router();
        let bookings = matched(&app, "/bookings/1").await;
        let again = matched(&app, "/bookings/2").await;
        let customers = matched(&app, "/customers/1").await;
        assert!(
            same(&bookings, &again),
            "the router shares one pattern per route"
        );
        let found = Arc::new("bookings route".to_string());
        let mut memo = Memo::new();
        memo.put(7, 3, 0, &bookings, &found);
        assert_eq!(memo.get(7, 3, 0, &again).as_deref(), Some(&*found));
        assert!(memo.get(7, 4, 0, &again).is_none(), "a reload misses");
        assert!(memo.get(8, 3, 0, &again).is_none(), "another layer misses");
        assert!(memo.get(7, 3, 2, &again).is_none(), "another method misses");
        assert!(
            memo.get(7, 3, 0, &customers).is_none(),
            "another route misses"
        );
    }

    /// The same pattern text at another address (another router) is not the entry's: it
    /// misses, and while the entry's generation holds it is not noted in its place.
    #[tokio::test]
    async fn the_same_text_elsewhere_is_another_pattern() {
        let (one, two) = (router(), router());
        let first = matched(&one, "/bookings/1").await;
        let second = matched(&two, "/bookings/1").await;
        assert_eq!(first.as_str(), second.as_str());
        assert!(!same(&first, &second));
        let (a, b) = (Arc::new(1_u8), Arc::new(2_u8));
        let mut memo = Memo::new();
        memo.put(1, 0, 0, &first, &a);
        assert!(memo.get(1, 0, 0, &second).is_none());
        memo.put(1, 0, 0, &second, &b);
        assert!(memo.get(1, 0, 0, &second).is_none(), "not noted");
        assert_eq!(memo.get(1, 0, 0, &first).as_deref(), Some(&1));
        memo.put(1, 1, 0, &second, &b);
        assert_eq!(
            memo.get(1, 1, 0, &second).as_deref(),
            Some(&2),
            "a new generation"
        );
    }

    /// The memo holds its routes weakly: once the layer drops them, their entries miss; and it
    /// keeps at most `ENTRIES`, the oldest replaced first.
    #[tokio::test]
    async fn entries_are_weak_and_bounded() {
        let app = router();
        let path = matched(&app, "/bookings/1").await;
        let mut memo = Memo::new();
        let dropped = Arc::new(0_usize);
        memo.put(1, 0, 0, &path, &dropped);
        drop(dropped);
        assert!(memo.get(1, 0, 0, &path).is_none());
        let kept: Vec<Arc<usize>> = (0..=ENTRIES).map(Arc::new).collect();
        for (cell, found) in kept.iter().enumerate() {
            memo.put(cell as u64 + 10, 0, 0, &path, found);
        }
        assert!(memo.get(10, 0, 0, &path).is_none(), "the oldest replaced");
        for cell in 1..=ENTRIES {
            assert_eq!(
                memo.get(cell as u64 + 10, 0, 0, &path).as_deref(),
                Some(&cell)
            );
        }
        assert_eq!(memo.entries.iter().flatten().count(), ENTRIES);
    }
}
