//! gRPC answers: `RESOURCE_EXHAUSTED` (and `UNAVAILABLE` when failing closed), never an HTTP 429.
//!
//! A gRPC client cannot read an HTTP 429: tonic turns it into `UNAVAILABLE`, which retry policies
//! retry at once. So a request whose `content-type` is `application/grpc…` is denied with a
//! trailers-only gRPC response (HTTP 200, no body) carrying:
//!
//! * `grpc-status: 8` (`RESOURCE_EXHAUSTED`) and a `grpc-message`;
//! * `grpc-retry-pushback-ms`, the server pushback of gRPC's retry design, in milliseconds;
//! * `grpc-status-details-bin`, a `google.rpc.Status` whose details hold a `google.rpc.RetryInfo`
//!   with the same delay (what Google APIs send);
//! * the same `Retry-After` and budget headers as HTTP answers, as metadata.

use bytes::Bytes;
use http::Response;
use http::header::{CONTENT_TYPE, HeaderMap, HeaderValue};

use crate::wire::{GRPC_DETAILS, GRPC_MESSAGE, GRPC_PUSHBACK, GRPC_STATUS, base64};

/// `RESOURCE_EXHAUSTED`.
const RESOURCE_EXHAUSTED: i32 = 8;
/// `UNAVAILABLE`.
const UNAVAILABLE: i32 = 14;
/// `PERMISSION_DENIED`.
const PERMISSION_DENIED: i32 = 7;

/// A gRPC status the layer answers with, before it is written: as the headers of a
/// trailers-only response, or as a `tonic::Status`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GrpcStatus {
    code: i32,
    message: &'static str,
    retry_after_micros: Option<u64>,
}

impl GrpcStatus {
    /// A gRPC call over the limit; `retry_after_micros` is `None` when the call can never be
    /// admitted.
    pub(crate) fn denied(retry_after_micros: Option<u64>) -> Self {
        let message = match retry_after_micros {
            Some(_) => "rate limit exceeded; retry after grpc-retry-pushback-ms",
            None => "this call costs more than the rate limit ever allows",
        };
        GrpcStatus {
            code: RESOURCE_EXHAUSTED,
            message,
            retry_after_micros,
        }
    }

    /// A gRPC call when the store failed and the layer fails closed.
    pub(crate) const UNAVAILABLE: GrpcStatus = GrpcStatus {
        code: UNAVAILABLE,
        message: "the rate limiter cannot decide right now; retry shortly",
        retry_after_micros: Some(1_000_000),
    };

    /// A gRPC call shed because the server has too many calls in flight.
    pub(crate) const SHED: GrpcStatus = GrpcStatus {
        code: UNAVAILABLE,
        message: "the server is at capacity for calls of this priority; retry shortly",
        retry_after_micros: Some(1_000_000),
    };

    /// A gRPC call from a client on the deny list.
    pub(crate) const FORBIDDEN: GrpcStatus = GrpcStatus {
        code: PERMISSION_DENIED,
        message: "this client may not call this service",
        retry_after_micros: None,
    };

    /// The trailers-only response of this status.
    pub(crate) fn response(self) -> Response<Bytes> {
        let mut response = Response::new(Bytes::new());
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert(&GRPC_STATUS, HeaderValue::from(self.code));
        // Messages here are plain ASCII: nothing to percent-encode.
        if let Ok(value) = HeaderValue::from_str(self.message) {
            headers.insert(&GRPC_MESSAGE, value);
        }
        self.write_pushback(headers);
        let details = status_details(self.code, self.message, self.retry_after_micros);
        if let Ok(value) = HeaderValue::from_str(&base64(&details)) {
            headers.insert(&GRPC_DETAILS, value);
        }
        response
    }

    /// `grpc-retry-pushback-ms`, when the status says when to retry.
    pub(crate) fn write_pushback(self, headers: &mut HeaderMap) {
        if let Some(micros) = self.retry_after_micros {
            headers.insert(&GRPC_PUSHBACK, HeaderValue::from(micros.div_ceil(1000)));
        }
    }

    /// This status as tonic's, with `metadata` (the pushback and the budget fields).
    #[cfg(feature = "tonic")]
    pub(crate) fn status(self, metadata: HeaderMap) -> tonic::Status {
        let details = status_details(self.code, self.message, self.retry_after_micros);
        tonic::Status::with_details_and_metadata(
            tonic::Code::from_i32(self.code),
            self.message,
            Bytes::from(details),
            tonic::metadata::MetadataMap::from_headers(metadata),
        )
    }
}

/// `google.rpc.Status { code, message, details: [Any(google.rpc.RetryInfo { retry_delay })] }`,
/// protobuf-encoded.
fn status_details(code: i32, message: &str, retry_after_micros: Option<u64>) -> Vec<u8> {
    let mut status = Vec::with_capacity(128);
    put_key(&mut status, 1, 0);
    put_varint(&mut status, code as u64);
    put_bytes(&mut status, 2, message.as_bytes());
    if let Some(micros) = retry_after_micros {
        let mut duration = Vec::new();
        let seconds = micros / 1_000_000;
        let nanos = (micros % 1_000_000) * 1000;
        if seconds > 0 {
            put_key(&mut duration, 1, 0);
            put_varint(&mut duration, seconds);
        }
        if nanos > 0 {
            put_key(&mut duration, 2, 0);
            put_varint(&mut duration, nanos);
        }
        let mut retry_info = Vec::new();
        put_bytes(&mut retry_info, 1, &duration);
        let mut any = Vec::new();
        put_bytes(&mut any, 1, b"type.googleapis.com/google.rpc.RetryInfo");
        put_bytes(&mut any, 2, &retry_info);
        put_bytes(&mut status, 3, &any);
    }
    status
}

fn put_key(out: &mut Vec<u8>, field: u64, wire_type: u64) {
    put_varint(out, (field << 3) | wire_type);
}

fn put_bytes(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    put_key(out, field, 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn put_varint(out: &mut Vec<u8>, mut n: u64) {
    while n >= 0x80 {
        out.push((n as u8 & 0x7f) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_and_the_retry_info_encoding() {
        let mut v = Vec::new();
        put_varint(&mut v, 300);
        assert_eq!(v, [0xac, 0x02]);
        let details = status_details(8, "m", Some(1_500_000));
        // code 8, message "m", then one Any.
        assert_eq!(&details[..5], &[0x08, 0x08, 0x12, 0x01, b'm']);
        assert_eq!(details[5], 0x1a);
        // It ends with the Duration: seconds 1, nanos 500000000.
        assert!(details.ends_with(&[0x08, 0x01, 0x10, 0x80, 0xca, 0xb5, 0xee, 0x01]));
    }
}
