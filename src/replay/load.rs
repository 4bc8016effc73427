//! [`LoadCheck`]: a bounded open-loop load on a running endpoint, every answer counted and
//! compared with what a replay of the same arrivals predicts for the rules in force.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use axum::body::Body;
use http::{HeaderName, HeaderValue, Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::arrival::Arrival;
use super::report::Report;
use super::run::{Replay, ReplayError};
use crate::store::Store;

/// A load check of a running endpoint (staging, or a test's own servers): requests sent at a
/// fixed rate for a bounded time over a few connections, round-robin over one or more
/// addresses, each answer read; then the same arrivals (their send times, client address, path
/// and key) replayed through the rules you expect in force. The check fails, with both
/// figures, when the endpoint admitted more or fewer requests than the rules predict beyond
/// the tolerance, or when a request got no answer.
///
/// ```no_run
/// use std::time::Duration;
/// use tollgate::clock::ManualClock;
/// use tollgate::replay::{LoadCheck, Replay};
/// use tollgate::store::MemoryStore;
/// use tollgate::{Quota, RateLimitLayer, Rule};
///
/// # async fn check() -> Result<(), Box<dyn std::error::Error>> {
/// // The rules staging should enforce: 100 a minute per client IP.
/// let clock = ManualClock::default();
/// let expected = RateLimitLayer::builder()
///     .rule(Rule::new("per-minute", Quota::per_minute(100)))
///     .store(MemoryStore::builder().clock(clock.clone()).build()?);
/// let outcome = LoadCheck::new(["http://staging.internal:8080/hello".parse()?])
///     .rate(200)
///     .duration(Duration::from_secs(5))
///     .run(Replay::new(expected).clock(clock))
///     .await?; // fails when staging admits other than 100 ± the tolerance
/// println!("{outcome}");
/// # Ok(())
/// # }
/// ```
///
/// The load is open loop: request `n` is due at `n / rate` seconds, whatever the answers
/// before it, unless every connection of its address is still waiting for an answer (it then
/// goes as soon as one is free, and is counted as late). The replay uses the times requests
/// were really sent. Plain HTTP/1.1 only: aim it at an address behind your TLS terminator.
#[derive(Clone, Debug)]
#[must_use = "a load check does nothing until it is run"]
pub struct LoadCheck {
    targets: Vec<Uri>,
    rate: u32,
    duration: Duration,
    connections: usize,
    keys: Vec<String>,
    key_header: HeaderName,
    tolerance: Option<u64>,
}

/// What a load check sent, what the endpoint answered, and what the rules predict.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct LoadOutcome {
    /// Requests sent.
    pub sent: u64,
    /// Requests answered with anything but 429.
    pub admitted: u64,
    /// Requests answered with 429.
    pub denied: u64,
    /// Requests that got no answer (the connection failed).
    pub failed: u64,
    /// Requests sent later than due because every connection of their address was busy.
    pub late: u64,
    /// Answers by status.
    pub statuses: Vec<(StatusCode, u64)>,
    /// The replay of the same arrivals through the rules: the prediction.
    pub predicted: Report,
    /// How far the admitted count may be from the predicted one.
    pub tolerance: u64,
}

impl LoadOutcome {
    /// The share of answers that were 429.
    pub fn denied_share(&self) -> f64 {
        share(self.denied, self.sent)
    }

    /// Whether the endpoint admitted what the rules predict, within the tolerance, and
    /// answered every request.
    pub fn holds(&self) -> bool {
        self.failed == 0 && self.admitted.abs_diff(self.predicted.total.admitted) <= self.tolerance
    }
}

fn share(part: u64, of: u64) -> f64 {
    if of == 0 {
        0.0
    } else {
        part as f64 / of as f64
    }
}

impl fmt::Display for LoadOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let predicted = &self.predicted.total;
        write!(
            f,
            "the endpoint admitted {} of {} ({:.1} % 429s); the rules predict {} ({:.1} % 429s), \
             within ±{}",
            self.admitted,
            self.sent,
            self.denied_share() * 100.0,
            predicted.admitted,
            share(predicted.denied, predicted.requests) * 100.0,
            self.tolerance
        )?;
        if self.failed > 0 {
            write!(f, "; {} requests got no answer", self.failed)?;
        }
        if self.late > 0 {
            write!(f, "; {} sent late (every connection busy)", self.late)?;
        }
        Ok(())
    }
}

/// Why a load check failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum LoadCheckError {
    /// The check is set up wrong (no address, a rate of 0, an address that is not
    /// `http://host:port/path`).
    Config(String),
    /// An address could not be reached.
    Connect {
        /// The address.
        target: String,
        /// Why.
        error: std::io::Error,
    },
    /// The prediction could not be made.
    Replay(ReplayError),
    /// The endpoint did not do what the rules predict: both figures.
    Mismatch(Box<LoadOutcome>),
}

