//! [`FromExtension`]: a key from a typed request extension.

use std::fmt;
use std::marker::PhantomData;

use http::request::Parts;

use super::{Extracted, Key, KeyExtractor};

/// A key from a typed request extension, such as the user an upstream
/// authentication layer put there.
///
/// ```
/// use tollgate::key::{FromExtension, Key, KeyExtractor};
///
/// // What your authentication middleware inserts.
/// #[derive(Clone)]
/// struct User {
///     id: u64,
///     tenant: String,
/// }
///
/// let by_user = FromExtension::new(|user: &User| Some(Key::text(user.id.to_string())));
/// let by_tenant = FromExtension::new(|user: &User| Some(Key::text(&user.tenant)));
///
/// let (mut parts, ()) = http::Request::new(()).into_parts();
/// parts.extensions.insert(User { id: 42, tenant: "acme".into() });
/// assert_eq!(by_user.extract(&parts).found(), Some(Key::text("42")));
/// assert_eq!(by_tenant.extract(&parts).found(), Some(Key::text("acme")));
/// ```
///
/// Extensions are set by server code, never by the client, so this is the strongest key: the
/// one your authentication established. The authentication layer must run *before* the rate
/// limit (be added after it, since the last layer added is the outermost). Requests without the
/// extension have no key; chain a fallback with [`or`](super::KeyExtractorExt::or).
///
/// A key from the request extension of type `T`, through `F`.
pub struct FromExtension<T, F> {
    f: F,
    _type: PhantomData<fn() -> T>,
}

impl<T, F> FromExtension<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(&T) -> Option<Key> + Send + Sync + 'static,
{
    /// Reads the extension of type `T` (the type of the closure's argument) and makes its key.
    pub fn new(f: F) -> Self {
        FromExtension {
            f,
            _type: PhantomData,
        }
    }
}

impl FromExtension<Key, fn(&Key) -> Option<Key>> {
    /// Reads a [`Key`] that upstream code inserted as an extension as it is.
    ///
    /// ```
    /// use tollgate::key::{FromExtension, Key, KeyExtractor};
    ///
    /// let (mut parts, ()) = http::Request::new(()).into_parts();
    /// parts.extensions.insert(Key::text("user-7"));
    /// assert_eq!(FromExtension::key().extract(&parts).found(), Some(Key::text("user-7")));
    /// ```
    pub fn key() -> Self {
        FromExtension::new(|key: &Key| Some(key.clone()))
    }
}

impl<T, F: Clone> Clone for FromExtension<T, F> {
    fn clone(&self) -> Self {
        FromExtension {
            f: self.f.clone(),
            _type: PhantomData,
        }
    }
}

impl<T, F> fmt::Debug for FromExtension<T, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FromExtension")
            .field("type", &std::any::type_name::<T>())
            .finish_non_exhaustive()
    }
}

impl<T, F> KeyExtractor for FromExtension<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(&T) -> Option<Key> + Send + Sync + 'static,
{
    fn extract(&self, parts: &Parts) -> Extracted {
        parts.extensions.get::<T>().and_then(&self.f).into()
    }
}
