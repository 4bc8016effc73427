//! The answers to denied requests: [`RateLimited`] for a custom answer, and the RFC 9457 problem
//! documents of draft-11 (`quota-exceeded` for a 429, `temporary-reduced-capacity` for a 503).

use std::sync::Arc;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Response, StatusCode};

use super::buffer::Buffer;
use crate::Decision;
use crate::algorithm::Outcome;
use crate::store::RuleSpec;

/// What a custom denied-response function is told: each rule checked for the request, and how
/// long to wait.
///
/// ```
/// use bytes::Bytes;
/// use tollgate::{Quota, RateLimitLayer, Rule};
///
/// let layer = RateLimitLayer::builder()
///     .rule(Rule::new("api", Quota::per_minute(100)))
///     .on_denied(|denied: &tollgate::RateLimited| {
///         let body = format!("slow down: try again in {:?} s", denied.retry_after_seconds());
///         http::Response::builder()
///             .status(http::StatusCode::SERVICE_UNAVAILABLE)
///             .body(Bytes::from(body))
///             .unwrap()
///     })
///     .build()
///     .unwrap();
/// # let _ = layer;
/// ```
#[derive(Clone, Debug)]
pub struct RateLimited {
    rules: Vec<(String, Outcome)>,
    retry_after_seconds: Option<u64>,
}

impl RateLimited {
    pub(crate) fn new(rules: &[Arc<RuleSpec>], applied: &[u16], decision: &Decision) -> Self {
        RateLimited {
            rules: applied
                .iter()
                .zip(decision.outcomes())
                .map(|(&i, o)| (rules[usize::from(i)].name().to_owned(), *o))
                .collect(),
            retry_after_seconds: decision.retry_after_seconds(),
        }
    }

    /// Each rule checked, by name, with its outcome (some admitted, at least one did not).
    pub fn rules(&self) -> &[(String, Outcome)] {
        &self.rules
    }

    /// The names of the rules that denied the request.
    pub fn violated(&self) -> impl Iterator<Item = &str> {
        self.rules
            .iter()
            .filter(|(_, o)| !o.allowed)
            .map(|(name, _)| name.as_str())
    }

    /// The `Retry-After` value: whole seconds, rounded up, at least 1; `None` when the request can
    /// never be admitted (its cost exceeds a rule's capacity).
    pub fn retry_after_seconds(&self) -> Option<u64> {
        self.retry_after_seconds
    }
}

pub(crate) static PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

/// draft-ietf-httpapi-ratelimit-headers-11 §5.1.
const QUOTA_EXCEEDED: &[u8] = b"{\"type\":\"https://iana.org/assignments/http-problem-types#quota-exceeded\",\"title\":\"Quota Exceeded\",\"status\":429,\"detail\":\"";

/// draft-ietf-httpapi-ratelimit-headers-11 §5.2.
const REDUCED_CAPACITY: &[u8] = b"{\"type\":\"https://iana.org/assignments/http-problem-types#temporary-reduced-capacity\",\"title\":\"Temporary Reduced Capacity\",\"status\":503,\"detail\":\"";

/// The problem documents of a layer's rules, written once where they do not change: a 429's
/// body names the violated policies and points to `Retry-After` (the budget fields carry the
/// numbers), so it is the same from one denial to the next.
pub(crate) struct ProblemBodies {
    /// The body when only rule `i` denied.
    single: Box<[Bytes]>,
}

impl ProblemBodies {
    pub(crate) fn new(rules: &[Arc<RuleSpec>]) -> Self {
        ProblemBodies {
            single: rules
                .iter()
                .map(|rule| quota_exceeded_body([rule.name()].into_iter(), true))
                .collect(),
        }
    }

    /// The default 429 answer (draft-11 §5.1): a `quota-exceeded` problem document naming the
    /// violated policies.
    pub(crate) fn quota_exceeded(
        &self,
        rules: &[Arc<RuleSpec>],
        applied: &[u16],
        decision: &Decision,
    ) -> Response<Bytes> {
        let can_retry = decision.retry_after_seconds().is_some();
        let violated = || {
            applied
                .iter()
                .zip(decision.outcomes())
                .filter(|(_, o)| !o.allowed)
                .map(|(&i, _)| usize::from(i))
        };
        let mut first_two = violated();
        let body = match (first_two.next(), first_two.next()) {
            (Some(only), None) if can_retry => self.single[only].clone(),
            _ => quota_exceeded_body(violated().map(|i| rules[i].name()), can_retry),
        };
        let mut response = Response::new(body);
        *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        let headers = response.headers_mut();
        headers.reserve(6);
        headers.insert(CONTENT_TYPE, PROBLEM_JSON.clone());
        response
    }

    /// The body of the 503 of a store failure (draft-11 §5.2): a `temporary-reduced-capacity`
    /// problem document naming the policies that could not be checked.
    pub(crate) fn reduced_capacity<'a>(policies: impl Iterator<Item = &'a str>) -> Bytes {
        problem_body(
            REDUCED_CAPACITY,
            b"The rate limiter cannot check these policies right now; retry after the number of seconds in Retry-After.",
            policies,
        )
    }

    /// The body of a request shed by load shedding: its violated policy is
    /// [`SHED_POLICY`](crate::shed::SHED_POLICY).
    pub(crate) fn shed() -> Bytes {
        problem_body(
            REDUCED_CAPACITY,
            b"The service has too many requests in flight for this request's priority; retry after the number of seconds in Retry-After.",
            std::iter::once(crate::shed::SHED_POLICY),
        )
    }
}

fn quota_exceeded_body<'a>(violated: impl Iterator<Item = &'a str>, can_retry: bool) -> Bytes {
    let detail: &[u8] = if can_retry {
        b"Rate limit exceeded; retry after the number of seconds in Retry-After."
    } else {
        b"This request costs more than the rate limit ever allows; it cannot succeed as it is."
    };
    problem_body(QUOTA_EXCEEDED, detail, violated)
}

/// A problem document: its type, title and status (`start`), a detail, and the
/// `violated-policies` member.
fn problem_body<'a>(start: &[u8], detail: &[u8], policies: impl Iterator<Item = &'a str>) -> Bytes {
    let mut body = <Buffer>::default();
    body.push(start)
        .push(detail)
        .push(b"\",\"violated-policies\":[");
    for (n, name) in policies.enumerate() {
        if n > 0 {
            body.push(b",");
        }
        // Rule names are validated to [A-Za-z0-9._-]: nothing to escape.
        body.push(b"\"").push(name.as_bytes()).push(b"\"");
    }
    body.push(b"]}");
    body.to_bytes()
}
