//! [`LoadCheck`]: a bounded open-loop load on a running endpoint, every answer counted and
//! compared with what a replay of the same arrivals predicts for the rules in force.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use http::{HeaderName, HeaderValue, Request, StatusCode, Uri};
use http_body::Body as _;
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::{Mutex, mpsc};
use tokio::task::JoinSet;
use tokio::time::{Instant, timeout};

use super::arrival::Arrival;
use super::report::Report;
use super::run::{Replay, ReplayError};
use crate::store::Store;

/// The most requests one check sends.
const MAX_REQUESTS: u64 = 1_000_000;

/// A load check of a running endpoint (staging, or a test's own servers): requests sent at a
/// fixed rate for a bounded time over a few connections, round-robin over one or more
/// addresses, each answer read; then the same arrivals (their send times, client address, path
/// and key, and the status each was answered with, as [`Replay`] answers it) replayed through
/// the rules you expect in force. The check fails, with both
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
///     .await?; // fails unless staging admits about 108: 100, and 5 s of 100 a minute
/// println!("{outcome}");
/// # Ok(())
/// # }
/// ```
///
/// The load is open loop: request `n` is due at `n / rate` seconds, whatever the answers
/// before it; the first free connection of its address sends it (one sent more than 5 ms after
/// its time is counted as late: every connection was busy, or this process was). A connection
/// the server closes is opened again; a request not answered within the
/// [`timeout`](LoadCheck::timeout) counts as failed. The replay uses the times requests were
/// really sent, on the wall clock (so that windows begin where the server's began), and the
/// connection's local address as the client's: behind NAT or a proxy that adds
/// `X-Forwarded-For`, the server sees another. Plain HTTP/1.1 only: aim it at an address behind
/// your TLS terminator.
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
    timeout: Duration,
}

/// What a load check sent, what the endpoint answered, and what the rules predict.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct LoadOutcome {
    /// Requests sent (or tried: see `failed`).
    pub sent: u64,
    /// Requests the endpoint let through: answered with anything but 429, 403 or 503.
    pub admitted: u64,
    /// Requests answered with 429.
    pub denied: u64,
    /// Requests answered with 403 or 503: refused by a deny list, a store failing closed or
    /// shedding (the rules' replay counts them as not admitted, as it does 429s).
    pub refused: u64,
    /// Requests that got no answer: the connection failed or could not be opened again, or
    /// the answer took longer than the timeout.
    pub failed: u64,
    /// Requests sent more than 5 ms after their time.
    pub late: u64,
    /// Answers by status.
    pub statuses: Vec<(StatusCode, u64)>,
    /// The replay of the same arrivals through the rules: the prediction.
    pub predicted: Report,
    /// How far the admitted count may be from the predicted one.
    pub tolerance: u64,
}

impl LoadOutcome {
    /// The share of requests answered with 429.
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
        if self.refused > 0 {
            write!(f, "; {} refused with 403 or 503", self.refused)?;
        }
        if self.failed > 0 {
            write!(f, "; {} requests got no answer", self.failed)?;
        }
        if self.late > 0 {
            write!(f, "; {} sent more than 5 ms late", self.late)?;
        }
        Ok(())
    }
}

/// Why a load check failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum LoadCheckError {
    /// The check is set up wrong (no address, a rate or a duration that makes no request or
    /// more than a million, an address that is not `http://host:port/path`).
    Config(String),
    /// An address could not be reached before the load began.
    Connect {
        /// The address.
        target: String,
        /// Why.
        error: std::io::Error,
    },
    /// The prediction could not be made.
    Replay(ReplayError),
    /// The endpoint did not do what the rules predict, or did not answer: both figures.
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
    at: SystemTime,
    peer: IpAddr,
    path: String,
    key: Option<String>,
    status: Option<StatusCode>,
    late: bool,
}

