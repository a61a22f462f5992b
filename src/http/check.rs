//! The checks a request goes through before the inner service runs: its route's limits, in
//! order, each taking one token; a refusal gives back what the limits before it took.
//!
//! [`now`] does all it can without awaiting: the route lookup, the entity ids, each limit's
//! memory of refused keys, and takes from live leases (the lease table's fast path, under a
//! plan resolved when the layer was built). A limit that needs the store (a direct-mode plan,
//! a lease to refill) hands the rest to [`finish`], which awaits.

use std::borrow::Cow;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use axum::extract::rejection::RawPathParamsRejection;
use axum::extract::{FromRequestParts, MatchedPath, OriginalUri, RawPathParams};
use axum::http::header::{CONTENT_TYPE, RETRY_AFTER};
use axum::http::request::Parts;
use axum::http::{HeaderValue, Method, Response, StatusCode};
use sha2::{Digest, Sha256};
use smallvec::SmallVec;

use super::fields;
use super::head::Head;
use super::headers::{Report, malformed_problem, problem, retry_after_secs};
use super::key::{HASHED, MalformedId, ParamValue, match_pattern, percent_decode};
use super::refund::{give_back, give_back_detached};
use super::route::{Config, Limit, OneRoute, RouteLimits, RouteTable, Routes, Scope, Segment};
use crate::bucket::Tokens;
use crate::key::{validate_key, validate_key_shape};
use crate::lease::Hint;
use crate::metrics::{HTTP_DENIED, HTTP_ERRORS, HTTP_WOULD_DENY};
use crate::policy::{FallbackMode, route_shape};
use crate::{DecidedBy, Decision};

/// Per limit of a route, inline up to this many (a route's own limit, its entity's and a
/// budget); a route of more keeps its keys and reports on the heap. The progress moves with
/// the response's future and is copied with it: at four, each copy carried one more key and
/// report (56 bytes), about 107 instructions a request for two limits
/// (`scripts/http-instructions.sh`).
const INLINE: usize = 3;

/// A limit's bucket key for one request.
#[derive(Debug)]
pub(crate) enum KeyOf {
    /// The request has no id for this limit: it is skipped.
    Skip,
    /// The key made with the route ([`Progress::made`]): a whole-route limit's.
    Fixed,
    /// Made for this request.
    Owned(String),
}

/// What the checks found so far: the route, each limit's key, the tokens taken and the reports;
/// once every limit allowed the request, what its response needs (the fields, and the
/// give-backs when an inner layer refuses it: [`apply`](Self::apply)).
///
/// Kept small (it moves with the response's future): a code-built route's strings are shared
/// with its other requests, and what a give-back needs of each take is one flag.
#[derive(Debug)]
pub(crate) struct Progress {
    /// The route's limits: with a code-built layer's route for the request's method and
    /// pattern, its endpoint, method, pattern and keys ([`RouteLimits::code`]; a file route's
    /// are its own).
    pub(crate) limits: Arc<RouteLimits>,
    keys: SmallVec<[KeyOf; INLINE]>,
    pub(crate) reports: SmallVec<[Report; INLINE]>,
    /// Bit `i`: limit `i` took a token (a route has at most
    /// [`MAX_ROUTE_LIMITS`](crate::policy::MAX_ROUTE_LIMITS) limits).
    taken: u16,
    /// Bit `i`: limit `i`'s token may go back (not a fallback's grant).
    givable: u16,
    /// The next limit to check.
    next: u8,
    /// Whether an admitted response carries the fields (not when they go on refusals only).
    fields: bool,
    /// Whether the fields include `X-RateLimit-{Name}-Remaining`.
    remaining: bool,
}

/// Whether the token `decision` took may go back: not one a fallback granted (the store did
/// not hand it out, and while it is failing a give-back would only wait for its timeout).
fn givable(decision: &Decision) -> bool {
    decision.allowed
        && !decision.would_deny
        && !matches!(decision.decided_by, DecidedBy::Fallback(_))
}

impl Progress {
    /// Limit `i`'s key for this request.
    fn key(&self, i: usize) -> Option<&str> {
        self.key_and_hint(i).map(|(key, _)| key)
    }

