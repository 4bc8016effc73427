//! [`Answers`]: what one layer writes, prepared once when it is built.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};

use super::denied::{PROBLEM_JSON, ProblemBodies, RateLimited};
use super::grpc::GrpcStatus;
use super::headers::{Headers, PolicyItems, write_budget};
use super::refusal::Refusal;
use crate::Decision;
use crate::store::RuleSpec;

/// A function that writes the response to a denied request.
pub(crate) type DeniedHandler = Arc<dyn Fn(&RateLimited) -> Response<Bytes> + Send + Sync>;

/// The answers of one layer: which budget fields it sends, its policies and problem documents
/// rendered once, and the user's own denied response if any.
pub(crate) struct Answers {
    /// The specs of the rules answered for, by index.
    rules: Box<[Arc<RuleSpec>]>,
    headers: Headers,
    policies: PolicyItems,
    problems: ProblemBodies,
    on_denied: Option<DeniedHandler>,
}

impl Answers {
    /// The answers for rules of these specs, by index.
    pub(crate) fn new(
        rules: Box<[Arc<RuleSpec>]>,
        headers: Headers,
        on_denied: Option<DeniedHandler>,
    ) -> Self {
        Answers {
            policies: PolicyItems::new(&rules),
            problems: ProblemBodies::new(&rules),
            rules,
            headers,
            on_denied,
        }
    }

    /// Which budget fields the layer sends.
    pub(crate) fn headers(&self) -> Headers {
        self.headers
    }

    /// The answer `refusal` is, as an HTTP answer or, for a gRPC call, its trailers-only form.
    pub(crate) fn render(&self, refusal: &Refusal, grpc: bool) -> Response<Bytes> {
        match refusal {
            Refusal::Denied { applied, decision } => self.denied(applied, decision, grpc),
            Refusal::Unavailable { closed } => self.unavailable(closed, grpc),
            Refusal::Forbidden => self.forbidden(grpc),
            Refusal::Shed { share } => self.shed(grpc, *share),
        }
    }

    /// The answer `refusal` is, as a `tonic::Status`: its code, message and `RetryInfo`, with
    /// `grpc-retry-pushback-ms` and the budget fields as metadata.
    #[cfg(feature = "tonic")]
    pub(crate) fn status(&self, refusal: &Refusal) -> tonic::Status {
        let mut metadata = HeaderMap::new();
        let status = match refusal {
            Refusal::Denied { decision, .. } => GrpcStatus::denied(decision.retry_after_micros()),
            Refusal::Unavailable { .. } => GrpcStatus::UNAVAILABLE,
            Refusal::Forbidden => GrpcStatus::FORBIDDEN,
            Refusal::Shed { .. } => GrpcStatus::SHED,
        };
        status.write_pushback(&mut metadata);
        if let Refusal::Denied { applied, decision } = refusal {
            self.write_budget(&mut metadata, applied, decision);
        }
        status.status(metadata)
    }

    /// Adds the budget fields of `decision` (and `Retry-After` for a denial) to an answer.
    pub(crate) fn write_budget(
        &self,
        headers: &mut HeaderMap,
        applied: &[u16],
        decision: &Decision,
    ) {
        write_budget(
            headers,
            self.headers,
            self.rules.len(),
            &self.policies,
            applied,
            decision,
        );
    }

    /// The answer to a denied request: 429 with a problem document (or the user's own answer),
    /// or gRPC `RESOURCE_EXHAUSTED`, with the budget fields.
    fn denied(&self, applied: &[u16], decision: &Decision, grpc: bool) -> Response<Bytes> {
        let mut response = match &self.on_denied {
            _ if grpc => GrpcStatus::denied(decision.retry_after_micros()).response(),
            Some(handler) => handler(&RateLimited::new(&self.rules, applied, decision)),
            None => self.problems.quota_exceeded(&self.rules, applied, decision),
        };
        self.write_budget(response.headers_mut(), applied, decision);
        response
    }

    /// The answer when the store failed and rules fail closed (`closed`, by index): 503 with
    /// `Retry-After: 1` and a `temporary-reduced-capacity` problem document naming the rules
    /// that could not be checked, or gRPC `UNAVAILABLE`.
    fn unavailable(&self, closed: &[u16], grpc: bool) -> Response<Bytes> {
        if grpc {
            return GrpcStatus::UNAVAILABLE.response();
        }
        let closed = closed.iter().map(|&i| self.rules[usize::from(i)].name());
        let mut response = Response::new(ProblemBodies::reduced_capacity(closed));
        *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        let headers = response.headers_mut();
        headers.insert(http::header::CONTENT_TYPE, PROBLEM_JSON.clone());
        headers.insert(RETRY_AFTER, HeaderValue::from_static("1"));
        response
    }

    /// The answer to a request shed by load shedding: 503 with `Retry-After: 1` and a
    /// `temporary-reduced-capacity` problem document naming the `"load-shedding"` policy,
    /// advertised with `share`, the requests in flight its class may join (draft-11 §5.2: "the
    /// new temporarily lower quota"); or gRPC `UNAVAILABLE`.
    fn shed(&self, grpc: bool, share: usize) -> Response<Bytes> {
        if grpc {
            return GrpcStatus::SHED.response();
        }
        static BODY: std::sync::OnceLock<Bytes> = std::sync::OnceLock::new();
        let body = BODY.get_or_init(ProblemBodies::shed).clone();
        let mut response = Response::new(body);
        *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        let headers = response.headers_mut();
        headers.insert(http::header::CONTENT_TYPE, PROBLEM_JSON.clone());
        headers.insert(RETRY_AFTER, HeaderValue::from_static("1"));
        if !self.headers.sends_ietf() {
            return response;
        }
        let mut policy = super::buffer::Buffer::<96>::default();
        policy
            .push(b"\"")
            .push(crate::shed::SHED_POLICY.as_bytes())
            .push(b"\";q=")
            .push_u64(share as u64)
            .push(b";qu=\"concurrent-requests\"");
        headers.insert(&super::headers::RATELIMIT_POLICY, policy.header_value());
        headers.insert(
            &super::headers::RATELIMIT,
            HeaderValue::from_static("\"load-shedding\";r=0"),
        );
        response
    }

    /// The answer to a request on the deny list: `403 Forbidden` with a problem document, or
    /// gRPC `PERMISSION_DENIED`.
    fn forbidden(&self, grpc: bool) -> Response<Bytes> {
        if grpc {
            return GrpcStatus::FORBIDDEN.response();
        }
        let mut response = Response::new(Bytes::from_static(
            br#"{"type":"about:blank","title":"Forbidden","status":403,"detail":"This client may not use this service."}"#,
        ));
        *response.status_mut() = StatusCode::FORBIDDEN;
        response
            .headers_mut()
            .insert(http::header::CONTENT_TYPE, PROBLEM_JSON.clone());
        response
    }
}
