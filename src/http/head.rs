//! What the checks read of a request ([`Head`]): its method, URI, headers and extensions,
//! borrowed from the request itself, or from its parts when the request had to be split.
//!
//! Split into parts and put back together, a request is copied twice (its head is 224 bytes),
//! on every request. Most routes' checks read only what a `Request` lends: the route's
//! pattern, a path segment, a header, the peer address. Two need the parts themselves: axum's
//! path parameters (`RawPathParams` is extracted from `Parts`) and an entity key made by the
//! application's own function (`EntityKey::from_fn` takes `&Parts`). A route whose limits need
//! them ([`RouteLimits::needs_parts`](super::route::RouteLimits)) is checked on the parts;
//! every other on the request as it came.

use axum::http::request::Parts;
use axum::http::{Extensions, HeaderMap, Method, Request, Uri};

/// A request's head as the checks read it.
pub(crate) trait Head {
    /// The request's method.
    fn method(&self) -> &Method;
    /// The request's URI (a nested router's is stripped of its prefix).
    fn uri(&self) -> &Uri;
    /// The request's header fields.
    fn headers(&self) -> &HeaderMap;
    /// The request's extensions.
    fn extensions(&self) -> &Extensions;
    /// The parts, when the request was split into them (`None` for a whole request).
    fn parts(&mut self) -> Option<&mut Parts>;
}

impl Head for Parts {
    fn method(&self) -> &Method {
        &self.method
    }
    fn uri(&self) -> &Uri {
        &self.uri
    }
    fn headers(&self) -> &HeaderMap {
        &self.headers
    }
    fn extensions(&self) -> &Extensions {
        &self.extensions
    }
    fn parts(&mut self) -> Option<&mut Parts> {
        Some(self)
    }
}

impl<B> Head for Request<B> {
    fn method(&self) -> &Method {
        self.method()
    }
    fn uri(&self) -> &Uri {
        self.uri()
    }
    fn headers(&self) -> &HeaderMap {
        self.headers()
    }
    fn extensions(&self) -> &Extensions {
        self.extensions()
    }
    fn parts(&mut self) -> Option<&mut Parts> {
        None
    }
}
