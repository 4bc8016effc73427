use std::sync::{Arc, OnceLock};

use http::header::{HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};

use super::buffer::Buffer;
use crate::Decision;
use crate::algorithm::{MICROS_PER_SECOND, Outcome};
use crate::clock::unix_micros;
use crate::store::RuleSpec;

/// Which budget headers to send.
///
/// ```
/// use tollgate::{Headers, ResetFormat};
///
/// let default = Headers::default(); // IETF RateLimit + RateLimit-Policy
/// assert_eq!(default, Headers::ietf());
/// let github_style = Headers::none().with_legacy(ResetFormat::EpochSeconds);
/// # let _ = github_style;
/// ```
///
/// * IETF (draft-ietf-httpapi-ratelimit-headers-11), one list item per rule:
///   `RateLimit-Policy: "burst";q=100;w=60` and `RateLimit: "burst";r=50;t=30`. `q` is the quota
///   and `w` its window in seconds (for token bucket and GCRA, the burst and the time to refill
///   it); `r` is what remains and `t` the effective window: the seconds within which the client
///   can use no more than `r`, that is until one more unit is available (rounded up, never 0).
///   A [concurrency limit](crate::Rule::concurrent) says `qu="concurrent-requests"` and no
///   window: `RateLimit-Policy: "searches";q=20;qu="concurrent-requests"`,
///   `RateLimit: "searches";r=3` (the free slots).
/// * Legacy `X-RateLimit-Limit` / `-Remaining` / `-Reset` for the most constrained rule (the
///   one that denied, or the one with the least left), with `Reset` as seconds from now or as a
///   Unix time.
///
/// `Retry-After` is always sent on a denial (unless the request can never be admitted), in whole
/// seconds rounded up: a request sent that much later is admitted. It is never earlier than the
/// end of the effective window `t` of a policy that denied (draft-11 §6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Headers {
    ietf: bool,
    legacy: Option<ResetFormat>,
}

impl Headers {
    /// Whether the draft-11 fields are sent.
    pub(crate) fn sends_ietf(self) -> bool {
        self.ietf
    }
}

/// How `X-RateLimit-Reset` is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ResetFormat {
    /// Seconds from now, rounded up.
    DeltaSeconds,
    /// A Unix time in seconds, rounded up (as GitHub does).
    EpochSeconds,
}

impl Headers {
    /// The IETF `RateLimit` and `RateLimit-Policy` fields (the default).
    pub const fn ietf() -> Self {
        Headers {
            ietf: true,
            legacy: None,
        }
    }

    /// No budget headers (denials still carry `Retry-After`).
    pub const fn none() -> Self {
        Headers {
            ietf: false,
            legacy: None,
        }
    }

    /// Adds `X-RateLimit-Limit`, `-Remaining` and `-Reset`.
    pub const fn with_legacy(mut self, reset: ResetFormat) -> Self {
        self.legacy = Some(reset);
        self
    }

    /// Drops the IETF fields.
    pub const fn without_ietf(mut self) -> Self {
        self.ietf = false;
        self
    }
}

impl Default for Headers {
    fn default() -> Self {
        Headers::ietf()
    }
}

pub(crate) static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub(crate) static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
static X_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
static X_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
static X_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// The `RateLimit-Policy` items of a layer's rules, and the start of each rule's `RateLimit`
/// item, rendered once.
pub(crate) struct PolicyItems {
    items: Box<[String]>,
    /// Each item as a field value of its own: a request that one rule limits (the common case,
    /// with or without a policy) shares it.
    item_values: Box<[HeaderValue]>,
    all: HeaderValue,
    /// `"name";r=` per rule.
    budget_prefixes: Box<[Box<[u8]>]>,
    /// Per rule: whether its `RateLimit` item has a `t` (a concurrency limit has no window).
    windows: Box<[bool]>,
}