impl fmt::Display for LoadCheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadCheckError::Config(message) => write!(f, "load check: {message}"),
            LoadCheckError::Connect { target, error } => {
                write!(f, "load check: cannot connect to {target}: {error}")
            }
            LoadCheckError::Replay(e) => write!(f, "load check: the prediction failed: {e}"),
            LoadCheckError::Mismatch(outcome) => write!(f, "load check failed: {outcome}"),
        }
    }
}

impl std::error::Error for LoadCheckError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LoadCheckError::Connect { error, .. } => Some(error),
            LoadCheckError::Replay(e) => Some(e),
            _ => None,
        }
    }
}

/// One answered (or failed) request.
struct Sent {
    index: u64,
    at: Instant,
    peer: IpAddr,
    path: String,
    key: Option<String>,
    status: Option<StatusCode>,
    late: bool,
}

impl LoadCheck {
    /// A check of these addresses (`http://host:port/path`), taken in turn.
    pub fn new<I: IntoIterator<Item = Uri>>(targets: I) -> Self {
        LoadCheck {
            targets: targets.into_iter().collect(),
            rate: 100,
            duration: Duration::from_secs(5),
            connections: 4,
            keys: Vec::new(),
            key_header: HeaderName::from_static("x-api-key"),
            tolerance: None,
        }
    }

    /// Requests per second, in all (default 100).
    pub fn rate(mut self, per_second: u32) -> Self {
        self.rate = per_second;
        self
    }

    /// How long the load lasts (default 5 s).
    pub fn duration(mut self, duration: Duration) -> Self {
        self.duration = duration;
        self
    }

    /// Connections to each address (default 4).
    pub fn connections(mut self, per_target: usize) -> Self {
        self.connections = per_target;
        self
    }

    /// Keys sent in turn, one per request, in the key header (default: none sent).
    pub fn keys<I, S>(mut self, keys: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.keys = keys.into_iter().map(Into::into).collect();
        self
    }

    /// The header keys are sent in (default `x-api-key`).
    pub fn key_header(mut self, name: HeaderName) -> Self {
        self.key_header = name;
        self
    }

    /// How far the admitted count may be from the prediction (default: 1 % of the requests
    /// sent, at least 2). The endpoint decides each request when it arrives, on its own clock,
    /// a network and queueing delay after it was sent: a request sent just before a unit comes
    /// back may be decided just after, and the other way round.
    pub fn tolerance(mut self, requests: u64) -> Self {
        self.tolerance = Some(requests);
        self
    }

    /// Sends the load, then replays the same arrivals through `expected` (the rules that
    /// should be in force, on a store of their own) and compares.
    pub async fn run<St: Store>(self, expected: Replay<St>) -> Result<LoadOutcome, LoadCheckError> {
        let outcome = self.load_and_predict(expected).await?;
        if outcome.holds() {
            Ok(outcome)
        } else {
            Err(LoadCheckError::Mismatch(Box::new(outcome)))
        }
    }

