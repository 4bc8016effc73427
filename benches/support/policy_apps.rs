//! The routers of `benches/policy.rs` and of `benches/instructions.rs policy …`: 1,000 routes
//! behind rules fixed in the layer, or behind a policy of 3 tiers × 1,000 routes and 10,000
//! tenants that resolves the same kind of rule for the same request.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
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

pub async fn serve_one(app: &Router, tenant: bool, header: bool) {
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

/// The measured routers by name, with whether their request carries a `Tenant` extension and
/// an `x-api-key` header; finalised as `axum::serve` does.
pub fn apps() -> Vec<(&'static str, Router, bool, bool)> {
    let fixed = |rule: Rule| {
        let layer = RateLimitLayer::builder().rule(rule).build().unwrap();
        router().layer(layer).with_state::<()>(())
    };
    let directory: Arc<HashMap<String, Tenant>> = Arc::new(
        (0..TENANTS)
            .map(|n| (format!("key-{n}"), Tenant::new(format!("t{n}"))))
            .collect(),
    );
    vec![
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
    ]
}
