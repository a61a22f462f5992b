//! [`RateLimit`]: the service, and the two checks it makes before the inner service runs.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use axum::extract::rejection::RawPathParamsRejection;
use axum::extract::{FromRequestParts, MatchedPath, OriginalUri, RawPathParams};
use axum::http::header::{CONTENT_TYPE, RETRY_AFTER};
use axum::http::request::Parts;
use axum::http::{HeaderValue, Method, Request, Response, StatusCode};
use sha2::{Digest, Sha256};
use tower::Service;

use super::headers::{self, LayerKind, Report, malformed_problem, problem, retry_after_secs};
use super::key::{MalformedId, ParamValue, match_pattern};
use super::refund::refund;
use super::route::{Config, RouteLimits, Routes};
use crate::bucket::Tokens;
use crate::error::validate_key;
use crate::metrics::{HTTP_DENIED, HTTP_ERRORS, HTTP_WOULD_DENY};
use crate::policy::{FallbackMode, route_shape};
use crate::{DecidedBy, Decision};

/// The service [`RateLimitLayer`](super::RateLimitLayer) wraps around `S`.
///
/// It never returns an error of its own: a denial is a `429` (or a `503` when the store is down
/// and the plan's fallback denies) and a limiter error lets the request through.
#[derive(Clone)]
pub struct RateLimit<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S: fmt::Debug> fmt::Debug for RateLimit<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S> RateLimit<S> {
    pub(crate) fn new(inner: S, config: Arc<Config>) -> Self {
        RateLimit { inner, config }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// The future of [`RateLimit`]: the two checks, then the inner service.
pub struct ResponseFuture<R, E> {
    inner: Pin<Box<dyn Future<Output = Result<R, E>> + Send>>,
}

impl<R, E> fmt::Debug for ResponseFuture<R, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ResponseFuture")
    }
}

impl<R, E> Future for ResponseFuture<R, E> {
    type Output = Result<R, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: From<String> + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<Response<ResBody>, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // The clone may not be ready; the one poll_ready readied is the one we call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let config = Arc::clone(&self.config);
        ResponseFuture {
            inner: Box::pin(async move {
                let (mut parts, body) = req.into_parts();
                let verdict = check(&config, &mut parts).await;
                match verdict {
                    Verdict::Pass => inner.call(Request::from_parts(parts, body)).await,
                    Verdict::Allow { policy, reports } => {
                        let mut response = inner.call(Request::from_parts(parts, body)).await?;
                        headers::write(response.headers_mut(), &policy, &reports);
                        Ok(response)
                    }
                    Verdict::Deny(response) => Ok(response.map(ResBody::from)),
                }
            }),
        }
    }
}

/// What the checks decided.
enum Verdict {
    /// No limit applies to the request.
    Pass,
    /// Every applicable layer allowed it.
    Allow {
        policy: HeaderValue,
        reports: Vec<Report>,
    },
    /// A layer denied it: the whole response.
    Deny(Response<String>),
}

/// The method whose limits a request is counted under: its own, but `HEAD` as `GET`, since a
/// router answers `HEAD` with the `GET` handler (axum does) and the two must share one limit.
fn limited_method(method: &Method) -> &str {
    if *method == Method::HEAD {
        Method::GET.as_str()
    } else {
        method.as_str()
    }
}

/// The method part of a code-built layer's keys and metric labels: one of a fixed set, since
/// the client chooses the method and must not choose its bucket (or a new metric series) by
/// inventing one. The standard methods are themselves (`HEAD` as `GET`, see
/// [`limited_method`]); any other method string (`X0`, `get`, `PURGE`) is [`OTHER_METHOD`].
fn key_method(method: &Method) -> &'static str {
    match *method {
        Method::GET | Method::HEAD => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::OPTIONS => "OPTIONS",
        Method::TRACE => "TRACE",
        Method::CONNECT => "CONNECT",
        _ => OTHER_METHOD,
    }
}

/// The method part of the keys of every request whose method is not a standard one.
const OTHER_METHOD: &str = "OTHER";

