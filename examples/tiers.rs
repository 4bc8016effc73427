//! Rules by tier, tenant and route, from a TOML file that reloads while the server runs.
//!
//! ```text
//! cargo run --example tiers
//! curl -i -H 'authorization: Bearer acme-1' http://127.0.0.1:3000/search
//! ```
//!
//! * The API key comes as `Authorization: Bearer <key>`. `free-…` is a tenant of tier `free`
//!   (5 per minute), `pro-…` a tenant of tier `pro` (50 per minute), each key a tenant of its
//!   own, named by the key's digest (`Tenant::hashed`): the key itself reaches neither the store
//!   nor the logs. `acme-…` is the tenant `acme` (tier `pro`, with an exception of 2 per minute
//!   on `/search`), named as `examples/tiers.toml` lists it. Without a key, a request gets the
//!   default tier, `free`, counted by client IP.
//! * Behind a proxy: the layer's key is `ClientIp`, trusting proxies on this machine
//!   (127.0.0.0/8, `::1`), so anonymous requests are counted by the client address the proxy
//!   wrote in `X-Forwarded-For`. Without `.key(..)` they would be keyed by the socket peer, the
//!   proxy itself, and every anonymous client would share one budget. Trust your own proxies'
//!   networks instead (or none, when clients connect directly).
//! * Routes `/` and `/search`; `GET /policy` (never limited) answers the version of the policy
//!   in force.
//! * Rules come from `examples/tiers.toml`, or from the file in `TOLLGATE_RULES`; edit it while
//!   the server runs and the change applies within a second (a bad edit is logged and the
//!   policy in force stays).
//!
//! Listens on 127.0.0.1:3000, or on the address in `TOLLGATE_ADDR`. Ctrl-C stops it.
//!
//! This example believes the API key's prefix. A real service looks each key up in its directory
//! (`TenantFromHeader::lookup_async`) or takes the tenant its authentication layer verified
//! (`TenantFromExtension`): a tenant is trusted as found.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use tollgate::RateLimitLayer;
use tollgate::key::ClientIp;
use tollgate::policy::{FileSource, Tenant, TenantFromHeader};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Reloads, and rejected edits, are logged at info and error.
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .init();

    let rules = std::env::var("TOLLGATE_RULES")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/examples/tiers.toml").to_owned());
    let limits = RateLimitLayer::builder()
        .policy_source(FileSource::new(&rules).interval(Duration::from_secs(1)))
        .tenant(TenantFromHeader::new("authorization").lookup(tenant_of_bearer))
        // Requests without a tenant are counted by the layer's key: behind a proxy, the client
        // it saw, not the proxy's own address.
        .key(ClientIp::new().parse_trusted_proxies(["127.0.0.0/8", "::1/128"])?)
        .build()?;
    let policy = limits
        .policy_handle()
        .expect("a layer with a policy source");

    let app = Router::new()
        .route("/", get(|| async { "Hello from behind tollgate!\n" }))
        .route("/search", get(|| async { "Search results.\n" }))
        .route_layer(limits)
        .route(
            "/policy",
            get(move || {
                let policy = policy.clone();
                async move { format!("{}\n", policy.version()) }
            }),
        );

    let addr = std::env::var("TOLLGATE_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await.map_err(|e| {
        format!("cannot listen on {addr}: {e} (set TOLLGATE_ADDR to another address)")
    })?;
    let addr = listener.local_addr()?;
    println!("tollgate tiers on http://{addr} (Ctrl-C to stop), rules from {rules}");
    println!();
    println!(
        "  curl -i http://{addr}/                                          # no key: tier free, 5/min per IP"
    );
    println!(
        "  curl -i -H 'authorization: Bearer free-1' http://{addr}/        # tier free, 5/min"
    );
    println!(
        "  curl -i -H 'authorization: Bearer pro-1' http://{addr}/         # tier pro, 50/min"
    );
    println!(
        "  curl -i -H 'authorization: Bearer acme-1' http://{addr}/search  # tenant acme: 2/min on /search"
    );
    println!(
        "  curl -i -H 'x-forwarded-for: 203.0.113.7' http://{addr}/        # through a proxy: that client's 5/min"
    );
    println!(
        "  curl http://{addr}/policy                                       # the version in force"
    );
    println!(
        "  for i in 1 2 3; do curl -s -o /dev/null -w '%{{http_code}}\\n' -H 'authorization: Bearer acme-1' http://{addr}/search; done"
    );
    println!();
    println!(
        "Edit {rules} while this runs (a limit, the version): the change applies within a second; \
         a bad edit is logged and the policy in force stays."
    );

    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        let _ = tokio::signal::ctrl_c().await;
        println!("\nshutting down");
    })
    .await?;
    Ok(())
}

/// The tenant of `Authorization: Bearer <key>` (the lookup gets the whole value, scheme
/// included): `free-…` and `pro-…` are tenants of their tier, named by the key's digest;
/// `acme-…` is the tenant acme. Other keys and schemes are no tenant (the default tier, by
/// client IP).
fn tenant_of_bearer(value: &str) -> Option<Tenant> {
    let (scheme, key) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let (prefix, rest) = key.split_once('-')?;
    if rest.is_empty() {
        return None;
    }
    match prefix {
        "free" | "pro" => Some(Tenant::new(key).with_tier(prefix).hashed()),
        "acme" => Some(Tenant::new("acme")),
        _ => None,
    }
}
