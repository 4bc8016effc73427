//! Composition: [`combine`] extractors into one key, or take the [`first_of`] several.

use std::fmt::Write;

use http::request::Parts;
use smallvec::SmallVec;

use super::{Extracted, Key, KeyExtractor, KeyFuture};

/// Extractors whose keys are joined into one. Made by [`combine`] or
/// [`KeyExtractorExt::and`].
#[derive(Clone, Debug)]
pub struct Combine<T>(T);

/// Extractors tried in order; the first key found wins. Made by [`first_of`] or
/// [`KeyExtractorExt::or`].
#[derive(Clone, Debug)]
pub struct FirstOf<T>(T);

/// Joins the keys of a tuple of 2 to 6 extractors into one key; no key if any is missing.
pub fn combine<T>(extractors: T) -> Combine<T>
where
    Combine<T>: KeyExtractor,
{
    Combine(extractors)
}

/// The first key found by a tuple of 2 to 6 extractors, tried in order.
pub fn first_of<T>(extractors: T) -> FirstOf<T>
where
    FirstOf<T>: KeyExtractor,
{
    FirstOf(extractors)
}

/// Combinators on every [`KeyExtractor`]: [`and`](KeyExtractorExt::and) joins keys into one
/// (as [`combine`] does), [`or`](KeyExtractorExt::or) takes the first key found (as [`first_of`]
/// does).
///
/// ```
/// use tollgate::key::{ClientIp, FromHeader, FromExtension, Key, KeyExtractor, KeyExtractorExt, Route, combine, first_of};
///
/// #[derive(Clone)]
/// struct UserId(u64);
///
/// // The user, else the API key, else the client IP.
/// let who = first_of((
///     FromExtension::new(|user: &UserId| Some(Key::text(user.0.to_string()))),
///     FromHeader::new("x-api-key").hashed(),
///     ClientIp::new(),
/// ));
/// // Per tenant and route: both must be found.
/// let tenant_route = combine((FromHeader::new("x-tenant"), Route::new()));
/// // The same, as methods.
/// let user_or_ip = FromExtension::new(|user: &UserId| Some(Key::text(user.0.to_string())))
///     .or(ClientIp::new());
/// let ip_route = ClientIp::new().and(Route::new());
///
/// let (mut parts, ()) = http::Request::new(()).into_parts();
/// parts.extensions.insert(UserId(7));
/// assert_eq!(who.extract(&parts).found(), Some(Key::text("7")));
/// assert_eq!(user_or_ip.extract(&parts).found(), Some(Key::text("7")));
/// # let _ = (tenant_route, ip_route);
/// ```
///
/// # Combine
///
/// [`combine`] (or [`and`](KeyExtractorExt::and)) asks every extractor; if any finds no key,
/// the combination has none. The parts are joined with `|` (`acme|/users/%7Bid%7D`); text keys
/// cannot contain a raw `|`, and a part that is itself a combination is hashed, so different
/// parts never give the same key. A long result is hashed like any text key.
///
/// # First of
///
/// [`first_of`] (or [`or`](KeyExtractorExt::or)) returns the first key found, in order. IP keys
/// and the global key come out as they are. Text keys from the second extractor on are tagged
/// with its position (`~1:…`), so that one source cannot name another's keys: a client that
/// sends `X-Api-Key: alice` is not counted as the authenticated user `alice`, and a header
/// value that looks like an address is not the IP key of that address (see [`Key::text`]).
///
/// Extractors are asked in order and the first key wins; when one is asynchronous, those after
/// it are asked at once too (their futures are awaited only if needed).
pub trait KeyExtractorExt: KeyExtractor + Sized {
    /// This key, or when it is missing, `other`'s: `first_of((self, other))`.
    fn or<O: KeyExtractor>(self, other: O) -> FirstOf<(Self, O)> {
        FirstOf((self, other))
    }

    /// This key and `other`'s joined into one: `combine((self, other))`.
    fn and<O: KeyExtractor>(self, other: O) -> Combine<(Self, O)> {
        Combine((self, other))
    }
}

impl<K: KeyExtractor> KeyExtractorExt for K {}

