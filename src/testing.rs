//! Testing your limits (feature `testing`): tollgate's answers in typed form, and a layer on a
//! clock you move.
//!
//! ```
//! use std::time::Duration;
//! use axum::{Router, body::Body, routing::get};
//! use http::Request;
//! use tollgate::clock::ManualClock;
//! use tollgate::key::Global;
//! use tollgate::store::MemoryStore;
//! use tollgate::testing::{Budget, Problem};
//! use tollgate::{Quota, RateLimitLayer, Rule};
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // A store on a clock of the test's own: no sleeping.
//! let clock = ManualClock::default();
//! let store = MemoryStore::builder().clock(clock.clone()).build()?;
//! let layer = RateLimitLayer::builder()
//!     .rule(Rule::new("api", Quota::per_minute(2)).key(Global))
//!     .store(store.clone())
//!     .build()?;
//! let app = Router::new().route("/", get(|| async { "ok" })).layer(layer);
//! let get = || Request::get("/").body(Body::empty()).unwrap();
//!
//! let first = app.clone().oneshot(get()).await?;
//! assert_eq!(Budget::of(first.headers())?.limit("api").unwrap().remaining, 1);
//! app.clone().oneshot(get()).await?;
//! let denied = app.clone().oneshot(get()).await?;
//! let budget = Budget::of(denied.headers())?;
//! assert_eq!(budget.retry_after, Some(30));
//! let problem = Problem::of(&axum::body::to_bytes(denied.into_body(), 4096).await?)?;
//! assert_eq!(problem.violated_policies, ["api"]);
//!
//! // Half a minute later, one request more; and every budget back for the next test.
//! clock.advance(Duration::from_secs(30));
//! assert_eq!(app.clone().oneshot(get()).await?.status(), 200);
//! store.clear();
//! # Ok(())
//! # }
//! ```

use std::fmt;

use http::HeaderMap;

/// One item of `RateLimit-Policy`: a rule's quota.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyItem {
    /// The rule's name.
    pub name: String,
    /// `q`: the quota.
    pub quota: u64,
    /// `w`: its window, in seconds.
    pub window: Option<u64>,
    /// `qu`: the quota's unit, when it is not requests (`concurrent-requests`).
    pub unit: Option<String>,
}

/// One item of `RateLimit`: what is left of a rule's budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitItem {
    /// The rule's name.
    pub name: String,
    /// `r`: what remains.
    pub remaining: u64,
    /// `t`: the seconds within which no more than `remaining` can be used (none for a
    /// concurrency limit).
    pub reset: Option<u64>,
}

/// The budget fields of an answer: `RateLimit-Policy`, `RateLimit` and `Retry-After`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Budget {
    /// The items of `RateLimit-Policy`, in order.
    pub policies: Vec<PolicyItem>,
    /// The items of `RateLimit`, in order.
    pub limits: Vec<LimitItem>,
    /// `Retry-After`, in seconds.
    pub retry_after: Option<u64>,
}

/// A field tollgate would not have written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError(String);

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ParseError {}

impl Budget {
    /// The budget fields of these headers (all of them empty when there are none).
    pub fn of(headers: &HeaderMap) -> Result<Budget, ParseError> {
        let text = |name: &str| -> Result<Option<&str>, ParseError> {
            headers
                .get(name)
                .map(|v| {
                    v.to_str()
                        .map_err(|_| ParseError(format!("{name} is not text")))
                })
                .transpose()
        };
        // A list field may come in several header lines: one list, joined (RFC 9651, 4.2).
        let list = |name: &str| -> Result<Option<String>, ParseError> {
            let mut joined: Option<String> = None;
            for value in headers.get_all(name) {
                let value = value
                    .to_str()
                    .map_err(|_| ParseError(format!("{name} is not text")))?;
                match &mut joined {
                    Some(list) => {
                        list.push_str(", ");
                        list.push_str(value);
                    }
                    None => joined = Some(value.to_owned()),
                }
            }
            Ok(joined)
        };
        let mut budget = Budget::default();
        if let Some(policy) = list("ratelimit-policy")?.as_deref() {
            for (name, params) in items(policy)? {
                budget.policies.push(PolicyItem {
                    quota: number(&params, "q")?
                        .ok_or_else(|| ParseError(format!("policy \"{name}\" has no q")))?,
                    window: number(&params, "w")?,
                    unit: params
                        .iter()
                        .find(|(k, _)| k == "qu")
                        .map(|(_, v)| v.trim_matches('"').to_owned()),
                    name,
                });
            }
        }
        if let Some(limit) = list("ratelimit")?.as_deref() {
            for (name, params) in items(limit)? {
                let field = |key: &str| {
                    number(&params, key)?
                        .ok_or_else(|| ParseError(format!("limit \"{name}\" has no {key}")))
                };
                budget.limits.push(LimitItem {
                    remaining: field("r")?,
                    reset: number(&params, "t")?,
                    name,
                });
            }
        }
        budget.retry_after = text("retry-after")?
            .map(|v| {
                v.trim()
                    .parse()
                    .map_err(|_| ParseError(format!("Retry-After {v:?} is not seconds")))
            })
            .transpose()?;
        Ok(budget)
    }

