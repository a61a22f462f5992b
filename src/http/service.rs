//! [`RateLimit`]: the service, and its future [`ResponseFuture`]: the checks (`check.rs`)
//! before the inner service runs, and the header fields on its response.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::http::{Request, Response};
use tower::Service;

use super::check::{self, Outcome, Progress};
use super::route::Config;

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
            // The limits' part of the response (`Progress::apply`). (Not the layer's `Config`:
            // its count is one more that every core's requests would share.)
            after: Option<Progress>,
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
                // Applied where it lies, then dropped there: moved out, it would be copied.
                if let Some(a) = after.as_mut() {
                    a.apply(&mut response);
                    *after = None;
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

    fn call(&mut self, mut req: Request<ReqBody>) -> Self::Future {
        // Checked on the request as it came; split into parts only for a route whose limits
        // read them (`head.rs`).
        let mut outcome = check::now(&self.config, &mut req);
        if let Outcome::NeedsParts = outcome {
            let (mut parts, body) = req.into_parts();
            outcome = check::now(&self.config, &mut parts);
            req = Request::from_parts(parts, body);
        }
        let state = match outcome {
            // `NeedsParts` only from a whole request: the parts' checks never give it.
            Outcome::Pass | Outcome::NeedsParts => State::Inner {
                future: self.inner.call(req),
                after: None,
            },
            Outcome::Allow(progress) => State::Inner {
                future: self.inner.call(req),
                after: Some(progress),
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
                            Outcome::Allow(mut progress) => {
                                let mut response = inner.call(req).await?;
                                progress.apply(&mut response);
                                Ok(response)
                            }
                            Outcome::Deny(response) => Ok(response.map(ResBody::from)),
                            Outcome::Pass | Outcome::Slow(_) | Outcome::NeedsParts => {
                                inner.call(req).await
                            }
                        }
                    }),
                }
            }
        };
        ResponseFuture { state }
    }
}
