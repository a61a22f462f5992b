//! [`RateLimit`]: the service, and its future [`ResponseFuture`]: the checks (`check.rs`)
//! before the inner service runs, and the header fields on its response.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use axum::extract::OriginalUri;
use axum::http::request::Parts;
use axum::http::{Method, Request, Response};
use tower::Service;

use super::check::{self, Outcome, Progress, RefusedByLimit};
use super::headers;
use super::key::match_pattern;
use super::route::{Config, RouteLimits};

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

/// The limits' part of a response: the header fields, and the give-backs when an inner layer
/// refused the request.
#[derive(Debug)]
struct After {
    config: Arc<Config>,
    progress: Progress,
}

impl After {
    fn apply<B>(mut self, response: &mut Response<B>) {
        // An inner layer's limit refused the request: what this layer's limits took goes back.
        if response.extensions().get::<RefusedByLimit>().is_some() {
            self.progress.give_back_all_detached(&self.config);
        }
        headers::write(
            response.headers_mut(),
            &self.progress.limits,
            &self.progress.reports,
        );
    }
}

pin_project_lite::pin_project! {
    /// The future of [`RateLimit`]: the inner service's, with the header fields added to its
    /// response; or the denial, ready; or, when a limit needed the store, the checks and then
    /// the inner service, boxed.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        state: State<F, B, E>,
    }
}

pin_project_lite::pin_project! {
    #[project = StateProj]
    enum State<F, B, E> {
        Inner {
            #[pin]
            future: F,
            after: Option<After>,
        },
        Ready {
            response: Option<Response<B>>,
        },
        Slow {
            future: Pin<Box<dyn Future<Output = Result<Response<B>, E>> + Send>>,
        },
    }
}

impl<F, B, E> fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ResponseFuture")
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<B>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Inner { future, after } => {
                let mut response = std::task::ready!(future.poll(cx))?;
                if let Some(after) = after.take() {
                    after.apply(&mut response);
                }
                Poll::Ready(Ok(response))
            }
            StateProj::Ready { response } => Poll::Ready(Ok(response
                .take()
                .expect("`ResponseFuture` polled after it completed"))),
            StateProj::Slow { future } => future.as_mut().poll(cx),
        }
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
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let (mut parts, body) = req.into_parts();
        let state = match check::now(&self.config, &mut parts) {
            Outcome::Pass => State::Inner {
                future: self.inner.call(Request::from_parts(parts, body)),
                after: None,
            },
            Outcome::Allow(progress) => State::Inner {
                future: self.inner.call(Request::from_parts(parts, body)),
                after: Some(After {
                    config: Arc::clone(&self.config),
                    progress,
                }),
            },
            Outcome::Deny(response) => State::Ready {
                response: Some(response.map(ResBody::from)),
            },
            Outcome::Slow(progress) => {
                // The clone may not be ready; the one poll_ready readied is the one we call.
                let clone = self.inner.clone();
                let mut inner = std::mem::replace(&mut self.inner, clone);
                let config = Arc::clone(&self.config);
                State::Slow {
                    future: Box::pin(async move {
                        match check::finish(&config, progress).await {
                            Outcome::Allow(progress) => {
                                let mut response =
                                    inner.call(Request::from_parts(parts, body)).await?;
                                After { config, progress }.apply(&mut response);
                                Ok(response)
                            }
                            Outcome::Deny(response) => Ok(response.map(ResBody::from)),
                            Outcome::Pass | Outcome::Slow(_) => {
                                inner.call(Request::from_parts(parts, body)).await
                            }
                        }
                    }),
                }
            }
        };
        ResponseFuture { state }
    }
}

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
pub(crate) fn unmatched(all: &[Arc<RouteLimits>], parts: &Parts, matched: Option<&str>) {
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
