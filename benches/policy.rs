//! What resolving a policy costs per request: an axum router of 1,000 routes behind a layer
//! whose rules are fixed, and behind a policy of 3 tiers × 1,000 routes and 10,000 tenants that
//! resolves the same kind of rule for the same request. Same run, same machine: read the
//! differences, not the absolute times.
//!
//! ```text
//! cargo bench --bench policy
//! ```
//!
//! * `fixed_ip` / `policy_ip`: a request without a tenant, counted by peer IP; the policy finds
//!   the default tier's rule for the route.
//! * `fixed_tenant` / `policy_tenant`: a request whose tenant an authentication layer inserted
//!   (a `Tenant` extension), counted by tenant; the policy finds the tenant, its tier and the
//!   tier's rule for the route.
//! * `policy_tenant_header`: the same, the tenant found from an `x-api-key` header through a
//!   directory of 10,000 keys (the extractor's cost included).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use criterion::{Criterion, criterion_group, criterion_main};
use http::Request;
use tollgate::policy::{
    Policy, Tenant, TenantFromExtension, TenantFromHeader, TenantKey, TenantRules, Tier,
};
use tollgate::{Quota, RateLimitLayer, Rule};
use tower::{Service, ServiceExt};

const ROUTES: usize = 1_000;
const TENANTS: usize = 10_000;
const TIERS: [&str; 3] = ["free", "pro", "enterprise"];

/// Never denies: every variant measures an admitted request.
fn quota() -> Quota {
    Quota::per_second(1_000_000).burst(1_000_000_000)
}

fn router() -> Router {
    let mut router = Router::new();
    for n in 0..ROUTES {
        router = router.route(&format!("/r{n}"), get(|| async { "ok" }));
    }
    router
}

fn policy() -> Policy {
    let mut policy = Policy::new("bench").default_tier("free");
    for tier in TIERS {
        let mut built = Tier::new(tier).rule(Rule::new(format!("{tier}-default"), quota()));
        for n in 0..ROUTES {
            built = built.route(
                format!("/r{n}"),
                [Rule::new(format!("{tier}-r{n}"), quota())],
            );
        }
        policy = policy.tier(built);
    }
    for n in 0..TENANTS {
        let mut tenant = TenantRules::new(format!("t{n}")).tier(TIERS[n % 3]);
        // One tenant in ten has an exception on a route (not the measured one).
        if n % 10 == 0 {
            tenant = tenant.route(
                format!("/r{}", n % (ROUTES - 1) + 1),
                [Rule::new(format!("t{n}-exception"), quota())],
            );
        }
        policy = policy.tenant(tenant);
    }
    policy
}

fn request(tenant: bool, header: bool) -> Request<Body> {
    let mut builder = Request::get("/r0");
    if header {
        builder = builder.header("x-api-key", "key-5001");
    }
    let mut request = builder.body(Body::empty()).unwrap();
    request
        .extensions_mut()
        .insert(ConnectInfo(SocketAddr::from(([127, 0, 0, 1], 40000))));
    if tenant {
        request.extensions_mut().insert(Tenant::new("t5001"));
    }
    request
}

async fn serve_one(app: &Router, tenant: bool, header: bool) {
    let mut app = app.clone();
    let response = app
        .as_service()
        .ready()
        .await
        .unwrap()
        .call(request(tenant, header))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body = http_body_util::BodyExt::collect(response.into_body())
        .await
        .unwrap();
    std::hint::black_box(body);
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let fixed = |rule: Rule| {
        let layer = RateLimitLayer::builder().rule(rule).build().unwrap();
        router().layer(layer).with_state::<()>(())
    };
    let directory: Arc<HashMap<String, Tenant>> = Arc::new(
        (0..TENANTS)
            .map(|n| (format!("key-{n}"), Tenant::new(format!("t{n}"))))
            .collect(),
    );
    let apps: Vec<(&str, Router, bool, bool)> = vec![
        (
            "fixed_ip",
            fixed(Rule::new("free-r0", quota())),
            false,
            false,
        ),
        (
            "policy_ip",
            router()
                .layer(RateLimitLayer::builder().policy(policy()).build().unwrap())
                .with_state(()),
            false,
            false,
        ),
        (
            "fixed_tenant",
            fixed(Rule::new("pro-r0", quota()).key(TenantKey)),
            true,
            false,
        ),
        (
            "policy_tenant",
            router()
                .layer(
                    RateLimitLayer::builder()
                        .policy(policy())
                        .tenant(TenantFromExtension)
                        .build()
                        .unwrap(),
                )
                .with_state(()),
            true,
            false,
        ),
        (
            "policy_tenant_header",
            router()
                .layer(
                    RateLimitLayer::builder()
                        .policy(policy())
                        .tenant(
                            TenantFromHeader::new("x-api-key")
                                .lookup(move |key: &str| directory.get(key).cloned()),
                        )
                        .build()
                        .unwrap(),
                )
                .with_state(()),
            false,
            true,
        ),
    ];
    let mut group = c.benchmark_group("policy_resolution");
    for (name, app, tenant, header) in &apps {
        group.bench_function(*name, |b| {
            b.to_async(&rt).iter(|| serve_one(app, *tenant, *header))
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(std::time::Duration::from_secs(1))
        .measurement_time(std::time::Duration::from_secs(4));
    targets = bench
}
criterion_main!(benches);
