//! Key names: `prefix:{identity}:rule`, and the Redis Cluster slot of a key.

use std::net::{IpAddr, Ipv4Addr};

use crate::ConfigError;
use crate::key::Key;

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "tollgate";

/// The number of Redis Cluster hash slots.
pub(crate) const SLOTS: u16 = 16384;

/// Checks a key prefix: 1 to 64 bytes, no braces (a brace would move the Cluster hash tag away
/// from the identity), no whitespace or control characters.
pub(crate) fn validate_prefix(prefix: &str) -> Result<(), ConfigError> {
    let bad = |c: char| matches!(c, '{' | '}') || c.is_whitespace() || c.is_control();
    if prefix.is_empty() || prefix.len() > 64 || prefix.chars().any(bad) {
        return Err(ConfigError::new(format!(
            "Redis key prefix {prefix:?} is not allowed; use 1 to 64 characters without braces, \
             spaces or control characters"
        )));
    }
    Ok(())
}

/// Writes `prefix:{identity}:rule` into `out`.
///
/// The identity is the key's sanitized text form ([`Key`]'s `Display`: no braces, escaped, long
/// values hashed), so the first `{…}` of the name is always the identity: every rule of one caller
/// hashes to the same Cluster slot. An empty identity would make Redis hash the whole name, so it
/// is written as `%` (a text no other identity has: `Key::text` escapes every `%`).
pub(crate) fn write_key(out: &mut String, prefix: &str, identity: &Key, rule: &str) {
    out.clear();
    write_part_key(out, prefix, identity, None, rule);
}

/// Where a key's name is written: a `String`, or a [`KeyName`]'s room.
trait NameOut: std::fmt::Write {
    fn push_text(&mut self, text: &str);
    fn written(&self) -> usize;
    /// Appends an IPv4 address as `Display` writes it.
    fn push_ipv4(&mut self, v4: Ipv4Addr) {
        push_dotted(self, v4);
    }
}

/// Appends `v4`, written first on the stack, as one text.
fn push_dotted(out: &mut (impl NameOut + ?Sized), v4: Ipv4Addr) {
    let mut dotted = [0; IPV4_LONGEST];
    let len = write_ipv4(&mut dotted, v4);
    // Digits and dots: always text.
    out.push_text(std::str::from_utf8(&dotted[..len]).unwrap_or_default());
}

/// The longest IPv4 address as text: `255.255.255.255`.
const IPV4_LONGEST: usize = 15;

/// Writes `v4` as `Display` does to the start of `out`, digit by digit (no formatting, no UTF-8
/// check), and returns its length.
#[inline(always)]
fn write_ipv4(out: &mut [u8; IPV4_LONGEST], v4: Ipv4Addr) -> usize {
    let mut len = 0;
    for (i, octet) in v4.octets().into_iter().enumerate() {
        if i > 0 {
            out[len] = b'.';
            len += 1;
        }
        if octet >= 100 {
            out[len] = b'0' + octet / 100;
            len += 1;
        }
        if octet >= 10 {
            out[len] = b'0' + octet / 10 % 10;
            len += 1;
        }
        out[len] = b'0' + octet % 10;
        len += 1;
    }
    len
}

impl NameOut for String {
    fn push_text(&mut self, text: &str) {
        self.push_str(text);
    }

    fn written(&self) -> usize {
        self.len()
    }
}

/// Writes the key of one sub-key of a split rule, `prefix:{identity~part}:rule`, or of a whole
/// key when `part` is `None`, after what `out` holds. The part is inside the hash tag, so that a
/// cluster spreads the sub-keys of one identity over its slots; `~` is escaped in text
/// identities, so no identity reads like another's sub-key.
fn write_part_key(
    out: &mut impl NameOut,
    prefix: &str,
    identity: &Key,
    part: Option<u16>,
    rule: &str,
) {
    out.push_text(prefix);
    out.push_text(":{");
    let start = out.written();
    match (identity.as_ip(), identity.as_text()) {
        // The common keys without the formatting machinery: they are written on every check.
        (Some(IpAddr::V4(v4)), _) => out.push_ipv4(v4),
        (_, Some(text)) => out.push_text(text),
        _ => {
            let _ = write!(out, "{identity}");
        }
    }
    if out.written() == start {
        out.push_text("%");
    }
    if let Some(part) = part {
        out.push_text("~");
        let mut digits = crate::decimal::Digits::default();
        out.push_text(std::str::from_utf8(digits.of(u64::from(part))).unwrap_or_default());
    }
    out.push_text("}:");
    out.push_text(rule);
}

