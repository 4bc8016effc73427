//! The `RateLimit` and `RateLimit-Policy` fields of draft-ietf-httpapi-ratelimit-headers-11,
//! read as the Lists of RFC 9651 (Structured Field Values) that they are, with the `sfv`
//! crate's parser.
//!
//! A field's lines are joined with `", "` and parsed as one List (RFC 9651 §4.2). A field that
//! does not parse, in any of its parts (a trailing comma or semicolon, an empty member, an
//! unterminated string or inner list, a bad escape, `?2`, an Integer of 16 digits, a Decimal of
//! 4 fractional digits, an empty parameter key…), is ignored whole: draft-11 says a malformed
//! field MUST be ignored, and RFC 9651 fails the whole field. What a field does not understand
//! and that parses (an inner list, a member that is not a String or a Token, a parameter of
//! another name, or a number parameter that is not a non-negative Integer) is skipped, the
//! rest of it kept.

use std::borrow::Cow;
use std::convert::Infallible;

use http::{HeaderMap, HeaderValue};
use sfv::visitor::ParameterVisitor;
use sfv::visitor::{EntryVisitor, Ignored, InnerListVisitor, ItemVisitor, ListVisitor};
use sfv::{BareItemFromInput, KeyRef};
use smallvec::SmallVec;

/// The most policies read from one field, those a target remembers: the first ones (the rest
/// is still parsed, so that a malformed field is ignored whatever its length).
const MAX_POLICIES: usize = super::MAX_NAMES;

/// The numbers of one policy of a `RateLimit` or `RateLimit-Policy` field: `r` and `t`, or `q`
/// and `w`; `None` where absent or not a non-negative Integer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Numbers {
    pub(crate) r: Option<u64>,
    pub(crate) t: Option<u64>,
    pub(crate) q: Option<u64>,
    pub(crate) w: Option<u64>,
}

/// One policy a field names: a member whose value is a String or a Token (draft-11), and its
/// numbers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Policy<'a> {
    /// The String's text (its escapes undone) or the Token.
    pub(crate) name: Cow<'a, str>,
    pub(crate) numbers: Numbers,
}

impl Policy<'_> {
    fn into_owned<'b>(self) -> Policy<'b> {
        Policy {
            name: Cow::Owned(self.name.into_owned()),
            numbers: self.numbers,
        }
    }
}

/// The policies of one field, in the order the field names them.
pub(crate) type Policies<'a> = SmallVec<[Policy<'a>; 2]>;

/// Reads the field `name` of `headers`: its policies, none when it is absent or malformed.
pub(crate) fn read<'a>(headers: &'a HeaderMap, name: &str) -> Policies<'a> {
    list(headers.get_all(name).iter().map(HeaderValue::as_bytes)).unwrap_or_default()
}

/// Parses the lines of one field as an RFC 9651 List, joined with `", "`: its policies (none
/// for no line), `None` when it does not parse.
pub(crate) fn list<'a>(lines: impl IntoIterator<Item = &'a [u8]>) -> Option<Policies<'a>> {
    let mut lines = lines.into_iter();
    let Some(first) = lines.next() else {
        return Some(Policies::new());
    };
    let Some(second) = lines.next() else {
        // One line, the usual case: names borrowed from it, nothing copied.
        return parse(first);
    };
    let mut joined = Vec::with_capacity(first.len() + 2 + second.len());
    joined.extend_from_slice(first);
    for line in std::iter::once(second).chain(lines) {
        joined.extend_from_slice(b", ");
        joined.extend_from_slice(line);
    }
    let policies = parse(&joined)?;
    Some(policies.into_iter().map(Policy::into_owned).collect())
}

fn parse(input: &[u8]) -> Option<Policies<'_>> {
    sfv::Parser::new(input)
        .parse_list_with_visitor(Members {
            policies: Policies::new(),
        })
        .ok()
}

/// Collects the policies of a List as the parser visits it.
struct Members<'de> {
    policies: Policies<'de>,
}

impl<'de> ListVisitor<'de> for Members<'de> {
    type Out = Policies<'de>;
    type Error = Infallible;

    fn entry(&mut self) -> Result<impl EntryVisitor<'de>, Self::Error> {
        // Past the bound, a member is parsed and not kept.
        Ok((self.policies.len() < MAX_POLICIES).then_some(Member {
            policies: &mut self.policies,
        }))
    }

    fn finish(self) -> Result<Self::Out, Self::Error> {
        Ok(self.policies)
    }
}

/// One member of the List, kept if it names a policy.
struct Member<'a, 'de> {
    policies: &'a mut Policies<'de>,
}

impl<'de> EntryVisitor<'de> for Member<'_, 'de> {
    type Error = Infallible;

    fn item(self) -> Result<impl ItemVisitor<'de>, Self::Error> {
        Ok(self)
    }

    fn inner_list(self) -> Result<impl InnerListVisitor<'de>, Self::Error> {
        // An inner list names no policy: parsed, and skipped.
        Ok(Ignored)
    }
}

impl<'de, 'a> ItemVisitor<'de> for Member<'a, 'de> {
    type Out = ();
    type Error = Infallible;

    fn bare_item(
        self,
        bare_item: BareItemFromInput<'de>,
    ) -> Result<impl ParameterVisitor<'de, Out = ()>, Self::Error> {
        let name = match bare_item {
            BareItemFromInput::String(Cow::Borrowed(text)) => Some(Cow::Borrowed(text.as_str())),
            BareItemFromInput::String(Cow::Owned(text)) => Some(Cow::Owned(String::from(text))),
            BareItemFromInput::Token(token) => Some(Cow::Borrowed(token.as_str())),
            _ => None,
        };
        Ok(Parameters {
            policies: self.policies,
            policy: name.map(|name| Policy {
                name,
                numbers: Numbers::default(),
            }),
        })
    }
}

