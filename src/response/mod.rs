//! Every answer the layer writes: the budget fields added to admitted responses, the 429 of a
//! denial, the 503 of a store failure when a rule fails closed, and their gRPC forms.
//!
//! * Allowed responses keep everything the inner service returned; the budget fields are added.
//! * Denied requests get `429 Too Many Requests`, `Retry-After` in whole seconds rounded up (never
//!   0, and never before the end of a denying policy's effective window), the budget fields, and
//!   an RFC 9457 `application/problem+json` body of draft-11's `quota-exceeded` type naming the
//!   violated policies. [`on_denied`](crate::RateLimitLayerBuilder::on_denied) replaces the body
//!   and status with your own; the fields are still added.
//! * When the store fails and a rule fails closed: `503 Service Unavailable`, `Retry-After: 1`
//!   and a problem body of draft-11's `temporary-reduced-capacity` type.
//! * gRPC calls (`content-type: application/grpc…`) are never answered with an HTTP status: they
//!   get a trailers-only `RESOURCE_EXHAUSTED` (`grpc-status: 8`) with `grpc-retry-pushback-ms`
//!   and a `google.rpc.RetryInfo` in `grpc-status-details-bin`, plus the same fields as
//!   metadata; `UNAVAILABLE` (`grpc-status: 14`) instead of the 503.

mod answers;
mod buffer;
mod denied;
mod grpc;
mod headers;
mod refusal;

pub use denied::RateLimited;
pub use headers::{Headers, ResetFormat};

pub(crate) use answers::{Answers, DeniedHandler};
pub(crate) use refusal::Refusal;

/// A `RESOURCE_EXHAUSTED` answer with this delay, for the client's tests.
#[cfg(test)]
pub(crate) fn grpc_denied_for_tests(retry_after_micros: u64) -> http::Response<bytes::Bytes> {
    grpc::GrpcStatus::denied(Some(retry_after_micros)).response()
}
