//! RESP2, the little of it a store speaks: commands written as arrays of bulk strings, the end of
//! a reply found without building it, and a reply of integers read into a buffer.
//!
//! ```text
//! *3\r\n$5\r\nFCALL\r\n$1\r\n0\r\n$1\r\nc\r\n        a command: FCALL, 0, c
//! *2\r\n:1733000000000000\r\n:7\r\n                  a reply of integers
//! ```
//!
//! Any other reply (an error, a string, nested arrays) is handed whole to redis-rs's parser, so
//! its errors keep their kinds (`NOSCRIPT`, `MOVED`, `WRONGPASS`…).

use redis::{RedisResult, Value};

use crate::decimal::Digits;

/// Appends `*<n>\r\n`: a command of `n` arguments follows.
pub(crate) fn array(out: &mut Vec<u8>, n: usize) {
    out.push(b'*');
    decimal(out, n as u64);
    out.extend_from_slice(b"\r\n");
}

/// Appends one argument: `$<len>\r\n<bytes>\r\n`.
pub(crate) fn bulk(out: &mut Vec<u8>, bytes: &[u8]) {
    out.push(b'$');
    decimal(out, bytes.len() as u64);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

/// Appends one argument, the decimal digits of `n`.
pub(crate) fn bulk_integer(out: &mut Vec<u8>, n: u64) {
    let mut digits = Digits::default();
    bulk(out, digits.of(n));
}

/// Appends the decimal digits of `n`.
pub(crate) fn decimal(out: &mut Vec<u8>, n: u64) {
    let start = out.len();
    out.resize(start + crate::decimal::len(n), 0);
    crate::decimal::write_end(&mut out[start..], n);
}

/// A command of these arguments, as bytes to send.
pub(crate) fn command(args: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + args.iter().map(|a| a.len() + 16).sum::<usize>());
    array(&mut out, args.len());
    for arg in args {
        bulk(&mut out, arg);
    }
    out
}

/// What the start of a buffer holds.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Frame {
    /// Not yet a whole reply: more bytes are needed.
    Partial,
    /// A whole reply of this many bytes.
    Whole(usize),
}

/// A reply that is not RESP2 (the stream is out of step, or not Redis): the connection cannot
/// be used any more.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Malformed;

/// The deepest nesting of arrays read; deeper is [`Malformed`] (no reply of a store nests).
const MAX_DEPTH: usize = 8;

/// Where the first reply in `buf` ends, without building it.
pub(crate) fn frame(buf: &[u8]) -> Result<Frame, Malformed> {
    let mut at = 0;
    // Elements still to read at each open array level.
    let mut open = [0u64; MAX_DEPTH];
    let mut depth = 0;
    loop {
        let Some(line_end) = line_end(buf, at)? else {
            return Ok(Frame::Partial);
        };
        let kind = buf[at];
        let line = &buf[at + 1..line_end];
        at = line_end + 2;
        match kind {
            b'+' | b'-' | b':' => {}
            b'$' => {
                let len = signed(line)?;
                if len >= 0 {
                    let len = usize::try_from(len).map_err(|_| Malformed)?;
                    let end = at.checked_add(len).ok_or(Malformed)?;
                    // The string and its CRLF: a length near the address space's end (a 32-bit
                    // build) is malformed, not a wrapped index.
                    let after = end.checked_add(2).ok_or(Malformed)?;
                    if buf.len() < after {
                        return Ok(Frame::Partial);
                    }
                    if &buf[end..after] != b"\r\n" {
                        return Err(Malformed);
                    }
                    at = after;
                } else if len != -1 {
                    return Err(Malformed);
                }
            }
            b'*' => {
                let len = signed(line)?;
                if len > 0 {
                    if depth == MAX_DEPTH {
                        return Err(Malformed);
                    }
                    open[depth] = len as u64;
                    depth += 1;
                    continue;
                } else if len < -1 {
                    return Err(Malformed);
                }
            }
            _ => return Err(Malformed),
        }
        // One element (or a whole reply) ended: close the arrays it completes.
        loop {
            if depth == 0 {
                return Ok(Frame::Whole(at));
            }
            open[depth - 1] -= 1;
            if open[depth - 1] > 0 {
                break;
            }
            depth -= 1;
        }
    }
}

