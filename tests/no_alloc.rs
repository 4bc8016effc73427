//! IP keys cost no allocation: extracting the client IP through a 5-hop `X-Forwarded-For` or
//! `Forwarded`, or reading 10,000 entries, allocates nothing. Nor does a request through the
//! layer counted by IP, whether its rule is fixed or resolved by a policy of tiers, tenants and
//! routes, nor one counted by its route.
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

/// The checks of this binary, by name.
const CHECKS: [(&str, fn()); 2] = [
    (
        "ip_extraction_does_not_allocate",
        ip_extraction_does_not_allocate,
    ),
    (
        "a_request_resolved_by_a_policy_does_not_allocate",
        a_request_resolved_by_a_policy_does_not_allocate,
    ),
];

/// Answers the parts of libtest's command line that runners use (`--list`, a name filter,
/// `--exact`, `--ignored`), so that `cargo test <filter>` and `cargo nextest` treat this binary
/// like any other.
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| args.iter().any(|a| a == name);
    if flag("--list") {
        if !flag("--ignored") {
            for (name, _) in CHECKS {
                println!("{name}: test");
            }
        }
        return;
    }
    let filters: Vec<&str> = args
        .iter()
        .filter(|a| !a.starts_with('-'))
        .map(String::as_str)
        .collect();
    let exact = flag("--exact");
    for (name, check) in CHECKS {
        let selected = filters.is_empty()
            || filters
                .iter()
                .any(|f| if exact { *f == name } else { name.contains(f) });
        if flag("--ignored") || !selected {
            println!("{name}: not selected");
            continue;
        }
        check();
        println!("{name}: ok");
    }
}

/// A request through the layer, driven to its response without a runtime (the memory store
/// decides inside `call`).
fn through<S>(service: &mut S, request: impl Fn() -> http::Request<()>) -> usize
where
    S: tower::Service<http::Request<()>>,
    S::Error: std::fmt::Debug,
{
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    // Made beforehand: building a request allocates, and that is not the layer's doing.
    let mut requests: Vec<_> = (0..1001).map(|_| request()).collect();
    allocations(|| {
        let future = service.call(requests.pop().unwrap());
        let mut future = std::pin::pin!(future);
        match future.as_mut().poll(&mut context) {
            std::task::Poll::Ready(response) => drop(response.unwrap()),
            std::task::Poll::Pending => panic!("the memory store decides at once"),
        }
    })
}

fn a_request_resolved_by_a_policy_does_not_allocate() {
    use tollgate::key::Route;
    use tollgate::policy::{Policy, TenantRules, Tier};
    use tollgate::{Headers, Quota, RateLimitLayer, Rule};
    use tower::Layer;

    let quota = Quota::per_second(1_000_000).burst(1_000_000_000);
    let inner = tower::service_fn(|_: http::Request<()>| {
        std::future::ready(Ok::<_, std::convert::Infallible>(http::Response::new(())))
    });
    // A gRPC method is a route without axum's router.
    let request = || {
        let mut request = http::Request::post("/shop.Search/Find")
            .header("content-type", "application/grpc")
            .body(())
            .unwrap();
        request
            .extensions_mut()
            .insert(SocketAddr::from(([10, 0, 0, 1], 40000)));
        request
    };
    let fixed = RateLimitLayer::builder()
        .rule(Rule::new("free-find", quota))
        .headers(Headers::none())
        .build()
        .unwrap();
    let mut policy = Policy::new("v1").default_tier("free");
    for tier in ["free", "pro"] {
        let mut built = Tier::new(tier).rule(Rule::new(format!("{tier}-default"), quota));
        for n in 0..1_000 {
            built = built.route(
                format!("/shop.Search/Method{n}"),
                [Rule::new(format!("{tier}-{n}"), quota)],
            );
        }
        built = built.route(
            "/shop.Search/Find",
            [Rule::new(format!("{tier}-find"), quota)],
        );
        policy = policy.tier(built);
    }
    for n in 0..10_000 {
        policy = policy.tenant(TenantRules::new(format!("t{n}")).tier("pro"));
    }
    let resolved = RateLimitLayer::builder()
        .policy(policy)
        .headers(Headers::none())
        .build()
        .unwrap();
    assert_eq!(
        through(&mut fixed.layer(inner), request),
        0,
        "fixed rule, IP key"
    );
    assert_eq!(
        through(&mut resolved.layer(inner), request),
        0,
        "rule resolved by tier and route, IP key"
    );
    // Counted by route (the gRPC method), with and without the HTTP method, in a policy.
    let by_route = Policy::new("v1")
        .tier(
            Tier::new("free")
                .rule(Rule::new("free-default", quota))
                .route(
                    "/shop.Search/Find",
                    [
                        Rule::new("per-route", quota).key(Route::new()),
                        Rule::new("per-method-route", quota).key(Route::new().with_method()),
                    ],
                ),
        )
        .default_tier("free");
    let by_route = RateLimitLayer::builder()
        .policy(by_route)
        .headers(Headers::none())
        .build()
        .unwrap();
    assert_eq!(
        through(&mut by_route.layer(inner), request),
        0,
        "rules resolved by route, route keys"
    );
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
