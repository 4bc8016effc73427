//! Fuzzes the client's reading of `RateLimit` fields (draft-ietf-httpapi-ratelimit-headers-11
//! policies, `r` and `t`) through `HonourLimitsLayer`.
//!
//! The first byte picks the status (200 or 429, with no `Retry-After`), the rest is split at
//! newlines into up to 8 `RateLimit` field lines. Besides "never panics", it checks that:
//!
//! * a wait is never longer than `MAX_ANNOUNCED_WAIT`;
//! * two paths whose answers named the same policies wait alike (a policy's wait covers every
//!   target that named it, whatever order the answers came in);
//! * a path whose answers named no policy is never held back.

#![no_main]

mod common;

use common::{Server, get, send, value};
use http::StatusCode;
use libfuzzer_sys::fuzz_target;
use tollgate::client::{HonourLimitsLayer, MAX_ANNOUNCED_WAIT};
use tower_layer::Layer;

fuzz_target!(|data: &[u8]| {
    let Some((&select, rest)) = data.split_first() else {
        return;
    };
    let mut server = Server::plain();
    server.status = if select % 2 == 0 {
        StatusCode::OK
    } else {
        StatusCode::TOO_MANY_REQUESTS
    };
    for line in rest.split(|&b| b == b'\n').take(8) {
        server.head.append("ratelimit", value(line));
    }
    let layer = HonourLimitsLayer::new();
    let mut named = layer.layer(server);
    let mut plain = layer.layer(Server::plain());

    assert_eq!(send(&mut named, get("http://a.test/a")), Ok(()));
    let a = send(&mut named, get("http://a.test/a"));
    let b = send(&mut named, get("http://a.test/b"));
    assert_eq!(b, Ok(()), "/b never answered, held back");
    let b = send(&mut named, get("http://a.test/b"));
    let (a, b) = (a.err(), b.err());
    assert_eq!(a.is_some(), b.is_some(), "/a waits {a:?}, /b {b:?}");
    for wait in [a, b].into_iter().flatten() {
        assert!(wait <= MAX_ANNOUNCED_WAIT);
    }
    for _ in 0..2 {
        assert_eq!(
            send(&mut plain, get("http://a.test/c")),
            Ok(()),
            "/c held back"
        );
    }
    // Another server's policies of the same names are others.
    assert_eq!(send(&mut plain, get("http://b.test/a")), Ok(()));
});
