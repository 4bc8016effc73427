//! What resolving a policy costs per request: an axum router of 1,000 routes behind a layer
//! whose rules are fixed, and behind a policy of 3 tiers × 1,000 routes and 10,000 tenants that
//! resolves the same kind of rule for the same request. Same run, same machine: read the
//! differences, not the absolute times.
//!
//! ```text
//! cargo bench --bench policy
//! ./scripts/instructions.sh     # the same routers, counted in instructions (POLICY=1)
//! ```
//!
//! * `fixed_ip` / `policy_ip`: a request without a tenant, counted by peer IP; the policy finds
//!   the default tier's rule for the route.
//! * `fixed_tenant` / `policy_tenant`: a request whose tenant an authentication layer inserted
//!   (a `Tenant` extension), counted by tenant; the policy finds the tenant, its tier and the
//!   tier's rule for the route.
//! * `policy_tenant_header`: the same, the tenant found from an `x-api-key` header through a
//!   directory of 10,000 keys (the extractor's cost included).

#[path = "support/policy_apps.rs"]
mod policy_apps;

use criterion::{Criterion, criterion_group, criterion_main};

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let apps = policy_apps::apps();
    let mut group = c.benchmark_group("policy_resolution");
    for (name, app, tenant, header) in &apps {
        group.bench_function(*name, |b| {
            b.to_async(&rt)
                .iter(|| policy_apps::serve_one(app, *tenant, *header))
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
