//! [`FromHeader`]: a key from a request header.

use http::HeaderName;
use http::request::Parts;

use super::{Extracted, Key, KeyExtractor};

/// A key from a request header (an API key, a tenant set by your gateway).
///
/// ```
/// use tollgate::key::{ClientIp, FromHeader, Key, KeyExtractor, KeyExtractorExt};
///
/// // Count by API key, hashed so the store never sees the secret; requests without one by IP.
/// let by_api_key = FromHeader::new("x-api-key").hashed().or(ClientIp::new());
///
/// let (parts, ()) = http::Request::get("/")
///     .header("x-api-key", "k-123")
///     .body(())
///     .unwrap()
///     .into_parts();
/// assert_eq!(by_api_key.extract(&parts).found(), Some(Key::digest("k-123")));
/// ```
///
/// A header is only as trustworthy as whoever writes it. A client writes its own headers, so a
/// header key limits nothing unless the value is checked before it is counted (an API key that
/// an upstream layer validated) or set by your own infrastructure, which strips it from
/// incoming requests. To key by an identity your authentication layer established, prefer
/// [`FromExtension`](super::FromExtension).
///
/// A key from the first value of a header, whitespace trimmed. Missing or empty headers give no
/// key. Values that are not UTF-8 are hashed; long ones are hashed by [`Key::text`].
#[derive(Clone, Debug)]
pub struct FromHeader {
    name: HeaderName,
    hashed: bool,
}

impl FromHeader {
    /// Reads the header `name`.
    ///
    /// # Panics
    ///
    /// If `name` is not a valid header name (a configuration mistake, found at start-up).
    pub fn new<N>(name: N) -> Self
    where
        N: TryInto<HeaderName>,
        N::Error: std::fmt::Debug,
    {
        let name = name
            .try_into()
            .unwrap_or_else(|e| panic!("FromHeader::new: not a valid header name: {e:?}"));
        FromHeader {
            name,
            hashed: false,
        }
    }

    /// Reads the header `name`, or says why `name` is not a header name (for names that come
    /// from configuration files).
    ///
    /// ```
    /// use tollgate::key::FromHeader;
    /// assert!(FromHeader::try_new("x-api-key").is_ok());
    /// assert!(FromHeader::try_new("not a header").unwrap_err().to_string().contains("header name"));
    /// ```
    pub fn try_new(name: &str) -> Result<Self, crate::ConfigError> {
        let name = HeaderName::try_from(name).map_err(|_| {
            crate::ConfigError::new(format!(
                "{name:?} is not a valid header name; use letters, digits and '-' (e.g. \"x-api-key\")"
            ))
        })?;
        Ok(FromHeader {
            name,
            hashed: false,
        })
    }

    /// Keys by the SHA-256 of the value ([`Key::digest`]) instead of the value: for secrets
    /// such as API keys and tokens, which then never reach the store or its logs.
    pub fn hashed(mut self) -> Self {
        self.hashed = true;
        self
    }

    /// The header this reads.
    pub fn name(&self) -> &HeaderName {
        &self.name
    }
}

impl KeyExtractor for FromHeader {
    fn extract(&self, parts: &Parts) -> Extracted {
        let Some(value) = parts.headers.get(&self.name) else {
            return Extracted::Missing;
        };
        let bytes = value.as_bytes().trim_ascii();
        if bytes.is_empty() {
            return Extracted::Missing;
        }
        let key = match std::str::from_utf8(bytes) {
            Ok(text) if !self.hashed => Key::text(text),
            _ => Key::digest(bytes),
        };
        Extracted::Found(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extract(extractor: &FromHeader, value: &[u8]) -> Option<Key> {
        let (parts, ()) = http::Request::get("/")
            .header("x-tenant", http::HeaderValue::from_bytes(value).unwrap())
            .body(())
            .unwrap()
            .into_parts();
        extractor.extract(&parts).found()
    }

    #[test]
    fn values() {
        let tenant = FromHeader::new("X-Tenant");
        assert_eq!(extract(&tenant, b" acme "), Some(Key::text("acme")));
        assert_eq!(extract(&tenant, b"a{b}"), Some(Key::text("a{b}")));
        assert_eq!(extract(&tenant, b"  "), None);
        assert_eq!(extract(&tenant, b"caf\xe9"), Some(Key::digest(b"caf\xe9")));
        assert_eq!(
            extract(&tenant.clone().hashed(), b"acme"),
            Some(Key::digest("acme"))
        );
        let (parts, ()) = http::Request::new(()).into_parts();
        assert_eq!(tenant.extract(&parts).found(), None);
    }
}
