//! The service behind every replica's layer.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use http::{HeaderName, Request, Response};
use tokio::sync::mpsc;

use super::facts::{Happened, Hold, Ledger};
use super::plan::Metered;
use super::rules::{ACTUAL, USAGE};
use crate::{Meter, Spend};

/// The service behind every replica's layer: it streams `x-tokens` units as server-sent
/// events, spending each from the meter first when the rule is metered by spends, and reports
/// its units in a trailer when the rule reads one (unless `x-forget` says it forgets to).
#[derive(Clone)]
pub(super) struct Handler {
    pub(super) ledger: Ledger,
    pub(super) replica: u32,
    pub(super) metered: Option<Metered>,
    /// The plan's rules' names, in order.
    pub(super) rules: Arc<[String]>,
}

impl Handler {
    pub(super) async fn serve(&self, request: Request<Body>) -> Response<Body> {
        let number = |name: &str| {
            request
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        };
        let key = number("x-key-index").unwrap_or(0) as u32;
        let id = number("x-request").unwrap_or(0);
        let tokens = number("x-tokens").unwrap_or(0);
        let forget = number("x-forget").is_some();
        let actual = number(ACTUAL);
        let status = number("x-status").map_or(200, |s| s as u16);
        let meter = request.extensions().get::<Meter>().cloned();
        self.ledger.note(
            id,
            key,
            Happened::Admitted {
                replica: self.replica,
            },
        );
        if let Some(actual) = actual {
            self.ledger
                .note(id, key, Happened::Answered { status, actual });
        }
        for (name, units) in meter.iter().flat_map(Meter::granted) {
            // A gold tier's rule is named `g<name>`.
            let plain = self.rules.iter().position(|r| *r == name);
            let gold = || {
                let name = name.strip_prefix('g')?;
                self.rules.iter().position(|r| r == name)
            };
            if let Some(rule) = plain.or_else(gold) {
                let rule = u16::try_from(rule).expect("a plan's rules fit a u16");
                self.ledger.note(id, key, Happened::Granted { rule, units });
            }
        }
        let hold = Hold {
            ledger: self.ledger.clone(),
            request: id,
            key,
        };
        let (frames, receiver) = mpsc::channel::<http_body::Frame<Bytes>>(1);
        let metered = self.metered;
        let ledger = self.ledger.clone();
        tokio::spawn(async move {
            let mut sent = 0u64;
            for _ in 0..tokens {
                if metered == Some(Metered::Spends)
                    && let Some(meter) = &meter
                    && meter.spend(1).await == Spend::Exhausted
                {
                    return;
                }
                let event = Bytes::from_static(b"data: t\n\n");
                if frames.send(http_body::Frame::data(event)).await.is_err() {
                    return;
                }
                sent += 1;
            }
            if metered == Some(Metered::Trailer) && !forget {
                let mut trailers = http::HeaderMap::new();
                trailers.insert(HeaderName::from_static(USAGE), sent.into());
                if frames
                    .send(http_body::Frame::trailers(trailers))
                    .await
                    .is_ok()
                {
                    ledger.note(id, key, Happened::Reported);
                }
            }
        });
        let stream = futures_util::stream::unfold((receiver, hold), |(mut receiver, hold)| async {
            let frame = receiver.recv().await?;
            Some((Ok::<_, Infallible>(frame), (receiver, hold)))
        });
        let mut response = Response::builder()
            .status(status)
            .header(http::header::CONTENT_TYPE, "text/event-stream");
        if let Some(actual) = actual {
            response = response.header(ACTUAL, actual);
        }
        response
            .body(Body::new(http_body_util::StreamBody::new(stream)))
            .expect("a response")
    }
}