    /// Limit `i`'s key for this request, with where the lease table last found it when it is
    /// the key made with the route.
    fn key_and_hint(&self, i: usize) -> Option<(&str, Option<&Hint>)> {
        match &self.keys[i] {
            KeyOf::Skip => None,
            KeyOf::Fixed => self.made(i).map(|(key, hint)| (key, Some(hint))),
            KeyOf::Owned(key) => Some((key, None)),
        }
    }

    /// Limit `i`'s key as made with its route (a whole-route limit's key, or an entity key's
    /// part before the id), and the lease table's hint for it. A policy file's route, and a
    /// budget, have them in the limit ([`Limit::key`]); a code-built layer's route for this
    /// request's method and pattern has the others
    /// ([`CodeRoute::keys`](super::route::CodeRoute::keys)), so every limit has one.
    fn made(&self, i: usize) -> Option<(&str, &Hint)> {
        let limit = &self.limits.limits[i];
        match (&limit.key, &self.limits.code) {
            (Some(key), _) => Some((key, &limit.hint.0)),
            (None, Some(code)) => Some((code.keys[i].as_deref()?, &code.hints[i].0)),
            (None, None) => None,
        }
    }

    /// Gives back every token taken so far (a later limit refused), and reports each limit
    /// whose token is back in its lease with it. Waits for the store's give-backs.
    pub(crate) async fn give_back_all(&mut self) {
        let (taken, givable) = self.take_taken();
        let limits = Arc::clone(&self.limits);
        for i in bits(taken) {
            let givable = givable & (1 << i) != 0;
            let limit = &limits.limits[i];
            let Some(key) = self.key(i) else { continue };
            let back = give_back(
                &limits.limiter,
                &limits.give_backs,
                &limit.plan,
                key,
                givable,
            )
            .await;
            self.given_back(back, i);
        }
    }

    /// [`give_back_all`](Self::give_back_all) without waiting (an inner layer refused).
    pub(crate) fn give_back_all_detached(&mut self) {
        let (taken, givable) = self.take_taken();
        let limits = Arc::clone(&self.limits);
        for i in bits(taken) {
            let givable = givable & (1 << i) != 0;
            let limit = &limits.limits[i];
            let Some(key) = self.key(i) else { continue };
            let back = give_back_detached(
                &limits.limiter,
                &limits.give_backs,
                &limit.plan,
                key,
                givable,
            );
            self.given_back(back, i);
        }
    }

    /// Finishes an admitted request's response: when an inner layer's limit refused it, gives
    /// back what this layer's limits took (without waiting); then writes the fields, unless
    /// they go on refusals only.
    pub(crate) fn apply<B>(&mut self, response: &mut Response<B>) {
        if response.extensions().get::<RefusedByLimit>().is_some() {
            self.give_back_all_detached();
        }
        if self.fields {
            fields::write(
                response.headers_mut(),
                &self.limits,
                &self.reports,
                self.remaining,
            );
        }
    }

    /// The limits that took a token and those whose token may go back, as bits, forgotten
    /// here (each is given back once).
    fn take_taken(&mut self) -> (u16, u16) {
        (
            std::mem::take(&mut self.taken),
            std::mem::take(&mut self.givable),
        )
    }

    /// Notes that limit `i` took a token, and whether it may go back.
    fn took(&mut self, i: usize, decision: &Decision) {
        self.took_as(i, givable(decision));
    }

    /// Notes that limit `i` took a token, which may go back when `givable`.
    fn took_as(&mut self, i: usize, givable: bool) {
        self.taken |= 1 << i;
        if givable {
            self.givable |= 1 << i;
        }
    }

    /// Reports limit `i`'s token back in its lease when `back`.
    fn given_back(&mut self, back: bool, i: usize) {
        let limit = &self.limits.limits[i];
        let plan = &limit.plan;
        if back && let Some(report) = self.reports.iter_mut().find(|r| r.limit == i) {
            let more = report
                .numbers(plan, limit.scale)
                .0
                .map(|r| Tokens::whole(r.saturating_add(1)));
            *report = Report::allowed(i, plan, more, None);
        }
    }
}