/// What the start of a buffer holds, read as an array of integers.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Integers {
    /// A whole array of integers, of this many bytes: its integers were appended.
    Whole(usize),
    /// The start of one: more bytes are needed (some integers may have been appended).
    Partial,
    /// Another reply (an error, a string, nested arrays): read it with [`frame`] and [`value`].
    Other,
}

/// Reads the reply at the start of `buf` when it is an array of integers, appending them to
/// `out`: the common reply of a call of checks, read in one pass without building values.
pub(crate) fn integers(buf: &[u8], out: &mut Vec<i64>) -> Integers {
    match buf.first() {
        None => return Integers::Partial,
        Some(b'*') => {}
        Some(_) => return Integers::Other,
    }
    let mut at = 1;
    let n = match number(buf, &mut at) {
        Read::Number(n) => match usize::try_from(n) {
            Ok(n) => n,
            Err(_) => return Integers::Other,
        },
        Read::Partial => return Integers::Partial,
        Read::Other => return Integers::Other,
    };
    // The count is the server's word: room for no more integers than the bytes read can hold
    // (four bytes each at least).
    out.reserve(n.min(buf.len() / 4));
    for _ in 0..n {
        match buf.get(at) {
            None => return Integers::Partial,
            Some(b':') => at += 1,
            Some(_) => return Integers::Other,
        }
        match number(buf, &mut at) {
            Read::Number(n) => out.push(n),
            Read::Partial => return Integers::Partial,
            Read::Other => return Integers::Other,
        }
    }
    Integers::Whole(at)
}

/// What [`number`] read.
enum Read {
    Number(i64),
    Partial,
    Other,
}

/// Reads a signed decimal integer ending in `\r\n` at `*at`, and moves `*at` past it.
fn number(buf: &[u8], at: &mut usize) -> Read {
    let mut i = *at;
    let negative = buf.get(i) == Some(&b'-');
    if negative {
        i += 1;
    }
    let start = i;
    let mut n: i64 = 0;
    loop {
        match buf.get(i) {
            None => return Read::Partial,
            Some(&d @ b'0'..=b'9') => {
                n = match n
                    .checked_mul(10)
                    .and_then(|n| n.checked_add(i64::from(d - b'0')))
                {
                    Some(n) => n,
                    None => return Read::Other,
                };
                i += 1;
            }
            Some(b'\r') => break,
            Some(_) => return Read::Other,
        }
    }
    match buf.get(i + 1) {
        None => return Read::Partial,
        Some(b'\n') if i > start => {}
        Some(_) => return Read::Other,
    }
    *at = i + 2;
    Read::Number(if negative { -n } else { n })
}

/// A whole reply as redis-rs reads it (an error reply is a `Value::ServerError`).
pub(crate) fn value(frame: &[u8]) -> RedisResult<Value> {
    redis::parse_redis_value(frame)
}

/// The position of the `\r` that ends the line starting at `from`, if the line is whole.
fn line_end(buf: &[u8], from: usize) -> Result<Option<usize>, Malformed> {
    let rest = buf.get(from..).unwrap_or_default();
    // A line holds at least its type byte.
    let Some(cr) = rest.iter().skip(1).position(|&b| b == b'\r') else {
        return Ok(None);
    };
    let cr = cr + 1;
    match rest.get(cr + 1) {
        None => Ok(None),
        Some(b'\n') => Ok(Some(from + cr)),
        Some(_) => Err(Malformed),
    }
}

