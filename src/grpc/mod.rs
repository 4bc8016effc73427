//! tonic without a server-wide layer: a [`RateLimitInterceptor`] for one generated service,
//! and [`RateLimitLayer`](crate::RateLimitLayer) itself on one service; and limits per message
//! of a stream ([`PerMessageLayer`]).
//!
//! ```
//! use tollgate::{Quota, RateLimitLayer, Rule};
//! use tonic::service::interceptor::InterceptedService;
//!
//! # fn main() -> Result<(), tollgate::ConfigError> {
//! // An interceptor on one service: 10 calls a minute per peer IP, in the memory store.
//! let (_reporter, health) = tonic_health::server::health_reporter();
//! let limits = RateLimitLayer::builder()
//!     .rule(Rule::new("health", Quota::per_minute(10)))
//!     .build()?;
//! let limited = InterceptedService::new(health, limits.interceptor()?);
//!
//! // The layer on one service: any store (Redis included), the budget fields on every answer.
//! let (_reporter, health) = tonic_health::server::health_reporter();
//! let layer = RateLimitLayer::builder()
//!     .rule(Rule::new("health-checks", Quota::per_minute(10)))
//!     .build()?;
//! let also_limited = tower_layer::Layer::layer(&layer, health);
//! let router = tonic::transport::Server::builder()
//!     .add_service(limited)
//!     # ;
//! # let _ = (router, also_limited);
//! # Ok(())
//! # }
//! ```
//!
//! **The interceptor** ([`RateLimitLayer::interceptor`](crate::RateLimitLayer::interceptor))
//! runs in tonic's `InterceptedService` before the call: it sees the call's metadata and its
//! extensions (the peer address, what an authentication layer put there), decides, and either
//! lets the call through or ends it with the layer's gRPC answer as a `Status`
//! (`RESOURCE_EXHAUSTED` with `RetryInfo` in its details and `grpc-retry-pushback-ms`,
//! `Retry-After` and the budget fields in its metadata). What it cannot do:
//!
//! - **wait**: tonic's interceptors are synchronous, so only stores that answer at once
//!   ([`DecidesAtOnce`], the memory store) can build one; for another store the compiler says
//!   to put the layer on the service instead. Delay rules are refused; key or tenant
//!   extractors that need an asynchronous lookup cannot be waited for either: such a call goes
//!   through unlimited, and a warning says so once. Shadow rules work (their second check is
//!   decided at once too).
//! - **see the response**: the budget fields go out only with denials (a successful call's
//!   response metadata is the handler's), and rules that act after the response
//!   (concurrency limits, charges by outcome or settled) are refused when the interceptor is
//!   made, and so is a reload of the policy that would bring them (or delay rules) in.
//! - **see the method**: tonic hands an interceptor no path. A service has its own
//!   interceptor, so its limits are per service; for limits per method (route keys, policy
//!   routes), put [`GrpcPathLayer`] on the server once
//!   (`Server::builder().layer(GrpcPathLayer)`) and the interceptor reads the path from it.
//!
//! **The layer on one service**: `RateLimitLayer` is a Tower layer, and the service it makes is
//! a tonic `NamedService` when the inner one is, so
//! `Server::builder().add_service(layer.layer(HealthServer::new(health)))` limits that service
//! alone, with any store, and adds the budget fields to every response. Inside the server's
//! router its calls' route is the service's pattern (`/package.Service/{*rest}`); with
//! [`GrpcPathLayer`] on the server, their method path (`/package.Service/Method`), for
//! [`Route`](crate::key::Route) keys, policy routes and the `route` label.
//!
//! Both answer a limited call with `RESOURCE_EXHAUSTED`, a `google.rpc.Status` whose details
//! hold a `google.rpc.RetryInfo`, and `grpc-retry-pushback-ms` (rounded up to the millisecond);
//! `scripts/test.sh` checks this with a client of another implementation (Python's `grpcio`).
//!
//! **Streams**: the layer counts a call once, when it opens (a stream is one request).
//! [`layer.per_message()`](crate::RateLimitLayer::per_message) makes a [`PerMessageLayer`] that
//! counts each message a client sends on a client or bidirectional stream instead (its rules'
//! cost each, on the same store; rules that act after a response are refused). A message is
//! checked once it has fully arrived, before the service sees it; when one is refused, the
//! service gets every message accepted before it, then the stream fails with
//! `RESOURCE_EXHAUSTED` and a `RetryInfo`, which ends the call (a service that ends as if its
//! client were done has its status replaced). Unary calls count their one message.
//!
//! ```
//! # fn streams() -> Result<(), tollgate::ConfigError> {
//! use tollgate::{Quota, RateLimitLayer, Rule};
//! // 100 messages a minute per peer, over all its streams.
//! let messages = RateLimitLayer::builder()
//!     .rule(Rule::new("messages", Quota::per_minute(100)))
//!     .build()?
//!     .per_message()?;
//! let (_reporter, health) = tonic_health::server::health_reporter();
//! let _router = tonic::transport::Server::builder().layer(messages).add_service(health);
//! # Ok(())
//! # }
//! # streams().unwrap();
//! ```

mod interceptor;
mod path;
mod per_message;

pub use interceptor::{DecidesAtOnce, RateLimitInterceptor};
pub use path::{GrpcPath, GrpcPathLayer, GrpcPathService};
pub use per_message::{PerMessage, PerMessageBody, PerMessageFuture, PerMessageLayer};
