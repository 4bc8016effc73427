//! Finding the field: which bodies are read, and the top-level member of a JSON object or the
//! field of a form, normalised into a key.

use std::collections::VecDeque;
use std::fmt;

use bytes::Bytes;
use http::HeaderMap;
use http::header::{CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE};
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::key::Key;

/// What one [`BodyKeyLayer`](super::BodyKeyLayer) looks for.
#[derive(Clone, Debug)]
pub(super) struct Config {
    pub(super) field: Box<str>,
    pub(super) limit: usize,
    pub(super) normalize: Normalize,
    pub(super) hashed: bool,
}

/// How a field's value is normalised before it becomes a key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Normalize {
    /// Trimmed and lowercased (the default): `" Alice@Example.COM "` and `"alice@example.com"`
    /// are one account.
    #[default]
    Email,
    /// Whitespace trimmed from both ends.
    Trim,
    /// The value as it is.
    Exact,
}

impl Normalize {
    pub(super) fn apply(self, value: &str) -> String {
        match self {
            Normalize::Email => value.trim().to_lowercase(),
            Normalize::Trim => value.trim().to_owned(),
            Normalize::Exact => value.to_owned(),
        }
    }
}

/// What a body is, for finding the field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Json,
    Form,
}

pub(super) fn content_kind(headers: &HeaderMap) -> Option<Kind> {
    let encoded = headers
        .get(CONTENT_ENCODING)
        .is_some_and(|e| !e.as_bytes().trim_ascii().eq_ignore_ascii_case(b"identity"));
    if encoded {
        return None;
    }
    let value = headers.get(CONTENT_TYPE)?.to_str().ok()?;
    let essence = value.split(';').next()?.trim();
    let (kind, subtype) = essence.split_once('/')?;
    if !kind.eq_ignore_ascii_case("application") {
        return None;
    }
    let json_suffix = subtype.len() > 5
        && subtype.is_char_boundary(subtype.len() - 5)
        && subtype[subtype.len() - 5..].eq_ignore_ascii_case("+json");
    if subtype.eq_ignore_ascii_case("json") || json_suffix {
        Some(Kind::Json)
    } else if subtype.eq_ignore_ascii_case("x-www-form-urlencoded") {
        Some(Kind::Form)
    } else {
        None
    }
}

pub(super) fn declared_len(headers: &HeaderMap) -> u64 {
    headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

pub(super) fn find(config: &Config, kind: Kind, chunks: &VecDeque<Bytes>) -> Option<Key> {
    let joined;
    let bytes: &[u8] = match chunks.len() {
        0 => &[],
        1 => &chunks[0],
        _ => {
            joined = chunks
                .iter()
                .flat_map(|c| c.iter().copied())
                .collect::<Vec<u8>>();
            &joined
        }
    };
    let value = match kind {
        Kind::Json => json_field(bytes, &config.field)?,
        Kind::Form => form_field(bytes, &config.field)?,
    };
    let value = config.normalize.apply(&value);
    if value.is_empty() {
        return None;
    }
    Some(if config.hashed {
        Key::digest(value)
    } else {
        Key::text(value)
    })
}

/// The top-level member `field` of a JSON object: a string, or a number as written.
fn json_field(bytes: &[u8], field: &str) -> Option<String> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = FieldOf(field).deserialize(&mut de).ok()?;
    de.end().ok()?;
    value
}

/// The value of the form field `field`, if it occurs exactly once.
fn form_field(bytes: &[u8], field: &str) -> Option<String> {
    let mut found = None;
    for (name, value) in form_urlencoded::parse(bytes) {
        if name == field {
            if found.is_some() {
                return None;
            }
            found = Some(value.into_owned());
        }
    }
    found
}

/// Finds a member of a JSON object; `None` when absent, repeated or not a scalar.
struct FieldOf<'f>(&'f str);

impl<'de> DeserializeSeed<'de> for FieldOf<'_> {
    type Value = Option<String>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for FieldOf<'_> {
    type Value = Option<String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found: Option<Option<String>> = None;
        let mut repeated = false;
        while let Some(is_field) = map.next_key_seed(NameIs(self.0))? {
            if is_field {
                let value = map.next_value::<Scalar>()?.0;
                repeated |= found.is_some();
                found = Some(value);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(if repeated { None } else { found.flatten() })
    }
}

