//! [`Replay`]: recorded traffic sent through a real layer, one request after another, on the
//! store's clock.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt;
use std::future::poll_fn;
use std::net::SocketAddr;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::response::Response;
use axum::routing::any;
use http::{HeaderName, HeaderValue, Request, StatusCode};
use tower_service::Service;

use super::arrival::Arrival;
use super::report::{Replayed, Report};
use super::traffic::TrafficError;
use crate::clock::ManualClock;
use crate::observe::{DecisionHook, DecisionReceiver};
use crate::store::Store;
use crate::{ActualCost, ConfigError, RateLimitLayerBuilder};

/// Why a replay stopped.
#[derive(Debug)]
#[non_exhaustive]
pub enum ReplayError {
    /// A line of the traffic could not be read.
    Traffic(TrafficError),
    /// The layer did not build.
    Config(ConfigError),
    /// A route could not be served by an axum `Router` (its pattern, and axum's reason).
    Route {
        /// The route pattern.
        route: String,
        /// Why axum refused it.
        message: String,
    },
    /// An arrival came before the one ahead of it: traffic must be in time order.
    OutOfOrder {
        /// `line N` or `arrival N`.
        place: String,
        /// How far before the arrival ahead of it.
        by: Duration,
    },
    /// An arrival could not be made into a request (a path, key or cost a request cannot carry).
    Request {
        /// `line N` or `arrival N`.
        place: String,
        /// What is wrong.
        message: String,
    },
    /// The layer answered a request without deciding it once (no decision event, or more than
    /// one).
    Decision {
        /// `line N` or `arrival N`.
        place: String,
        /// How many decision events it had.
        events: usize,
    },
}

impl fmt::Display for ReplayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReplayError::Traffic(e) => write!(f, "traffic: {e}"),
            ReplayError::Config(e) => write!(f, "the layer does not build: {e}"),
            ReplayError::Route { route, message } => {
                write!(
                    f,
                    "the route `{route}` cannot be served by an axum Router: {message}"
                )
            }
            ReplayError::OutOfOrder { place, by } => write!(
                f,
                "{place}: comes {by:?} before the arrival ahead of it; sort the traffic by time"
            ),
            ReplayError::Request { place, message } => write!(f, "{place}: {message}"),
            ReplayError::Decision { place, events } => write!(
                f,
                "{place}: the layer answered with {events} decision events instead of one"
            ),
        }
    }
}

impl std::error::Error for ReplayError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ReplayError::Traffic(e) => Some(e),
            ReplayError::Config(e) => Some(e),
            _ => None,
        }
    }
}

impl From<TrafficError> for ReplayError {
    fn from(e: TrafficError) -> Self {
        ReplayError::Traffic(e)
    }
}

impl From<ConfigError> for ReplayError {
    fn from(e: ConfigError) -> Self {
        ReplayError::Config(e)
    }
}

