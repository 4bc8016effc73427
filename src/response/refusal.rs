//! [`Refusal`]: what the layer answers for the inner service, as values, before it is written
//! (an HTTP answer, its gRPC form, or a `tonic::Status`).

use smallvec::SmallVec;

use crate::Decision;

/// An answer for the inner service, before it is written.
pub(crate) enum Refusal {
    /// Over the limit (429, gRPC `RESOURCE_EXHAUSTED`): the rules that applied, by index, and
    /// their decision (shadow rules left out).
    Denied {
        applied: SmallVec<[u16; 4]>,
        decision: Decision,
    },
    /// The store failed and these rules, by index, fail closed (503, gRPC `UNAVAILABLE`).
    Unavailable { closed: SmallVec<[u16; 4]> },
    /// On the deny list (403, gRPC `PERMISSION_DENIED`).
    Forbidden,
    /// Shed by load shedding (503, gRPC `UNAVAILABLE`): the requests in flight the request's
    /// class may join.
    Shed { share: usize },
}