/// The key of one charge, as a new string.
pub(crate) fn key_name(prefix: &str, identity: &Key, rule: &str) -> String {
    let mut out = String::with_capacity(longest_name(prefix, identity, None, rule));
    write_part_key(&mut out, prefix, identity, None, rule);
    out
}

/// The length of a key's name at most (exactly, for a text identity of a whole key): an IPv6
/// address is at most 39 characters, `~<part>` 6, the braces and colons 4.
fn longest_name(prefix: &str, identity: &Key, part: Option<u16>, rule: &str) -> usize {
    let identity_len = identity.as_text().map_or(39, str::len);
    let part_len = part.map_or(0, |_| 6);
    prefix.len() + identity_len + part_len + rule.len() + 4
}

/// The bytes a [`KeyName`] holds without an allocation: `prefix:{identity}:rule` with the default
/// prefix, an IPv6 address and a rule name of 19 bytes fits.
const INLINE: usize = 70;

// Its length is a byte.
const _: () = assert!(INLINE < 256);

/// The name of the Redis key a check charges, held inline when it is short (most are), so that
/// writing it allocates nothing; always valid UTF-8.
#[derive(Clone)]
pub(crate) struct KeyName(Repr);

#[derive(Clone)]
enum Repr {
    Inline { len: u8, bytes: [u8; INLINE] },
    Heap(String),
}

impl KeyName {
    /// The key of one charge, of a split rule's sub-key `part` or of the whole key.
    pub(crate) fn new(prefix: &str, identity: &Key, part: Option<u16>, rule: &str) -> Self {
        let longest = longest_name(prefix, identity, part, rule);
        if longest > INLINE && identity.as_text().is_some() {
            // Too long to hold (a hashed identity is 71 bytes alone): one allocation of the
            // room it needs, as a `String` would take.
            let mut name = String::with_capacity(longest);
            write_part_key(&mut name, prefix, identity, part, rule);
            return KeyName(Repr::Heap(name));
        }
        let mut room = Room::default();
        write_part_key(&mut room, prefix, identity, part, rule);
        room.name()
    }

    /// The name's bytes, as they are sent.
    #[inline]
    pub(crate) fn as_bytes(&self) -> &[u8] {
        match &self.0 {
            Repr::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Repr::Heap(name) => name.as_bytes(),
        }
    }

    /// The name as text.
    pub(crate) fn as_str(&self) -> &str {
        // Only whole `str`s are written into it.
        std::str::from_utf8(self.as_bytes()).unwrap_or_default()
    }
}

impl From<&str> for KeyName {
    fn from(name: &str) -> Self {
        let mut room = Room::default();
        room.push_text(name);
        room.name()
    }
}

impl PartialEq for KeyName {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for KeyName {}

impl std::fmt::Debug for KeyName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

impl std::fmt::Display for KeyName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A [`KeyName`] being written: inline until a text does not fit, then all of it on the heap.
struct Room {
    len: usize,
    bytes: [u8; INLINE],
    spilled: Option<String>,
}

impl Default for Room {
    fn default() -> Self {
        Room {
            len: 0,
            bytes: [0; INLINE],
            spilled: None,
        }
    }
}

impl Room {
    /// The name written.
    fn name(self) -> KeyName {
        match self.spilled {
            Some(name) => KeyName(Repr::Heap(name)),
            None => KeyName(Repr::Inline {
                // At most INLINE, which is below 256.
                len: self.len as u8,
                bytes: self.bytes,
            }),
        }
    }
}

// Inlined into `KeyName::new`, which writes five pieces on every check: the calls cost more than
// the short copies (about 120 instructions a check).
impl NameOut for Room {
    #[inline(always)]
    fn push_text(&mut self, text: &str) {
        match &mut self.spilled {
            None if self.len + text.len() <= INLINE => {
                self.bytes[self.len..self.len + text.len()].copy_from_slice(text.as_bytes());
                self.len += text.len();
            }
            None => {
                let mut heap = String::with_capacity(self.len + text.len() + 16);
                // Whole `str`s were written before.
                heap.push_str(std::str::from_utf8(&self.bytes[..self.len]).unwrap_or_default());
                heap.push_str(text);
                self.spilled = Some(heap);
            }
            Some(heap) => heap.push_str(text),
        }
    }