/// What the checks decided.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// No limit applies to the request.
    Pass,
    /// Every limit allowed it.
    Allow(Progress),
    /// A limit refused it (or its id is malformed): the whole response.
    Deny(Response<String>),
    /// A limit needs the store: [`finish`] goes on.
    Slow(Progress),
    /// The route's limits read the request's parts, and [`now`] was given the whole request:
    /// nothing was counted or taken, and the caller checks the parts instead.
    NeedsParts,
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
/// inventing one. Any other method string (`X0`, `get`, `PURGE`) is `OTHER`.
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
        _ => "OTHER",
    }
}

/// The route of a request, found in `config` (a code-built layer's for the request's method and
/// pattern), or `None` when no limit applies.
fn route_of(config: &Config, head: &impl Head) -> Option<Arc<RouteLimits>> {
    let path = head.extensions().get::<MatchedPath>();
    let matched = path.map(MatchedPath::as_str);
    match &config.routes {
        Routes::One(one) => code_route(one, head.method(), path),
        Routes::Table(cell) => {
            let unmatched = |table: &RouteTable| {
                super::unmatched::unmatched(&table.all, head, matched);
            };
            let (Some(path), Some(matched)) = (path, matched) else {
                cell.with(unmatched);
                return None;
            };
            let method = head.method();
            cell.lookup(
                method,
                path,
                |table| {
                    let shape = route_shape(matched)?;
                    // A route listed for the method itself first (a file may list HEAD on
                    // its own), then, for HEAD, the GET route whose handler answers it.
                    let own = method.as_str();
                    let counted = limited_method(method);
                    table
                        .by_shape
                        .get(&format!("{own}:{shape}"))
                        .or_else(|| {
                            (counted != own)
                                .then(|| table.by_shape.get(&format!("{counted}:{shape}")))
                                .flatten()
                        })
                        .cloned()
                },
                unmatched,
            )
        }
    }
}

/// A code-built layer's route for a request with `method` that the router matched as `path`
/// (`None` outside a router): its limits' copy for the method and pattern. Apart from
/// [`route_of`], which a file route's request runs: inlined there, it made that path's code
/// larger and slower.
#[inline(never)]
fn code_route(
    one: &OneRoute,
    method: &Method,
    path: Option<&MatchedPath>,
) -> Option<Arc<RouteLimits>> {
    let given = one.limits.pattern.as_deref();
    let pattern = given.or(path.map(MatchedPath::as_str))?;
    let from = if given.is_some() { None } else { path };
    Some(
        one.per_pattern
            .get(key_method(method), from, pattern, |method| {
                one.limits.for_pattern(method, pattern)
            }),
    )
}