/// The two checks: global first; a global denial stops there; then the entity, if the request
/// has one; an entity denial gives the global token back. A malformed entity id is refused
/// with `400` before either bucket is touched.
async fn check(config: &Config, parts: &mut Parts) -> Verdict {
    let matched = parts
        .extensions
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_owned());
    // The pattern for the keys, the router's pattern (for finding path parameters), the method.
    let (limits, pattern, router_pattern, method) = match &config.routes {
        Routes::One(limits) => match limits.pattern.clone().or(matched) {
            Some(p) => (
                Arc::clone(limits),
                p.clone(),
                p,
                key_method(&parts.method).to_owned(),
            ),
            None => return Verdict::Pass,
        },
        Routes::Table(cell) => {
            let table = Arc::clone(&cell.read());
            let (by_shape, all) = (&table.by_shape, &table.all);
            let found = matched.as_deref().and_then(|matched| {
                let shape = route_shape(matched)?;
                // A route listed for the method itself first (a file may list HEAD on its
                // own), then, for HEAD, the GET route whose handler answers it.
                let own = parts.method.as_str();
                let counted = limited_method(&parts.method);
                by_shape.get(&format!("{own}:{shape}")).or_else(|| {
                    (counted != own)
                        .then(|| by_shape.get(&format!("{counted}:{shape}")))
                        .flatten()
                })
            });
            match (found, matched) {
                (Some(limits), Some(matched)) => {
                    let file = limits.file.as_ref().expect("a file route");
                    (
                        Arc::clone(limits),
                        file.path.clone(),
                        matched,
                        file.method.clone(),
                    )
                }
                (_, matched) => {
                    unmatched(all, parts, matched.as_deref());
                    return Verdict::Pass;
                }
            }
        }
    };
    if limits.is_empty() {
        return Verdict::Pass;
    }
    let endpoint = format!("{method}:{pattern}");
    if let Some(file) = &limits.file {
        file.checked.increment(1);
    }
    let limiter = &config.limiter;
    let cost = Tokens::whole(1);
    let mut reports = Vec::with_capacity(2);

    // The entity id first: a malformed one is refused before any token is taken.
    let entity = match &limits.entity {
        None => None,
        Some((entity_key, plan)) => {
            let params = if entity_key.needs_path_params() {
                path_params(parts, &router_pattern)
                    .await
                    .map(|p| file_names(p, &limits, &router_pattern))
            } else {
                Ok(Vec::new())
            };
            match params.and_then(|p| entity_key.extract(parts, &p, &config.trusted)) {
                Ok(id) => id.map(|id| (Arc::clone(plan), id)),
                Err(why) => return malformed(&why, &endpoint, &limits),
            }
        }
    };

    let mut global_taken: Option<(Arc<crate::policy::Plan>, String, Decision)> = None;
    if let Some(plan) = &limits.global {
        let key = format!("ratelimit:api:{endpoint}");
        match limiter.try_acquire_with(plan, &key, 1.0).await {
            Ok(d) if d.allowed && !d.would_deny => {
                reports.push(Report::allowed(LayerKind::Api, plan, d.remaining));
                global_taken = Some((Arc::clone(plan), key, d));
            }
            // A shadow layer or plan: the denial is reported and counted, and the request goes
            // on (no token was taken, so none is given back later).
            Ok(d) if d.would_deny || limits.shadow.api => {
                reports.push(Report::denied(
                    LayerKind::Api,
                    plan,
                    d.remaining,
                    d.retry_after,
                ));
                count_would_deny(&limits, LayerKind::Api, &method, &pattern);
            }
            Ok(d) => {
                reports.push(Report::denied(
                    LayerKind::Api,
                    plan,
                    d.remaining,
                    d.retry_after,
                ));
                count_denied(&limits, LayerKind::Api, &method, &pattern);
                return deny(LayerKind::Api, &d, &endpoint, &limits, &reports);
            }
            Err(_) => count_error(&limits, LayerKind::Api, &method, &pattern),
        }
    }

    if let Some((plan, id)) = &entity {
        let key = match &limits.budget {
            Some(budget) => hashed_key(&format!("ratelimit:budget:{budget}"), id),
            None => entity_bucket_key(&endpoint, id),
        };
        match limiter.try_acquire_with(plan, &key, 1.0).await {
            Ok(d) if d.allowed && !d.would_deny => {
                reports.push(Report::allowed(LayerKind::Entity, plan, d.remaining));
            }
            // The endpoint's token stays taken: the request goes ahead.
            Ok(d) if d.would_deny || limits.shadow.entity => {
                reports.push(Report::denied(
                    LayerKind::Entity,
                    plan,
                    d.remaining,
                    d.retry_after,
                ));
                count_would_deny(&limits, LayerKind::Entity, &method, &pattern);
            }
            Ok(d) => {
                if let Some((gplan, gkey, gd)) = &global_taken
                    && refund(limiter, gplan, gkey, cost, gd).await
                {
                    let back = gd
                        .remaining
                        .map(|r| std::cmp::min(r.saturating_add(cost), gplan.capacity()));
                    reports[0] = Report::allowed(LayerKind::Api, gplan, back);
                }
                reports.push(Report::denied(
                    LayerKind::Entity,
                    plan,
                    d.remaining,
                    d.retry_after,
                ));
                count_denied(&limits, LayerKind::Entity, &method, &pattern);
                return deny(LayerKind::Entity, &d, &endpoint, &limits, &reports);
            }
            Err(_) => count_error(&limits, LayerKind::Entity, &method, &pattern),
        }
    }
    Verdict::Allow {
        policy: limits.policy.clone(),
        reports,
    }
}

