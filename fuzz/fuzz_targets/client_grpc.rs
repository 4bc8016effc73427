//! Fuzzes the client's reading of a gRPC status that asks to wait: `grpc-retry-pushback-ms`,
//! and a `google.rpc.RetryInfo` in `grpc-status-details-bin` (base64, then protobuf), in a
//! trailers-only answer's head or in the trailers, through `HonourLimitsLayer`.
//!
//! The first byte picks the status (8, 14, 0 or 13), where it comes (head or trailers), and how
//! the details are made: the input's text as sent (the base64 decoder's input), the input's
//! bytes base64-encoded (the protobuf reader's), or a well-formed `Status` whose `RetryInfo`
//! holds a delay made of the input. Then the pushback line, a newline, the details. Besides
//! "never panics", it checks that:
//!
//! * only `RESOURCE_EXHAUSTED` (8) and `UNAVAILABLE` (14) make a wait, at most a day;
//! * a pushback of 2 s or more is a wait, and without details a wait is at most the pushback;
//! * a well-formed `RetryInfo` alone waits its delay (capped to a day), and a negative or
//!   malformed delay waits nothing;
//! * the wait holds back the call's method only: not another method, nor another server.

#![no_main]

mod common;

use std::time::Duration;

use common::{base64, field, grpc, send, value, varint};
use http::HeaderMap;
use libfuzzer_sys::fuzz_target;
use tollgate::client::{HonourLimitsLayer, MAX_ANNOUNCED_WAIT};
use tower_layer::Layer;

/// A `google.rpc.Status` of `code` with one `RetryInfo` of `seconds` and `nanos`.
fn status_with_retry_info(code: u64, seconds: i64, nanos: i32) -> Vec<u8> {
    let mut duration = Vec::new();
    varint(1 << 3, &mut duration);
    varint(seconds as u64, &mut duration);
    varint(2 << 3, &mut duration);
    varint(i64::from(nanos) as u64, &mut duration);
    let mut retry_info = Vec::new();
    field(1, &duration, &mut retry_info);
    let mut any = Vec::new();
    field(1, b"type.googleapis.com/google.rpc.RetryInfo", &mut any);
    field(2, &retry_info, &mut any);
    let mut status = Vec::new();
    varint(1 << 3, &mut status);
    varint(code, &mut status);
    field(3, &any, &mut status);
    status
}

fuzz_target!(|data: &[u8]| {
    let Some((&select, rest)) = data.split_first() else {
        return;
    };
    let code = ["8", "14", "0", "13"][usize::from(select & 3)];
    let in_trailers = select & 4 != 0;
    let mode = (select >> 3) % 3;
    let (pushback, details) = match rest.iter().position(|&b| b == b'\n') {
        Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
        None => (None, rest),
    };
    let pushback = pushback.map(value);
    let mut status = HeaderMap::new();
    status.insert("grpc-status", code.parse().unwrap());
    if let Some(pushback) = &pushback {
        status.insert("grpc-retry-pushback-ms", pushback.clone());
    }
    // The delay of a well-formed RetryInfo: `None` when it asks no wait.
    let mut delay = None;
    match mode {
        0 => {
            status.insert("grpc-status-details-bin", value(details));
        }
        1 => {
            status.insert("grpc-status-details-bin", base64(details).parse().unwrap());
        }
        _ => {
            let mut n = [0u8; 12];
            for (to, from) in n.iter_mut().zip(details) {
                *to = *from;
            }
            let seconds = i64::from_le_bytes(n[..8].try_into().unwrap());
            let nanos = i32::from_le_bytes(n[8..].try_into().unwrap());
            let encoded = base64(&status_with_retry_info(8, seconds, nanos));
            status.insert("grpc-status-details-bin", encoded.parse().unwrap());
            if seconds >= 0 && (0..1_000_000_000).contains(&nanos) {
                delay = Some(Duration::new(seconds as u64, nanos as u32).min(MAX_ANNOUNCED_WAIT));
            }
        }
    }
    let mut server = common::Server::plain();
    server
        .head
        .insert("content-type", "application/grpc".parse().unwrap());
    if in_trailers {
        server.trailers = Some(status);
    } else {
        server.head.extend(status);
    }
    let mut client = HonourLimitsLayer::new().layer(server);

    assert_eq!(
        send(&mut client, grpc("http://a.test/pkg.Jobs/Export")),
        Ok(())
    );
    let again = send(&mut client, grpc("http://a.test/pkg.Jobs/Export"));
    let refusing = code == "8" || code == "14";
    if let Err(wait) = again {
        assert!(refusing, "status {code} made a wait");
        assert!(wait <= MAX_ANNOUNCED_WAIT);
    }
    // As sent: the bytes a header value cannot hold are spaces.
    let pushback = pushback
        .and_then(|p| p.to_str().ok().map(str::to_owned))
        .and_then(|p| p.trim().parse::<u64>().ok())
        .map(|ms| Duration::from_millis(ms).min(MAX_ANNOUNCED_WAIT));
    if refusing {
        if pushback.is_some_and(|p| p >= Duration::from_secs(2)) {
            assert!(again.is_err(), "a pushback of {pushback:?} made no wait");
        }
        if mode == 2 {
            let told = pushback.max(delay);
            match (again, told) {
                (Err(wait), Some(told)) => assert!(wait <= told, "{wait:?} for {told:?}"),
                (Err(wait), None) => panic!("a wait of {wait:?}, none told"),
                (Ok(()), Some(told)) => assert!(told < Duration::from_secs(1), "{told:?} unheard"),
                (Ok(()), None) => {}
            }
        }
    }
    // Not answered yet, so never held back: another method, the same method of another server.
    for other in [
        "http://a.test/pkg.Jobs/Health",
        "http://b.test/pkg.Jobs/Export",
    ] {
        assert_eq!(send(&mut client, grpc(other)), Ok(()), "{other} held back");
    }
});
