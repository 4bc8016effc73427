//! Fuzzes the gRPC message framing of `PerMessageLayer`: a request stream cut into messages
//! by their 5-byte prefixes, each checked before the service sees it.
//!
//! The first byte is the rule's budget (1 to 8 messages a minute), the second the size of the
//! chunks the stream arrives in (1 to 64 bytes), the rest is the stream. Besides "never
//! panics", it checks that:
//!
//! * the service gets a prefix of the stream, bytes in order and unchanged, and all of it when
//!   no message was refused;
//! * a refusal comes between two messages (none is cut in two) and only once the budget is
//!   spent: the service got exactly as many checked messages as the budget;
//! * no more messages are admitted than the budget.

#![no_main]

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame};
use libfuzzer_sys::fuzz_target;
use tollgate::key::Global;
use tollgate::{Quota, RateLimitLayer, Rule};
use tower_layer::Layer;
use tower_service::Service;

/// The most bytes of one message held for its check (tollgate's, tonic's default).
const MAX_HELD_MESSAGE: usize = 4 * 1024 * 1024;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    })
}

/// A request stream arriving in chunks.
struct Chunks(std::collections::VecDeque<Bytes>);

impl Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.0.pop_front().map(|c| Ok(Frame::data(c))))
    }
}

/// What the service got: the bytes, and whether the stream failed.
#[derive(Default)]
struct Got {
    bytes: Vec<u8>,
    failed: bool,
}

/// A service that reads the whole request stream.
#[derive(Clone)]
struct Reader(Arc<Mutex<Got>>);

impl Service<Request<tonic::body::Body>> for Reader {
    type Response = Response<String>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<String>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<tonic::body::Body>) -> Self::Future {
        let got = self.0.clone();
        Box::pin(async move {
            let mut body = std::pin::pin!(request.into_body());
            while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
                let mut got = got.lock().unwrap();
                match frame {
                    Ok(frame) => {
                        if let Ok(data) = frame.into_data() {
                            got.bytes.extend_from_slice(&data);
                        }
                    }
                    Err(_) => {
                        assert!(!got.failed, "the stream went on after its error");
                        got.failed = true;
                        break;
                    }
                }
            }
            Ok(Response::new(String::new()))
        })
    }
}

/// Where each message the layer checks starts and ends in `stream` (a message longer than
/// it holds ends at its prefix), the end of a message cut short excluded.
fn messages(stream: &[u8]) -> Vec<(usize, usize)> {
    let mut found = Vec::new();
    let mut at = 0;
    while let Some(prefix) = stream.get(at..at + 5) {
        let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
        if len > MAX_HELD_MESSAGE {
            found.push((at, at + 5));
            break;
        }
        if stream.len() < at + 5 + len {
            break;
        }
        found.push((at, at + 5 + len));
        at += 5 + len;
    }
    found
}

fuzz_target!(|data: &[u8]| {
    let [budget, chunk, stream @ ..] = data else {
        return;
    };
    let budget = u64::from(budget % 8 + 1);
    let chunk = usize::from(chunk % 64 + 1);
    let got = Arc::new(Mutex::new(Got::default()));
    runtime().block_on(async {
        let layer = RateLimitLayer::builder()
            .rule(Rule::new("messages", Quota::per_minute(budget)).key(Global))
            .build()
            .unwrap()
            .per_message()
            .unwrap();
        let mut service = layer.layer(Reader(got.clone()));
        let body = Chunks(stream.chunks(chunk).map(Bytes::copy_from_slice).collect());
        let request = Request::post("http://a.test/pkg.Jobs/Upload")
            .header("content-type", "application/grpc")
            .body(tonic::body::Body::new(body))
            .unwrap();
        std::future::poll_fn(|cx| service.poll_ready(cx))
            .await
            .unwrap();
        let _ = service.call(request).await;
    });
    let got = got.lock().unwrap();
    assert!(
        stream.starts_with(&got.bytes),
        "the service got bytes not sent"
    );
    let messages = messages(stream);
    // The checked messages the service got (a long one's prefix counts).
    let passed = messages
        .iter()
        .filter(|(_, end)| *end <= got.bytes.len())
        .count();
    assert!(
        passed as u64 <= budget,
        "{passed} messages passed a budget of {budget}"
    );
    if got.failed {
        assert_eq!(passed as u64, budget, "refused with budget left");
        assert!(
            got.bytes.is_empty() || messages.iter().any(|(_, end)| *end == got.bytes.len()),
            "refused inside a message: {} bytes passed",
            got.bytes.len()
        );
    } else {
        assert_eq!(
            got.bytes.len(),
            stream.len(),
            "the stream was cut without an error"
        );
    }
});