    /// The `RateLimit-Policy` item of a rule.
    pub fn policy(&self, name: &str) -> Option<&PolicyItem> {
        self.policies.iter().find(|p| p.name == name)
    }

    /// The `RateLimit` item of a rule.
    pub fn limit(&self, name: &str) -> Option<&LimitItem> {
        self.limits.iter().find(|l| l.name == name)
    }
}

/// `"name";k=v;k=v, "other";k=v`: the items of a structured-field list, as tollgate writes it.
type Params = Vec<(String, String)>;

fn items(field: &str) -> Result<Vec<(String, Params)>, ParseError> {
    field
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| {
            let mut parts = item.split(';');
            let name = parts.next().unwrap_or_default().trim();
            let name = name
                .strip_prefix('"')
                .and_then(|n| n.strip_suffix('"'))
                .ok_or_else(|| ParseError(format!("{item:?} does not start with a quoted name")))?
                .to_owned();
            let params = parts
                .map(|param| {
                    let (key, value) = param
                        .split_once('=')
                        .ok_or_else(|| ParseError(format!("{param:?} is not key=value")))?;
                    Ok((key.trim().to_owned(), value.trim().to_owned()))
                })
                .collect::<Result<Params, ParseError>>()?;
            Ok((name, params))
        })
        .collect()
}

fn number(params: &Params, key: &str) -> Result<Option<u64>, ParseError> {
    params
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| {
            v.parse()
                .map_err(|_| ParseError(format!("{key}={v} is not a number")))
        })
        .transpose()
}

/// An RFC 9457 problem body, as tollgate writes its 429, 503 and 403.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// `type`.
    pub problem_type: String,
    /// `title`.
    pub title: String,
    /// `status`.
    pub status: u16,
    /// `detail`.
    pub detail: Option<String>,
    /// `violated-policies`: the rules that denied.
    pub violated_policies: Vec<String>,
}

impl Problem {
    /// The problem in a response body.
    pub fn of(body: &[u8]) -> Result<Problem, ParseError> {
        let value: serde_json::Value = serde_json::from_slice(body)
            .map_err(|e| ParseError(format!("not a JSON problem: {e}")))?;
        let text = |key: &str| value.get(key).and_then(|v| v.as_str()).map(str::to_owned);
        Ok(Problem {
            problem_type: text("type").ok_or_else(|| ParseError("no type".into()))?,
            title: text("title").ok_or_else(|| ParseError("no title".into()))?,
            status: value
                .get("status")
                .and_then(|v| v.as_u64())
                .and_then(|v| u16::try_from(v).ok())
                .ok_or_else(|| ParseError("no status".into()))?,
            detail: text("detail"),
            violated_policies: value
                .get("violated-policies")
                .and_then(|v| v.as_array())
                .map(|names| {
                    names
                        .iter()
                        .filter_map(|n| n.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_in_several_header_lines_is_one_list() {
        let mut headers = HeaderMap::new();
        headers.append("ratelimit-policy", "\"a\";q=10;w=60".parse().unwrap());
        headers.append(
            "ratelimit-policy",
            "\"b\";q=2;qu=\"concurrent-requests\"".parse().unwrap(),
        );
        headers.append("ratelimit", "\"a\";r=9;t=6".parse().unwrap());
        headers.append("ratelimit", "\"b\";r=1".parse().unwrap());
        let budget = Budget::of(&headers).unwrap();
        let names: Vec<&str> = budget.policies.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(
            budget.policies[1].unit.as_deref(),
            Some("concurrent-requests")
        );
        assert_eq!(budget.limit("b").unwrap().remaining, 1);
        assert_eq!(budget.limit("a").unwrap().reset, Some(6));
        assert_eq!(budget.limit("b").unwrap().reset, None);
    }
}