/// The checks that need no waiting; see the [module docs](self). Given a whole request, a
/// route whose limits read the request's parts is [`Outcome::NeedsParts`], before anything is
/// counted or taken.
pub(crate) fn now(config: &Config, req: &mut impl Head) -> Outcome {
    let Some(limits) = route_of(config, req) else {
        return Outcome::Pass;
    };
    if limits.is_empty() {
        return Outcome::Pass;
    }
    if limits.needs_parts && req.parts().is_none() {
        return Outcome::NeedsParts;
    }
    match (&limits.file, &limits.code) {
        (Some(file), _) => file.checked.increment(1),
        (None, Some(_)) => {}
        (None, None) => return Outcome::Pass,
    }
    let mut progress = Progress {
        keys: SmallVec::with_capacity(limits.limits.len()),
        reports: SmallVec::new(),
        taken: 0,
        givable: 0,
        next: 0,
        fields: config.fields_on_admitted(&limits),
        remaining: config.remaining_fields(&limits),
        limits,
    };

    // The entity ids first: a malformed one is refused before any token is taken.
    let mut params = match req.parts() {
        Some(parts) if progress.limits.needs_params => {
            Some(Params::of(parts, progress.router_pattern()))
        }
        _ => None,
    };
    for i in 0..progress.limits.limits.len() {
        let limit = &progress.limits.limits[i];
        let key = match &limit.scope {
            Scope::Route => KeyOf::Fixed,
            Scope::Entity {
                key,
                param,
                segment,
            } => {
                // A code-built route's parameter: where its pattern has it.
                let segment = segment.or_else(|| progress.limits.code.as_ref()?.segments[i]);
                let id: Result<Option<Cow<'_, str>>, MalformedId> =
                    match (key.path_param_name(), segment, &params) {
                        (Some(name), Some(at), _) => segment_id(req, at, name),
                        (Some(name), None, _) => {
                            // A file route's parameter that is not a whole segment: read once,
                            // from the parts (`needs_parts`).
                            let params = match (&mut params, req.parts()) {
                                (Some(params), _) => Some(&*params),
                                (None, Some(parts)) => Some(
                                    &*params.insert(Params::of(parts, progress.router_pattern())),
                                ),
                                (None, None) => None,
                            };
                            params
                                .and_then(|params| params.get(*param, name))
                                .transpose()
                                .map(|id| id.map(Cow::Owned))
                        }
                        _ => key
                            .extract(req, &[], &config.trusted)
                            .map(|id| id.map(Cow::Owned)),
                    };
                match id {
                    // A borrowed id is a path segment as the client sent it (`segment_id`):
                    // the URI parser admitted no NUL byte in it.
                    Ok(Some(id)) if !id.is_empty() => match progress.made(i) {
                        Some((prefix, _)) => {
                            KeyOf::Owned(hashed_key(prefix, &id, matches!(id, Cow::Borrowed(_))))
                        }
                        None => KeyOf::Skip,
                    },
                    Ok(_) => KeyOf::Skip,
                    Err(why) => return Outcome::Deny(malformed(&why, &limit.name, &progress)),
                }
            }
        };
        progress.keys.push(key);
    }

    // A key remembered as refused is refused now, before any token is taken.
    let mut clock = None;
    for i in 0..progress.limits.limits.len() {
        let limit = &progress.limits.limits[i];
        if limit.shadow || limit.refused.is_empty() {
            continue;
        }
        let Some(key) = progress.key(i) else { continue };
        let now = || *clock.get_or_insert_with(crate::clock::instant);
        if let Some(wait) = limit.refused.until(key, now) {
            let decision = refused(limit, wait);
            progress
                .reports
                .push(Report::denied(i, &limit.plan, decision.remaining, wait));
            count(&progress, i, Event::Denied);
            return Outcome::Deny(deny(i, &decision, &progress, config));
        }
    }

    // Then each limit in order, from its lease while one answers: the lease table pinned once
    // for them all, a fixed key found through its limit's hint.
    let mut pinned = None;
    while usize::from(progress.next) < progress.limits.limits.len() {
        let i = usize::from(progress.next);
        let Some((key, hint)) = progress.key_and_hint(i) else {
            progress.next += 1;
            continue;
        };
        let limit = &progress.limits.limits[i];
        let Some(nanos) = limit.lease_nanos else {
            return Outcome::Slow(progress);
        };
        match config
            .limiter
            .take_now(&mut pinned, &limit.plan, nanos, limit.index, key, hint)
        {
            Some(left) => {
                progress.reports.push(Report::leased(i, left));
                // A lease's token may go back (a lease decided, not a fallback).
                progress.took_as(i, true);
                progress.next += 1;
            }
            None => return Outcome::Slow(progress),
        }
    }
    Outcome::Allow(progress)
}

/// The rest of the checks, from the first limit [`now`] could not decide.
pub(crate) async fn finish(config: &Config, mut progress: Progress) -> Outcome {
    while usize::from(progress.next) < progress.limits.limits.len() {
        let i = usize::from(progress.next);
        progress.next += 1;
        let Some(key) = progress.key(i) else { continue };
        let limits = Arc::clone(&progress.limits);
        let limit = &limits.limits[i];
        match config.limiter.try_acquire_with(&limit.plan, key, 1.0).await {
            Ok(d) if d.allowed && !d.would_deny => {
                progress
                    .reports
                    .push(Report::allowed(i, &limit.plan, d.remaining, d.reset_after));
                progress.took(i, &d);
            }
            // A shadow limit or plan: the denial is reported and counted, and the request goes
            // on (no token was taken, so none is given back later).
            Ok(d) if d.would_deny || limit.shadow => {
                progress
                    .reports
                    .push(Report::denied(i, &limit.plan, d.remaining, d.retry_after));
                count(&progress, i, Event::WouldDeny);
            }
            Ok(d) => {
                if d.decided_by == DecidedBy::Store && !d.retry_after.is_zero() {
                    let now = crate::clock::instant();
                    limit.refused.remember(key, now + d.retry_after, now);
                }
                progress.give_back_all().await;
                progress
                    .reports
                    .push(Report::denied(i, &limit.plan, d.remaining, d.retry_after));
                count(&progress, i, Event::Denied);
                return Outcome::Deny(deny(i, &d, &progress, config));
            }
            Err(_) => count(&progress, i, Event::Error),
        }
    }
    Outcome::Allow(progress)
}

