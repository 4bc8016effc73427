//! [`Route`]: a key per route pattern or gRPC method.

use std::collections::HashMap;
use std::sync::{OnceLock, RwLock};

use http::Method;
use http::request::Parts;

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
/// and expires with its window. A layer on one service of a tonic server sees the service's
/// route pattern (`/package.Service/{*rest}`): one key per service, unless
/// `tollgate::grpc::GrpcPathLayer` (feature `tonic`) is on the server, which makes it per method.
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
        let grpc = crate::wire::is_grpc(headers);
        // Inside a tonic server (which routes with axum) the matched path is the service's
        // wildcard, the same for every method: the path `GrpcPathLayer` recorded before the
        // routing names the method. (A client cannot forge an extension, only a content type.)
        #[cfg(feature = "tonic")]
        if grpc
            && let Some(GrpcPath(path)) = extensions.get::<GrpcPath>()
            && is_grpc_method_path(path.path())
        {
            return Some(path.path());
        }
        #[cfg(feature = "axum")]
        if let Some(matched) = extensions.get::<axum::extract::MatchedPath>() {
            return Some(matched.as_str());
        }
        #[cfg(not(any(feature = "axum", feature = "tonic")))]
        let _ = extensions;
        if grpc && is_grpc_method_path(uri.path()) {
            return Some(uri.path());
        }
        None
    }
}

/// A gRPC call's path, `/package.Service/Method`, as
/// [`GrpcPathLayer`](crate::grpc::GrpcPathLayer) records it.
#[cfg(feature = "tonic")]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrpcPath(pub http::uri::PathAndQuery);

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

/// The names a route key puts before its route: the nine standard methods, and `OTHER`.
const METHODS: [&str; 10] = [
    "GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "CONNECT", "TRACE", "OTHER",
];

fn method_index(method: &Method) -> usize {
    match *method {
        Method::GET => 0,
        Method::POST => 1,
        Method::PUT => 2,
        Method::DELETE => 3,
        Method::PATCH => 4,
        Method::HEAD => 5,
        Method::OPTIONS => 6,
        Method::CONNECT => 7,
        Method::TRACE => 8,
        _ => 9,
    }
}

impl KeyExtractor for Route {
    fn extract(&self, parts: &Parts) -> Extracted {
        let Some(route) = Self::route(parts) else {
            return Extracted::Missing;
        };
        let method = self.method.then(|| method_index(&parts.method));
        Extracted::Found(interned(method, route))
    }
}

/// The longest list of route keys kept, for every `Route` extractor of the process together.
/// A server's route patterns are few; gRPC method paths are chosen by clients, so past this
/// many the keys of new routes are made per request instead.
const MAX_INTERNED_ROUTES: usize = 4096;

/// Route keys made once and shared, by method (the last list for routes without one): a key is
/// an escaped copy of its route, which would otherwise be made per request.
type RouteKeys = [HashMap<Box<str>, Key, foldhash::fast::RandomState>; METHODS.len() + 1];

fn route_keys() -> &'static RwLock<(RouteKeys, usize)> {
    static KEYS: OnceLock<RwLock<(RouteKeys, usize)>> = OnceLock::new();
    KEYS.get_or_init(|| RwLock::new((std::array::from_fn(|_| HashMap::default()), 0)))
}

/// The key of `route`, after the method of index `method` when there is one.
fn interned(method: Option<usize>, route: &str) -> Key {
    let list = method.unwrap_or(METHODS.len());
    let keys = route_keys();
    if let Some(key) = keys.read().unwrap_or_else(|p| p.into_inner()).0[list].get(route) {
        return key.clone();
    }
    let key = match method {
        Some(i) => Key::text(format!("{} {route}", METHODS[i])),
        None => Key::text(route),
    };
    let mut keys = keys.write().unwrap_or_else(|p| p.into_inner());
    let (lists, len) = &mut *keys;
    if *len < MAX_INTERNED_ROUTES && !lists[list].contains_key(route) {
        lists[list].insert(route.into(), key.clone());
        *len += 1;
    }
    key
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
    fn route_keys_are_the_same_made_once_or_again() {
        let (parts, ()) = http::Request::post("/a.B/Made")
            .header("content-type", "application/grpc")
            .body(())
            .unwrap()
            .into_parts();
        for _ in 0..3 {
            assert_eq!(
                Route::new().extract(&parts).found(),
                Some(Key::text("/a.B/Made"))
            );
            assert_eq!(
                Route::new().with_method().extract(&parts).found(),
                Some(Key::text("POST /a.B/Made"))
            );
        }
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
        assert_eq!(
            METHODS[method_index(&Method::from_bytes(b"BREW").unwrap())],
            "OTHER"
        );
        assert_eq!(METHODS[method_index(&Method::PATCH)], "PATCH");
    }
}
