//! [`Route`]: a key per route pattern or gRPC method.

use http::request::Parts;
use http::{Method, header::CONTENT_TYPE};

use super::{Extracted, Key, KeyExtractor};

/// The longest gRPC path used as a route key; longer ones have no route key.
pub const MAX_GRPC_PATH_LEN: usize = 256;

/// A key per route pattern (`/users/{id}`, never the raw URI), optionally with the method; for gRPC, the `/package.Service/Method` path.
///
/// ```
/// use axum::{Router, routing::get};
/// use tollgate::key::{ClientIp, KeyExtractorExt, Route};
/// use tollgate::{Quota, RateLimitLayer, Rule};
///
/// // Each client gets 30 requests per minute on each route; /users/1 and /users/2 share one.
/// let layer = RateLimitLayer::builder()
///     .rule(Rule::new("per-route", Quota::per_minute(30)).key(ClientIp::new().and(Route::new())))
///     .build()?;
/// let app: Router = Router::new()
///     .route("/users/{id}", get(|| async { "user" }))
///     .route_layer(layer);
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
///
/// With axum the route is the pattern of `MatchedPath`, present when the layer runs inside the
/// router (`Router::route_layer`, `Router::layer`, or a layer on a route). A raw path would let a
/// client invent a new key per request (`/users/1`, `/users/2`, …). Requests that matched no
/// route have no route key: they share the [`Key::unidentified`] budget of the rule (chain a
/// constant fallback to name it, or let the rule [skip](crate::Rule::skip_unidentified) them).
///
/// For gRPC requests (`content-type: application/grpc…`) the key is the request path, which
/// names the method, when it has the form `/package.Service/Method`. Methods are keyed by name
/// as they arrive; a client can name methods that do not exist, but each such key is short
/// and expires with its window.
///
/// [`with_method`](Route::with_method) puts the method first (`GET /users/{id}`); methods other
/// than the nine standard ones share the name `OTHER`, so they cannot multiply keys either.
#[derive(Clone, Copy, Debug, Default)]
pub struct Route {
    method: bool,
}

impl Route {
    /// The route pattern, or the gRPC method path.
    pub const fn new() -> Self {
        Route { method: false }
    }

    /// Puts the request method before the route: `GET /users/{id}`.
    pub const fn with_method(mut self) -> Self {
        self.method = true;
        self
    }

    /// The route of a request: the axum route pattern or the gRPC method path.
    ///
    /// ```
    /// use tollgate::key::Route;
    ///
    /// let (parts, ()) = http::Request::post("/helloworld.Greeter/SayHello")
    ///     .header("content-type", "application/grpc")
    ///     .body(())
    ///     .unwrap()
    ///     .into_parts();
    /// assert_eq!(Route::route(&parts), Some("/helloworld.Greeter/SayHello"));
    /// ```
    pub fn route(parts: &Parts) -> Option<&str> {
        Self::route_in(&parts.uri, &parts.headers, &parts.extensions)
    }

    /// [`route`](Route::route) from the pieces of a request head.
    pub(crate) fn route_in<'a>(
        uri: &'a http::Uri,
        headers: &'a http::HeaderMap,
        extensions: &'a http::Extensions,
    ) -> Option<&'a str> {
        #[cfg(feature = "axum")]
        if let Some(matched) = extensions.get::<axum::extract::MatchedPath>() {
            return Some(matched.as_str());
        }
        #[cfg(not(feature = "axum"))]
        let _ = extensions;
        let grpc = headers
            .get(CONTENT_TYPE)
            .is_some_and(|ct| ct.as_bytes().starts_with(b"application/grpc"));
        if grpc && is_grpc_method_path(uri.path()) {
            return Some(uri.path());
        }
        None
    }
}

/// `/package.Service/Method`: two non-empty segments of `A-Z a-z 0-9 _ .`.
fn is_grpc_method_path(path: &str) -> bool {
    let Some(rest) = path.strip_prefix('/') else {
        return false;
    };
    let Some((service, method)) = rest.split_once('/') else {
        return false;
    };
    let ok = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.')
    };
    path.len() <= MAX_GRPC_PATH_LEN && ok(service) && ok(method)
}

fn method_name(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        Method::CONNECT => "CONNECT",
        Method::TRACE => "TRACE",
        _ => "OTHER",
    }
}

impl KeyExtractor for Route {
    fn extract(&self, parts: &Parts) -> Extracted {
        let Some(route) = Self::route(parts) else {
            return Extracted::Missing;
        };
        let key = if self.method {
            Key::text(format!("{} {route}", method_name(&parts.method)))
        } else {
            Key::text(route)
        };
        Extracted::Found(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grpc(path: &str) -> Option<Key> {
        let (parts, ()) = http::Request::post(path)
            .header("content-type", "application/grpc+proto")
            .body(())
            .unwrap()
            .into_parts();
        Route::new().extract(&parts).found()
    }

    #[test]
    fn grpc_paths() {
        assert_eq!(grpc("/a.B/C"), Some(Key::text("/a.B/C")));
        assert_eq!(grpc("/a.B/C/D"), None);
        assert_eq!(grpc("/a.B/"), None);
        assert_eq!(grpc("/a%20B/C"), None);
        assert_eq!(grpc(&format!("/a/{}", "m".repeat(300))), None);
    }

    #[test]
    fn plain_requests_have_no_route() {
        let (parts, ()) = http::Request::get("/users/1")
            .body(())
            .unwrap()
            .into_parts();
        assert_eq!(Route::new().extract(&parts).found(), None);
    }

    #[test]
    fn methods_are_bounded() {
        assert_eq!(method_name(&Method::from_bytes(b"BREW").unwrap()), "OTHER");
        assert_eq!(method_name(&Method::PATCH), "PATCH");
    }
}