/// Recorded traffic sent through a real [`RateLimitLayer`](crate::RateLimitLayer), built from
/// your builder, with a report of what it admitted and denied.
///
/// The layer is applied with `Router::layer` to an axum `Router` that serves every route the
/// policy names (and those of [`routes`](Replay::routes)), and every other path as a fallback:
/// rules by route see the route pattern, as in your service. Each request carries its
/// arrival's address as the socket peer (axum's `ConnectInfo`), its key in
/// [`key_header`](Replay::key_header), its cost in [`cost_header`](Replay::cost_header) if one
/// is set, and its other headers, each answered and its body read to the end before the next
/// is sent.
///
/// What the service answered is what the replay answers, so that rules that charge by the
/// response are predicted as they were charged:
///
/// * An admitted request is answered with its recorded [`status`](Arrival::status), so that a
///   [`charge_on_status`](crate::Rule::charge_on_status) rule counts the failed logins it
///   counted in service; `200 OK` when none is recorded, or when the recorded one is `429`
///   (the limits of the day refused it, and what the service would have answered is not in the
///   record). A [`charge_when`](crate::Rule::charge_when) rule that reads more of the response
///   than its status sees an empty one.
/// * Its recorded [`actual_cost`](Arrival::actual_cost) is on the response as an
///   [`ActualCost`] and in the header of each [`settle_from_header`](crate::Rule::settle_from_header)
///   rule, so that [`settle`](crate::Rule::settle) rules are charged what it cost; without one
///   they keep their estimate, as in service, and the report counts such requests
///   ([`Report::at_estimate`]).
/// * Metered rules ([`Rule::meter`](crate::Rule::meter)) are charged what their stream spends
///   as it streams, and concurrency rules decide by what is in flight at once: a record holds
///   neither, so a replay refuses them as not predicted, by name, unless
///   [`allow_unpredicted`](Replay::allow_unpredicted) lets them in.
///
/// Time: with [`clock`](Replay::clock), the store's [`ManualClock`] is set to each arrival's
/// time ([`Arrival::at`], since the Unix epoch), so a day of traffic replays in seconds, fixed
/// and sliding windows begin where they began in service, and the same traffic always gets the
/// same answers (the clock is moved back to the first arrival: give the replay a store of its
/// own). Without one, requests are sent at their times from the first, in real time (for a
/// store on its own clock, such as Redis's); those sent more than 5 ms late, because the store
/// could not keep up, are counted ([`Report::late`]).
///
/// Delay rules ([`RuleMode::Delay`](crate::policy::RuleMode::Delay)) wait on tokio's timer,
/// in real time: a replay on a clock refuses them (replay without a clock, or with the rules
/// enforced).
///
/// The replay installs its own [decision hook](crate::RateLimitLayerBuilder::decision_hook)
/// on the builder, in place of any other.
#[must_use = "a replay does nothing until it is run"]
pub struct Replay<St> {
    builder: RateLimitLayerBuilder<St>,
    clock: Option<ManualClock>,
    routes: Vec<String>,
    key_header: HeaderName,
    cost_header: Option<HeaderName>,
    keep_decisions: bool,
    reorder_within: Duration,
    allow_unpredicted: bool,
}

/// Sent this much after its time, a request of a replay in real time is counted as late.
const LATE: Duration = Duration::from_millis(5);

impl<St> fmt::Debug for Replay<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Replay")
            .field("clock", &self.clock.is_some())
            .field("routes", &self.routes)
            .field("key_header", &self.key_header)
            .field("cost_header", &self.cost_header)
            .field("keep_decisions", &self.keep_decisions)
            .field("reorder_within", &self.reorder_within)
            .field("allow_unpredicted", &self.allow_unpredicted)
            .finish_non_exhaustive()
    }
}

impl<St: Store> Replay<St> {
    /// A replay through the layer `builder` builds.
    pub fn new(builder: RateLimitLayerBuilder<St>) -> Self {
        Replay {
            builder,
            clock: None,
            routes: Vec::new(),
            key_header: HeaderName::from_static("x-api-key"),
            cost_header: None,
            keep_decisions: false,
            reorder_within: Duration::ZERO,
            allow_unpredicted: false,
        }
    }

    /// The store's clock, moved to each arrival's time.
    pub fn clock(mut self, clock: ManualClock) -> Self {
        self.clock = Some(clock);
        self
    }

    /// Route patterns to serve besides those the policy names (`/users/{id}`), so that the
    /// report counts requests by them.
    pub fn routes<I, S>(mut self, routes: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.routes.extend(routes.into_iter().map(Into::into));
        self
    }

    /// The header an arrival's key is sent in (default `x-api-key`).
    pub fn key_header(mut self, name: HeaderName) -> Self {
        self.key_header = name;
        self
    }

