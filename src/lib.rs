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
//!            inner service ◄── admitted: budget headers added ◄────────────┤
//!            429 + Retry-After + problem+json ◄── denied ──────────────────┘
//! ```
//!
//! * [`key`]: who is asking (the peer IP by default, any [`KeyExtractor`](key::KeyExtractor)).
//! * [`policy`]: how much they may do: [`Rule`]s of a [`Quota`] and an [`Algorithm`].
//! * [`store`]: how much they already did: [`MemoryStore`](store::MemoryStore) (default), or
//!   Redis shared by every replica so that "100 per minute" means 100 per minute fleet-wide.
//! * [`algorithm`]: the reference model of the five algorithms, shared by every store.
//! * [`response`]: `RateLimit` / `RateLimit-Policy`, `X-RateLimit-*`, `Retry-After`, the 429 body.
//!
//! The layer keeps the inner service's error type, so it needs no `HandleErrorLayer`, and works
//! with `Router::layer`, `Router::route_layer`, `tower::ServiceBuilder` and
//! `tonic::transport::Server::builder().layer`.
//!
//! # Features
//!
//! * `axum` (default): the peer IP from axum's `ConnectInfo<SocketAddr>`, route keys from
//!   `MatchedPath`, and [`BodyKeyLayer`](key::BodyKeyLayer) (keys from a field of the body).
//! * `redis` (default): the Redis and Redis Cluster stores.
//! * `tonic`: the peer IP from tonic's `TcpConnectInfo`.
//!
//! gRPC needs no feature: a call over the limit gets `RESOURCE_EXHAUSTED`, never an HTTP 429.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod algorithm;
pub mod clock;
pub mod decision;
pub mod future;
pub mod key;
pub mod layer;
pub mod policy;
pub mod response;
pub mod service;
pub mod store;
mod warn;

pub use algorithm::Algorithm;
pub use decision::Decision;
pub use future::ResponseFuture;
pub use layer::{RateLimitLayer, RateLimitLayerBuilder};
pub use policy::{ConfigError, Cost, FailureMode, Quota, Rule};
pub use service::RateLimit;
