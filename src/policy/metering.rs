//! [`Metering`]: how a [metered](crate::Rule::meter) rule counts a streamed response's units —
//! its chunk, and optionally the units of each data frame or a usage number in the trailers.
//!
//! ```
//! use tollgate::http::HeaderName;
//! use tollgate::{Quota, Rule};
//!
//! // A handler that cannot be changed: the layer counts each server-sent event as one token.
//! let by_frame = Rule::new("tokens", Quota::per_minute(10_000))
//!     .meter(500)
//!     .meter_frames(|frame: &[u8]| frame.windows(6).filter(|w| w == b"data: ").count() as u64);
//! // A gRPC service that reports its usage in the trailers: settled to that number.
//! let by_trailer = Rule::new("tokens", Quota::per_minute(10_000))
//!     .meter(500)
//!     .meter_usage_trailer(HeaderName::from_static("x-usage-tokens"));
//! # let _ = (by_frame, by_trailer);
//! ```

use std::fmt;
use std::sync::Arc;

use http::HeaderName;

/// The units of one data frame of a response.
pub(crate) type FrameUnits = Arc<dyn Fn(&[u8]) -> u64 + Send + Sync>;

/// How a metered rule counts: its chunk, and where the units come from besides the handler's
/// own [`Meter::spend`](crate::Meter::spend).
#[derive(Clone)]
pub(crate) struct Metering {
    /// Units taken from the store at a time.
    pub(crate) chunk: u64,
    /// Counts each data frame of the response as it passes: a frame that goes past the units
    /// held is delivered while the next chunk is asked for (no frame passes until that is
    /// known), so the frame that crosses the budget is a debt of at most its units.
    pub(crate) frames: Option<FrameUnits>,
    /// A trailer holding the response's total usage: the charge is settled to it.
    pub(crate) usage_trailer: Option<HeaderName>,
}

impl Metering {
    pub(crate) fn new(chunk: u64) -> Self {
        Metering {
            chunk,
            frames: None,
            usage_trailer: None,
        }
    }

    /// Whether `other` counts the same way (the same frame function, cloned).
    pub(crate) fn same_as(&self, other: &Metering) -> bool {
        let same_frames = match (&self.frames, &other.frames) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        self.chunk == other.chunk && same_frames && self.usage_trailer == other.usage_trailer
    }
}

impl fmt::Debug for Metering {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metering")
            .field("chunk", &self.chunk)
            .field("frames", &self.frames.is_some())
            .field("usage_trailer", &self.usage_trailer)
            .finish()
    }
}
