use http::request::Parts;

use super::{Extracted, Key, KeyExtractor};

/// One key for every request: a limit on the whole service (per replica with the memory store,
/// fleet-wide with Redis).
///
/// ```
/// use tollgate::key::Global;
/// use tollgate::{Quota, Rule};
///
/// let rule = Rule::new("everyone", Quota::per_second(1000)).key(Global);
/// # let _ = rule;
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct Global;

impl KeyExtractor for Global {
    fn extract(&self, _parts: &Parts) -> Extracted {
        Extracted::Found(Key::global())
    }
}