    /// The header an arrival's cost is sent in (default: none, costs are not sent), for rules
    /// whose [`Cost`](crate::Cost) reads it.
    pub fn cost_header(mut self, name: HeaderName) -> Self {
        self.cost_header = Some(name);
        self
    }

    /// Sends arrivals up to `window` out of time order in time order (default: none; an
    /// arrival earlier than one before it is an error). Access logs need it: nginx's
    /// `$time_local` and Apache's `%t` are written when a request ends, so a slow request's
    /// line comes after those of requests that came later; set the window to your slowest
    /// request. An arrival further out of order is still an error.
    pub fn reorder_within(mut self, window: Duration) -> Self {
        self.reorder_within = window;
        self
    }

    /// Keeps each request's decision in [`Report::decisions`] (default off).
    pub fn keep_decisions(mut self, keep: bool) -> Self {
        self.keep_decisions = keep;
        self
    }

    /// Replays rules whose outcome a replay does not predict, metered and concurrency rules,
    /// instead of refusing them (default off): their names are in [`Report::unpredicted`], and
    /// the report's figures for them are not what the service would do: a metered rule is
    /// charged nothing (its response spends nothing, and its chunk goes back when it ends), a
    /// concurrency rule never denies (requests are replayed one at a time).
    pub fn allow_unpredicted(mut self, allow: bool) -> Self {
        self.allow_unpredicted = allow;
        self
    }

    /// Replays arrivals made in code.
    pub async fn run<I>(self, arrivals: I) -> Result<Report, ReplayError>
    where
        I: IntoIterator<Item = Arrival>,
    {
        self.run_traffic(arrivals.into_iter().map(Ok)).await
    }

    /// Replays traffic read from a file ([`Traffic`](super::Traffic)), stopping at its first
    /// bad line.
    pub async fn run_traffic<I>(self, traffic: I) -> Result<Report, ReplayError>
    where
        I: IntoIterator<Item = Result<Arrival, TrafficError>>,
    {
        let (hook, events) = DecisionHook::channel(16);
        let layer = self.builder.decision_hook(hook).build()?;
        let delay_rules = layer.delay_rules();
        if self.clock.is_some() && !delay_rules.is_empty() {
            // Their requests wait on tokio's timer while the clock stands still: they would be
            // denied after their longest wait, in real time, where in service they pass.
            return Err(ReplayError::Config(ConfigError::new(format!(
                "the delay rules {delay_rules:?} wait in real time: replay them without a \
                 clock (in real time), or as enforced rules"
            ))));
        }
        let unpredicted: Vec<String> = layer
            .unpredicted_rules()
            .into_iter()
            .map(|(name, what)| format!("{name:?} ({what})"))
            .collect();
        if !unpredicted.is_empty() && !self.allow_unpredicted {
            // What they decide depends on what no record holds: what a stream spends and when,
            // how long a request is in flight.
            return Err(ReplayError::Config(ConfigError::new(format!(
                "the rules {} are not predicted by a replay: a metered rule's charge is what its \
                 stream spends as it streams, a concurrency rule's what is in flight at once, \
                 and a replay records neither; replay a policy without them, or \
                 .allow_unpredicted(true) to replay them anyway (named in Report::unpredicted)",
                unpredicted.join(", ")
            ))));
        }
        let settle_rules = layer.settle_rules();
        let mut settle_headers: Vec<HeaderName> = settle_rules
            .iter()
            .filter_map(|(_, header)| header.clone())
            .collect();
        settle_headers.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        settle_headers.dedup();
        let settle_headers: Arc<[HeaderName]> = settle_headers.into();
        let mut routes = layer.routes();
        routes.extend(self.routes);
        routes.sort();
        routes.dedup();

        let served = Arc::new(AtomicU64::new(0));
        let answer = {
            let served = served.clone();
            move |request: Request<Body>| {
                served.fetch_add(1, Ordering::Relaxed);
                let recorded = request
                    .extensions()
                    .get::<Recorded>()
                    .copied()
                    .unwrap_or_default();
                let response = recorded.response(&settle_headers);
                async move { response }
            }
        };
        let mut router = Router::new();
        for route in routes {
            let answer = answer.clone();
            let pattern = route.clone();
            // axum refuses some patterns by panicking (`:id`, two names for one segment).
            router = catch_unwind(AssertUnwindSafe(move || {
                router.route(&pattern, any(answer))
            }))
            .map_err(|panic| ReplayError::Route {
                route,
                message: panic_message(&panic),
            })?;
        }
        let mut sender = Sender {
            router: router.fallback(any(answer)).layer(layer),
            events,
            served,
            clock: self.clock,
            key_header: self.key_header,
            cost_header: self.cost_header,
            keep_decisions: self.keep_decisions,
            started: tokio::time::Instant::now(),
            first: None,
            settle_rules: settle_rules.into_iter().map(|(name, _)| name).collect(),
            report: Report {
                unpredicted,
                ..Report::default()
            },
        };

        // Arrivals up to `reorder_within` apart are sent in time order, from a heap of those
        // not yet sent; one further back is an error.
        let window = self.reorder_within;
        let mut waiting: BinaryHeap<Reverse<Waiting>> = BinaryHeap::new();
        let mut newest = Duration::ZERO;
        for (index, arrival) in traffic.into_iter().enumerate() {
            let arrival = arrival?;
            if arrival.at.saturating_add(window) < newest {
                return Err(ReplayError::OutOfOrder {
                    place: arrival.place(index),
                    by: newest - arrival.at,
                });
            }
            newest = newest.max(arrival.at);
            waiting.push(Reverse(Waiting { index, arrival }));
            while let Some(Reverse(next)) = waiting.peek()
                && next.arrival.at.saturating_add(window) <= newest
            {
                let Some(Reverse(next)) = waiting.pop() else {
                    break;
                };
                sender.send(next.index, next.arrival).await?;
            }
        }
        while let Some(Reverse(next)) = waiting.pop() {
            sender.send(next.index, next.arrival).await?;
        }
        Ok(sender.report)
    }
}