    fn written(&self) -> usize {
        match &self.spilled {
            Some(heap) => heap.len(),
            None => self.len,
        }
    }

    /// Straight into the room when the longest address fits (no copy, no UTF-8 check); near
    /// the room's end, as one text that spills where it must.
    #[inline(always)]
    fn push_ipv4(&mut self, v4: Ipv4Addr) {
        if self.spilled.is_none()
            && let Some(room) = self
                .bytes
                .get_mut(self.len..self.len + IPV4_LONGEST)
                .and_then(|room| <&mut [u8; IPV4_LONGEST]>::try_from(room).ok())
        {
            self.len += write_ipv4(room, v4);
            return;
        }
        push_dotted(self, v4);
    }
}

impl std::fmt::Write for Room {
    fn write_str(&mut self, text: &str) -> std::fmt::Result {
        self.push_text(text);
        Ok(())
    }
}

/// The Redis Cluster slot of a key: CRC16 (XMODEM) of its hash tag (the text between the first
/// `{` and the next `}`, when not empty) or of the whole key, modulo 16384.
pub(crate) fn slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        let close = rest.iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    crc16(tagged.unwrap_or(key)) % SLOTS
}

/// CRC-16/XMODEM (polynomial 0x1021, initial value 0), as Redis Cluster uses it.
fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_names_put_the_identity_in_the_hash_tag() {
        assert_eq!(
            key_name("tollgate", &Key::text("user-1"), "burst"),
            "tollgate:{user-1}:burst"
        );
        assert_eq!(
            key_name("app", &Key::text("a{b}"), "daily"),
            "app:{a%7Bb%7D}:daily"
        );
        assert_eq!(key_name("app", &Key::text(""), "r"), "app:{%}:r");
        assert_eq!(key_name("app", &Key::global(), "r"), "app:{global}:r");
        // The name a check sends is the same, held inline.
        for (identity, expected) in [
            (Key::text("user-1"), "app:{user-1}:r"),
            (Key::text("a{b}"), "app:{a%7Bb%7D}:r"),
            (Key::text(""), "app:{%}:r"),
            (Key::global(), "app:{global}:r"),
        ] {
            assert_eq!(KeyName::new("app", &identity, None, "r").as_str(), expected);
        }
        assert_eq!(
            KeyName::new("app", &Key::text(""), Some(0), "r").as_str(),
            "app:{%~0}:r"
        );
    }

    #[test]
    fn ipv4_key_names_are_the_addresses_as_displayed() {
        // Every octet length, its ends, and the zero octet.
        for octets in [
            [0, 0, 0, 0],
            [9, 10, 99, 100],
            [127, 0, 0, 1],
            [203, 0, 113, 7],
            [255, 255, 255, 255],
            [1, 22, 199, 200],
        ] {
            let ip = IpAddr::from(octets);
            let key = Key::ip(ip);
            assert_eq!(key_name("t", &key, "r"), format!("t:{{{key}}}:r"));
            assert_eq!(key_name("t", &key, "r"), format!("t:{{{ip}}}:r"));
            assert_eq!(
                KeyName::new("t", &key, Some(12), "r").as_str(),
                format!("t:{{{ip}~12}}:r")
            );
            assert_eq!(
                KeyName::new("t", &key, None, "r").as_str(),
                key_name("t", &key, "r")
            );
        }
    }

    #[test]
    fn ipv4_key_names_near_the_end_of_the_room_are_written_whole() {
        // The address goes into the room at once only when its longest form fits; past that,
        // as one text, spilling to the heap where it does not fit.
        for ip in [
            IpAddr::from([1, 2, 3, 4]),
            IpAddr::from([10, 20, 30, 40]),
            IpAddr::from([255, 255, 255, 255]),
        ] {
            let key = Key::ip(ip);
            for prefix_len in 40..=64 {
                let prefix = "p".repeat(prefix_len);
                for rule in ["r", "a-longer-rule-name"] {
                    let expected = format!("{prefix}:{{{ip}}}:{rule}");
                    let name = KeyName::new(&prefix, &key, None, rule);
                    assert_eq!(name.as_str(), expected);
                    // Held inline exactly when it fits, whichever way the address went in.
                    assert_eq!(
                        matches!(name.0, Repr::Inline { .. }),
                        expected.len() <= INLINE,
                        "{expected}"
                    );
                    assert_eq!(key_name(&prefix, &key, rule), expected);
                    assert_eq!(
                        KeyName::new(&prefix, &key, Some(12), rule).as_str(),
                        format!("{prefix}:{{{ip}~12}}:{rule}")
                    );
                }
            }
        }
    }

    #[test]
    fn key_names_too_long_to_hold_inline_are_written_whole() {
        let long = "x".repeat(INLINE);
        let v4 = Key::ip(IpAddr::from([203, 0, 113, 255]));
        // 39 characters, the longest an address is written.
        let v6 = Key::ip(
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"
                .parse::<IpAddr>()
                .unwrap(),
        );
        let hashed = Key::text(format!("sha256:{}", "0".repeat(64)));
        for (prefix, identity, rule, inline) in [
            // Text identities too long to hold go to the heap at once.
            (long.as_str(), Key::text("user-1"), "r", false),
            ("tollgate", Key::text(&long), "r", false),
            ("t", hashed, "r", false),
            ("tollgate", Key::text("user-1"), long.as_str(), false),
            // Exactly the room (70 bytes), and one byte more: spilled at the rule.
            ("tollgate", v6.clone(), "a-rule-of-nineteen-", true),
            ("tollgate", v6.clone(), "a-rule-of-twenty-chr", false),
            // Spilled while the address is written (an IPv6 one, an IPv4 one near the room's
            // end), at the prefix's end, and at the rule.
            (&long[..40], v6, "r", false),
            (&long[..INLINE - 8], v4.clone(), "r", false),
            (long.as_str(), v4.clone(), "r", false),
            ("tollgate", v4, long.as_str(), false),
        ] {
            let expected = key_name(prefix, &identity, rule);
            let name = KeyName::new(prefix, &identity, None, rule);
            assert_eq!(name.as_str(), expected);
            assert_eq!(name.as_bytes(), expected.as_bytes());
            assert_eq!(name, KeyName::from(expected.as_str()));
            assert_eq!(matches!(name.0, Repr::Inline { .. }), inline, "{expected}");
            assert_eq!(
                KeyName::new(prefix, &identity, Some(3), rule).as_str(),
                part_name(prefix, &identity, 3, rule)
            );
        }
    }

    /// A split key's name, written the long way.
    fn part_name(prefix: &str, identity: &Key, part: u16, rule: &str) -> String {
        let whole = key_name(prefix, identity, rule);
        let close = whole.find("}:").unwrap();
        format!("{}~{part}{}", &whole[..close], &whole[close..])
    }

    #[test]
    fn all_rules_of_one_identity_share_a_slot() {
        let key = Key::text("client-42");
        let a = slot(key_name("tollgate", &key, "burst").as_bytes());
        let b = slot(key_name("tollgate", &key, "daily").as_bytes());
        assert_eq!(a, b);
    }

    #[test]
    fn slots_match_the_redis_cluster_specification() {
        // The test vector of the Redis Cluster specification: CRC16("123456789") = 0x31C3.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"{user1000}.following"), slot(b"{user1000}.followers"));
        assert_eq!(slot(b"foo{}{bar}"), slot(b"foo{}{bar}"));
        assert_ne!(slot(b"foo{}{bar}"), slot(b"bar"));
        assert_eq!(slot(b"foo{{bar}}zap"), slot(b"{bar"));
        assert_eq!(slot(b"foo{bar}{zap}"), slot(b"bar"));
    }

    #[test]
    fn prefixes_are_validated() {
        assert!(validate_prefix("tollgate").is_ok());
        assert!(validate_prefix("eu-west:app").is_ok());
        assert!(validate_prefix("").is_err());
        assert!(validate_prefix("a{b").is_err());
        assert!(validate_prefix("a b").is_err());
    }
}