/// The index of a layer in [`FileRoute`](super::route::FileRoute)'s counter pairs.
fn layer_index(layer: LayerKind) -> usize {
    match layer {
        LayerKind::Api => 0,
        LayerKind::Entity => 1,
    }
}

/// Counts a denial: through the handle registered at build time for a policy file's route, by
/// the macro (its first denial creates the series) for a layer built in code.
fn count_denied(limits: &RouteLimits, layer: LayerKind, method: &str, pattern: &str) {
    match &limits.file {
        Some(file) => file.denied[layer_index(layer)].increment(1),
        None => metrics::counter!(HTTP_DENIED, "layer" => layer.name(),
            "method" => method.to_owned(), "route" => pattern.to_owned())
        .increment(1),
    }
}

/// Counts a denial a shadow layer or plan let through, as [`count_denied`].
fn count_would_deny(limits: &RouteLimits, layer: LayerKind, method: &str, pattern: &str) {
    match &limits.file {
        Some(file) => file.would_deny[layer_index(layer)].increment(1),
        None => metrics::counter!(HTTP_WOULD_DENY, "layer" => layer.name(),
            "method" => method.to_owned(), "route" => pattern.to_owned())
        .increment(1),
    }
}

/// Counts a request a layer could not check, as [`count_denied`].
fn count_error(limits: &RouteLimits, layer: LayerKind, method: &str, pattern: &str) {
    match &limits.file {
        Some(file) => file.errors[layer_index(layer)].increment(1),
        None => metrics::counter!(HTTP_ERRORS, "layer" => layer.name(),
            "method" => method.to_owned(), "route" => pattern.to_owned())
        .increment(1),
    }
}

/// The router's path parameters under the policy file's names: a router pattern of the same
/// shape as the file's may name its parameters differently, and they are matched by position.
fn file_names(
    mut params: Vec<(String, ParamValue)>,
    limits: &RouteLimits,
    router_pattern: &str,
) -> Vec<(String, ParamValue)> {
    if let Some(file) = &limits.file
        && file.path != router_pattern
        && params.len() == file.params.len()
    {
        for ((name, _), file_name) in params.iter_mut().zip(&file.params) {
            name.clone_from(file_name);
        }
    }
    params
}

/// The most bytes of a request path quoted in the unmatched-route warning.
const MAX_LOGGED_PATH: usize = 200;

