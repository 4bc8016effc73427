//! Key names: `prefix:{identity}:rule`, and the Redis Cluster slot of a key.

use std::fmt::Write as _;
use std::net::IpAddr;

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
    write_part_key(out, prefix, identity, None, rule);
}

/// Writes the key of one sub-key of a split rule, `prefix:{identity~part}:rule`, or of a whole
/// key when `part` is `None`. The part is inside the hash tag, so that a cluster spreads the
/// sub-keys of one identity over its slots; `~` is escaped in text identities, so no identity
/// reads like another's sub-key.
fn write_part_key(out: &mut String, prefix: &str, identity: &Key, part: Option<u16>, rule: &str) {
    out.clear();
    out.push_str(prefix);
    out.push_str(":{");
    let start = out.len();
    match (identity.as_ip(), identity.as_text()) {
        // The common keys without the formatting machinery: they are written on every check.
        (Some(IpAddr::V4(v4)), _) => {
            // Digit by digit into the room reserved: no formatting, no UTF-8 check.
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push('.');
                }
                if octet >= 100 {
                    out.push(char::from(b'0' + octet / 100));
                }
                if octet >= 10 {
                    out.push(char::from(b'0' + octet / 10 % 10));
                }
                out.push(char::from(b'0' + octet % 10));
            }
        }
        (_, Some(text)) => out.push_str(text),
        _ => {
            let _ = write!(out, "{identity}");
        }
    }
    if out.len() == start {
        out.push('%');
    }
    if let Some(part) = part {
        out.push('~');
        let mut digits = crate::decimal::Digits::default();
        out.push_str(std::str::from_utf8(digits.of(u64::from(part))).unwrap_or_default());
    }
    out.push_str("}:");
    out.push_str(rule);
}

/// The key of one charge, as a new string.
pub(crate) fn key_name(prefix: &str, identity: &Key, rule: &str) -> String {
    part_key_name(prefix, identity, None, rule)
}

/// The key of one charge of a sub-key (or the whole key), as a new string.
pub(crate) fn part_key_name(prefix: &str, identity: &Key, part: Option<u16>, rule: &str) -> String {
    // IPv6 addresses are at most 39 characters; "~<part>" and the braces at most 9.
    let identity_len = identity.as_text().map_or(39, str::len);
    let mut out = String::with_capacity(prefix.len() + rule.len() + identity_len + 12);
    write_part_key(&mut out, prefix, identity, part, rule);
    out
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
                part_key_name("t", &key, Some(12), "r"),
                format!("t:{{{ip}~12}}:r")
            );
        }
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
