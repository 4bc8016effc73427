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
//! * [`Rule`], [`Quota`], [`Algorithm`], [`Cost`]: how much they may do.
//! * [`store`]: how much they already did: [`MemoryStore`](store::MemoryStore) (default), or
//!   Redis shared by every replica so that "100 per minute" means 100 per minute fleet-wide.
//! * [`algorithm`]: the reference model of the five algorithms, shared by every store.
//! * [`Headers`], [`RateLimited`]: what clients are told — `RateLimit` / `RateLimit-Policy`
//!   (draft-ietf-httpapi-ratelimit-headers-11), `X-RateLimit-*`, `Retry-After`, and an RFC 9457
//!   problem body.
//!
//! The layer keeps the inner service's error type, so it needs no `HandleErrorLayer`, and works
//! with `Router::layer`, `Router::route_layer`, `tower::ServiceBuilder` and
//! `tonic::transport::Server::builder().layer`.
//!
//! # Features
//!
//! * `axum` (default): the peer IP from axum's `ConnectInfo<SocketAddr>`, route keys from
//!   `MatchedPath`, and [`BodyKeyLayer`](key::BodyKeyLayer) (keys from a field of the body).
//! * `tonic` (default): the peer IP from tonic's `TcpConnectInfo`, so that a tonic server limits
//!   by client without any setup.
//! * `redis` (default): the Redis and Redis Cluster stores.
//!
//! gRPC needs no feature to be answered right: a call over the limit gets `RESOURCE_EXHAUSTED`,
//! never an HTTP 429.

#![warn(missing_docs)]
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod algorithm;
pub mod client;
pub mod clock;
mod decide;
mod decision;
mod error;
pub mod future;
#[cfg(feature = "tonic")]
pub mod grpc;
mod held;
pub mod key;
mod layer;
mod limiter;
pub mod observe;
pub mod policy;
mod response;
mod service;
pub mod shed;
pub mod store;
#[cfg(feature = "testing")]
pub mod testing;
mod warn;

/// The `http` crate, whose types the layer takes and returns (as axum re-exports it).
pub use http;

/// The README's code blocks, compiled (and run where they can) as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

pub use algorithm::kind::Algorithm;
pub use decision::{Decision, DecisionSource};
pub use error::ConfigError;
pub use layer::{DEFAULT_MAX_WAITING, MAX_RULES, RateLimitLayer, RateLimitLayerBuilder};
pub use limiter::{Limiter, LimiterError};
pub use policy::cost::Cost;
pub use policy::failure::FailureMode;
pub use policy::mode::RuleMode;
pub use policy::outcome::{ActualCost, ChargeWhen};
pub use policy::quota::Quota;
pub use policy::rule::{DEFAULT_LEASE_TTL, DEFAULT_MAX_HOLD, Rule};
pub use response::{Headers, RateLimited, ResetFormat, ResponseBody};
pub use service::RateLimit;
pub use shed::{Priority, Shedding};
#[cfg(feature = "redis")]
pub use store::breaker::CircuitBreaker;