impl Progress {
    /// `METHOD:pattern` of the route.
    fn endpoint(&self) -> &str {
        match (&self.limits.file, &self.limits.code) {
            (Some(file), _) => &file.endpoint,
            (None, Some(code)) => &code.endpoint,
            (None, None) => "",
        }
    }

    /// The pattern the router matched, or the file's (for path parameters without axum).
    fn router_pattern(&self) -> &str {
        match (&self.limits.code, &self.limits.file) {
            (Some(code), _) => &code.pattern,
            (None, Some(file)) => &file.path,
            (None, None) => "",
        }
    }
}

/// A decision answered from a limit's memory of refused keys.
fn refused(limit: &Limit, wait: Duration) -> Decision {
    Decision {
        allowed: false,
        would_deny: false,
        remaining: Some(crate::bucket::Tokens::ZERO),
        limit: limit.plan.capacity(),
        retry_after: wait,
        reset_after: None,
        decided_by: DecidedBy::Store,
        store_time: None,
    }
}

/// The id in segment `at` of the request's path (the whole path as the client sent it, which
/// the router matched against the route's full pattern), percent-decoded; `None` when the
/// path has no such segment. The pattern's last segment is the path's part after its last `/`
/// (the router matched the whole path), found from the end.
fn segment_id<'a>(
    head: &'a impl Head,
    at: Segment,
    name: &str,
) -> Result<Option<Cow<'a, str>>, MalformedId> {
    // The router's path, as the client sent it, is `OriginalUri`'s; a nested router's own
    // `uri` lost the prefix it matched. The last segment of a path the prefix left some of is
    // the same in both: read there, without looking the original up among the extensions.
    let own = head.uri().path();
    let found = match at.last.then(|| last_segment(own)) {
        Some(found) if !found.0.is_empty() => Some(found),
        _ => {
            let path = match head.extensions().get::<OriginalUri>() {
                Some(OriginalUri(uri)) => uri.path(),
                None => own,
            };
            if at.last {
                Some(last_segment(path))
            } else {
                nth_segment(path, at.at)
            }
        }
    };
    let Some((raw, escaped)) = found else {
        return Ok(None);
    };
    if !escaped {
        return Ok(Some(Cow::Borrowed(raw)));
    }
    percent_decode(raw)
        .map(|id| Some(Cow::Owned(id)))
        .ok_or_else(|| MalformedId::PathNotUtf8 {
            name: Some(name.to_owned()),
        })
}

/// The part of `path` after its last `/`, and whether it holds a `%`: one pass back from the
/// end.
fn last_segment(path: &str) -> (&str, bool) {
    let bytes = path.as_bytes();
    let (mut start, mut escaped) = (bytes.len(), false);
    while start > 0 {
        match bytes[start - 1] {
            b'/' => break,
            b'%' => escaped = true,
            _ => {}
        }
        start -= 1;
    }
    (&path[start..], escaped)
}

/// The segment after the `at`-th slash of `path` (past the leading ones), what
/// `split('/').nth(at)` gives, and whether it holds a `%`: one pass over the bytes.
fn nth_segment(path: &str, at: usize) -> Option<(&str, bool)> {
    let bytes = path.as_bytes();
    let mut start = bytes.iter().position(|&b| b != b'/').unwrap_or(bytes.len());
    let (mut seen, mut end, mut escaped) = (0, start, false);
    while end < bytes.len() {
        match bytes[end] {
            b'/' if seen == at => break,
            b'/' => {
                seen += 1;
                start = end + 1;
                escaped = false;
            }
            b'%' => escaped = true,
            _ => {}
        }
        end += 1;
    }
    (seen == at).then(|| (&path[start..end], escaped))
}

/// A request's path parameters, read once for all its limits.
enum Params {
    /// axum's, percent-decoded.
    Raw(RawPathParams),
    /// The pattern matched against the path, when axum gives none.
    Matched(Vec<(String, ParamValue)>),
    /// axum refused them all and the path does not match the pattern either.
    Malformed,
}

