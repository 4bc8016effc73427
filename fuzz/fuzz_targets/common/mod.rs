//! What the fuzz targets share: header values from bytes, a server whose answer is made of
//! the input, and futures polled to their end without a runtime.

#![allow(dead_code)]

use std::convert::Infallible;
use std::future::{Future, Ready, ready};
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::{Body, Frame};
use tollgate::client::ClientError;
use tower_service::Service;

/// The bytes as a header value: bytes a value cannot hold become spaces.
pub fn value(bytes: &[u8]) -> HeaderValue {
    let bytes: Vec<u8> = bytes
        .iter()
        .map(|&b| {
            if b == b'\t' || (b >= 0x20 && b != 0x7f) {
                b
            } else {
                b' '
            }
        })
        .collect();
    HeaderValue::from_bytes(&bytes).expect("a sanitized header value")
}

/// Polls a future that never waits (the services here answer at once).
pub fn now<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    match future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("a future of a service that answers at once waited"),
    }
}

/// A body of no data and, maybe, trailers.
pub struct Trailers(pub Option<HeaderMap>);

impl Body for Trailers {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.0.take().map(|t| Ok(Frame::trailers(t))))
    }
}

/// A server that answers every request alike: a status, a head, maybe trailers.
#[derive(Clone)]
pub struct Server {
    pub status: StatusCode,
    pub head: HeaderMap,
    pub trailers: Option<HeaderMap>,
}

impl Server {
    pub fn plain() -> Self {
        Server {
            status: StatusCode::OK,
            head: HeaderMap::new(),
            trailers: None,
        }
    }
}

impl<B> Service<Request<B>> for Server {
    type Response = Response<Trailers>;
    type Error = Infallible;
    type Future = Ready<Result<Response<Trailers>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<B>) -> Self::Future {
        let mut response = Response::new(Trailers(self.trailers.clone()));
        *response.status_mut() = self.status;
        *response.headers_mut() = self.head.clone();
        ready(Ok(response))
    }
}

/// Sends `request` through a client layer: `Ok(())` when sent (its body read to the end),
/// else the wait the layer told.
pub fn send<S, B>(client: &mut S, request: Request<()>) -> Result<(), Duration>
where
    S: Service<Request<()>, Response = Response<B>, Error = ClientError<Infallible>>,
    B: Body,
{
    if now(std::future::poll_fn(|cx| client.poll_ready(cx))).is_err() {
        panic!("the client was not ready");
    }
    match now(client.call(request)) {
        Ok(response) => {
            let mut body = pin!(response.into_body());
            let mut cx = Context::from_waker(Waker::noop());
            loop {
                match body.as_mut().poll_frame(&mut cx) {
                    Poll::Ready(Some(_)) => {}
                    Poll::Ready(None) => return Ok(()),
                    Poll::Pending => panic!("a body that never waits waited"),
                }
            }
        }
        Err(ClientError::Throttled(throttled)) => Err(throttled.wait()),
        Err(ClientError::Inner(never)) => match never {},
    }
}

pub fn get(uri: &str) -> Request<()> {
    Request::get(uri).body(()).unwrap()
}

pub fn grpc(uri: &str) -> Request<()> {
    Request::post(uri)
        .header("content-type", "application/grpc")
        .body(())
        .unwrap()
}

/// Standard base64 with padding.
pub fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A protobuf varint.
pub fn varint(mut n: u64, out: &mut Vec<u8>) {
    loop {
        let byte = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// A length-delimited protobuf field.
pub fn field(number: u64, bytes: &[u8], out: &mut Vec<u8>) {
    varint(number << 3 | 2, out);
    varint(bytes.len() as u64, out);
    out.extend_from_slice(bytes);
}
