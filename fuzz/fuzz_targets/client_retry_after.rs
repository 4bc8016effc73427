//! Fuzzes the client's reading of `Retry-After` (delay-seconds or an HTTP-date) through
//! `HonourLimitsLayer`.
//!
//! The first byte picks the status (429, 503, 200, 500), the rest is the value. Besides "never
//! panics", it checks that:
//!
//! * only a 429 or a 503 makes a wait, never longer than `MAX_ANNOUNCED_WAIT`;
//! * a wait of whole seconds is at most what the value says (capped to a day), and a value of
//!   2 s or more is a wait;
//! * the wait holds back the call's target only: not another path, method or server.

#![no_main]

mod common;

use std::time::Duration;

use common::{Server, get, send, value};
use http::StatusCode;
use libfuzzer_sys::fuzz_target;
use tollgate::client::{HonourLimitsLayer, MAX_ANNOUNCED_WAIT};
use tower_layer::Layer;

fuzz_target!(|data: &[u8]| {
    let Some((&select, rest)) = data.split_first() else {
        return;
    };
    let status = [429, 503, 200, 500][usize::from(select % 4)];
    let mut server = Server::plain();
    server.status = StatusCode::from_u16(status).unwrap();
    let value = value(rest);
    server.head.insert("retry-after", value.clone());
    let mut client = HonourLimitsLayer::new().layer(server);

    assert_eq!(send(&mut client, get("http://a.test/x")), Ok(()));
    let again = send(&mut client, get("http://a.test/x?page=2"));
    let refusing = status == 429 || status == 503;
    if let Err(wait) = again {
        assert!(refusing, "a {status} made a wait");
        assert!(wait <= MAX_ANNOUNCED_WAIT);
    }
    if refusing
        && let Some(seconds) = value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
    {
        let told = Duration::from_secs(seconds).min(MAX_ANNOUNCED_WAIT);
        match again {
            Err(wait) => assert!(wait <= told, "{wait:?} for {seconds} s"),
            Ok(()) => assert!(seconds < 2, "{seconds} s made no wait"),
        }
    }
    for other in ["http://a.test/y", "http://b.test/x"] {
        assert_eq!(send(&mut client, get(other)), Ok(()), "{other} held back");
    }
    let post = http::Request::post("http://a.test/x").body(()).unwrap();
    assert_eq!(send(&mut client, post), Ok(()), "POST held back");
});