/// An arrival not yet sent, first by time, then by its place in the traffic.
struct Waiting {
    index: usize,
    arrival: Arrival,
}

impl Waiting {
    fn order(&self) -> (Duration, usize) {
        (self.arrival.at, self.index)
    }
}

impl PartialEq for Waiting {
    fn eq(&self, other: &Self) -> bool {
        self.order() == other.order()
    }
}

impl Eq for Waiting {}

impl PartialOrd for Waiting {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Waiting {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.order().cmp(&other.order())
    }
}

/// Sends arrivals through the router one at a time and counts their decisions.
struct Sender {
    router: Router,
    events: DecisionReceiver,
    served: Arc<AtomicU64>,
    clock: Option<ManualClock>,
    key_header: HeaderName,
    cost_header: Option<HeaderName>,
    keep_decisions: bool,
    started: tokio::time::Instant,
    first: Option<Duration>,
    /// The names of the policy's settle rules.
    settle_rules: Vec<String>,
    report: Report,
}

impl Sender {
    async fn send(&mut self, index: usize, arrival: Arrival) -> Result<(), ReplayError> {
        let place = || arrival.place(index);
        let first = *self.first.get_or_insert(arrival.at);
        let offset = arrival.at.saturating_sub(first);
        match &self.clock {
            // The store's clock shows the arrival's own time: windows fall where they fell.
            Some(clock) => clock.set(u64::try_from(arrival.at.as_micros()).unwrap_or(u64::MAX)),
            None => {
                let due = self.started + offset;
                tokio::time::sleep_until(due).await;
                if tokio::time::Instant::now().saturating_duration_since(due) > LATE {
                    self.report.late += 1;
                }
            }
        }
        let request = request_of(&arrival, &self.key_header, self.cost_header.as_ref()).map_err(
            |message| ReplayError::Request {
                place: place(),
                message,
            },
        )?;

        let before = self.served.load(Ordering::Relaxed);
        let _ = poll_fn(|cx| Service::<Request<Body>>::poll_ready(&mut self.router, cx)).await;
        let response = match self.router.call(request).await {
            Ok(response) => response,
            Err(never) => match never {},
        };
        let status = response.status();
        // Read to the end, as a client would: a held slot is given back there.
        let _ = axum::body::to_bytes(response.into_body(), usize::MAX).await;
        let admitted = self.served.load(Ordering::Relaxed) > before;

        let mut decided = None;
        let mut count = 0;
        while let Ok(event) = self.events.try_recv() {
            count += 1;
            decided = Some(event);
        }
        let (1, Some(event)) = (count, decided) else {
            return Err(ReplayError::Decision {
                place: place(),
                events: count,
            });
        };
        self.report.count(&event, admitted);
        if admitted
            && arrival.actual_cost.is_none()
            && event
                .rules
                .iter()
                .any(|rule| self.settle_rules.iter().any(|name| **name == *rule.name))
        {
            self.report.at_estimate += 1;
        }
        if self.keep_decisions {
            self.report.decisions.push(Replayed {
                index,
                line: arrival.line,
                at: offset,
                status,
                admitted,
                event,
            });
        }
        Ok(())
    }
}

