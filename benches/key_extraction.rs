//! What finding the key of a request costs.
//!
//! ```text
//! cargo bench --bench key_extraction
//! ```
//!
//! * `client_ip/xff_5_hops`: the client IP through a 5-hop `X-Forwarded-For` (the client, then
//!   four trusted proxies; the socket peer is a fifth), trusted networks as CIDRs.
//! * `client_ip/forwarded_5_hops`: the same with RFC 7239 `Forwarded`.
//! * `client_ip/xff_hops_5`: the same header with a hop count.
//! * `client_ip/xff_10000_trusted`: a 10,000-entry header of trusted addresses (read up to
//!   `MAX_HOPS`, then the peer).
//! * `peer_ip`: the socket peer alone.
//! * `text/...`: header, route and combined text keys (these allocate).

use std::hint::black_box;
use std::net::SocketAddr;

use criterion::{Criterion, criterion_group, criterion_main};
use http::request::Parts;
use tollgate::key::{ClientIp, FromHeader, KeyExtractor, KeyExtractorExt, PeerIp, ProxyHeader};

fn parts(headers: &[(&str, &str)]) -> Parts {
    let mut request = http::Request::get("/users/42");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let (mut parts, ()) = request.body(()).unwrap().into_parts();
    parts
        .extensions
        .insert(SocketAddr::from(([10, 0, 0, 1], 40000)));
    parts
}

fn extract(extractor: &impl KeyExtractor, parts: &Parts) -> bool {
    extractor.extract(parts).found().is_some()
}

fn bench(c: &mut Criterion) {
    let trusted = || {
        ClientIp::new()
            .parse_trusted_proxies(["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fd00::/8"])
            .unwrap()
    };
    let xff = parts(&[(
        "x-forwarded-for",
        "198.51.100.7, 10.0.0.4, 10.0.0.3, 10.0.0.2, 10.0.0.5",
    )]);
    let fwd = parts(&[(
        "forwarded",
        "for=198.51.100.7;proto=https, for=10.0.0.4, for=10.0.0.3, for=10.0.0.2, for=10.0.0.5",
    )]);
    let huge = parts(&[("x-forwarded-for", &vec!["10.0.0.9"; 10_000].join(", "))]);

    let mut group = c.benchmark_group("client_ip");
    let cidr = trusted();
    group.bench_function("xff_5_hops", |b| b.iter(|| extract(&cidr, black_box(&xff))));
    let cidr_fwd = trusted().header(ProxyHeader::Forwarded);
    group.bench_function("forwarded_5_hops", |b| {
        b.iter(|| extract(&cidr_fwd, black_box(&fwd)))
    });
    let hops = ClientIp::new().trusted_hops(5);
    group.bench_function("xff_hops_5", |b| b.iter(|| extract(&hops, black_box(&xff))));
    // Every entry trusted: the hint is logged once (no subscriber here), then the peer.
    group.bench_function("xff_10000_trusted", |b| {
        b.iter(|| extract(&cidr, black_box(&huge)))
    });
    group.finish();

    let plain = parts(&[]);
    c.bench_function("peer_ip", |b| {
        b.iter(|| extract(&PeerIp::new(), black_box(&plain)))
    });

    let mut group = c.benchmark_group("text");
    let api = parts(&[("x-api-key", "k-0123456789abcdef")]);
    let header = FromHeader::new("x-api-key");
    group.bench_function("header", |b| b.iter(|| extract(&header, black_box(&api))));
    let hashed = FromHeader::new("x-api-key").hashed();
    group.bench_function("header_hashed", |b| {
        b.iter(|| extract(&hashed, black_box(&api)))
    });
    let combined = FromHeader::new("x-api-key").and(trusted());
    let both = parts(&[
        ("x-api-key", "k-0123456789abcdef"),
        ("x-forwarded-for", "198.51.100.7, 10.0.0.4"),
    ]);
    group.bench_function("header_and_client_ip", |b| {
        b.iter(|| extract(&combined, black_box(&both)))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
