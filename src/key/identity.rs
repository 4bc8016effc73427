use std::fmt;
use std::hash::{Hash, Hasher};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
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
/// // A text identity never reads like another kind of key.
/// assert_ne!(Key::text("203.0.113.7").to_string(), "203.0.113.7");
/// assert_ne!(Key::text("global"), Key::global());
/// ```
///
/// IP keys never allocate. The textual form (`Display`) is what the Redis store puts between the
/// braces of its keys; distinct keys have distinct textual forms.
#[derive(Clone, PartialEq, Eq)]
pub struct Key(Repr);

#[derive(Clone, PartialEq, Eq)]
enum Repr {
    Global,
    Unidentified,
    Ip(IpAddr),
    Text(Arc<str>),
}

/// One write per key (the derived form made four for an IP address): the memory store hashes a
/// key on every request.
impl Hash for Key {
    #[inline(always)]
    fn hash<H: Hasher>(&self, state: &mut H) {
        match &self.0 {
            Repr::Global => state.write_u8(0),
            Repr::Unidentified => state.write_u8(1),
            Repr::Ip(IpAddr::V4(v4)) => state.write_u32(v4.to_bits()),
            Repr::Ip(IpAddr::V6(v6)) => state.write_u128(v6.to_bits()),
            Repr::Text(text) => text.hash(state),
        }
    }
}

/// Text identities longer than this many bytes (after escaping) are replaced by their SHA-256.
pub const MAX_TEXT_KEY_LEN: usize = 128;

/// The prefix of hashed identities.
const HASH_PREFIX: &str = "sha256:";

impl Key {
    /// The one key of [`Global`](super::Global).
    pub const fn global() -> Self {
        Key(Repr::Global)
    }

    /// The key that counts every request whose extractor found no key (written `unidentified`):
    /// such requests share one budget per rule instead of going unlimited. See
    /// [`Rule::skip_unidentified`](crate::Rule::skip_unidentified).
    ///
    /// ```
    /// use tollgate::key::Key;
    ///
    /// assert_eq!(Key::unidentified().to_string(), "unidentified");
    /// // A client cannot name it through a text identity.
    /// assert_ne!(Key::text("unidentified"), Key::unidentified());
    /// ```
    pub const fn unidentified() -> Self {
        Key(Repr::Unidentified)
    }

    /// Whether this is the [`unidentified`](Key::unidentified) key.
    pub fn is_unidentified(&self) -> bool {
        matches!(self.0, Repr::Unidentified)
    }

    /// An IP address as it is (an IPv6 address that embeds an IPv4 client becomes that IPv4
    /// address: see [`canonical_ip`]).
    pub fn ip(ip: IpAddr) -> Self {
        Key(Repr::Ip(canonical_ip(ip)))
    }

