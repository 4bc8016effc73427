//! Rate limiting for Tower services — Axum, Hyper and Tonic — in one process or across a whole
//! fleet of replicas.
//!
//! ```
//! use std::net::SocketAddr;
//! use axum::{Router, routing::get};
//! use tollgate::{Quota, RateLimitLayer};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! // 5 requests per minute per client IP, in process memory.
//! let app = Router::new()
//!     .route("/", get(|| async { "hello" }))
//!     .layer(RateLimitLayer::new(Quota::per_minute(5))?);
//!
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
//! # Ok(())
//! # }
//! ```
//!
//! A request goes one way through the layer:
//!
//! ```text
//! request ─► key extractor ─► rules ─► store.check (one atomic step) ─► decision
//!                                                                          │
//!            inner service ◄── admitted: budget fields added ◄─────────────┤
//!            429 + Retry-After + problem+json ◄── denied ──────────────────┘
//! ```
//!
//! * [`key`]: who is asking (the peer IP by default, any [`KeyExtractor`](key::KeyExtractor)).
//! * [`Rule`], [`Quota`], [`Algorithm`], [`Cost`]: how much they may do (below).
//! * [`store`]: how much they already did: [`MemoryStore`](store::MemoryStore) (default), or
//!   Redis shared by every replica so that "100 per minute" means 100 per minute fleet-wide.
//! * [`policy`]: limits by tier, tenant and route, from code or a rules file reloaded live.
//! * [`algorithm`]: the reference model of the five algorithms, shared by every store.
//! * [`Headers`], [`RateLimited`]: what clients are told — `RateLimit` / `RateLimit-Policy`
//!   (draft-ietf-httpapi-ratelimit-headers-11), `X-RateLimit-*`, `Retry-After`, and an RFC 9457
//!   problem body (below).
//! * [`Shedding`]: load shedding; [`grpc`]: tonic services and streams; [`client`]: clients that
//!   honour the limit; [`observe`]: metrics, the span, the rejection log, the decision hook.
//!
//! Inside, each module imports only from those below it: leaves (errors, [`clock`], log
//! throttling, metric functions, gRPC wire helpers), then [`algorithm`] and load shedding,
//! [`key`], [`store`], the answers, [`policy`], [`observe`], the request path (an `engine` that
//! gates, checks, decides, falls back and settles, driven in one place), and last the faces:
//! the layer, its service, future and body, [`Limiter`], [`grpc`], [`client`].
//! `ARCHITECTURE.md` in the repository is the map; a check in CI holds it.
//!
//! The layer keeps the inner service's error type, so it needs no `HandleErrorLayer`, and works
//! with `Router::layer`, `Router::route_layer`, `tower::ServiceBuilder` and
//! `tonic::transport::Server::builder().layer`. The inner service is called only after the
//! request is admitted.
//!
//! # Rules, quotas and algorithms
//!
//! ```
//! use tollgate::key::Global;
//! use tollgate::{Algorithm, ConfigError, Cost, Quota, RateLimitLayer, Rule};
//!
//! fn limits() -> Result<RateLimitLayer, ConfigError> {
//!     RateLimitLayer::builder()
//!         // 10 per second with bursts of 20, per client IP (the default key).
//!         .rule(Rule::new("burst", Quota::per_second(10).burst(20)))
//!         // 1000 per day, counted in calendar days.
//!         .rule(Rule::new("daily", Quota::per_day(1000)).algorithm(Algorithm::FixedWindow))
//!         // 5000 per second for the whole service; exports cost 10 units.
//!         .rule(Rule::new("everyone", Quota::per_second(5000)).key(Global).cost(Cost::from_fn(|parts| {
//!             if parts.uri.path().starts_with("/export") { 10 } else { 1 }
//!         })))
//!         .build()
//! }
//! # limits().unwrap();
//! ```
//!
//! `Quota::per_second(n)` means *n per second* (also `per_minute`, `per_hour`, `per_day`,
//! [`Quota::new`]`(n, period)`). Rule names appear in headers and store keys. Zero quotas, zero
//! periods, a zero burst, a burst on a window algorithm, a fixed cost above what a rule can ever
//! hold, duplicate names, and a sliding log longer than 10,000 entries are [`ConfigError`]s from
//! `build()`.
//!
//! | algorithm | behaviour | state per key |
//! |---|---|---|
//! | `TokenBucket` (default) | bursts up to `burst`, then `limit` per `period`, one unit every `period / limit` | two numbers (one integer in Redis) |
//! | `Gcra` | the same decisions as the token bucket, as one timestamp | one number |
//! | `FixedWindow` | `limit` per calendar window; up to 2 × `limit` around a boundary | a counter |
//! | `SlidingWindowLog` | exact: never more than `limit` in any `period`; `limit` ≤ 10,000 | one entry per unit |
//! | `SlidingWindowCounter` | the previous window, weighted, plus the current one; approximate | two counters |
//!
//! Choose by what the sentence means. "100 per minute" for an API is a rate: the token bucket
//! lets a client burst, then gives one unit back every `period / limit`. "5 failed logins per 15
//! minutes" is a count: once the 5 are spent, the token bucket would give one guess back every
//! 3 minutes, while a [`SlidingWindowLog`](Algorithm::SlidingWindowLog) refuses until the first
//! failure is 15 minutes old (a lockout), and a fixed window resets at the window's end.
//!
//! One layer checks up to [`MAX_RULES`] rules in one atomic step: all are charged, or none.
//! Layers stacked on one another are checked one after the other, so they are **not**
//! all-or-nothing: a request that an inner layer denies keeps the charges of the outer ones. Put
//! rules that must be charged together in one layer.
//!
//! # Concurrency limits
//!
//! A rate limit does not stop one client that sends a few very expensive queries at once. A
//! [concurrency rule](Rule::concurrent) counts the requests **in flight** instead: a request
//! takes a slot when it is admitted and gives it back when its response body ends (a streamed
//! body, or a gRPC stream, at its last frame; a client that disconnects, an inner service that
//! fails: when the response is dropped).
//!
//! ```
//! use std::time::Duration;
//! use tollgate::{Quota, RateLimitLayer, Rule};
//!
//! fn search_limits() -> Result<RateLimitLayer, tollgate::ConfigError> {
//!     RateLimitLayer::builder()
//!         // 20 searches in flight per client IP, and 100 per minute.
//!         .rule(Rule::concurrent("searches-in-flight", 20).max_hold(Duration::from_secs(30)))
//!         .rule(Rule::new("searches", Quota::per_minute(100)))
//!         .build()
//! }
//! # search_limits().unwrap();
//! ```
//!
//! * **Stacked, all or nothing**: a request a rate rule denies takes no slot; one denied a slot
//!   is charged to no rate rule.
//! * **Answers**: `429` with `Retry-After: 1` (a slot comes back when some response ends, which
//!   no store can foresee), `RateLimit-Policy: "searches-in-flight";q=20;qu="concurrent-requests"`
//!   (draft-11 §3.1.2: no window) and `RateLimit: "searches-in-flight";r=0`; gRPC gets
//!   `RESOURCE_EXHAUSTED`.
//! * **Stores**: the memory store keeps, per key, when each slot was taken. On Redis and Redis
//!   Cluster the key is a list of the times its slots were taken, on the server's clock: slots
//!   are taken in the same atomic call as the rate rules' charges, and given back in one call
//!   when the response ends. A slot is held at most `max_hold` (default [`DEFAULT_MAX_HOLD`],
//!   60 s): a replica that dies holding slots leaks them for that long, never longer. Choose it
//!   longer than your longest response: a response that outlives it keeps going, but its slot
//!   counts as free (slots are not renewed).
//! * **A request that leaves mid-check**: a call to Redis that takes slots waits for its reply a
//!   while past the check's time budget (four budgets, at least a second); if the request
//!   stopped waiting meanwhile, the slots are given back at once. Only a reply that never comes
//!   leaves them until `max_hold`.
//! * From code, [`Limiter::charge`] takes slots and [`Limiter::give_back`] (with the charge's
//!   decision) returns them; [`Limiter::refund`] refuses a concurrency rule, since it cannot tell
//!   which slots.
//! * Concurrency rules cannot be leased, split or charged by the response (`charge_when`,
//!   `settle`: refused at build time), are never answered from the deny cache, and hold at most
//!   10,000 slots per key.
//!
//! # Charges that follow the response
//!
//! **Counting only failures.** A login limit should count wrong passwords, not logins. A rule
//! with [`charge_on_status`](Rule::charge_on_status) (or [`charge_when`](Rule::charge_when) and
//! a closure over the response head) still **reserves** its unit when a request is admitted, so
//! that concurrent requests are counted exactly (50 concurrent failing logins against a limit of
//! 5 admit 5), and gives it back once the response head is there if the response does not match.
//! The answer's `RateLimit` field is the budget after the refund. A response that never comes
//! (the inner service failed, the client left) keeps its charge.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::key::FromBody;
//! use tollgate::{Algorithm, Headers, Quota, RateLimitLayer, Rule};
//!
//! fn login_limits() -> Result<RateLimitLayer, tollgate::ConfigError> {
//!     RateLimitLayer::builder()
//!         // Only the failed ones, per account: never more than 5 in any 15 minutes.
//!         .rule(
//!             Rule::new("failed-logins", Quota::new(5, Duration::from_secs(15 * 60)))
//!                 .algorithm(Algorithm::SlidingWindowLog)
//!                 .key(FromBody)
//!                 .charge_on_status([401, 403]),
//!         )
//!         // Every attempt, per account.
//!         .rule(Rule::new("attempts", Quota::per_minute(10)).key(FromBody))
//!         // `RateLimit: "failed-logins";r=4` would tell an attacker the guesses left.
//!         .headers(Headers::none())
//!         .build()
//! }
//! # login_limits().unwrap();
//! ```
//!
//! **Costs known after the response.** An LLM endpoint's cost is the tokens the model used,
//! known once it answered. A rule with a `cost` estimate and [`settle`](Rule::settle) reserves
//! the estimate, then settles at the real cost: the handler sets a response extension
//! [`ActualCost`]`(n)`, or a header the layer reads and removes
//! ([`settle_from_header`](Rule::settle_from_header)). The difference is charged, or given back,
//! in one store call that the response waits for (none on the memory store; one round trip on
//! Redis, so that the client's next request sees it):
//!
//! ```
//! use axum::{Extension, Router, routing::post};
//! use tollgate::key::FromHeader;
//! use tollgate::{ActualCost, Quota, RateLimitLayer, Rule};
//!
//! fn app() -> Result<Router, tollgate::ConfigError> {
//!     let limits = RateLimitLayer::builder()
//!         .rule(
//!             Rule::new("tokens", Quota::per_minute(10_000))
//!                 .key(FromHeader::new("x-api-key").hashed())
//!                 .cost(500) // reserved when admitted
//!                 .settle(), // settled at the handler's ActualCost
//!         )
//!         .build()?;
//!     Ok(Router::new()
//!         .route("/complete", post(|| async { (Extension(ActualCost(1_234)), "an answer") }))
//!         .layer(limits))
//! }
//! # app().unwrap();
//! ```
//!
//! When the real cost is more than is left, the key goes into **debt** and its next requests
//! wait for it: token bucket and GCRA move the time the bucket is full again further out; the
//! fixed window counts past its quota until the window ends (which forgives the rest); the
//! sliding window counter counts past its quota, and the debt weighs on the next window too. A
//! sliding window log (one entry per unit) cannot hold a debt: settling one is refused at build
//! time, as is settling or charging by outcome a leased or split rule.
//!
//! A cost known only as the response streams (an LLM's tokens, generated one by one) is
//! [metered](Rule::meter): the rule's units are taken from the store a chunk at a time while
//! the producer [spends](Meter::spend) them, a spent budget stops the producer and ends the
//! stream with the refusal (a final server-sent event, gRPC trailers), and the charge is
//! settled to what was spent when the response ends or the client leaves.
//!
//! # Answers
//!
//! ```
//! use tollgate::http::{Response, StatusCode, header};
//! use tollgate::{ConfigError, Headers, Quota, RateLimitLayer, ResetFormat, Rule};
//!
//! fn layer() -> Result<RateLimitLayer, ConfigError> {
//!     RateLimitLayer::builder()
//!         .rule(Rule::new("api", Quota::per_minute(100)))
//!         .headers(Headers::ietf().with_legacy(ResetFormat::EpochSeconds)) // + X-RateLimit-* (GitHub style)
//!         .on_denied(|denied| {                                            // your own 429 body
//!             let body = format!("slow down: retry in {} s\n", denied.retry_after_seconds().unwrap_or(60));
//!             Response::builder()
//!                 .status(StatusCode::TOO_MANY_REQUESTS)
//!                 .header(header::CONTENT_TYPE, "text/plain; charset=utf-8")
//!                 .body(body.into())
//!                 .expect("a valid response")
//!         })
//!         .build()
//! }
//! # layer().unwrap();
//! ```
//!
//! * `RateLimit-Policy: "burst";q=100;w=60` and `RateLimit: "burst";r=50;t=30`, one item per
//!   rule, as draft-ietf-httpapi-ratelimit-headers-11 defines them: `q` the quota and `w` its
//!   window in seconds (for token bucket and GCRA, the burst and the time to refill it); `r` what
//!   remains and `t` the effective window, the seconds within which the client can use no more
//!   than `r` (the time until one more unit is available; never 0). On a denial, every rule
//!   reports its budget as it stands: a denied request is charged nothing. [`Headers::none`]
//!   sends none of them (where the budget is nobody's business, such as failed logins).
//! * `Retry-After` on every denial, in whole seconds rounded up, never 0, and never before the
//!   end of a denying policy's `t`: a request sent that many seconds later is admitted. (A
//!   request whose cost exceeds what a rule can ever hold is denied without `Retry-After`: no
//!   wait would help.)
//! * The 429 body is an RFC 9457 problem of the draft's type
//!   `https://iana.org/assignments/http-problem-types#quota-exceeded`, naming the denying rules
//!   in `violated-policies`; when the store fails and a rule fails closed, the 503 is of the
//!   type `…#temporary-reduced-capacity`.
//! * gRPC calls (`content-type: application/grpc…`) get a trailers-only `RESOURCE_EXHAUSTED`
//!   (`grpc-status: 8`) with `grpc-retry-pushback-ms` and a `google.rpc.RetryInfo` in
//!   `grpc-status-details-bin`, plus the same fields as metadata; never an HTTP 429.
//! * Every denial is logged at `info`, target `tollgate::denied` (the rules that denied, a
//!   digest of the key, never the key itself): see [`observe`].
//!
//! **Browsers (CORS).** A browser sends a preflight (`OPTIONS` with `Origin` and
//! `Access-Control-Request-Method`) before many cross-origin requests; it is not counted
//! ([`count_preflight(true)`](RateLimitLayerBuilder::count_preflight) counts it). Any client can
//! send those headers, so `OPTIONS` must be cheap behind the layer: a CORS layer answers it
//! before any handler. For a browser to read a 429, the CORS headers must be on it: put
//! tower-http's `CorsLayer` **outside** the limit, so that it answers preflights and adds its
//! headers to every response, denials included, and expose the budget fields:
//!
//! ```
//! use axum::{Router, routing::get};
//! use tollgate::http::{HeaderName, header};
//! use tollgate::{Quota, RateLimitLayer, Rule};
//! use tower_http::cors::{Any, CorsLayer};
//!
//! fn app() -> Result<Router, tollgate::ConfigError> {
//!     let limits = RateLimitLayer::builder().rule(Rule::new("api", Quota::per_minute(100))).build()?;
//!     Ok(Router::new()
//!         .route("/api", get(|| async { "ok" }))
//!         .layer(limits)                                   // inner: runs second
//!         .layer(
//!             CorsLayer::new()                             // outer: runs first, wraps every answer
//!                 .allow_origin(Any)
//!                 .expose_headers([
//!                     HeaderName::from_static("ratelimit"),
//!                     HeaderName::from_static("ratelimit-policy"),
//!                     header::RETRY_AFTER,
//!                 ]),
//!         ))
//! }
//! # app().unwrap();
//! ```
//!
//! # From your own code
//!
//! [`RateLimitLayer::limiter`] reads and changes a layer's budgets outside the request path, with
//! the same rules (by name, from the policy in force), the same store, memory or Redis /
//! Cluster, and the same atomicity. A budget is a rule and a key: [`Limiter::key_of`] gives the
//! key the rule counts a request by (its extractor, run on the request head a handler has), or
//! build one as the extractor does (`Key::text`, `Key::ip`; `Key::digest` of the value for a
//! hashed header):
//!
//! ```
//! use tollgate::key::{FromHeader, Key};
//! use tollgate::{Quota, RateLimitLayer, Rule};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let layer = RateLimitLayer::builder()
//!     .rule(Rule::new("login", Quota::per_minute(5)).key(FromHeader::new("x-account")))
//!     .build()?;
//! let limiter = layer.limiter();
//! // In a handler: the head of the request being served.
//! let (parts, ()) = http::Request::post("/login").header("x-account", "alice").body(())?.into_parts();
//! let account = limiter.key_of("login", &parts)?.expect("the request has a key");
//! assert_eq!(account, Key::text("alice"));
//! let budget = limiter.peek("login", &account).await?;      // charges nothing
//! assert_eq!(budget.remaining, 5);
//! limiter.charge("login", &account, 2).await?;              // checked and charged, like a request
//! limiter.refund("login", &account, 1).await?;              // one back
//! limiter.force("login", &account, 10).await?;              // whatever the budget: a debt
//! limiter.reset("login", &account).await?;                  // a solved captcha, a new billing cycle
//! assert_eq!(limiter.peek("login", &account).await?.remaining, 5);
//! # Ok(())
//! # }
//! ```
//!
//! # Features
//!
//! * `axum` (default): the peer IP from axum's `ConnectInfo<SocketAddr>`, route keys from
//!   `MatchedPath`, and [`BodyKeyLayer`] (keys from a JSON or form field of the body).
//! * `tonic` (default): the peer IP from tonic's `TcpConnectInfo`, so that a tonic server limits
//!   by client without any setup, and [`grpc`]: the interceptor, `GrpcPathLayer` and limits per
//!   message of a stream.
//! * `redis` (default): [`RedisStore`], [`RedisClusterStore`] and [`CircuitBreaker`].
//! * `toml` (default): rules files: [`Policy::from_toml`], [`Policy::from_file`] and
//!   [`FileSource`] (live reload).
//! * `metrics`: metrics through the [`metrics`](https://docs.rs/metrics) facade (decisions,
//!   store latency and errors, breakers, the memory store, policy reloads); install any
//!   exporter, such as `metrics-exporter-prometheus`. See [`observe`].
//! * `testing`: [`testing`] (answers in typed form) and `clock(..)` on the Redis store
//!   builders, for tests and simulations; with `axum`, [`replay`]: recorded traffic through a
//!   real layer, and a report of what each rule, tier, tenant and route admitted.
//! * `tls`: TLS to Redis (`rediss://`) for both Redis stores, with rustls and its ring
//!   provider (no system OpenSSL): `tls_ca` and `tls_client_cert` on their builders. Enables
//!   `redis`.
//!
//! `default-features = false` builds the layer with the memory store alone. gRPC needs no
//! feature to be answered right: a call over the limit gets `RESOURCE_EXHAUSTED`, never an HTTP
//! 429. Minimum supported Rust version: 1.88.
//!
#![cfg_attr(feature = "axum", doc = "[`BodyKeyLayer`]: key::BodyKeyLayer")]
#![cfg_attr(
    not(feature = "axum"),
    doc = "[`BodyKeyLayer`]: https://docs.rs/tollgate/latest/tollgate/key/struct.BodyKeyLayer.html"
)]
#![cfg_attr(
    feature = "redis",
    doc = "[`RedisStore`]: store::RedisStore\n[`RedisClusterStore`]: store::RedisClusterStore"
)]
#![cfg_attr(
    not(feature = "redis"),
    doc = "[`RedisStore`]: https://docs.rs/tollgate/latest/tollgate/store/struct.RedisStore.html