/// A signed decimal integer, as RESP writes one.
fn signed(digits: &[u8]) -> Result<i64, Malformed> {
    let (negative, digits) = match digits.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, digits),
    };
    if digits.is_empty() || digits.len() > 19 {
        return Err(Malformed);
    }
    let mut n: i64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return Err(Malformed);
        }
        n = n
            .checked_mul(10)
            .and_then(|n| n.checked_add(i64::from(d - b'0')))
            .ok_or(Malformed)?;
    }
    Ok(if negative { -n } else { n })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_arrays_of_bulk_strings() {
        assert_eq!(
            command(&[b"SET", b"k", b""]),
            b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$0\r\n\r\n"
        );
        let mut out = Vec::new();
        bulk_integer(&mut out, 0);
        bulk_integer(&mut out, u64::MAX);
        assert_eq!(out, b"$1\r\n0\r\n$20\r\n18446744073709551615\r\n");
    }

    #[test]
    fn a_reply_ends_where_its_last_element_does() {
        let replies: [&[u8]; 9] = [
            b"+OK\r\n",
            b"-ERR no\r\n",
            b":-12\r\n",
            b"$3\r\na\r\n\r\n",
            b"$-1\r\n",
            b"*-1\r\n",
            b"*0\r\n",
            b"*2\r\n:1\r\n*2\r\n$1\r\nx\r\n*0\r\n",
            b"*3\r\n*1\r\n*1\r\n:1\r\n+a\r\n$0\r\n\r\n",
        ];
        for reply in replies {
            let mut buf = reply.to_vec();
            buf.extend_from_slice(b"+NEXT\r\n");
            assert_eq!(frame(&buf), Ok(Frame::Whole(reply.len())), "{reply:?}");
            // Every shorter prefix is partial.
            for cut in 0..reply.len() {
                assert_eq!(
                    frame(&reply[..cut]),
                    Ok(Frame::Partial),
                    "{reply:?} cut at {cut}"
                );
            }
        }
    }

    #[test]
    fn what_is_not_resp_is_malformed() {
        for bad in [
            &b"hello\r\n"[..],
            b"$3\r\nabcd\r\n",
            b"*-2\r\n",
            b"$-5\r\n",
            b"$99999999999999999999\r\n",
            b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n",
        ] {
            assert_eq!(frame(bad), Err(Malformed), "{bad:?}");
        }
    }

    #[test]
    fn a_count_no_reply_could_hold_is_not_believed() {
        let mut out = Vec::new();
        for huge in [&b"*9223372036854775807\r\n"[..], b"*100000000000\r\n:1\r\n"] {
            assert_eq!(integers(huge, &mut out), Integers::Partial);
            assert!(out.capacity() < 16, "{}", out.capacity());
        }
        assert_eq!(
            integers(b"*99999999999999999999\r\n", &mut out),
            Integers::Other
        );
    }

    #[test]
    fn integers_are_read_from_an_array_of_integers_only() {
        let reply = b"*3\r\n:1\r\n:-1\r\n:9007199254740993\r\n";
        let mut out = Vec::new();
        let mut buf = reply.to_vec();
        buf.extend_from_slice(b"*1\r\n");
        assert_eq!(integers(&buf, &mut out), Integers::Whole(reply.len()));
        assert_eq!(out, [1, -1, 9_007_199_254_740_993]);
        for cut in 0..reply.len() {
            assert_eq!(
                integers(&reply[..cut], &mut Vec::new()),
                Integers::Partial,
                "{cut}"
            );
        }
        for other in [
            &b":1\r\n"[..],
            b"*1\r\n$1\r\n1\r\n",
            b"-ERR x\r\n",
            b"*-1\r\n",
        ] {
            assert_eq!(
                integers(other, &mut Vec::new()),
                Integers::Other,
                "{other:?}"
            );
        }
    }

    #[test]
    fn other_replies_keep_redis_rs_kinds() {
        let error = value(b"-NOSCRIPT No matching script.\r\n")
            .unwrap()
            .extract_error()
            .unwrap_err();
        assert_eq!(
            error.kind(),
            redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
        );
        assert_eq!(value(b"+OK\r\n").unwrap(), Value::Okay);
    }
}