    /// An IP address, IPv6 addresses cut to their first `v6_prefix` bits (clamped to 128), so
    /// that one host cannot rotate through its subnet. An IPv6 address that embeds an IPv4
    /// client becomes that IPv4 address first (see [`canonical_ip`]).
    pub fn ip_prefix(ip: IpAddr, v6_prefix: u8) -> Self {
        match canonical_ip(ip) {
            IpAddr::V6(v6) => {
                let bits = u32::from(v6_prefix.min(128));
                let mask = u128::MAX.checked_shl(128 - bits).unwrap_or(0);
                Key(Repr::Ip(IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask))))
            }
            v4 => Key(Repr::Ip(v4)),
        }
    }

    /// A text identity.
    ///
    /// * `%`, `{`, `}`, `|`, `~`, whitespace and control characters are percent-escaped, so that
    ///   distinct inputs stay distinct and the result is safe inside a Redis Cluster hash tag
    ///   (`|` and `~` are the separators of [`combine`](super::combine) and
    ///   [`first_of`](super::first_of)).
    /// * A text that would read like another kind of key (an IP address, `global`,
    ///   `unidentified`, a hashed `sha256:` identity) or is empty has its first character escaped (the empty text
    ///   becomes `%`), so a client cannot name someone else's IP key through a text identity.
    /// * A result longer than [`MAX_TEXT_KEY_LEN`] bytes is replaced by `sha256:` and the hex
    ///   digest of the escaped text (71 bytes).
    pub fn text(identity: impl AsRef<str>) -> Self {
        let identity = identity.as_ref();
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
        let mut out = if escaped_len == identity.len() {
            if escaped_len <= MAX_TEXT_KEY_LEN && !is_ambiguous(identity) {
                return Key(Repr::Text(identity.into()));
            }
            identity.to_owned()
        } else {
            let mut out = String::with_capacity(escaped_len);
            for c in identity.chars() {
                if needs_escape(c) {
                    push_escaped(&mut out, c);
                } else {
                    out.push(c);
                }
            }
            out
        };
        if is_ambiguous(&out) {
            match out.chars().next() {
                None => out.push('%'),
                Some(first) => {
                    let mut fixed = String::with_capacity(out.len() + 2);
                    push_escaped(&mut fixed, first);
                    fixed.push_str(&out[first.len_utf8()..]);
                    out = fixed;
                }
            }
        }
        if out.len() > MAX_TEXT_KEY_LEN {
            return Key::digest(out.as_bytes());
        }
        Key(Repr::Text(out.into()))
    }

    /// `sha256:` and the hex SHA-256 digest of `bytes`: an opaque, fixed-size identity for
    /// secrets (API keys, tokens), personal data (emails) and values that are not UTF-8. The
    /// store then never sees the value itself.
    ///
    /// ```
    /// use tollgate::key::Key;
    ///
    /// let key = Key::digest("secret-api-key");
    /// assert!(key.to_string().starts_with("sha256:"));
    /// assert_eq!(key.to_string().len(), 71);
    /// ```
    pub fn digest(bytes: impl AsRef<[u8]>) -> Self {
        Key(Repr::Text(hex_digest(bytes.as_ref()).into()))
    }

    /// A key from text that is already escaped (no raw `{`, `}` or control characters), as the
    /// combinators build it; hashed when longer than [`MAX_TEXT_KEY_LEN`].
    pub(crate) fn from_escaped(text: String) -> Self {
        if text.len() > MAX_TEXT_KEY_LEN {
            Key::digest(text.as_bytes())
        } else {
            Key(Repr::Text(text.into()))
        }
    }

    /// The IP address, for IP keys.
    pub fn as_ip(&self) -> Option<IpAddr> {
        match self.0 {
            Repr::Ip(ip) => Some(ip),
            _ => None,
        }
    }

    /// The text, for text keys (escaped or hashed as described in [`Key::text`]).
    pub fn as_text(&self) -> Option<&str> {
        match &self.0 {
            Repr::Text(text) => Some(text),
            _ => None,
        }
    }

    /// Whether this is the [`global`](Key::global) key.
    pub fn is_global(&self) -> bool {
        matches!(self.0, Repr::Global)
    }
}

/// The well-known NAT64 prefix `64:ff9b::/96` (RFC 6052), as the top 96 bits of an address.
const NAT64_PREFIX: u128 = 0x0064_ff9b_0000_0000_0000_0000_0000_0000;

/// The address a client is counted by: an IPv4-mapped IPv6 address (`::ffff:a.b.c.d`) and an
/// address of the NAT64 / SIIT well-known prefix (`64:ff9b::a.b.c.d`, RFC 6052) stand for the
/// IPv4 client `a.b.c.d`; every other address is itself.
///
/// Without this, every IPv4 client behind a NAT64 gateway would share the gateway's IPv6 /64.
/// Only the well-known /96 is un-mapped, and only for global IPv4 addresses: RFC 6052 §3.1 does
/// not allow it to carry private or special ones, so `64:ff9b::10.0.0.3` is not `10.0.0.3` (and
/// cannot pass for a trusted proxy in `10.0.0.0/8`). A network-specific prefix (§2.2) is a choice
/// of the operator's that tollgate cannot see.
///
/// ```
/// use std::net::IpAddr;
/// use tollgate::key::canonical_ip;
///
/// let nat64: IpAddr = "64:ff9b::93.184.216.34".parse().unwrap();
/// assert_eq!(canonical_ip(nat64), "93.184.216.34".parse::<IpAddr>().unwrap());
/// let private: IpAddr = "64:ff9b::10.0.0.3".parse().unwrap();
/// assert_eq!(canonical_ip(private), private);
/// ```
pub fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) if v6.to_bits() >> 32 == NAT64_PREFIX >> 32 => {
            let v4 = Ipv4Addr::from_bits(v6.to_bits() as u32);
            if is_global_v4(v4) { IpAddr::V4(v4) } else { ip }
        }
        other => other.to_canonical(),
    }
}

