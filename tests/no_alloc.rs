//! IP keys cost no allocation: extracting the client IP through a 5-hop `X-Forwarded-For` or
//! `Forwarded`, or reading 10,000 entries, allocates nothing.
//!
//! A binary of its own with no test harness (`harness = false`): the only thread is `main`, so no
//! runner thread can allocate while it measures. A check that fails panics, and the binary exits
//! with an error.

use std::net::SocketAddr;

use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use tollgate::key::{ClientIp, KeyExtractor, PeerIp, ProxyHeader, forwarded};

#[global_allocator]
static GLOBAL: &StatsAlloc<std::alloc::System> = &INSTRUMENTED_SYSTEM;

fn parts(name: &str, value: &str) -> http::request::Parts {
    let (mut parts, ()) = http::Request::get("/")
        .header(name, value)
        .body(())
        .unwrap()
        .into_parts();
    parts
        .extensions
        .insert(SocketAddr::from(([10, 0, 0, 1], 40000)));
    parts
}

fn allocations(mut f: impl FnMut()) -> usize {
    allocations_in(1000, &mut f)
}

fn allocations_in(runs: usize, mut f: impl FnMut()) -> usize {
    f(); // warm up
    let region = Region::new(GLOBAL);
    for _ in 0..runs {
        f();
    }
    region.change().allocations
}

const NAME: &str = "ip_extraction_does_not_allocate";

/// Answers the parts of libtest's command line that runners use (`--list`, a name filter,
/// `--exact`, `--ignored`), so that `cargo test <filter>` and `cargo nextest` treat this binary
/// like any other.
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| args.iter().any(|a| a == name);
    if flag("--list") {
        if !flag("--ignored") {
            println!("{NAME}: test");
        }
        return;
    }
    let filters: Vec<&str> = args
        .iter()
        .filter(|a| !a.starts_with('-'))
        .map(String::as_str)
        .collect();
    let exact = flag("--exact");
    let selected = filters.is_empty()
        || filters
            .iter()
            .any(|f| if exact { *f == NAME } else { NAME.contains(f) });
    if flag("--ignored") || !selected {
        println!("{NAME}: not selected");
        return;
    }
    ip_extraction_does_not_allocate();
    println!("{NAME}: ok");
}

fn ip_extraction_does_not_allocate() {
    let cidr = ClientIp::new()
        .parse_trusted_proxies(["10.0.0.0/8"])
        .unwrap();
    let xff = parts(
        "x-forwarded-for",
        "198.51.100.7, 10.0.0.4, 10.0.0.3, 10.0.0.2, 10.0.0.1",
    );
    let fwd = parts(
        "forwarded",
        "for=\"[2001:db8::7]:443\", for=10.0.0.4, for=10.0.0.3;proto=https, for=10.0.0.2, for=10.0.0.1",
    );
    let forwarded_ip = cidr.clone().header(ProxyHeader::Forwarded);
    let hops = ClientIp::new().trusted_hops(5);
    let huge = parts("x-forwarded-for", &vec!["10.0.0.9"; 10_000].join(", "));

    let key = |e: &dyn KeyExtractor, p: &http::request::Parts| {
        let key = e.extract(p).found().unwrap();
        assert!(key.as_ip().is_some());
    };
    assert_eq!(allocations(|| key(&cidr, &xff)), 0, "CIDR, X-Forwarded-For");
    assert_eq!(
        allocations(|| key(&forwarded_ip, &fwd)),
        0,
        "CIDR, Forwarded"
    );
    assert_eq!(allocations(|| key(&hops, &xff)), 0, "hops");
    assert_eq!(allocations(|| key(&PeerIp::new(), &xff)), 0, "peer");
    assert_eq!(
        allocations(|| key(&cidr, &huge)),
        0,
        "10,000 trusted entries"
    );
    let value = huge.headers.get("x-forwarded-for").unwrap().as_bytes();
    assert_eq!(
        allocations_in(10, || assert_eq!(
            forwarded::x_forwarded_for(value).count(),
            10_000
        )),
        0,
        "parsing 10,000 entries"
    );
}