[`RedisClusterStore`]: https://docs.rs/tollgate/latest/tollgate/store/struct.RedisClusterStore.html
[`CircuitBreaker`]: https://docs.rs/tollgate/latest/tollgate/struct.CircuitBreaker.html"
)]
#![cfg_attr(
    feature = "toml",
    doc = "[`Policy::from_toml`]: policy::Policy::from_toml
[`Policy::from_file`]: policy::Policy::from_file
[`FileSource`]: policy::FileSource"
)]
#![cfg_attr(
    not(feature = "toml"),
    doc = "[`Policy::from_toml`]: https://docs.rs/tollgate/latest/tollgate/policy/struct.Policy.html#method.from_toml
[`Policy::from_file`]: https://docs.rs/tollgate/latest/tollgate/policy/struct.Policy.html#method.from_file
[`FileSource`]: https://docs.rs/tollgate/latest/tollgate/policy/struct.FileSource.html"
)]
#![cfg_attr(
    not(feature = "tonic"),
    doc = "[`grpc`]: https://docs.rs/tollgate/latest/tollgate/grpc/index.html"
)]
#![cfg_attr(
    not(feature = "testing"),
    doc = "[`testing`]: https://docs.rs/tollgate/latest/tollgate/testing/index.html"
)]
#![cfg_attr(
    not(all(feature = "testing", feature = "axum")),
    doc = "[`replay`]: https://docs.rs/tollgate/latest/tollgate/replay/index.html"
)]
#![warn(missing_docs)]
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod algorithm;
mod body;
pub mod client;
pub mod clock;
mod decimal;
mod engine;
mod error;
pub mod future;
#[cfg(feature = "tonic")]
pub mod grpc;
pub mod key;
mod layer;
mod limiter;
pub mod observe;
pub mod policy;
#[cfg(all(feature = "testing", feature = "axum"))]
pub mod replay;
mod response;
mod runtime;
mod service;
mod shed;
#[cfg(all(test, feature = "redis"))]
mod sim;
pub mod store;
#[cfg(feature = "metrics")]
mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;
mod throttle;
mod wire;

/// The `http` crate, whose types the layer takes and returns (as axum re-exports it).
pub use http;

/// The README's code blocks, compiled (and run where they can) as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

pub use algorithm::decision::{Decision, DecisionSource};
pub use algorithm::kind::Algorithm;
pub use body::ResponseBody;
pub use engine::{Meter, Spend};
pub use error::ConfigError;
pub use layer::{DEFAULT_MAX_WAITING, RateLimitLayer, RateLimitLayerBuilder};
pub use limiter::{Limiter, LimiterError};
pub use policy::MAX_RULES;
pub use policy::cost::Cost;
pub use policy::failure::FailureMode;
pub use policy::mode::RuleMode;
pub use policy::outcome::{ActualCost, ChargeWhen};
pub use policy::quota::Quota;
pub use policy::rule::{DEFAULT_LEASE_TTL, DEFAULT_MAX_HOLD, Rule};
pub use policy::share::{DEFAULT_UNTIL_COUNTED, FallbackShare};
pub use response::{Headers, RateLimited, ResetFormat};
pub use service::RateLimit;
pub use shed::{Adaptive, Priority, Shedding};
#[cfg(feature = "redis")]
pub use store::breaker::CircuitBreaker;