/// The parameters of a member: a policy's numbers, kept once the member has parsed.
struct Parameters<'a, 'de> {
    policies: &'a mut Policies<'de>,
    /// The policy the member names; `None` for a member that names none.
    policy: Option<Policy<'de>>,
}

impl<'de> ParameterVisitor<'de> for Parameters<'_, 'de> {
    type Out = ();
    type Error = Infallible;

    fn parameter(
        &mut self,
        key: &'de KeyRef,
        value: BareItemFromInput<'de>,
    ) -> Result<(), Self::Error> {
        let Some(policy) = &mut self.policy else {
            return Ok(());
        };
        // The last of a repeated parameter wins (RFC 9651 §4.2.3.2), whatever its type.
        let number = value
            .as_integer()
            .and_then(|n| u64::try_from(i64::from(n)).ok());
        let numbers = &mut policy.numbers;
        match key.as_str() {
            "r" => numbers.r = number,
            "t" => numbers.t = number,
            "q" => numbers.q = number,
            "w" => numbers.w = number,
            _ => {}
        }
        Ok(())
    }

    fn finish(self) -> Result<Self::Out, Self::Error> {
        if let Some(policy) = self.policy {
            self.policies.push(policy);
        }
        Ok(())
    }
}

#[cfg(test)]
mod vectors;

#[cfg(test)]
mod tests {
    use super::*;

    fn one(line: &str) -> Option<Policies<'_>> {
        list([line.as_bytes()])
    }

    fn names<'a>(policies: &'a Policies<'_>) -> Vec<&'a str> {
        policies.iter().map(|p| p.name.as_ref()).collect()
    }

    #[test]
    fn a_field_s_policies_and_their_numbers() {
        let policies = one(r#""a";r=3;t=12, b;q=100;w=60;qu="requests", "c\"d";r=0"#).unwrap();
        assert_eq!(names(&policies), ["a", "b", "c\"d"]);
        assert_eq!(
            policies[0].numbers,
            Numbers {
                r: Some(3),
                t: Some(12),
                ..Numbers::default()
            }
        );
        assert_eq!(
            policies[1].numbers,
            Numbers {
                q: Some(100),
                w: Some(60),
                ..Numbers::default()
            }
        );
        // A `;` or a `,` inside a name is the name's.
        let policies = one(r#""a;r=0, b";r=4;t=9"#).unwrap();
        assert_eq!(names(&policies), ["a;r=0, b"]);
        assert_eq!(policies[0].numbers.r, Some(4));
    }

    #[test]
    fn what_names_no_policy_or_is_no_number_is_skipped_and_the_rest_kept() {
        let policies =
            one(r#"1, (a b);r=0, ?1;r=0, "p";r=-1;t=1.5;w=?1;q="5";pk=:AQ==:, "x";r=0;t=4"#)
                .unwrap();
        assert_eq!(names(&policies), ["p", "x"]);
        assert_eq!(policies[0].numbers, Numbers::default());
        assert_eq!(policies[1].numbers.t, Some(4));
        // The last of a repeated parameter wins, even one that is not a number.
        let policies = one(r#""p";r=0;r=2, "q";t=5;t=1.0"#).unwrap();
        assert_eq!(policies[0].numbers.r, Some(2));
        assert_eq!(policies[1].numbers.t, None);
    }

    #[test]
    fn a_malformed_field_is_none_whole() {
        for line in [
            r#""p";r=0;t=60,"#,
            r#""p";r=0;t=60;"#,
            r#""p";r=0;t=60, , "q";r=1"#,
            r#""p";r=0;t=60, "q"#,
            r#""p";r=0;t=60, ("q" "r""#,
            r#""p";r=0;t=60, "q\x""#,
            r#""p";r=0;t=60, ?2"#,
            r#""p";r=0;t=60, 1234567890123456"#,
            r#""p";r=0;t=60, 1.2345"#,
            r#""p";r=0;t=60, "q";=1"#,
            r#""p";r=0;t=60, "q";R=1"#,
            "\"p\";r=0;t=60, \"caf\u{e9}\"",
        ] {
            assert_eq!(one(line), None, "{line}");
        }
        assert_eq!(
            list([&b"\"p\";r=0;t=60"[..], b"\"q\";r=1;"]),
            None,
            "a malformed second line"
        );
    }

    #[test]
    fn lines_are_joined_as_one_list() {
        let policies = list([&b"\"a\";r=1"[..], b"b;r=2, \"c\\\\\";r=3"]).unwrap();
        assert_eq!(names(&policies), ["a", "b", "c\\"]);
        assert_eq!(policies[2].numbers.r, Some(3));
        assert_eq!(list(std::iter::empty()), Some(Policies::new()));
        assert_eq!(one(""), Some(Policies::new()), "an empty List");
        // Joined, an empty line is a trailing comma.
        assert_eq!(list([&b"\"a\";r=1"[..], b""]), None);
    }

    #[test]
    fn the_policies_kept_are_bounded_and_the_rest_still_parsed() {
        let many: Vec<String> = (0..40).map(|n| format!("\"p{n}\";r={n}")).collect();
        let field = many.join(", ");
        let policies = one(&field).unwrap();
        assert_eq!(policies.len(), MAX_POLICIES);
        assert_eq!(policies[MAX_POLICIES - 1].name, "p15");
        assert_eq!(one(&format!("{field}, ?2")), None);
    }
}