impl PolicyItems {
    pub(crate) fn new(rules: &[Arc<RuleSpec>]) -> Self {
        let items: Box<[String]> = rules
            .iter()
            .map(|rule| {
                let (quota, window) = rule.policy();
                if rule.algorithm().is_concurrency() {
                    // draft-11 §3.1.2: a quota of concurrent requests has no window.
                    format!("\"{}\";q={quota};qu=\"concurrent-requests\"", rule.name())
                } else {
                    format!("\"{}\";q={quota};w={window}", rule.name())
                }
            })
            .collect();
        let all = HeaderValue::from_str(&items.join(", ")).unwrap_or(HeaderValue::from_static(""));
        let item_values = items
            .iter()
            .map(|item| HeaderValue::from_str(item).unwrap_or(HeaderValue::from_static("")))
            .collect();
        let budget_prefixes = rules
            .iter()
            .map(|rule| format!("\"{}\";r=", rule.name()).into_bytes().into())
            .collect();
        PolicyItems {
            items,
            item_values,
            all,
            budget_prefixes,
            windows: rules
                .iter()
                .map(|rule| !rule.algorithm().is_concurrency())
                .collect(),
        }
    }

    fn value(&self, applied: &[u16], total: usize) -> HeaderValue {
        if applied.len() == total {
            return self.all.clone();
        }
        if let [one] = applied {
            return self.item_values[usize::from(*one)].clone();
        }
        let mut out = <Buffer>::default();
        for &i in applied {
            if !out.is_empty() {
                out.push(b", ");
            }
            out.push(self.items[usize::from(i)].as_bytes());
        }
        out.header_value()
    }
}

/// `Retry-After` values up to an hour are made once and shared.
fn retry_after_value(seconds: u64) -> HeaderValue {
    static COMMON: OnceLock<Box<[HeaderValue]>> = OnceLock::new();
    let common = COMMON.get_or_init(|| (0..=3600u64).map(HeaderValue::from).collect());
    usize::try_from(seconds)
        .ok()
        .and_then(|i| common.get(i))
        .cloned()
        .unwrap_or_else(|| HeaderValue::from(seconds))
}

fn seconds_up(micros: u64) -> u64 {
    micros.div_ceil(MICROS_PER_SECOND)
}

/// Adds the budget headers (and `Retry-After` for a denial) of `decision` to `headers`.
pub(crate) fn write_budget(
    headers: &mut HeaderMap,
    style: Headers,
    rule_count: usize,
    policies: &PolicyItems,
    applied: &[u16],
    decision: &Decision,
) {
    let outcomes = decision.outcomes();
    if !decision.allowed()
        && let Some(seconds) = decision.retry_after_seconds()
    {
        headers.insert(RETRY_AFTER, retry_after_value(seconds));
    }
    if outcomes.is_empty() {
        return;
    }
    if style.ietf {
        headers.append(&RATELIMIT_POLICY, policies.value(applied, rule_count));
        let mut value = Buffer::<128>::default();
        for (&i, outcome) in applied.iter().zip(outcomes) {
            if !value.is_empty() {
                value.push(b", ");
            }
            value
                .push(&policies.budget_prefixes[usize::from(i)])
                .push_u64(outcome.remaining);
            // A concurrency limit's slots come back when responses end: no time to promise.
            if policies.windows[usize::from(i)] {
                value.push(b";t=").push_u64(seconds_up(outcome.window));
            }
        }
        headers.append(&RATELIMIT, value.header_value());
    }
    if let Some(format) = style.legacy {
        if headers.contains_key(&X_LIMIT) {
            // An inner (more specific) layer already described its limit.
            return;
        }
        let at = binding_outcome(outcomes);
        let binding = &outcomes[at];
        // A concurrency limit resets when a slot comes back: its estimate, not its longest hold.
        let reset_micros = if applied
            .get(at)
            .is_some_and(|&i| !policies.windows[usize::from(i)])
        {
            binding.window
        } else {
            binding.reset
        };
        let reset = seconds_up(reset_micros);
        let reset = match format {
            ResetFormat::DeltaSeconds => reset,
            ResetFormat::EpochSeconds => seconds_up(unix_micros().saturating_add(reset_micros)),
        };
        headers.insert(&X_LIMIT, HeaderValue::from(binding.limit));
        headers.insert(&X_REMAINING, HeaderValue::from(binding.remaining));
        headers.insert(&X_RESET, HeaderValue::from(reset));
    }
}

/// The rule that constrains the client most: the denying one with the longest wait, else the
/// one with the least left.
fn binding_outcome(outcomes: &[Outcome]) -> usize {
    outcomes
        .iter()
        .enumerate()
        .filter(|(_, o)| !o.allowed)
        .max_by_key(|(_, o)| o.retry_after)
        .or_else(|| outcomes.iter().enumerate().min_by_key(|(_, o)| o.remaining))
        .map_or(0, |(i, _)| i)
}
