use std::fmt::Write;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Response, StatusCode};

use crate::algorithm::{MICROS_PER_SECOND, Outcome};
use crate::decision::Decision;
use crate::policy::CompiledRule;

/// What a custom denied-response function is told: each rule checked for the request, and how
/// long to wait.
///
/// ```
/// use bytes::Bytes;
/// use tollgate::{Quota, RateLimitLayer, Rule};
///
/// let layer = RateLimitLayer::builder()
///     .rule(Rule::new("api", Quota::per_minute(100)))
///     .on_denied(|denied: &tollgate::response::RateLimited| {
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
    pub(crate) fn new(rules: &[CompiledRule], applied: &[u16], decision: &Decision) -> Self {
        RateLimited {
            rules: applied
                .iter()
                .zip(decision.outcomes())
                .map(|(&i, o)| (rules[usize::from(i)].spec.name().to_owned(), *o))
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

static PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

/// The default 429 answer: an RFC 9457 problem document naming the violated policies.
pub(crate) fn problem_response(
    rules: &[CompiledRule],
    applied: &[u16],
    decision: &Decision,
) -> Response<Bytes> {
    let retry = decision.retry_after_seconds();
    let mut body = String::with_capacity(256);
    body.push_str(
        "{\"type\":\"https://www.rfc-editor.org/rfc/rfc6585#section-4\",\"title\":\"Too Many Requests\",\"status\":429,\"detail\":\"",
    );
    match retry {
        Some(1) => body.push_str("Rate limit exceeded; retry in 1 second."),
        Some(s) => {
            let _ = write!(body, "Rate limit exceeded; retry in {s} seconds.");
        }
        None => body.push_str("This request costs more than the rate limit ever allows."),
    }
    body.push_str("\",\"violated_policies\":[");
    let mut first = true;
    for (&i, outcome) in applied.iter().zip(decision.outcomes()) {
        if outcome.allowed {
            continue;
        }
        if !first {
            body.push(',');
        }
        first = false;
        // Rule names are validated to [A-Za-z0-9._-]: nothing to escape.
        let _ = write!(
            body,
            "{{\"policy\":\"{}\",\"limit\":{},\"remaining\":{},\"reset\":{}",
            rules[usize::from(i)].spec.name(),
            outcome.limit,
            outcome.remaining,
            outcome.reset.div_ceil(MICROS_PER_SECOND),
        );
        if outcome.retry_after != u64::MAX {
            let _ = write!(
                body,
                ",\"retry_after\":{}",
                outcome.retry_after.div_ceil(MICROS_PER_SECOND).max(1)
            );
        }
        body.push('}');
    }
    body.push_str("]}");
    let mut response = Response::new(Bytes::from(body));
    *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, PROBLEM_JSON.clone());
    response
}
