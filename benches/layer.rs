//! What the layer costs per request, without the network: an axum router called in process,
//! bare and behind tollgate / tower_governor, allowing and rejecting. Same run, same machine.
//!
//! ```text
//! cargo bench --bench layer
//! ./scripts/instructions.sh     # the same routers, counted in instructions
//! ```

#[path = "support/layer_apps.rs"]
mod layer_apps;

use criterion::{Criterion, criterion_group, criterion_main};

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("axum_in_process");
    for (name, app) in layer_apps::apps() {
        group.bench_function(name, |b| {
            b.to_async(&rt).iter(|| layer_apps::serve_one(&app))
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(std::time::Duration::from_secs(1)).measurement_time(std::time::Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