/// A request due: its number, when, and its key.
type Due = (u64, Instant, Option<String>);

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
            timeout: Duration::from_secs(10),
        }
    }

    /// Requests per second, in all (default 100).
    pub fn rate(mut self, per_second: u32) -> Self {
        self.rate = per_second;
        self
    }

    /// How long the load lasts (default 5 s). `rate × duration` requests are sent: at least
    /// one, at most a million.
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

    /// The longest wait for a connection to open or for an answer (default 10 s): a request
    /// not answered by then counts as failed, and its connection is opened again.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
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
        let total = self.requests()?;
        // Every connection first, so that a refused address fails before any load. The tasks
        // end with the check, or when it is dropped.
        let mut tasks = JoinSet::new();
        let (done_sender, mut done) = mpsc::unbounded_channel::<Sent>();
        let mut queues = Vec::with_capacity(self.targets.len());
        for target in &self.targets {
            let (addr, host, path) = address_of(target)?;
            let (queue, due) = mpsc::unbounded_channel::<Due>();
            let due = Arc::new(Mutex::new(due));
            for _ in 0..self.connections {
                let connection = open(&addr, self.timeout, &mut tasks)
                    .await
                    .map_err(|error| LoadCheckError::Connect {
                        target: target.to_string(),
                        error,
                    })?;
                let lane = Lane {
                    addr: addr.clone(),
                    host: host.clone(),
                    path: path.clone(),
                    key_header: self.key_header.clone(),
                    timeout: self.timeout,
                    connection: Some(connection),
                    done: done_sender.clone(),
                };
                tasks.spawn(lane.serve(due.clone()));
            }
            queues.push(queue);
        }
        drop(done_sender);

        // The schedule: request n due at n / rate, to address n mod targets.
        let started = Instant::now();
        let wall_start = SystemTime::now();
        let interval = 1.0 / f64::from(self.rate);
        for n in 0..total {
            let due = started + Duration::from_secs_f64(n as f64 * interval);
            tokio::time::sleep_until(due).await;
            let key = (!self.keys.is_empty())
                .then(|| self.keys[(n % self.keys.len() as u64) as usize].clone());
            let _ = queues[(n % queues.len() as u64) as usize].send((n, due, key));
        }
        drop(queues);

        let mut sent = Vec::with_capacity(total as usize);
        while let Some(request) = done.recv().await {
            sent.push(request);
        }
        tasks.abort_all();
        sent.sort_by_key(|s| (s.at, s.index));

        let mut outcome = LoadOutcome {
            sent: sent.len() as u64,
            admitted: 0,
            denied: 0,
            refused: 0,
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
                Some(StatusCode::FORBIDDEN | StatusCode::SERVICE_UNAVAILABLE) => {
                    outcome.refused += 1
                }
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

        // The arrivals at their wall-clock times, never before the load began.
        let arrivals = sent.into_iter().map(|request| {
            let at = request
                .at
                .max(wall_start)
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default();
            let mut arrival = Arrival::get(at, request.path).ip(request.peer);
            arrival.key = request.key;
            // What the endpoint answered is what the replay answers: a rule charged by the
            // status is predicted as it was charged.
            arrival.status = request.status.map(|status| status.as_u16());
            arrival
        });
        outcome.predicted = expected
            .run(arrivals)
            .await
            .map_err(LoadCheckError::Replay)?;
        Ok(outcome)
    }

    /// `rate × duration`, checked.
    fn requests(&self) -> Result<u64, LoadCheckError> {
        if self.targets.is_empty() {
            return Err(LoadCheckError::Config("no address to load".to_owned()));
        }
        if self.connections == 0 {
            return Err(LoadCheckError::Config(
                "at least one connection to each address".to_owned(),
            ));
        }
        for key in &self.keys {
            HeaderValue::from_str(key).map_err(|_| {
                LoadCheckError::Config(format!("the key `{key}` cannot be sent in a header"))
            })?;
        }
        for target in &self.targets {
            address_of(target)?;
        }
        let total = (self.duration.as_secs_f64() * f64::from(self.rate)).round();
        if !(1.0..=MAX_REQUESTS as f64).contains(&total) {
            return Err(LoadCheckError::Config(format!(
                "{} requests a second for {:?} is {total} requests: at least 1, at most {MAX_REQUESTS}",
                self.rate, self.duration
            )));
        }
        Ok(total as u64)
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

/// An open HTTP/1.1 connection and the address the server sees it from.
struct Connection {
    sender: SendRequest<Body>,
    peer: IpAddr,
}

/// Opens a connection within `limit`; its driving task goes into `tasks`.
async fn open(
    addr: &str,
    limit: Duration,
    tasks: &mut JoinSet<()>,
) -> Result<Connection, std::io::Error> {
    let timed_out = || std::io::Error::new(std::io::ErrorKind::TimedOut, "no connection in time");
    let stream = timeout(limit, TcpStream::connect(addr))
        .await
        .map_err(|_| timed_out())??;
    let _ = stream.set_nodelay(true);
    let peer = stream.local_addr()?.ip();
    let (sender, connection) = timeout(
        limit,
        hyper::client::conn::http1::handshake(TokioIo::new(stream)),
    )
    .await
    .map_err(|_| timed_out())?
    .map_err(std::io::Error::other)?;
    tasks.spawn(async move {
        let _ = connection.await;
    });
    Ok(Connection { sender, peer })
}

/// One connection: takes the next request due at its address when it is free, and sends it.
struct Lane {
    addr: String,
    host: String,
    path: String,
    key_header: HeaderName,
    timeout: Duration,
    connection: Option<Connection>,
    done: mpsc::UnboundedSender<Sent>,
}

impl Lane {
    async fn serve(mut self, due: Arc<Mutex<mpsc::UnboundedReceiver<Due>>>) {
        // Connections opened again run in this lane's own set, ended with it.
        let mut reopened = JoinSet::new();
        loop {
            let next = due.lock().await.recv().await;
            let Some((index, due_at, key)) = next else {
                break;
            };
            let late = Instant::now().saturating_duration_since(due_at) > Duration::from_millis(5);
            // A connection the server closed after its last answer is opened again first.
            if let Some(connection) = &mut self.connection
                && !matches!(
                    timeout(self.timeout, connection.sender.ready()).await,
                    Ok(Ok(()))
                )
            {
                self.connection = None;
            }
            if self.connection.is_none() {
                self.connection = open(&self.addr, self.timeout, &mut reopened).await.ok();
            }
            let at = SystemTime::now();
            let (peer, status) = match &mut self.connection {
                Some(connection) => (
                    connection.peer,
                    send(
                        connection,
                        &self.host,
                        &self.path,
                        &self.key_header,
                        key.as_deref(),
                        self.timeout,
                    )
                    .await,
                ),
                None => (IpAddr::from([127, 0, 0, 1]), None),
            };
            if status.is_none() {
                // Closed, broken or too slow: the next request opens another.
                self.connection = None;
            }
            let _ = self.done.send(Sent {
                index,
                at,
                peer,
                path: self.path.clone(),
                key,
                status,
                late,
            });
        }
    }
}

/// One request on `connection`, its answer read to the end, all within `limit`.
async fn send(
    connection: &mut Connection,
    host: &str,
    path: &str,
    key_header: &HeaderName,
    key: Option<&str>,
    limit: Duration,
) -> Option<StatusCode> {
    let mut request = Request::get(path)
        .header(http::header::HOST, host)
        .body(Body::empty())
        .ok()?;
    if let Some(key) = key {
        request
            .headers_mut()
            .insert(key_header.clone(), HeaderValue::from_str(key).ok()?);
    }
    let exchange = async {
        connection.sender.ready().await.ok()?;
        let response = connection.sender.send_request(request).await.ok()?;
        let status = response.status();
        drain(response.into_body()).await?;
        Some(status)
    };
    timeout(limit, exchange).await.ok().flatten()
}

/// Reads a body to its end, keeping nothing.
async fn drain(mut body: Incoming) -> Option<()> {
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        frame.ok()?;
    }
    Some(())
}
