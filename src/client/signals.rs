//! What a server says about when to come back, read from a response's head or trailers:
//! `Retry-After` (RFC 9110 §10.2.3, on a 429 or a 503), the `RateLimit` field of
//! draft-ietf-httpapi-ratelimit-headers-11 (each policy's `r` and `t`, as [`fields`](super::fields)
//! reads them), gRPC's
//! `grpc-retry-pushback-ms`, and a `google.rpc.RetryInfo` in `grpc-status-details-bin`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, StatusCode};

use super::fields::{Numbers, Policy};
use crate::clock::{MONTHS, unix_seconds};

/// The longest wait a server may announce and be believed: a day. A longer one (a
/// misconfigured or hostile server, draft-11 §8.5.1) is capped to it.
pub const MAX_ANNOUNCED_WAIT: Duration = Duration::from_secs(24 * 60 * 60);

/// What an answer says about a scope's wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Word {
    /// Nothing about it (a refusal without a time, a gRPC status still to come, `r` without
    /// `t`): a known wait stays.
    Nothing,
    /// No wait: a call was served, or a policy has budget.
    Go,
    /// Wait this long from now (at most [`MAX_ANNOUNCED_WAIT`]).
    Wait(Duration),
}

impl Word {
    /// The word of both: the longer wait, else `Go` if either says it.
    fn and(self, other: Word) -> Word {
        match (self, other) {
            (Word::Wait(a), Word::Wait(b)) => Word::Wait(a.max(b)),
            (Word::Wait(w), _) | (_, Word::Wait(w)) => Word::Wait(w),
            (Word::Go, _) | (_, Word::Go) => Word::Go,
            _ => Word::Nothing,
        }
    }

    fn wait(wait: Option<Duration>) -> Word {
        wait.map_or(Word::Nothing, |w| Word::Wait(w.min(MAX_ANNOUNCED_WAIT)))
    }
}

/// What an answer's head says of the call's target: `Retry-After` of a 429 or a 503, or the
/// status of a trailers-only gRPC answer.
pub(crate) fn said_of_target(status: StatusCode, headers: &HeaderMap) -> Word {
    let http =
        if status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE {
            Word::wait(
                headers
                    .get(http::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(retry_after),
            )
        } else if crate::wire::is_grpc(headers) {
            // Served over HTTP; the call's own status is in the head or the trailers.
            Word::Nothing
        } else {
            Word::Go
        };
    match said_by_grpc(headers) {
        Some(grpc) => http.and(grpc),
        None => http,
    }
}

/// What a gRPC status says (in a trailers-only answer's head, or in trailers), `None` without
/// one: `RESOURCE_EXHAUSTED` or `UNAVAILABLE` waits its pushback, else its `RetryInfo`; any
/// other status says the call was answered.
pub(crate) fn said_by_grpc(headers: &HeaderMap) -> Option<Word> {
    let status = headers.get("grpc-status")?.as_bytes();
    if status != b"8" && status != b"14" {
        return Some(Word::Go);
    }
    Some(Word::wait(wait_of_grpc(headers)))
}

/// The wait of a refusing gRPC status: its pushback, or its `RetryInfo`, the longer of both.
pub(crate) fn wait_of_grpc(headers: &HeaderMap) -> Option<Duration> {
    let pushback = headers
        .get("grpc-retry-pushback-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_millis);
    let info = headers
        .get("grpc-status-details-bin")
        .and_then(|v| crate::wire::base64_decode(v.as_bytes()))
        .and_then(|status| retry_info(&status));
    longest(pushback, info).map(|w| w.min(MAX_ANNOUNCED_WAIT))
}

fn longest(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// A `Retry-After` value: delay-seconds, or an HTTP-date (IMF-fixdate) from now.
pub(crate) fn retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = imf_fixdate(value)?;
    let now = SystemTime::now().duration_since(UNIX_EPOCH).ok()?;
    Some(at.saturating_sub(now))
}

/// An IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`), as a time since the Unix epoch.
fn imf_fixdate(value: &str) -> Option<Duration> {
    let b = value.as_bytes();
    if b.len() != 29 || &b[3..5] != b", " || &b[25..] != b" GMT" {
        return None;
    }
    let number = |from: usize, len: usize| -> Option<u64> {
        let text = value.get(from..from + len)?;
        text.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| text.parse().ok())?
    };
    let day = number(5, 2)?;
    let month = MONTHS.iter().position(|m| value.get(8..11) == Some(*m))? as u64 + 1;
    let year = number(12, 4)?;
    let (hour, minute, second) = (number(17, 2)?, number(20, 2)?, number(23, 2)?);
    if b[7] != b' ' || b[11] != b' ' || b[16] != b' ' || b[19] != b':' || b[22] != b':' {
        return None;
    }
    unix_seconds(year, month, day, hour, minute, second).map(Duration::from_secs)
}

/// What each policy of a `RateLimit` field says (any answer may say it): `r=0` and a `t` waits
/// `t` seconds, `r` above 0 (or `t=0`) has budget now, `r=0` without a `t` says nothing.
pub(crate) fn policies<'a>(field: &'a [Policy<'_>]) -> impl Iterator<Item = (&'a str, Word)> {
    field.iter().map(|policy| {
        let Numbers { r, t, .. } = policy.numbers;
        let word = match (r, t) {
            (Some(0), Some(0)) => Word::Go,
            (Some(0), Some(t)) => Word::wait(Some(Duration::from_secs(t))),
            (Some(0), None) | (None, _) => Word::Nothing,
            (Some(_), _) => Word::Go,
        };
        (policy.name.as_ref(), word)
    })
}

/// One protobuf field: its number and its value (a varint, or length-delimited bytes).
enum Field<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
}

