//! [`async_fn()`]: a key that needs an asynchronous lookup.

use std::fmt;
use std::future::Future;

use http::request::Parts;

use super::{Extracted, Key, KeyExtractor};

/// An extractor from a closure that returns a future. Made by [`async_fn()`].
#[derive(Clone)]
pub struct AsyncFn<F> {
    f: F,
}

/// A key that needs asynchronous work, such as looking up the tenant of an API
/// key.
///
/// ```
/// use std::collections::HashMap;
/// use std::sync::Arc;
/// use tollgate::key::{Key, KeyExtractor, async_fn};
///
/// let tenants: Arc<HashMap<String, String>> =
///     Arc::new([("k-1".to_owned(), "acme".to_owned())].into());
///
/// let by_tenant = async_fn(move |parts: &http::request::Parts| {
///     // Copy what the lookup needs out of the request: the future must not borrow it.
///     let api_key = parts.headers.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::to_owned);
///     let tenants = tenants.clone();
///     async move {
///         // An asynchronous lookup (a cache, a database) would go here.
///         let tenant = tenants.get(&api_key?)?;
///         Some(Key::text(tenant))
///     }
/// });
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let (parts, ()) = http::Request::get("/").header("x-api-key", "k-1").body(()).unwrap().into_parts();
/// let key = by_tenant.extract(&parts).resolve().await;
/// assert_eq!(key, Some(Key::text("acme")));
/// # });
/// ```
///
/// The closure runs synchronously with the request head; the future it returns is awaited by
/// the layer before the store is asked, so its latency adds to every request's. Keep lookups
/// cached. A future that resolves to `None` means the key is missing: the request is counted under
/// [`Key::unidentified`], unless the rule [skips](crate::Rule::skip_unidentified) such requests.
///
/// An extractor from a closure that reads the request head and returns a future of the key.
pub fn async_fn<F, Fut>(f: F) -> AsyncFn<F>
where
    F: Fn(&Parts) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Option<Key>> + Send + 'static,
{
    AsyncFn { f }
}

impl<F> fmt::Debug for AsyncFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncFn").finish_non_exhaustive()
    }
}

impl<F, Fut> KeyExtractor for AsyncFn<F>
where
    F: Fn(&Parts) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Option<Key>> + Send + 'static,
{
    fn extract(&self, parts: &Parts) -> Extracted {
        Extracted::Pending(Box::pin((self.f)(parts)))
    }
}
