//! Keys from the request body: [`BodyKeyLayer`] finds a field (an email on a login route) and
//! [`FromBody`] counts by it.

mod field;
mod from_body;
mod layer;
mod replay;

pub use field::Normalize;
pub use from_body::{BodyFieldKey, BodyOutcome, BodyScan, FromBody};
pub use layer::{BodyKey, BodyKeyFuture, BodyKeyLayer, DEFAULT_BODY_LIMIT};