/// Whether an object member's name is the field's.
struct NameIs<'f>(&'f str);

impl<'de> DeserializeSeed<'de> for NameIs<'_> {
    type Value = bool;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for NameIs<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a member name")
    }

    fn visit_str<E: de::Error>(self, name: &str) -> Result<bool, E> {
        Ok(name == self.0)
    }
}

/// A string or number as text; anything else (consumed) as `None`.
struct Scalar(Option<String>);

impl<'de> de::Deserialize<'de> for Scalar {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ScalarVisitor)
    }
}

struct ScalarVisitor;

impl<'de> Visitor<'de> for ScalarVisitor {
    type Value = Scalar;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Scalar, E> {
        Ok(Scalar(Some(v.to_owned())))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Scalar, E> {
        Ok(Scalar(Some(v.to_string())))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Scalar, E> {
        Ok(Scalar(Some(v.to_string())))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Scalar, E> {
        Ok(Scalar(None))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Scalar, E> {
        Ok(Scalar(None))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Scalar, E> {
        Ok(Scalar(None))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Scalar, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Scalar(None))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Scalar, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Scalar(None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_fields() {
        let f = |body: &str| json_field(body.as_bytes(), "email");
        assert_eq!(
            f(r#"{"email":"a@b.c","password":"x"}"#),
            Some("a@b.c".into())
        );
        assert_eq!(
            f(r#"{"x":{"email":"no"},"email":"yes"}"#),
            Some("yes".into())
        );
        assert_eq!(f(r#"{"em\u0061il":"escaped"}"#), Some("escaped".into()));
        assert_eq!(f(r#"{"email":12}"#), Some("12".into()));
        assert_eq!(f(r#"{"email":"a","email":"b"}"#), None);
        assert_eq!(f(r#"{"email":null}"#), None);
        assert_eq!(f(r#"{"email":["a"]}"#), None);
        assert_eq!(f(r#"{"other":"a"}"#), None);
        assert_eq!(f(r#"["email","a"]"#), None);
        assert_eq!(f(r#"{"email":"a"} trailing"#), None);
        assert_eq!(f(r#"{"email":"a""#), None);
        assert_eq!(f(""), None);
    }

    #[test]
    fn form_fields() {
        let f = |body: &str| form_field(body.as_bytes(), "email");
        assert_eq!(f("email=a%40b.c&password=x"), Some("a@b.c".into()));
        assert_eq!(f("password=x&email=A+B"), Some("A B".into()));
        assert_eq!(f("email=a&email=b"), None);
        assert_eq!(f("e-mail=a"), None);
    }

    #[test]
    fn content_kinds() {
        let kind = |ct: &str, enc: Option<&str>| {
            let mut headers = HeaderMap::new();
            headers.insert(CONTENT_TYPE, ct.parse().unwrap());
            if let Some(enc) = enc {
                headers.insert(CONTENT_ENCODING, enc.parse().unwrap());
            }
            content_kind(&headers)
        };
        assert_eq!(kind("application/json", None), Some(Kind::Json));
        assert_eq!(
            kind("Application/JSON; charset=utf-8", None),
            Some(Kind::Json)
        );
        assert_eq!(kind("application/vnd.api+json", None), Some(Kind::Json));
        assert_eq!(
            kind("application/x-www-form-urlencoded", None),
            Some(Kind::Form)
        );
        assert_eq!(kind("application/json", Some("identity")), Some(Kind::Json));
        assert_eq!(kind("application/json", Some("gzip")), None);
        assert_eq!(kind("text/plain", None), None);
        assert_eq!(kind("multipart/form-data; boundary=x", None), None);
        assert_eq!(kind("json", None), None);
    }

    #[test]
    fn normalisation() {
        assert_eq!(
            Normalize::Email.apply("  Alice@Example.COM\t"),
            "alice@example.com"
        );
        assert_eq!(Normalize::Trim.apply(" Bob "), "Bob");
        assert_eq!(Normalize::Exact.apply(" Bob "), " Bob ");
    }
}