impl Params {
    /// The parameters of a request that the router matched (or `pattern`, without axum).
    fn of(parts: &mut Parts, pattern: &str) -> Params {
        // `RawPathParams` reads the request's extensions and never waits.
        let raw = {
            let mut fut = std::pin::pin!(RawPathParams::from_request_parts(parts, &()));
            match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
                Poll::Ready(r) => Some(r),
                Poll::Pending => None,
            }
        };
        match raw {
            Some(Ok(params)) => Params::Raw(params),
            Some(Err(RawPathParamsRejection::MissingPathParams(_))) | None => {
                Params::Matched(match_pattern(pattern, parts.uri.path()).unwrap_or_default())
            }
            Some(Err(_)) => {
                let path = match parts.extensions.get::<OriginalUri>() {
                    Some(OriginalUri(uri)) => uri.path(),
                    None => parts.uri.path(),
                };
                match match_pattern(pattern, path) {
                    Some(p) => Params::Matched(p),
                    None => Params::Malformed,
                }
            }
        }
    }

    /// The parameter at `position` among the route's (a file route's, whose router pattern
    /// may name it otherwise), or called `name`.
    fn get(&self, position: Option<usize>, name: &str) -> Option<ParamValue> {
        match self {
            Params::Raw(params) => match position {
                Some(p) => params.iter().nth(p).map(|(_, v)| Ok(v.to_owned())),
                None => params
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| Ok(v.to_owned())),
            },
            Params::Matched(params) => match position {
                Some(p) => params.get(p).map(|(_, v)| v.clone()),
                None => params
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, v)| v.clone()),
            },
            Params::Malformed => Some(Err(MalformedId::PathNotUtf8 { name: None })),
        }
    }
}

/// `ratelimit:entity:{endpoint}:{id}`; an id that would make the key unusable (too long, NUL)
/// is replaced by `sha256:` and its hex digest, so every id still gets its own bucket. An id
/// that itself starts with `sha256:` is hashed too, so it can never pose as another id's digest.
#[cfg(test)]
pub(crate) fn entity_bucket_key(endpoint: &str, id: &str) -> String {
    hashed_key(&format!("ratelimit:entity:{endpoint}:"), id, false)
}

/// `{prefix}{id}` (`prefix` ends in `:`), the id hashed when it would make the key unusable.
/// `no_nul`: the id is known to hold no NUL byte, and is not scanned for one.
fn hashed_key(prefix: &str, id: &str, no_nul: bool) -> String {
    let mut key = String::with_capacity(prefix.len() + id.len());
    key.push_str(prefix);
    key.push_str(id);
    let usable = if no_nul {
        debug_assert!(!id.contains('\0'));
        validate_key_shape(&key).is_ok()
    } else {
        validate_key(&key).is_ok()
    };
    if usable && !id.starts_with(HASHED) {
        return key;
    }
    let digest = Sha256::digest(id.as_bytes());
    key.truncate(prefix.len());
    key.push_str(HASHED);
    for b in digest.iter() {
        use std::fmt::Write as _;
        let _ = write!(key, "{b:02x}");
    }
    key
}

/// The positions of the set bits of `mask`, lowest first.
fn bits(mut mask: u16) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        let i = mask.trailing_zeros();
        (mask != 0).then(|| {
            mask &= mask - 1;
            i as usize
        })
    })
}

/// What a limit's metrics count.
#[derive(Clone, Copy)]
enum Event {
    Denied,
    WouldDeny,
    Error,
}

/// Counts an event of limit `i`: through the handle registered at build time for a policy
/// file's route, by the macro (its first event creates the series) for a layer built in code.
fn count(progress: &Progress, i: usize, event: Event) {
    let limit = &progress.limits.limits[i];
    match (&limit.counters, &progress.limits.code) {
        (Some(c), _) => match event {
            Event::Denied => c.denied.increment(1),
            Event::WouldDeny => c.would_deny.increment(1),
            Event::Error => c.errors.increment(1),
        },
        (None, Some(code)) => {
            let (method, pattern) = (code.method, &code.pattern);
            let name = match event {
                Event::Denied => HTTP_DENIED,
                Event::WouldDeny => HTTP_WOULD_DENY,
                Event::Error => HTTP_ERRORS,
            };
            metrics::counter!(name, "layer" => limit.name.to_string(),
                "method" => method, "route" => pattern.clone())
            .increment(1);
        }
        (None, None) => {}
    }
}