/// The request an arrival makes.
fn request_of(
    arrival: &Arrival,
    key_header: &HeaderName,
    cost_header: Option<&HeaderName>,
) -> Result<Request<Body>, String> {
    let mut request = Request::builder()
        .method(arrival.method.clone())
        .uri(arrival.path.as_str())
        .body(Body::empty())
        .map_err(|e| format!("the path `{}` cannot be requested: {e}", arrival.path))?;
    let status = match arrival.status {
        // The limits of the day refused it: what the service answers is not recorded.
        None | Some(429) => None,
        Some(status) => Some(
            StatusCode::from_u16(status)
                .map_err(|_| format!("the status {status} is not an HTTP status"))?,
        ),
    };
    request.extensions_mut().insert(Recorded {
        status,
        actual_cost: arrival.actual_cost,
    });
    if let Some(ip) = arrival.ip {
        request
            .extensions_mut()
            .insert(ConnectInfo(SocketAddr::new(ip, 0)));
    }
    let headers = request.headers_mut();
    if let Some(key) = &arrival.key {
        let value = HeaderValue::from_str(key)
            .map_err(|_| format!("the key `{key}` cannot be sent in a header"))?;
        headers.insert(key_header.clone(), value);
    }
    if let (Some(cost), Some(name)) = (arrival.cost, cost_header) {
        headers.insert(name.clone(), HeaderValue::from(cost));
    }
    for (name, value) in &arrival.headers {
        headers.append(name.clone(), value.clone());
    }
    Ok(request)
}

/// What an arrival's service answered when it was recorded, carried to the replay's handler
/// in the request's extensions.
#[derive(Clone, Copy, Debug, Default)]
struct Recorded {
    /// The status to answer with (none: `200 OK`).
    status: Option<StatusCode>,
    /// What the request really cost, reported to settle rules.
    actual_cost: Option<u64>,
}

impl Recorded {
    /// The response the service gave: its status, and its cost as an [`ActualCost`] and in
    /// each header that settle rules read it from.
    fn response(self, settle_headers: &[HeaderName]) -> Response {
        let mut response = Response::new(Body::empty());
        *response.status_mut() = self.status.unwrap_or(StatusCode::OK);
        if let Some(units) = self.actual_cost {
            response.extensions_mut().insert(ActualCost(units));
            for name in settle_headers {
                response
                    .headers_mut()
                    .insert(name.clone(), HeaderValue::from(units));
            }
        }
        response
    }
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "axum refused it".to_owned())
}
