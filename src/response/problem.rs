use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Response, StatusCode};

use crate::algorithm::Outcome;
use crate::decision::Decision;
use crate::policy::CompiledRule;
use crate::response::buffer::Buffer;

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

pub(crate) static PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

const TYPE_AND_TITLE: &[u8] =
    b"{\"type\":\"https://www.rfc-editor.org/rfc/rfc6585#section-4\",\"title\":\"Too Many Requests\",\"status\":429,\"detail\":\"";

/// The 429 documents of a layer's rules, written once: the body names the violated policies and
/// points to `Retry-After` (the budget headers carry the numbers), so it does not change from one
/// denial to the next.
pub(crate) struct ProblemBodies {
    /// The body when only rule `i` denied.
    single: Box<[Bytes]>,
}

impl ProblemBodies {
    pub(crate) fn new(rules: &[CompiledRule]) -> Self {
        ProblemBodies {
            single: rules
                .iter()
                .map(|rule| problem_body([rule.spec.name()].into_iter(), true))
                .collect(),
        }
    }
}

/// Writes a problem document for these violated policies.
fn problem_body<'a>(violated: impl Iterator<Item = &'a str> + Clone, can_retry: bool) -> Bytes {
    let mut body = <Buffer>::default();
    body.push(TYPE_AND_TITLE);
    if can_retry {
        body.push(b"Rate limit exceeded; retry after the number of seconds in Retry-After.");
    } else {
        body.push(
            b"This request costs more than the rate limit ever allows; it cannot succeed as it is.",
        );
    }
    body.push(b"\",\"violated_policies\":[");
    for (n, name) in violated.enumerate() {
        if n > 0 {
            body.push(b",");
        }
        // Rule names are validated to [A-Za-z0-9._-]: nothing to escape.
        body.push(b"\"").push(name.as_bytes()).push(b"\"");
    }
    body.push(b"]}");
    body.to_bytes()
}

/// The default 429 answer: an RFC 9457 problem document naming the violated policies.
pub(crate) fn problem_response(
    rules: &[CompiledRule],
    bodies: &ProblemBodies,
    applied: &[u16],
    decision: &Decision,
) -> Response<Bytes> {
    let can_retry = decision.retry_after_seconds().is_some();
    let mut violated = applied
        .iter()
        .zip(decision.outcomes())
        .filter(|(_, o)| !o.allowed)
        .map(|(&i, _)| usize::from(i));
    let body = match (violated.next(), violated.next()) {
        (Some(only), None) if can_retry => bodies.single[only].clone(),
        _ => {
            let names = applied
                .iter()
                .zip(decision.outcomes())
                .filter(|(_, o)| !o.allowed)
                .map(|(&i, _)| rules[usize::from(i)].spec.name());
            problem_body(names, can_retry)
        }
    };
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    let headers = response.headers_mut();
    headers.reserve(6);
    headers.insert(CONTENT_TYPE, PROBLEM_JSON.clone());
    response
}
