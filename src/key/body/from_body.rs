//! [`FromBody`]: the extractor that counts by the field [`BodyKeyLayer`](super::BodyKeyLayer)
//! found, and the extensions it leaves on a request.

use http::request::Parts;

#[cfg(doc)]
use crate::key::BodyKeyLayer;
use crate::key::{Extracted, Key, KeyExtractor};
use crate::throttle::Once;

/// The key [`BodyKeyLayer`] found in a request body; read by [`FromBody`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BodyFieldKey(pub(super) Key);

impl BodyFieldKey {
    /// The key.
    pub fn key(&self) -> &Key {
        &self.0
    }
}

/// What [`BodyKeyLayer`] did with a request body; an extension of every request it passed on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BodyScan {
    /// The outcome.
    pub outcome: BodyOutcome,
    /// How many body bytes the layer held before passing the request on.
    pub buffered: usize,
}

/// See [`BodyScan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BodyOutcome {
    /// The field was found: the request carries a [`BodyFieldKey`].
    Found,
    /// The whole body was read but has no usable field (absent, repeated, empty, not a string or
    /// number, or the body is not valid JSON).
    Missing,
    /// The body is larger than the limit (declared or found while reading).
    TooLarge,
    /// Not JSON or a form, or content-encoded: not read.
    NotChecked,
    /// The body failed while being read; the inner service sees the same error.
    Unreadable,
}

/// Counts by the [`BodyFieldKey`] that [`BodyKeyLayer`] found; no key without one.
///
/// If a request reaches it that no [`BodyKeyLayer`] read (the body layer was placed inside the
/// rate limit, or only on other routes), this is reported once through `tracing`.
#[derive(Clone, Copy, Debug, Default)]
pub struct FromBody;

static HINTED: Once = Once::new();

impl KeyExtractor for FromBody {
    fn extract(&self, parts: &Parts) -> Extracted {
        if let Some(found) = parts.extensions.get::<BodyFieldKey>() {
            return Extracted::Found(found.0.clone());
        }
        if parts.extensions.get::<BodyScan>().is_none() && HINTED.first() {
            tracing::warn!(
                "tollgate: FromBody saw a request that no BodyKeyLayer had read, so it has no \
                 body key (the rule's fallback, if any, applies). If this route should be keyed \
                 by its body, add BodyKeyLayer outside RateLimitLayer on it (with Router, add it \
                 after). Reported once."
            );
        }
        Extracted::Missing
    }
}