/// The IPv4-mapped range `::ffff:0:0/96`, as the top 96 bits of an address.
const MAPPED_PREFIX: u128 = 0xffff << 32;

/// A network as keys hold its clients: a network within the IPv4-mapped range, /96 or longer
/// (`::ffff:10.0.0.0/104`), is its IPv4 network (`10.0.0.0/8`), as [`canonical_ip`] makes its
/// addresses IPv4 ones. Any other network is itself, host bits cleared. (A NAT64 network is not
/// made an IPv4 one: only its global addresses are counted as IPv4 ones.)
pub(crate) fn canonical_net(net: ipnet::IpNet) -> ipnet::IpNet {
    ipv4_within(net, MAPPED_PREFIX).map_or(net.trunc(), ipnet::IpNet::V4)
}

/// The IPv4 network a network within the NAT64 well-known prefix (`64:ff9b::/96`), /96 or
/// longer, stands for.
pub(crate) fn nat64_net(net: ipnet::IpNet) -> Option<ipnet::Ipv4Net> {
    ipv4_within(net, NAT64_PREFIX)
}

/// The IPv4 network that an IPv6 network within the /96 `range` (its top 96 bits), /96 or
/// longer, carries in its last 32 bits.
fn ipv4_within(net: ipnet::IpNet, range: u128) -> Option<ipnet::Ipv4Net> {
    let ipnet::IpNet::V6(v6) = net.trunc() else {
        return None;
    };
    let prefix = v6.prefix_len().checked_sub(96)?;
    let bits = v6.network().to_bits();
    (bits >> 32 == range >> 32)
        .then(|| ipnet::Ipv4Net::new(Ipv4Addr::from_bits(bits as u32), prefix).ok())
        .flatten()
}

/// Whether an IPv4 address may stand behind the NAT64 well-known prefix: not private, shared,
/// loopback, link-local, "this network", documentation, benchmarking, reserved, multicast or
/// broadcast (the ranges of RFC 6890 that are not globally reachable).
fn is_global_v4(v4: Ipv4Addr) -> bool {
    let [a, b, c, _] = v4.octets();
    !(v4.is_private()
        || v4.is_loopback()
        || v4.is_link_local()
        || v4.is_unspecified()
        || v4.is_broadcast()
        || v4.is_documentation()
        || v4.is_multicast()
        || a == 0
        || (a == 100 && (64..128).contains(&b)) // shared address space, RFC 6598
        || (a == 192 && b == 0 && c == 0) // IETF protocol assignments
        || (a == 198 && (b == 18 || b == 19)) // benchmarking
        || a >= 240)
}

fn needs_escape(c: char) -> bool {
    matches!(c, '%' | '{' | '}' | '|' | '~') || c.is_control() || c.is_whitespace()
}

/// Whether (already escaped) text reads like a key of another kind.
fn is_ambiguous(text: &str) -> bool {
    text.is_empty()
        || text == "global"
        || text == "unidentified"
        || text.starts_with(HASH_PREFIX)
        || (text.len() <= 45 && text.parse::<IpAddr>().is_ok())
}

fn push_escaped(out: &mut String, c: char) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut buf = [0u8; 4];
    for byte in c.encode_utf8(&mut buf).bytes() {
        out.push('%');
        out.push(char::from(HEX[usize::from(byte >> 4)]));
        out.push(char::from(HEX[usize::from(byte & 0xf)]));
    }
}

