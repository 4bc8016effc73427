//! A concurrency limit: `GET /slow` takes a second and allows 5 requests at once per client IP;
//! `GET /` is not limited. A request holds its slot until its response body has been sent.
//! And load shedding that learns its capacity: `GET /work` has 8 workers of 50 ms, behind
//! `Shedding::new(64).adaptive(..)`; `GET /capacity` tells what it learned.
//!
//! ```text
//! cargo run --example concurrency
//! seq 20 | xargs -P 20 -I{} curl -s -o /dev/null -w '%{http_code}\n' http://127.0.0.1:3000/slow | sort | uniq -c
//! seq 400 | xargs -P 50 -I{} curl -s -o /dev/null -w '%{http_code}\n' http://127.0.0.1:3000/work | sort | uniq -c
//! curl http://127.0.0.1:3000/capacity
//! ```
//!
//! Twenty at once on `/slow`: five 200s and fifteen 429s, whose `RateLimit-Policy` says
//! `"slow";q=5;qu="concurrent-requests"`. Fifty at once on `/work`: 200s for about as many as
//! keep its 8 workers busy with a short queue, and 503s (`Retry-After: 1`) for the rest, so that
//! those served wait a request's time or two (about 100 ms), not the whole queue's. `/capacity`
//! says what it learned: 4 at the start, while it measures the no-load latency (the first 50
//! requests), then about 10, its 8 workers and a short queue (`capacity 11 of 64, 0 in
//! flight`). Listens on 127.0.0.1:3000, or on the address in `TOLLGATE_ADDR`. Ctrl-C stops it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use tokio::sync::Semaphore;
use tollgate::{Adaptive, RateLimitLayer, Rule, Shedding};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // 5 requests in flight per client IP (the layer's default key); a slot a replica never gave
    // back (it died) is free after the longest hold, 60 s unless `.max_hold(..)` says otherwise.
    let at_most_five = RateLimitLayer::builder()
        .rule(Rule::concurrent("slow", 5))
        .build()?;

    // At most 64 in flight on /work; below that, as many as keep latency near its no-load level
    // (measured at the start, and again every 30 s).
    let shedding = Shedding::new(64).adaptive(Adaptive::new());
    // A layer of its own that only sheds: no rule.
    let shed = RateLimitLayer::builder().shed(shedding.clone()).build()?;
    let workers = Arc::new(Semaphore::new(8));

    let app = Router::new()
        .route(
            "/work",
            get(move || {
                let workers = workers.clone();
                async move {
                    // The semaphore is never closed: a worker always comes.
                    let _worker = workers.acquire().await.ok();
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    "Worked for 50 ms.\n"
                }
            })
            .route_layer(shed),
        )
        .route(
            "/capacity",
            get(move || {
                let shedding = shedding.clone();
                async move {
                    format!(
                        "capacity {} of 64, {} in flight\n",
                        shedding.capacity_now(),
                        shedding.in_flight()
                    )
                }
            }),
        )
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(1)).await;
                "Done, after a second of hard work.\n"
            })
            .route_layer(at_most_five),
        )
        .route(
            "/",
            get(|| async { "Not limited. Try /slow twenty times at once.\n" }),
        );

    let addr = std::env::var("TOLLGATE_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await.map_err(|e| {
        format!("cannot listen on {addr}: {e} (set TOLLGATE_ADDR to another address)")
    })?;
    let addr = listener.local_addr()?;
    println!("tollgate concurrency example on http://{addr} (Ctrl-C to stop)");
    println!("/slow takes 1 s and allows 5 requests at once per client IP; / is not limited. Try:");
    println!();
    println!("  curl -i http://{addr}/slow");
    println!(
        "  seq 20 | xargs -P 20 -I{{}} curl -s -o /dev/null -w '%{{http_code}}\\n' http://{addr}/slow | sort | uniq -c"
    );
    println!();
    println!(
        "Twenty at once give five 200s and fifteen 429s with Retry-After: 1 and \
         RateLimit-Policy: \"slow\";q=5;qu=\"concurrent-requests\"."
    );
    println!();
    println!(
        "/work has 8 workers of 50 ms behind adaptive load shedding (at most 64 in flight). Try:"
    );
    println!();
    println!(
        "  seq 400 | xargs -P 50 -I{{}} curl -s -o /dev/null -w '%{{http_code}}\\n' http://{addr}/work | sort | uniq -c"
    );
    println!("  curl http://{addr}/capacity");

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