/// The fields of a protobuf message (varints and length-delimited ones; others end it).
fn fields(mut message: &[u8]) -> impl Iterator<Item = (u64, Field<'_>)> {
    std::iter::from_fn(move || {
        let key = varint(&mut message)?;
        let field = match key & 7 {
            0 => Field::Varint(varint(&mut message)?),
            2 => {
                let len = usize::try_from(varint(&mut message)?).ok()?;
                let (bytes, rest) = message.split_at_checked(len)?;
                message = rest;
                Field::Bytes(bytes)
            }
            _ => return None,
        };
        Some((key >> 3, field))
    })
}

fn varint(bytes: &mut &[u8]) -> Option<u64> {
    let mut n = 0u64;
    for shift in (0..64).step_by(7) {
        let (&byte, rest) = bytes.split_first()?;
        *bytes = rest;
        n |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(n);
        }
    }
    None
}

/// The delay of the `google.rpc.RetryInfo` among a `google.rpc.Status`'s details.
fn retry_info(status: &[u8]) -> Option<Duration> {
    const RETRY_INFO: &[u8] = b"type.googleapis.com/google.rpc.RetryInfo";
    for (number, field) in fields(status) {
        // google.rpc.Status: 3 = details (google.protobuf.Any: 1 = type_url, 2 = value).
        let (3, Field::Bytes(any)) = (number, field) else {
            continue;
        };
        let mut type_url = None;
        let mut value = None;
        for (number, field) in fields(any) {
            match (number, field) {
                (1, Field::Bytes(url)) => type_url = Some(url),
                (2, Field::Bytes(bytes)) => value = Some(bytes),
                _ => {}
            }
        }
        if type_url != Some(RETRY_INFO) {
            continue;
        }
        // RetryInfo: 1 = retry_delay (google.protobuf.Duration: 1 = seconds, 2 = nanos, both
        // signed; the last of a repeated field wins). A negative delay asks no wait.
        let (mut seconds, mut nanos) = (0i64, 0i64);
        for (number, field) in fields(value.unwrap_or_default()) {
            if let (1, Field::Bytes(duration)) = (number, field) {
                for (number, field) in fields(duration) {
                    match (number, field) {
                        (1, Field::Varint(n)) => seconds = n as i64,
                        (2, Field::Varint(n)) => nanos = i64::from(n as i32),
                        _ => {}
                    }
                }
            }
        }
        if seconds < 0 || !(0..=999_999_999).contains(&nanos) {
            return None;
        }
        return Some(Duration::new(seconds as u64, nanos as u32));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_in_seconds_and_as_a_date() {
        assert_eq!(retry_after("12"), Some(Duration::from_secs(12)));
        assert_eq!(
            imf_fixdate("Sun, 06 Nov 1994 08:49:37 GMT"),
            Some(Duration::from_secs(784_111_777))
        );
        assert_eq!(
            retry_after("Sun, 06 Nov 1994 08:49:37 GMT"),
            Some(Duration::ZERO)
        );
        assert_eq!(retry_after("soon"), None);
        assert_eq!(imf_fixdate("Sun, 36 Nov 1994 08:49:37 GMT"), None);
    }

    fn said(field: &str) -> Vec<(String, Word)> {
        let read = super::super::fields::list([field.as_bytes()]).unwrap_or_default();
        policies(&read)
            .map(|(name, word)| (name.to_owned(), word))
            .collect()
    }

    fn named(said: &[(&str, Word)]) -> Vec<(String, Word)> {
        said.iter().map(|(n, w)| ((*n).to_owned(), *w)).collect()
    }

    #[test]
    fn the_policies_of_the_ratelimit_field_and_what_each_says() {
        let wait = |s| Word::Wait(Duration::from_secs(s));
        assert_eq!(said(r#""a";r=0;t=12"#), named(&[("a", wait(12))]));
        assert_eq!(
            said(r#""a";r=3;t=12, "b";r=0;t=5"#),
            named(&[("a", Word::Go), ("b", wait(5))])
        );
        assert_eq!(
            said(r#""slots";r=0"#),
            named(&[("slots", Word::Nothing)]),
            "no window: no time to wait"
        );
        assert_eq!(said(r#""x";r=0;t=0"#), named(&[("x", Word::Go)]));
        assert_eq!(said("token;r=0;t=7"), named(&[("token", wait(7))]));
        assert_eq!(said("garbage"), named(&[("garbage", Word::Nothing)]));
        assert_eq!(
            said(r#""a";r=0;t=5, "unclosed;r=0;t=5"#),
            named(&[]),
            "malformed"
        );
        assert_eq!(
            said(r#""big";r=0;t=99999999999"#),
            named(&[("big", Word::Wait(MAX_ANNOUNCED_WAIT))])
        );
    }

    #[test]
    fn what_a_head_says_of_its_target() {
        let mut headers = HeaderMap::new();
        headers.insert("retry-after", "7".parse().unwrap());
        let seven = Word::Wait(Duration::from_secs(7));
        assert_eq!(
            said_of_target(StatusCode::TOO_MANY_REQUESTS, &headers),
            seven
        );
        assert_eq!(
            said_of_target(StatusCode::SERVICE_UNAVAILABLE, &headers),
            seven
        );
        assert_eq!(
            said_of_target(StatusCode::OK, &headers),
            Word::Go,
            "Retry-After of a 200 asks no wait"
        );
        headers.remove("retry-after");
        assert_eq!(
            said_of_target(StatusCode::TOO_MANY_REQUESTS, &headers),
            Word::Nothing
        );
        // A gRPC answer's status is in its head (trailers-only) or to come in its trailers.
        headers.insert("content-type", "application/grpc".parse().unwrap());
        assert_eq!(said_of_target(StatusCode::OK, &headers), Word::Nothing);
        headers.insert("grpc-status", "0".parse().unwrap());
        assert_eq!(said_of_target(StatusCode::OK, &headers), Word::Go);
        headers.insert("grpc-status", "8".parse().unwrap());
        headers.insert("grpc-retry-pushback-ms", "7000".parse().unwrap());
        assert_eq!(said_of_target(StatusCode::OK, &headers), seven);
    }

    #[test]
    fn grpc_pushback_and_retry_info() {
        let mut headers = HeaderMap::new();
        headers.insert("grpc-status", "8".parse().unwrap());
        headers.insert("grpc-retry-pushback-ms", "1500".parse().unwrap());
        assert_eq!(
            said_by_grpc(&headers),
            Some(Word::Wait(Duration::from_millis(1500)))
        );
        // A Status with RetryInfo of 3.5 s, as tollgate's answers carry it.
        let answer = crate::response::grpc_denied_for_tests(3_500_000);
        headers.remove("grpc-retry-pushback-ms");
        headers.insert(
            "grpc-status-details-bin",
            answer.headers()["grpc-status-details-bin"].clone(),
        );
        assert_eq!(
            said_by_grpc(&headers),
            Some(Word::Wait(Duration::from_millis(3500)))
        );
        headers.insert("grpc-status", "0".parse().unwrap());
        assert_eq!(said_by_grpc(&headers), Some(Word::Go), "OK asks no wait");
        headers.insert("grpc-status", "14".parse().unwrap());
        headers.remove("grpc-status-details-bin");
        assert_eq!(said_by_grpc(&headers), Some(Word::Nothing));
        headers.remove("grpc-status");
        assert_eq!(said_by_grpc(&headers), None);
    }

    #[test]
    fn a_negative_retry_info_asks_no_wait() {
        // google.rpc.Status { details: [Any { RetryInfo { retry_delay: { seconds: -1 } } }] }
        let mut duration = vec![0x08];
        duration.extend_from_slice(&[0xff; 9]);
        duration.push(0x01);
        let mut retry_info = vec![0x0a, duration.len() as u8];
        retry_info.extend_from_slice(&duration);
        let url = b"type.googleapis.com/google.rpc.RetryInfo";
        let mut any = vec![0x0a, url.len() as u8];
        any.extend_from_slice(url);
        any.push(0x12);
        any.push(retry_info.len() as u8);
        any.extend_from_slice(&retry_info);
        let mut status = vec![0x08, 0x08, 0x1a, any.len() as u8];
        status.extend_from_slice(&any);
        assert_eq!(retry_info_of(&status), None);
    }

    fn retry_info_of(status: &[u8]) -> Option<Duration> {
        retry_info(status)
    }

    #[test]
    fn an_announced_wait_is_capped() {
        let mut headers = HeaderMap::new();
        headers.insert("retry-after", "99999999999".parse().unwrap());
        assert_eq!(
            said_of_target(StatusCode::TOO_MANY_REQUESTS, &headers),
            Word::Wait(MAX_ANNOUNCED_WAIT)
        );
        headers.insert("grpc-status", "8".parse().unwrap());
        headers.insert("grpc-retry-pushback-ms", "99999999999999".parse().unwrap());
        assert_eq!(said_by_grpc(&headers), Some(Word::Wait(MAX_ANNOUNCED_WAIT)));
    }
}