/// `sha256:` and the hex SHA-256 digest of `bytes` (the text of [`Key::digest`]).
pub(crate) fn hex_digest(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let digest = Sha256::digest(bytes);
    let mut out = String::with_capacity(HASH_PREFIX.len() + 64);
    out.push_str(HASH_PREFIX);
    for byte in digest {
        out.push(char::from(HEX[usize::from(byte >> 4)]));
        out.push(char::from(HEX[usize::from(byte & 0xf)]));
    }
    out
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Repr::Global => f.write_str("global"),
            Repr::Unidentified => f.write_str("unidentified"),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_separators_and_braces() {
        assert_eq!(Key::text("a|b~c").to_string(), "a%7Cb%7Ec");
        assert_eq!(Key::text("{x} y\n").to_string(), "%7Bx%7D%20y%0A");
        assert_eq!(Key::text("100%").to_string(), "100%25");
        assert_eq!(Key::text("alice").to_string(), "alice");
    }

    #[test]
    fn text_never_reads_like_another_kind() {
        assert_eq!(Key::text("1.2.3.4").to_string(), "%31.2.3.4");
        assert_eq!(Key::text("::1").to_string(), "%3A:1");
        assert_eq!(Key::text("global").to_string(), "%67lobal");
        assert_eq!(Key::text("sha256:abc").to_string(), "%73ha256:abc");
        assert_eq!(Key::text("").to_string(), "%");
        assert_ne!(Key::text("1.2.3.4"), Key::ip("1.2.3.4".parse().unwrap()));
        // Escapes stay distinct from what they escape.
        assert_ne!(Key::text("%31.2.3.4"), Key::text("1.2.3.4"));
        assert_ne!(Key::text("%"), Key::text(""));
    }

    #[test]
    fn long_text_is_hashed_to_a_fixed_size() {
        let long = Key::text("é".repeat(100));
        let text = long.as_text().unwrap();
        assert!(text.starts_with("sha256:") && text.len() == 71);
        assert_ne!(long, Key::text("é".repeat(101)));
        assert_eq!(Key::text("a".repeat(128)).to_string().len(), 128);
        assert_eq!(Key::text("a".repeat(129)).to_string().len(), 71);
        // Escaping the first character of an ambiguous text may cross the limit: hashed too.
        let ambiguous = format!("sha256:{}", "a".repeat(MAX_TEXT_KEY_LEN - 7));
        assert_eq!(ambiguous.len(), MAX_TEXT_KEY_LEN);
        assert_eq!(Key::text(&ambiguous).to_string().len(), 71);
    }

    #[test]
    fn ip_keys_are_canonical_and_grouped() {
        let mapped: IpAddr = "::ffff:192.0.2.1".parse().unwrap();
        assert_eq!(Key::ip(mapped).to_string(), "192.0.2.1");
        assert_eq!(Key::ip_prefix(mapped, 64).to_string(), "192.0.2.1");
        let v6: IpAddr = "2001:db8:1:2:3:4:5:6".parse().unwrap();
        assert_eq!(Key::ip_prefix(v6, 48).to_string(), "2001:db8:1::");
        assert_eq!(Key::ip_prefix(v6, 200).to_string(), "2001:db8:1:2:3:4:5:6");
        assert_eq!(Key::ip_prefix(v6, 0).to_string(), "::");
    }

    #[test]
    fn nat64_addresses_are_their_ipv4_client() {
        // RFC 6052's well-known prefix: every IPv4 client behind a NAT64 / SIIT gateway would
        // otherwise share the gateway's /64.
        let a: IpAddr = "64:ff9b::5db8:d822".parse().unwrap();
        let b: IpAddr = "64:ff9b::801:101".parse().unwrap();
        assert_eq!(Key::ip(a).to_string(), "93.184.216.34");
        assert_eq!(Key::ip_prefix(a, 64).to_string(), "93.184.216.34");
        assert_eq!(Key::ip_prefix(b, 64).to_string(), "8.1.1.1");
        assert_ne!(Key::ip_prefix(a, 64), Key::ip_prefix(b, 64));
        // Other addresses of 64:ff9b::/32 that are not in the /96 stay IPv6.
        let local_use: IpAddr = "64:ff9b:1::c000:201".parse().unwrap();
        assert!(Key::ip(local_use).as_ip().unwrap().is_ipv6());
        // The well-known prefix never carries a private address (RFC 6052 §3.1).
        let private: IpAddr = "64:ff9b::a00:3".parse().unwrap();
        assert_eq!(canonical_ip(private), private);
    }
}