/// A request the table has no route for: when its path fits a file route of its method (or
/// `GET`'s, for `HEAD`), the router matched it under another pattern (or none) and the route's
/// limits did not apply. Counted per route; the first one of each route is logged.
fn unmatched(all: &[Arc<RouteLimits>], parts: &Parts, matched: Option<&str>) {
    // The path as this service sees it (a nested router strips its prefix) and as the client
    // sent it: a file route may have been written for either.
    let path = parts.uri.path();
    let original = parts
        .extensions
        .get::<OriginalUri>()
        .map_or(path, |OriginalUri(uri)| uri.path());
    let own = parts.method.as_str();
    let counted = limited_method(&parts.method);
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

/// The matched route's path parameters: axum's, or the pattern matched against the path.
///
/// axum refuses to give any parameter when one of them is not UTF-8 once percent-decoded; the
/// pattern is then matched against the original path, and when even that fails the request's
/// parameters are malformed.
async fn path_params(
    parts: &mut Parts,
    pattern: &str,
) -> Result<Vec<(String, ParamValue)>, MalformedId> {
    match RawPathParams::from_request_parts(parts, &()).await {
        Ok(params) => Ok(params
            .iter()
            .map(|(k, v)| (k.to_owned(), Ok(v.to_owned())))
            .collect()),
        Err(RawPathParamsRejection::MissingPathParams(_)) => {
            Ok(match_pattern(pattern, parts.uri.path()).unwrap_or_default())
        }
        Err(_) => {
            let path = match parts.extensions.get::<OriginalUri>() {
                Some(OriginalUri(uri)) => uri.path(),
                None => parts.uri.path(),
            };
            match_pattern(pattern, path).ok_or(MalformedId::PathNotUtf8 { name: None })
        }
    }
}

/// `ratelimit:entity:{endpoint}:{id}`; an id that would make the key unusable (too long, NUL)
/// is replaced by `sha256:` and its hex digest, so every id still gets its own bucket. An id
/// that itself starts with `sha256:` is hashed too, so it can never pose as another id's digest.
pub(crate) fn entity_bucket_key(endpoint: &str, id: &str) -> String {
    hashed_key(&format!("ratelimit:entity:{endpoint}"), id)
}

/// `{prefix}:{id}`, the id hashed as [`entity_bucket_key`] does.
fn hashed_key(prefix: &str, id: &str) -> String {
    let key = format!("{prefix}:{id}");
    if !id.starts_with(HASHED) && validate_key(&key).is_ok() {
        return key;
    }
    let digest = Sha256::digest(id.as_bytes());
    let mut hex = String::with_capacity(64);
    for b in digest.iter() {
        hex.push_str(&format!("{b:02x}"));
    }
    format!("{prefix}:{HASHED}{hex}")
}

/// What marks a hashed id in an entity key.
const HASHED: &str = "sha256:";

/// The `400 Bad Request` for a malformed entity id: no bucket was touched.
fn malformed(why: &MalformedId, endpoint: &str, limits: &RouteLimits) -> Verdict {
    let body = malformed_problem(why, endpoint);
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::BAD_REQUEST;
    let h = response.headers_mut();
    h.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    headers::write(h, &limits.policy, &[]);
    Verdict::Deny(response)
}

/// The denial response: status, problem body and every header field.
fn deny(
    layer: LayerKind,
    decision: &Decision,
    endpoint: &str,
    limits: &RouteLimits,
    reports: &[Report],
) -> Verdict {
    let retry = retry_after_secs(decision.retry_after);
    let unavailable = decision.decided_by == DecidedBy::Fallback(FallbackMode::Deny);
    let (status, body) = problem(layer, endpoint, retry, unavailable);
    let mut response = Response::new(body);
    *response.status_mut() = status;
    let h = response.headers_mut();
    h.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    h.insert(RETRY_AFTER, HeaderValue::from(retry));
    headers::write(h, &limits.policy, reports);
    Verdict::Deny(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entity_keys_hash_ids_the_store_would_refuse() {
        let e = "GET:/bookings/{bookingId}";
        assert_eq!(
            entity_bucket_key(e, "123"),
            "ratelimit:entity:GET:/bookings/{bookingId}:123"
        );
        let long = "x".repeat(5000);
        let k = entity_bucket_key(e, &long);
        assert!(k.starts_with("ratelimit:entity:GET:/bookings/{bookingId}:sha256:"));
        assert_eq!(
            k.len(),
            "ratelimit:entity:GET:/bookings/{bookingId}:sha256:".len() + 64
        );
        assert_ne!(k, entity_bucket_key(e, &"y".repeat(5000)));
        assert!(validate_key(&entity_bucket_key(e, "a\0b")).is_ok());
        // An id written as another id's digest is hashed again: it cannot share its bucket.
        let posing = k.rsplit_once(':').map(|(_, hex)| format!("sha256:{hex}"));
        let posing = posing.unwrap();
        assert_ne!(entity_bucket_key(e, &posing), k);
        assert!(
            entity_bucket_key(e, &posing)
                .starts_with("ratelimit:entity:GET:/bookings/{bookingId}:sha256:")
        );
    }
}
