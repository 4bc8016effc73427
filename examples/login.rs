//! Limiting `POST /login` by the email in the body, so that rotating IP addresses does not buy
//! more password guesses.
//!
//! ```text
//! cargo run --example login
//! TOLLGATE_ADDR=127.0.0.1:8080 cargo run --example login
//! ```
//!
//! Each account (the normalised email of a JSON or form body) gets 5 **failed** logins per 15
//! minutes (a login that succeeds gives its unit back: `Rule::charge_on_status([401])`) and 10
//! attempts per minute; each IP gets 20 per minute on top. Bodies without a usable email (too
//! large, another content type, no field) share one budget: padding a body does not escape the
//! account limit. The password is `open-sesame`.
//!
//! * The failed logins are counted by a sliding window log: never more than 5 in any 15
//!   minutes, so the sixth guess waits until the first is 15 minutes old. The default token
//!   bucket would hand back one guess every 3 minutes (15 / 5) once the 5 are spent: not the
//!   lockout that "5 per 15 minutes" promises.
//! * The layer sends no `RateLimit` fields (`Headers::none()`): on a login they would tell an
//!   attacker how many guesses remain. Denials still carry `Retry-After`.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::routing::{get, post};
use http::StatusCode;
use tollgate::key::{BodyKeyLayer, FromBody, Key, KeyExtractorExt, PeerIp};
use tollgate::{Algorithm, Headers, Quota, RateLimitLayer, Rule};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr: SocketAddr = std::env::var("TOLLGATE_ADDR")
        .unwrap_or_else(|_| "127.0.0.1:3000".to_owned())
        .parse()?;

    let no_account = |_: &http::request::Parts| Some(Key::text("login-without-account"));
    let limit = RateLimitLayer::builder()
        // Counts only failed logins: reserved when a login is let in, given back if it succeeds.
        // Never more than 5 in any 15 minutes (the sliding log is exact; a token bucket would
        // give one guess back every 3 minutes).
        .rule(
            Rule::new("failed-logins", Quota::new(5, Duration::from_secs(15 * 60)))
                .algorithm(Algorithm::SlidingWindowLog)
                .key(FromBody.or(no_account))
                .charge_on_status([401]),
        )
        .rule(Rule::new("per-account", Quota::per_minute(10)).key(FromBody.or(no_account)))
        .rule(Rule::new("per-ip", Quota::per_minute(20)).key(PeerIp::new()))
        // No budget fields: they would tell an attacker how many guesses remain.
        .headers(Headers::none())
        .build()?;

    // The handler receives the body exactly as it was sent.
    let check = |body: Bytes| async move {
        if body.windows(11).any(|w| w == b"open-sesame") {
            return (StatusCode::OK, "welcome\n".to_owned());
        }
        (
            StatusCode::UNAUTHORIZED,
            format!(
                "invalid credentials (the handler received all {} bytes)\n",
                body.len()
            ),
        )
    };
    let login = Router::new()
        .route("/login", post(check))
        .route_layer(limit) // inner: decides by the key the body layer found
        .route_layer(BodyKeyLayer::new("email")); // outer: runs first (added last)
    let app = Router::new()
        .route(
            "/",
            get(|| async { "POST /login with an email and a password\n" }),
        )
        .merge(login);

    let listener = tokio::net::TcpListener::bind(addr).await?;
    let url = format!("http://{}/login", listener.local_addr()?);
    println!(
        "listening on {url} (per account: 5 failed logins per 15 minutes, 10 attempts per minute; 20 per IP)"
    );
    println!();
    println!("# JSON: six wrong passwords on one account, the sixth is 429 for 15 minutes");
    println!(
        "for i in 1 2 3 4 5 6; do curl -s -o /dev/null -w '%{{http_code}}\\n' -H 'content-type: application/json' -d '{{\"email\":\"alice@example.com\",\"password\":\"guess'$i'\"}}' {url}; done"
    );
    println!("# a form with another spelling of the same email: still 429, with Retry-After");
    println!("curl -i -d 'email=%20ALICE@Example.com&password=x' {url}");
    println!("# another account has its own budget: 401");
    println!(
        "curl -i -H 'content-type: application/json' -d '{{\"email\":\"bob@example.com\",\"password\":\"x\"}}' {url}"
    );
    println!("# the right password: 200, and the failed-logins budget is not spent");
    println!(
        "curl -i -H 'content-type: application/json' -d '{{\"email\":\"carol@example.com\",\"password\":\"open-sesame\"}}' {url}"
    );
    println!();
    println!("Ctrl-C to stop.");

    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        let _ = tokio::signal::ctrl_c().await;
        println!("shutting down");
    })
    .await?;
    Ok(())
}
