use std::fmt;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::Arc;

use sha2::{Digest, Sha256};

/// Who a request counts against: the whole service, an IP address (or IPv6 prefix), or a text
/// identity (user, API key, tenant…).
///
/// ```
/// use std::net::IpAddr;
/// use tollgate::key::Key;
///
/// let ip: IpAddr = "2001:db8:1:2:3:4:5:6".parse().unwrap();
/// assert_eq!(Key::ip_prefix(ip, 64).to_string(), "2001:db8:1:2::");
/// // Identities come from untrusted input: braces, `%` and control characters are escaped,
/// // long values are hashed, so they are safe inside a Redis Cluster hash tag.
/// assert_eq!(Key::text("a{b}").to_string(), "a%7Bb%7D");
/// assert_eq!(Key::text("x".repeat(500)).to_string().len(), 71); // "sha256:" + 64 hex digits
/// ```
///
/// IP keys never allocate. The textual form (`Display`) is what the Redis store puts between the
/// braces of its keys.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Key(Repr);

#[derive(Clone, PartialEq, Eq, Hash)]
enum Repr {
    Global,
    Ip(IpAddr),
    Text(Arc<str>),
}

/// Text identities longer than this many bytes (after escaping) are replaced by their SHA-256.
pub const MAX_TEXT_KEY_LEN: usize = 128;

impl Key {
    /// The one key of [`Global`](super::Global).
    pub const fn global() -> Self {
        Key(Repr::Global)
    }

    /// An IP address as it is (an IPv4-mapped IPv6 address becomes IPv4).
    pub fn ip(ip: IpAddr) -> Self {
        Key(Repr::Ip(ip.to_canonical()))
    }

    /// An IP address, IPv6 addresses cut to their first `v6_prefix` bits (clamped to 128), so
    /// that one host cannot rotate through its subnet. IPv4-mapped IPv6 addresses become IPv4.
    pub fn ip_prefix(ip: IpAddr, v6_prefix: u8) -> Self {
        match ip.to_canonical() {
            IpAddr::V6(v6) => {
                let bits = u32::from(v6_prefix.min(128));
                let mask = u128::MAX.checked_shl(128 - bits).unwrap_or(0);
                Key(Repr::Ip(IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask))))
            }
            v4 => Key(Repr::Ip(v4)),
        }
    }

    /// A text identity. `%`, `{`, `}`, whitespace and control characters are percent-escaped (so
    /// distinct inputs stay distinct); a result longer than [`MAX_TEXT_KEY_LEN`] bytes is
    /// replaced by `sha256:` and the hex digest of the input.
    pub fn text(identity: impl AsRef<str>) -> Self {
        let identity = identity.as_ref();
        let needs_escape =
            |c: char| matches!(c, '%' | '{' | '}') || c.is_control() || c.is_whitespace();
        let escaped_len: usize = identity
            .chars()
            .map(|c| {
                if needs_escape(c) {
                    3 * c.len_utf8()
                } else {
                    c.len_utf8()
                }
            })
            .sum();
        if escaped_len > MAX_TEXT_KEY_LEN {
            let digest = Sha256::digest(identity.as_bytes());
            let mut out = String::with_capacity(7 + 64);
            out.push_str("sha256:");
            for byte in digest {
                out.push(char::from_digit(u32::from(byte >> 4), 16).unwrap_or('0'));
                out.push(char::from_digit(u32::from(byte & 0xf), 16).unwrap_or('0'));
            }
            return Key(Repr::Text(out.into()));
        }
        if escaped_len == identity.len() {
            return Key(Repr::Text(identity.into()));
        }
        let mut out = String::with_capacity(escaped_len);
        for c in identity.chars() {
            if needs_escape(c) {
                let mut buf = [0u8; 4];
                for byte in c.encode_utf8(&mut buf).bytes() {
                    out.push('%');
                    out.push(
                        char::from_digit(u32::from(byte >> 4), 16)
                            .unwrap_or('0')
                            .to_ascii_uppercase(),
                    );
                    out.push(
                        char::from_digit(u32::from(byte & 0xf), 16)
                            .unwrap_or('0')
                            .to_ascii_uppercase(),
                    );
                }
            } else {
                out.push(c);
            }
        }
        Key(Repr::Text(out.into()))
    }

    /// The IP address, for IP keys.
    pub fn as_ip(&self) -> Option<IpAddr> {
        match self.0 {
            Repr::Ip(ip) => Some(ip),
            _ => None,
        }
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Repr::Global => f.write_str("global"),
            Repr::Ip(ip) => write!(f, "{ip}"),
            Repr::Text(text) => f.write_str(text),
        }
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({self})")
    }
}