/// The `400 Bad Request` for a malformed entity id of limit `name`: no bucket was touched.
fn malformed(why: &MalformedId, name: &str, progress: &Progress) -> Response<String> {
    let body = malformed_problem(why, name, progress.endpoint());
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::BAD_REQUEST;
    let h = response.headers_mut();
    h.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    fields::write(h, &progress.limits, &[], false);
    response
}

/// Marks a response refused by a limit, so that a layer around this one gives back what its
/// own limits took.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RefusedByLimit;

/// The denial of limit `i`: status, problem body and every header field.
fn deny(i: usize, decision: &Decision, progress: &Progress, config: &Config) -> Response<String> {
    let retry = retry_after_secs(decision.retry_after);
    let unavailable = decision.decided_by == DecidedBy::Fallback(FallbackMode::Deny);
    let name = &progress.limits.limits[i].name;
    let (status, body) = problem(name, progress.endpoint(), retry, unavailable);
    let mut response = Response::new(body);
    *response.status_mut() = status;
    response.extensions_mut().insert(RefusedByLimit);
    let h = response.headers_mut();
    h.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    h.insert(RETRY_AFTER, HeaderValue::from(retry));
    fields::write(
        h,
        &progress.limits,
        &progress.reports,
        config.remaining_fields(&progress.limits),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The id's segment is what `split('/').nth(at)` gives past the leading slashes, borrowed
    /// unless it holds a `%`, decoded then; the last one the same found from the end.
    #[test]
    fn segment_ids_are_the_split_segments() {
        let paths = [
            "/bookings/1",
            "/bookings/12/rooms/7",
            "//bookings/x",
            "/bookings/",
            "/bookings",
            "/",
            "/a%2Fb/c%20d/e",
            "/bookings/%E2%9C%93",
        ];
        for path in paths {
            let (parts, ()) = axum::http::Request::get(path)
                .body(())
                .unwrap()
                .into_parts();
            let count = path.trim_start_matches('/').split('/').count();
            for at in 0..5 {
                let split = path.trim_start_matches('/').split('/').nth(at);
                let expected = split.map(|raw| percent_decode(raw).unwrap());
                // Counted from the start, and for the last segment found from the end too.
                for last in [false, at + 1 == count] {
                    let got = segment_id(&parts, Segment { at, last }, "id").unwrap();
                    assert_eq!(got.as_deref(), expected.as_deref(), "{path} {at} {last}");
                    if let (Some(got), Some(raw)) = (&got, split) {
                        assert_eq!(matches!(got, Cow::Borrowed(_)), !raw.contains('%'));
                    }
                }
            }
        }
        let (parts, ()) = axum::http::Request::get("/bookings/%FF")
            .body(())
            .unwrap()
            .into_parts();
        for last in [false, true] {
            assert!(segment_id(&parts, Segment { at: 1, last }, "id").is_err());
        }
    }

    /// A made key fits when every key made from it does: itself for a whole-route limit; for an
    /// entity limit with the longest id kept (a digest), which `hashed_key` then makes valid.
    #[test]
    fn made_keys_fit_when_their_longest_key_does() {
        use crate::http::key::{DIGEST_BYTES, made_keys_fit};
        let max = crate::key::MAX_KEY_BYTES;
        let fixed = |n: usize| format!("ratelimit:api:GET:/{}", "a".repeat(n - 19));
        assert!(made_keys_fit(&fixed(max), false));
        assert!(!made_keys_fit(&fixed(max + 1), false));
        let digest = HASHED.len() + 2 * DIGEST_BYTES;
        let prefix = |n: usize| format!("{}:", fixed(n - 1));
        assert!(made_keys_fit(&prefix(max - digest), true));
        assert!(!made_keys_fit(&prefix(max - digest + 1), true));
        let longest = hashed_key(&prefix(max - digest), &"x".repeat(5000), false);
        assert_eq!(longest.len(), max);
        assert!(validate_key(&longest).is_ok());
    }

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