fn combine_all(members: &[&dyn KeyExtractor], parts: &Parts) -> Extracted {
    let mut keys: SmallVec<[Option<Key>; 4]> = SmallVec::new();
    let mut pending: SmallVec<[(usize, KeyFuture); 2]> = SmallVec::new();
    for (i, member) in members.iter().enumerate() {
        match member.extract(parts) {
            Extracted::Missing => return Extracted::Missing,
            Extracted::Found(key) => keys.push(Some(key)),
            Extracted::Pending(future) => {
                keys.push(None);
                pending.push((i, future));
            }
        }
    }
    if pending.is_empty() {
        return Extracted::Found(join(keys.iter().flatten()));
    }
    Extracted::Pending(Box::pin(async move {
        for (i, future) in pending {
            keys[i] = Some(future.await?);
        }
        Some(join(keys.iter().flatten()))
    }))
}

fn join<'a>(keys: impl Iterator<Item = &'a Key>) -> Key {
    let mut out = String::new();
    for (i, key) in keys.enumerate() {
        if i > 0 {
            out.push('|');
        }
        match key.as_text() {
            // A combination inside a combination: its own `|` would be ambiguous.
            Some(text) if text.contains('|') => out.push_str(&Key::digest(text).to_string()),
            Some(text) => out.push_str(text),
            None => {
                let _ = write!(out, "{key}");
            }
        }
    }
    Key::from_escaped(out)
}

enum Step {
    Found(Key),
    Pending(usize, KeyFuture),
}

fn first_of_all(members: &[&dyn KeyExtractor], parts: &Parts) -> Extracted {
    let mut steps: SmallVec<[Step; 2]> = SmallVec::new();
    for (i, member) in members.iter().enumerate() {
        match member.extract(parts) {
            Extracted::Missing => {}
            Extracted::Found(key) => {
                let key = tag(i, key);
                if steps.is_empty() {
                    return Extracted::Found(key);
                }
                steps.push(Step::Found(key));
                break;
            }
            Extracted::Pending(future) => steps.push(Step::Pending(i, future)),
        }
    }
    if steps.is_empty() {
        return Extracted::Missing;
    }
    Extracted::Pending(Box::pin(async move {
        for step in steps {
            match step {
                Step::Found(key) => return Some(key),
                Step::Pending(i, future) => {
                    if let Some(key) = future.await {
                        return Some(tag(i, key));
                    }
                }
            }
        }
        None
    }))
}

/// Tags text keys from the extractor at position `i` (see the module documentation).
fn tag(i: usize, key: Key) -> Key {
    match key.as_text() {
        Some(text) if i > 0 || text.starts_with('~') => Key::from_escaped(format!("~{i}:{text}")),
        _ => key,
    }
}

/// Shared extractors whose keys are joined into one (as [`combine`] does).
pub(crate) struct CombineShared(pub(crate) Vec<super::SharedExtractor>);

/// Shared extractors tried in order (as [`first_of`] does).
pub(crate) struct FirstOfShared(pub(crate) Vec<super::SharedExtractor>);

impl KeyExtractor for CombineShared {
    fn extract(&self, parts: &Parts) -> Extracted {
        let members: SmallVec<[&dyn KeyExtractor; 4]> = self.0.iter().map(|e| &**e).collect();
        combine_all(&members, parts)
    }
}

impl KeyExtractor for FirstOfShared {
    fn extract(&self, parts: &Parts) -> Extracted {
        let members: SmallVec<[&dyn KeyExtractor; 4]> = self.0.iter().map(|e| &**e).collect();
        first_of_all(&members, parts)
    }
}

macro_rules! tuples {
    ($($name:ident $idx:tt),+) => {
        impl<$($name: KeyExtractor),+> KeyExtractor for Combine<($($name,)+)> {
            fn extract(&self, parts: &Parts) -> Extracted {
                combine_all(&[$(&self.0.$idx as &dyn KeyExtractor),+], parts)
            }
        }

        impl<$($name: KeyExtractor),+> KeyExtractor for FirstOf<($($name,)+)> {
            fn extract(&self, parts: &Parts) -> Extracted {
                first_of_all(&[$(&self.0.$idx as &dyn KeyExtractor),+], parts)
            }
        }
    };
}

