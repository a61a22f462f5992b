//! A request the route table has no route for, although its path fits one: counted per
//! route, and the first of each route logged.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::extract::OriginalUri;
use axum::http::Method;

use super::head::Head;
use super::key::match_pattern;
use super::route::RouteLimits;

/// The method whose limits a request is counted under: its own, but `HEAD` as `GET`.
fn limited_method(method: &Method) -> &str {
    if *method == Method::HEAD {
        Method::GET.as_str()
    } else {
        method.as_str()
    }
}

/// The most bytes of a request path quoted in the unmatched-route warning.
const MAX_LOGGED_PATH: usize = 200;

/// A request the table has no route for: when its path fits a file route of its method (or
/// `GET`'s, for `HEAD`), the router matched it under another pattern (or none) and the route's
/// limits did not apply. Counted per route; the first one of each route is logged.
pub(crate) fn unmatched(all: &[Arc<RouteLimits>], head: &impl Head, matched: Option<&str>) {
    // The path as this service sees it (a nested router strips its prefix) and as the client
    // sent it: a file route may have been written for either.
    let path = head.uri().path();
    let original = head
        .extensions()
        .get::<OriginalUri>()
        .map_or(path, |OriginalUri(uri)| uri.path());
    let own = head.method().as_str();
    let counted = limited_method(head.method());
    let Some(file) = all.iter().filter_map(|l| l.file.as_ref()).find(|f| {
        (f.method == own || f.method == counted)
            && (match_pattern(&f.path, path).is_some()
                || (original != path && match_pattern(&f.path, original).is_some()))
    }) else {
        return;
    };
    file.unmatched.increment(1);
    if !file.warned.swap(true, Ordering::Relaxed) {
        let mut shown = path;
        if shown.len() > MAX_LOGGED_PATH {
            let mut end = MAX_LOGGED_PATH;
            while !shown.is_char_boundary(end) {
                end -= 1;
            }
            shown = &shown[..end];
        }
        tracing::warn!(
            method = %file.method,
            route = %file.path,
            router_pattern = matched.unwrap_or("(none: no MatchedPath)"),
            path = shown,
            "tokenlease: a request fits the policy route {} {} but the router matched it as {}, \
             so it passed unlimited; make the policy pattern the router's full pattern (a nested \
             router's includes its prefix) and apply the layer with Router::route_layer \
             (counted in tokenlease_http_unmatched_total; logged once per route)",
            file.method,
            file.path,
            matched.unwrap_or("nothing"),
        );
    }
}
