//! [`CheckFuture`]: the future of a Redis store's check.

use std::future::Future;
use std::pin::Pin;

use crate::Decision;
use crate::store::StoreError;

/// The future of a Redis check (or, for another output, of an operation outside checks).
pub(crate) type CheckFuture<T = Decision> =
    Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'static>>;