    async fn load_and_predict<St: Store>(
        self,
        expected: Replay<St>,
    ) -> Result<LoadOutcome, LoadCheckError> {
        if self.targets.is_empty() {
            return Err(LoadCheckError::Config("no address to load".to_owned()));
        }
        if self.rate == 0 || self.connections == 0 {
            return Err(LoadCheckError::Config(
                "the rate and the connections must be at least 1".to_owned(),
            ));
        }
        for key in &self.keys {
            HeaderValue::from_str(key).map_err(|_| {
                LoadCheckError::Config(format!("the key `{key}` cannot be sent in a header"))
            })?;
        }
        let total = (self.duration.as_secs_f64() * f64::from(self.rate)).round() as u64;

        // Every connection first, so that a refused address fails before any load.
        let (done_sender, mut done) = mpsc::unbounded_channel::<Sent>();
        let mut lanes = Vec::new();
        for target in &self.targets {
            let (addr, host, path) = address_of(target)?;
            let mut target_lanes = Vec::new();
            for _ in 0..self.connections {
                let stream =
                    TcpStream::connect(&addr)
                        .await
                        .map_err(|error| LoadCheckError::Connect {
                            target: target.to_string(),
                            error,
                        })?;
                let _ = stream.set_nodelay(true);
                let peer = stream.local_addr().map(|a| a.ip()).map_err(|error| {
                    LoadCheckError::Connect {
                        target: target.to_string(),
                        error,
                    }
                })?;
                let (sender, connection) =
                    hyper::client::conn::http1::handshake(TokioIo::new(stream))
                        .await
                        .map_err(|e| LoadCheckError::Connect {
                            target: target.to_string(),
                            error: std::io::Error::other(e),
                        })?;
                tokio::spawn(connection);
                let (queue, requests) = mpsc::unbounded_channel::<(u64, Instant, Option<String>)>();
                let lane = Lane {
                    sender,
                    peer,
                    host: host.clone(),
                    path: path.clone(),
                    key_header: self.key_header.clone(),
                    done: done_sender.clone(),
                };
                tokio::spawn(lane.serve(requests));
                target_lanes.push(queue);
            }
            lanes.push(target_lanes);
        }
        drop(done_sender);

        // The schedule: request n due at n / rate, to address n mod targets, its connections in
        // turn.
        let started = Instant::now();
        let interval = 1.0 / f64::from(self.rate);
        for n in 0..total {
            let due = started + Duration::from_secs_f64(n as f64 * interval);
            tokio::time::sleep_until(due).await;
            let target = &lanes[(n % lanes.len() as u64) as usize];
            let lane = &target[((n / lanes.len() as u64) % target.len() as u64) as usize];
            let key = (!self.keys.is_empty())
                .then(|| self.keys[(n % self.keys.len() as u64) as usize].clone());
            let _ = lane.send((n, due, key));
        }
        drop(lanes);

        let mut sent = Vec::with_capacity(total as usize);
        while let Some(request) = done.recv().await {
            sent.push(request);
        }
        sent.sort_by_key(|s| (s.at, s.index));

        let mut outcome = LoadOutcome {
            sent: sent.len() as u64,
            admitted: 0,
            denied: 0,
            failed: 0,
            late: 0,
            statuses: Vec::new(),
            predicted: Report::default(),
            tolerance: self
                .tolerance
                .unwrap_or_else(|| (sent.len() as u64 / 100).max(2)),
        };
        for request in &sent {
            outcome.late += u64::from(request.late);
            match request.status {
                None => outcome.failed += 1,
                Some(StatusCode::TOO_MANY_REQUESTS) => outcome.denied += 1,
                Some(_) => outcome.admitted += 1,
            }
            if let Some(status) = request.status {
                match outcome.statuses.iter_mut().find(|(s, _)| *s == status) {
                    Some((_, count)) => *count += 1,
                    None => outcome.statuses.push((status, 1)),
                }
            }
        }
        outcome.statuses.sort();

        let arrivals = sent
            .into_iter()
            .filter(|request| request.status.is_some())
            .map(|request| {
                let at = request.at.saturating_duration_since(started);
                let mut arrival = Arrival::get(at, request.path).ip(request.peer);
                arrival.key = request.key;
                arrival
            });
        outcome.predicted = expected
            .run(arrivals)
            .await
            .map_err(LoadCheckError::Replay)?;
        Ok(outcome)
    }
}

/// `http://host:port/path` as the address to connect to, the `Host` header and the path.
fn address_of(target: &Uri) -> Result<(String, String, String), LoadCheckError> {
    let bad = |why: &str| {
        LoadCheckError::Config(format!(
            "the address `{target}` {why} (like http://127.0.0.1:3000/hello)"
        ))
    };
    if target.scheme_str() != Some("http") {
        return Err(bad("is not http://"));
    }
    let authority = target.authority().ok_or_else(|| bad("has no host"))?;
    let port = authority.port_u16().unwrap_or(80);
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let addr = match host.parse::<IpAddr>() {
        Ok(ip) => SocketAddr::new(ip, port).to_string(),
        Err(_) => format!("{host}:{port}"),
    };
    let path = target
        .path_and_query()
        .map_or("/".to_owned(), |p| p.as_str().to_owned());
    Ok((addr, authority.as_str().to_owned(), path))
}

/// One connection: sends its requests in order, each after the answer before it.
struct Lane {
    sender: hyper::client::conn::http1::SendRequest<Body>,
    peer: IpAddr,
    host: String,
    path: String,
    key_header: HeaderName,
    done: mpsc::UnboundedSender<Sent>,
}

impl Lane {
    async fn serve(
        mut self,
        mut requests: mpsc::UnboundedReceiver<(u64, Instant, Option<String>)>,
    ) {
        let mut failed = false;
        while let Some((index, due, key)) = requests.recv().await {
            let at = Instant::now();
            let late = at.saturating_duration_since(due) > Duration::from_millis(5);
            // A connection that failed sends nothing more: its requests count as failed.
            let status = if failed {
                None
            } else {
                self.send(key.as_deref()).await
            };
            failed |= status.is_none();
            let _ = self.done.send(Sent {
                index,
                at,
                peer: self.peer,
                path: self.path.clone(),
                key,
                status,
                late,
            });
        }
    }

    async fn send(&mut self, key: Option<&str>) -> Option<StatusCode> {
        let mut request = Request::get(self.path.as_str())
            .header(http::header::HOST, self.host.as_str())
            .body(Body::empty())
            .ok()?;
        if let Some(key) = key {
            request
                .headers_mut()
                .insert(self.key_header.clone(), HeaderValue::from_str(key).ok()?);
        }
        self.sender.ready().await.ok()?;
        let response = self.sender.send_request(request).await.ok()?;
        let status = response.status();
        axum::body::to_bytes(Body::new(response.into_body()), 1 << 20)
            .await
            .ok()?;
        Some(status)
    }
}