tuples!(A 0, B 1);
tuples!(A 0, B 1, C 2);
tuples!(A 0, B 1, C 2, D 3);
tuples!(A 0, B 1, C 2, D 3, E 4);
tuples!(A 0, B 1, C 2, D 3, E 4, F 5);

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;
    use crate::key::Global;

    fn text(value: &'static str) -> impl KeyExtractor + Clone {
        move |_: &Parts| Some(Key::text(value))
    }

    fn none() -> impl KeyExtractor + Clone {
        |_: &Parts| None
    }

    fn ip(value: &'static str) -> impl KeyExtractor + Clone {
        move |_: &Parts| Some(Key::ip(value.parse::<IpAddr>().unwrap()))
    }

    fn run(extractor: &impl KeyExtractor) -> Option<Key> {
        let (parts, ()) = http::Request::new(()).into_parts();
        match extractor.extract(&parts) {
            Extracted::Found(key) => Some(key),
            Extracted::Missing => None,
            Extracted::Pending(future) => futures_lite(future),
        }
    }

    fn futures_lite(future: KeyFuture) -> Option<Key> {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(future)
    }

    fn later(value: Option<&'static str>) -> impl KeyExtractor + Clone {
        crate::key::async_fn(move |_: &Parts| async move { value.map(Key::text) })
    }

    #[test]
    fn combine_joins_or_misses() {
        let k = run(&combine((text("acme"), ip("192.0.2.1"), Global))).unwrap();
        assert_eq!(k.to_string(), "acme|192.0.2.1|global");
        assert_eq!(run(&combine((text("acme"), none()))), None);
        assert_ne!(
            run(&text("a|b").and(text("c"))),
            run(&text("a").and(text("b|c")))
        );
    }

    #[test]
    fn nested_combinations_stay_distinct() {
        let nested = run(&text("a").and(text("b")).and(text("c"))).unwrap();
        assert!(nested.to_string().starts_with("sha256:"), "{nested}");
        assert!(nested.to_string().ends_with("|c"), "{nested}");
        let long = run(&combine((text("x"), move |_: &Parts| {
            Some(Key::text("y".repeat(127)))
        })))
        .unwrap();
        assert_eq!(long.to_string().len(), 71);
    }

    #[test]
    fn first_of_tags_later_text_keys_only() {
        assert_eq!(
            run(&first_of((text("alice"), text("bob")))),
            Some(Key::text("alice"))
        );
        let later_text = run(&first_of((none(), text("alice")))).unwrap();
        assert_eq!(later_text.to_string(), "~1:alice");
        assert_ne!(later_text, Key::text("alice"));
        assert_eq!(
            run(&none().or(ip("192.0.2.1"))),
            Some(Key::ip("192.0.2.1".parse().unwrap()))
        );
        assert_eq!(run(&none().or(Global)), Some(Key::global()));
        assert_eq!(run(&first_of((none(), none(), none()))), None);
        // A first key that starts with the tag character is tagged too.
        let nested = run(&none().or(text("x")).or(text("y"))).unwrap();
        assert_eq!(nested.to_string(), "~0:~1:x");
        assert_ne!(nested, run(&none().or(none()).or(text("~1:x"))).unwrap());
    }

    #[test]
    fn asynchronous_members() {
        assert_eq!(
            run(&later(Some("a")).and(text("b"))).unwrap().to_string(),
            "a|b"
        );
        assert_eq!(run(&later(None).and(text("b"))), None);
        assert_eq!(
            run(&first_of((later(None), later(Some("b")), text("c"))))
                .unwrap()
                .to_string(),
            "~1:b"
        );
        assert_eq!(
            run(&first_of((later(None), none(), text("c"))))
                .unwrap()
                .to_string(),
            "~2:c"
        );
        assert_eq!(
            run(&first_of((later(Some("a")), text("c")))),
            Some(Key::text("a"))
        );
        assert_eq!(run(&later(None).or(later(None))), None);
    }
}
