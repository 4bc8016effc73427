//! [`Arrival`]: one recorded request, as much of it as a policy keys on.

use std::net::IpAddr;
use std::time::Duration;

use http::{HeaderName, HeaderValue, Method};

/// One request of recorded traffic: when it came, from where, to what, and who sent it.
///
/// ```
/// use std::time::Duration;
/// use tollgate::replay::Arrival;
///
/// let arrival = Arrival::get(Duration::from_millis(250), "/search")
///     .ip("203.0.113.7".parse().unwrap())
///     .key("pro-1");
/// assert_eq!(arrival.path, "/search");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Arrival {
    /// When it came, since the Unix epoch (a file's timestamp). A replay on a clock sets the
    /// store's clock to it; one in real time keeps the differences from the first arrival.
    /// Arrivals made in code may count from 0: windows then start at whole multiples of their
    /// length from it.
    pub at: Duration,
    /// The client's address: the socket peer the layer sees (none: a request without one).
    pub ip: Option<IpAddr>,
    /// Its method.
    pub method: Method,
    /// Its path and query (`/search?q=x`).
    pub path: String,
    /// Its API key or tenant key, sent in the replay's key header (default `x-api-key`).
    pub key: Option<String>,
    /// Its cost, sent in the replay's cost header when one is set
    /// ([`Replay::cost_header`](super::Replay::cost_header)).
    pub cost: Option<u64>,
    /// What it really cost, as its handler reported it when it was recorded (an
    /// [`ActualCost`](crate::ActualCost), a usage header): a [`settle`](crate::Rule::settle)
    /// rule is settled at it. None (the default, and what older records have): the rule keeps
    /// its estimate, as for a response that reports no cost.
    pub actual_cost: Option<u64>,
    /// Other request headers.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The status it was answered with when it was recorded, if known: a replay that admits
    /// it answers with it (`200 OK` when unknown, or when it is `429`, a refusal by the limits
    /// of the day, which hides what the service would have answered).
    pub status: Option<u16>,
    /// The line of the file it was read from (none for arrivals made in code).
    pub line: Option<u64>,
}

impl Arrival {
    /// A request of `method` to `path` at `at`.
    pub fn new(at: Duration, method: Method, path: impl Into<String>) -> Self {
        Arrival {
            at,
            ip: None,
            method,
            path: path.into(),
            key: None,
            cost: None,
            actual_cost: None,
            headers: Vec::new(),
            status: None,
            line: None,
        }
    }

    /// A `GET` of `path` at `at`.
    pub fn get(at: Duration, path: impl Into<String>) -> Self {
        Self::new(at, Method::GET, path)
    }

    /// Sets the client's address.
    pub fn ip(mut self, ip: IpAddr) -> Self {
        self.ip = Some(ip);
        self
    }

    /// Sets the API key (or whatever the replay's key header carries).
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Sets the cost.
    pub fn cost(mut self, cost: u64) -> Self {
        self.cost = Some(cost);
        self
    }

    /// Sets what it really cost when it was recorded.
    pub fn actual_cost(mut self, units: u64) -> Self {
        self.actual_cost = Some(units);
        self
    }

    /// Adds a request header.
    pub fn header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.headers.push((name, value));
        self
    }

    /// Sets the status it was answered with when recorded.
    pub fn status(mut self, status: u16) -> Self {
        self.status = Some(status);
        self
    }

    /// Sets the line of the file it came from.
    pub fn line(mut self, line: u64) -> Self {
        self.line = Some(line);
        self
    }

    /// Where it came from, for error messages: `line N` or `arrival N` (counted from 1).
    pub(super) fn place(&self, index: usize) -> String {
        match self.line {
            Some(line) => format!("line {line}"),
            None => format!("arrival {}", index + 1),
        }
    }
}
