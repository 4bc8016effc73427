//! What clients are told: budget headers, the 429 answer, and the response body type.
//!
//! ```
//! use tollgate::response::{Headers, ResetFormat};
//! use tollgate::{Quota, RateLimitLayer};
//!
//! // IETF `RateLimit` / `RateLimit-Policy` plus GitHub-style `X-RateLimit-*` with epoch resets.
//! let layer = RateLimitLayer::builder()
//!     .rule(tollgate::Rule::new("api", Quota::per_minute(100)))
//!     .headers(Headers::ietf().with_legacy(ResetFormat::EpochSeconds))
//!     .build()
//!     .unwrap();
//! # let _ = layer;
//! ```
//!
//! * Allowed responses keep everything the inner service returned; the budget headers are added.
//! * Denied requests get `429 Too Many Requests`, `Retry-After` in whole seconds rounded up (never
//!   0), the budget headers, and an RFC 9457 `application/problem+json` body naming the violated
//!   policies. [`on_denied`](crate::RateLimitLayerBuilder::on_denied) replaces the body and
//!   status with your own; the headers are still added.
//! * gRPC calls (`content-type: application/grpc…`) are never answered with an HTTP 429: they get
//!   a trailers-only `RESOURCE_EXHAUSTED` (`grpc-status: 8`) with `grpc-retry-pushback-ms` and a
//!   `google.rpc.RetryInfo` in `grpc-status-details-bin`, plus the same headers as metadata.
//!   When the store fails and the layer fails closed, they get `UNAVAILABLE` (`grpc-status: 14`).

mod body;
mod buffer;
mod grpc;
mod headers;
mod problem;

pub use body::ResponseBody;
pub use headers::{Headers, ResetFormat};
pub use problem::RateLimited;

pub(crate) use grpc::{grpc_denied, grpc_unavailable, is_grpc};
pub(crate) use headers::{PolicyItems, write_headers};
pub(crate) use problem::{PROBLEM_JSON, ProblemBodies, problem_response};
