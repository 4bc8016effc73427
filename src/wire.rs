//! gRPC on the wire, for both ends: whether a message is a gRPC call, the names of gRPC's status
//! metadata, and the base64 of its `-bin` metadata.

use http::header::{CONTENT_TYPE, HeaderMap, HeaderName};

/// `grpc-status`.
pub(crate) static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
/// `grpc-message`.
pub(crate) static GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
/// `grpc-retry-pushback-ms`, the server pushback of gRPC's retry design.
pub(crate) static GRPC_PUSHBACK: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");
/// `grpc-status-details-bin`, a `google.rpc.Status`.
pub(crate) static GRPC_DETAILS: HeaderName = HeaderName::from_static("grpc-status-details-bin");

/// Whether a message is a gRPC call (by its `content-type`).
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// Standard base64 without padding, as gRPC `-bin` metadata is sent.
pub(crate) fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 0x3f) as usize]));
        }
    }
    out
}

/// Standard base64, with or without padding (gRPC's `-bin` metadata).
pub(crate) fn base64_decode(text: &[u8]) -> Option<Vec<u8>> {
    let value = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            _ => return None,
        } as u32)
    };
    let text: Vec<u8> = text.iter().copied().filter(|&c| c != b'=').collect();
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    for chunk in text.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= value(c)? << (18 - 6 * i);
        }
        let bytes = n.to_be_bytes();
        match chunk.len() {
            4 => out.extend_from_slice(&bytes[1..4]),
            3 => out.extend_from_slice(&bytes[1..3]),
            2 => out.push(bytes[1]),
            _ => return None,
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_standard_alphabet_without_padding() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg");
        assert_eq!(base64(b"fo"), "Zm8");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64(&[0xff, 0xfe]), "//4");
    }

    #[test]
    fn base64_decodes_what_it_encodes() {
        for bytes in [&b""[..], b"f", b"fo", b"foo", b"foobar", &[0xff, 0xfe]] {
            assert_eq!(
                base64_decode(base64(bytes).as_bytes()).as_deref(),
                Some(bytes)
            );
        }
    }
}
