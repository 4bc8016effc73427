//! The client's half of the contract: honour what a server said about when to come back.
//!
//! ```
//! use http_body_util::Empty;
//! use tollgate::client::HonourLimitsLayer;
//! use tower::ServiceBuilder;
//!
//! # fn build<S>(inner: S) where S: tower::Service<http::Request<Empty<bytes::Bytes>>> {
//! // Any Tower HTTP client: hyper-util's, or a tonic `Channel`.
//! let client = ServiceBuilder::new()
//!     .layer(HonourLimitsLayer::new())
//!     .service(inner);
//! # let _ = client;
//! # }
//! ```
//!
//! [`HonourLimitsLayer`] reads every answer for a server's request to wait: `Retry-After` on a
//! 429 or a 503 (seconds, or an HTTP date), a `RateLimit` policy whose budget is spent (`r=0`
//! with a `t`, draft-ietf-httpapi-ratelimit-headers-11), and for gRPC `RESOURCE_EXHAUSTED` or
//! `UNAVAILABLE` with `grpc-retry-pushback-ms` or a `google.rpc.RetryInfo` (in a trailers-only
//! answer's head, or in the trailers). Until that time has passed, the calls the wait covers
//! are not sent: they fail at once with [`Throttled`], which tells the wait left. A tonic
//! client sees `RESOURCE_EXHAUSTED` with the wait in its message. A wait longer than
//! [`MAX_ANNOUNCED_WAIT`] (a day) is capped to it.
//!
//! [`RetryAfterLayer`] waits instead of failing: a call the server asked to wait is retried
//! after the server's delay plus a random jitter (so that clients told the same delay do not
//! come back at the same instant), a few times at most, within a retry budget shared by the
//! layer's calls (so that retries cannot multiply the load). It needs requests whose body can
//! be cloned. The refusals it retries are not hidden: [`RetryAfterLayer::retries`] counts them
//! (one count for the layer, its clones and the services it made), and
//! [`RetryAfterLayer::on_retry`] is called with each ([`Retried`]: its status, which retry of
//! the call it is, the wait asked), for a log line or a metric of the 429s a paced client
//! still met:
//!
//! ```
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use std::sync::Arc;
//! use tollgate::client::{Retry, RetryAfterLayer};
//!
//! let refused = Arc::new(AtomicU64::new(0));
//! let counted = refused.clone();
//! let layer = RetryAfterLayer::new(Retry::new()).on_retry(move |retried| {
//!     counted.fetch_add(1, Ordering::Relaxed);
//!     eprintln!("retrying a {} in {:?}", retried.status(), retried.wait());
//! });
//! assert_eq!(layer.retries(), 0);
//! ```
//!
//! Both work against any server that sends these fields, not only tollgate's.
//!
//! # Malformed fields
//!
//! `RateLimit` and `RateLimit-Policy` are read as the Structured Field Lists they are (RFC 9651,
//! with the `sfv` crate's parser): a field's lines joined with `", "`, then parsed whole. A
//! field that does not parse in any of its parts (a trailing comma or semicolon, an empty
//! member, an unterminated string or inner list, a bad escape, `?2`, an Integer of 16 digits, a
//! Decimal of 4 fractional digits, an empty or upper-case parameter key, a character that is
//! not ASCII) is ignored whole, as draft-11 says a malformed field must be: a spent policy it
//! names holds nothing back. What parses and names no policy (a member that is neither a
//! String nor a Token, an inner list) is skipped, and a number that is not a non-negative
//! Integer (`r=-1`, `t=1.5`) is taken as absent; the rest of the field is kept. The first 16
//! policies of a field are read. The HTTP working group's Structured Field test vectors of
//! Lists and Items are run against this parsing (`src/client/fields/vectors.rs`).
//!
//! # Pacing
//!
//! Told when to wait, a client still sends as fast as it can until it is denied. With
//! [`Pacing`] (`HonourLimitsLayer::new().pace(Pacing::new())`, or
//! `Retry::new().pace(Pacing::new())`), a layer also spreads its calls to fit the budget the
//! server announces, and is seldom denied at all:
//!
//! ```
//! use tollgate::client::{HonourLimitsLayer, Pacing, Retry, RetryAfterLayer};
//!
//! // A call that comes before its turn fails at once with `Throttled` (`is_paced()`), whose
//! // `wait()` is the time to its turn: sleep it and call again.
//! let fail_fast = HonourLimitsLayer::new().pace(Pacing::new());
//! // Waits for its turn, then sends.
//! let patient = RetryAfterLayer::new(Retry::new().pace(Pacing::new()));
//! # let _ = (fail_fast, patient);
//! ```
//!
//! * **A token bucket per policy**, shaped by each answer: `r` units now (`RateLimit`), coming
//!   back at the policy's rate, `q` per `w` seconds (`RateLimit-Policy`; `r` per `t` without
//!   one). A call paying a policy (a target whose answers named it) goes at once while a unit
//!   is left, else waits for the next; a newer answer sets the units again (an older one, to a
//!   call sent before, cannot). Against "100 a minute", a loop of 1,000 calls sends 100 at
//!   once, then one every 0.6 s: no 429, in 540 s, the least the budget allows
//!   (`tests/client.rs`).
//! * **The time to the next unit** replaces a spent policy's wait where that wait is only `t`
//!   rounded up to the second (`t` at most `w / q`, rounded up): `"api";r=0;t=1` under
//!   `q=100;w=60` waits 0.6 s, not a second. A refusal's wait, and a longer `t` (a fixed
//!   window's end), stand.
//! * **Jitter**: up to 10 % of each delay ([`Pacing::jitter`]), so that clients told the same
//!   budget do not come back at the same instant. A `RetryAfterLayer` call waits for its turn
//!   up to [`Pacing::max_delay`] (30 s) and its `max_wait`; a turn further away fails it with
//!   [`Throttled`] at once.
//! * **Clients that share a key** see the same `r` and cannot see each other. Each takes the
//!   share of the budget its own calls are of what the budget lost between two of its answers,
//!   and halves it on a refusal. Ten clients on one key of 100 a minute, 100 calls each:
//!   78–81 refusals paced (the jitter is random), 735 without pacing (`tests/client.rs`). What still limits them: a
//!   client learns of the others only from its answers, so the first burst (each sees `r`
//!   units and takes them) and every change in how many there are cost refusals, and a client
//!   alone after the others left regains its rate over a few calls.
//!
//! # What a wait covers
//!
//! A wait covers what the server said it covers, no more:
//!
//! * `Retry-After` on a 429 or a 503, and a gRPC call's pushback or `RetryInfo`: the call's
//!   **target**, that is its authority, method and path (the query is not part of it: `/a?p=2`
//!   is `/a`; a gRPC method is its path, `/package.Service/Method`).
//! * A spent `RateLimit` policy, on any answer (the 200 that spent the last unit included): the
//!   targets whose answers **carried that policy's name**. A client has no other way to learn
//!   what a policy applies to, so a target keeps the names of its latest answer that named
//!   any. `/export`'s 200 saying `"export";r=0;t=3600` holds back `/export` for an hour, and
//!   not `/health`, whose answers never named `export`.
//!
//! No answer holds back a whole server: none of these fields says it covers more than that,
//! and a client that guessed wider would fail its own unrelated calls (a health check, a cheap
//! read) for as long as the longest wait, up to a day. What that costs: a target the client
//! has not yet seen with a spent policy (a new path under a server-wide limit) is sent once
//! per wait, and its answer, a 429 most likely, teaches the client.
//!
//! A later answer sets a wait: the answer to a request sent after a wait was learned, speaking
//! of the same scope (that target, or a policy of that name), sets it to what it says,
//! shorter, longer or over (`r` above 0, `t=0`, or an answer of that target that is not a
//! refusal). The answer to a request sent before can only make it longer: the server may have
//! counted that request before the one that spent the budget.
//!
//! The waits are the layer's, shared by the services it makes: a client that calls a server
//! for many users the server limits apart wants a layer per user.
//!
//! Memory is bounded: a layer remembers at most [`MAX_TARGETS`] targets, and as many spent
//! policies, each by a keyed 128-bit hash of its authority and path or name (a fixed size,
//! however long the path or name), and at most 16 policy names per target (the first ones of
//! its answer). Past that, a quarter is forgotten at once: first the targets with no wait
//! running, least recently answered first, then those whose wait ends soonest (for policies:
//! those over, then the soonest to end). A target forgotten is sent again once, and its answer
//! teaches the client again.

mod body;
mod fields;
mod pacing;
mod retry;
mod signals;

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hash};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::time::Instant;

use http::{Request, Response};
use pin_project_lite::pin_project;
use smallvec::SmallVec;
use tower_layer::Layer;
use tower_service::Service;

pub use body::ClientBody;
use pacing::Paces;
pub use pacing::Pacing;
pub use retry::{Retried, Retry, RetryAfter, RetryAfterLayer};
pub use signals::MAX_ANNOUNCED_WAIT;
use signals::Word;

/// The most targets (authority, method and path) a layer remembers, and the most spent
/// policies; past it, a quarter is forgotten (see [what a wait covers](self#what-a-wait-covers)).
pub const MAX_TARGETS: usize = 1024;

/// The most policy names a target remembers: the first ones of its answer.
const MAX_NAMES: usize = 16;

/// A wait: until when, and the number drawn when it was learned (a request whose number is
/// higher was sent after it).
#[derive(Clone, Copy, Debug)]
struct Wait {
    until: Instant,
    learned: u64,
}

/// A target the layer knows: its own wait (`Retry-After`, pushback), the policies its latest
/// answer named, and when it was last answered.
#[derive(Debug)]
struct Known {
    wait: Option<Wait>,
    policies: SmallVec<[u128; 2]>,
    answered: u64,
}

#[derive(Debug, Default)]
struct Remembered {
    targets: HashMap<u128, Known>,
    /// The policies spent, by authority and name.
    spent: HashMap<u128, Wait>,
}

/// The waits a server asked for, by what they cover (see the [module](crate::client)).
#[derive(Debug, Default)]
pub(crate) struct Waits {
    state: Mutex<Remembered>,
    /// Numbers for requests sent and waits learned: a request sent after a wait has a higher one.
    numbers: AtomicU64,
    /// The keys of the hashes targets and policies are remembered by.
    keys: [RandomState; 2],
    /// The budgets calls are paced to, with pacing.
    pace: Option<Paces>,
    /// Jitter for paced calls.
    draws: Draws,
}

/// Uniform draws in `[0, 1)` for jitter: a counter hashed with the process's random keys (no
/// random-number crate needed; the draws need only not align between clients).
#[derive(Debug, Default)]
pub(crate) struct Draws {
    random: RandomState,
    count: AtomicU64,
}

impl Draws {
    /// The next draw.
    pub(crate) fn unit(&self) -> f64 {
        let draw = self.count.fetch_add(1, Ordering::Relaxed);
        (self.random.hash_one(draw) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A request's target, by hash, and its server's (for the policies it names).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Target {
    id: u128,
    server: u128,
}

impl Waits {
    /// Waits that also pace calls as `pacing` says.
    pub(crate) fn pacing(pacing: Option<Pacing>) -> Self {
        Waits {
            pace: pacing.map(Paces::new),
            ..Waits::default()
        }
    }

    fn hash(&self, value: impl Hash) -> u128 {
        let [a, b] = &self.keys;
        (u128::from(a.hash_one(&value)) << 64) | u128::from(b.hash_one(&value))
    }

    /// The target of `request`: its authority (`""` for a request with a path only, as a tonic
    /// `Channel`'s are: one channel, one server; so give each channel a layer of its own),
    /// method and path.
    pub(crate) fn target_of<B>(&self, request: &Request<B>) -> Target {
        let uri = request.uri();
        let authority = uri.authority().map_or("", |a| a.as_str());
        let server = self.hash((0u8, authority));
        Target {
            id: self.hash((1u8, server, request.method().as_str(), uri.path())),
            server,
        }
    }

    /// A number for a request about to be sent.
    pub(crate) fn sent(&self) -> u64 {
        self.numbers.fetch_add(1, Ordering::SeqCst)
    }

    /// The wait left for `target`, if any: its own, or that of a policy it named.
    pub(crate) fn left(&self, target: Target) -> Option<Duration> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let known = state.targets.get(&target.id)?;
        let mut until = known.wait.map(|w| w.until);
        for policy in &known.policies {
            if let Some(wait) = state.spent.get(policy) {
                until = until.max(Some(wait.until));
            }
        }
        let left = until?.checked_duration_since(Instant::now())?;
        (!left.is_zero()).then_some(left)
    }

    /// With pacing, the time until the turn of a call to `target` drawn as `number`, jitter
    /// included; `None` when it may go now (it then takes its units of the budgets it pays).
    pub(crate) fn paced(&self, target: Target, number: u64) -> Option<Duration> {
        let paces = self.pace.as_ref()?;
        let policies = {
            let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            state.targets.get(&target.id)?.policies.clone()
        };
        paces.delay(&policies, number, self.draws.unit())
    }

    /// With pacing, learns the budgets an answer to call `sent` to `target` announces, and
    /// turns a spent policy's wait into a pace where the wait is only the time to its next unit
    /// (`t` rounded up to the second, no more than `w / q`): the pace knows it to the
    /// millisecond. A refusal's own wait stays.
    fn learn_budgets(
        &self,
        target: Target,
        sent: u64,
        status: http::StatusCode,
        headers: &http::HeaderMap,
        ratelimit: &[fields::Policy<'_>],
        policies: &mut [(&str, Word)],
    ) {
        let Some(paces) = &self.pace else {
            return;
        };
        // Refused by a limit: a 429, or gRPC RESOURCE_EXHAUSTED (a 503 may be an outage).
        let refused = status == http::StatusCode::TOO_MANY_REQUESTS
            || headers.get("grpc-status").is_some_and(|s| s == "8");
        let quotas = fields::read(headers, "ratelimit-policy");
        let mut budgets: SmallVec<[(&str, fields::Numbers); 2]> = SmallVec::new();
        for (field, budget) in [(&quotas[..], false), (ratelimit, true)] {
            for policy in field {
                let name = policy.name.as_ref();
                let at = match budgets.iter().position(|(n, _)| *n == name) {
                    Some(at) => at,
                    None if budgets.len() < MAX_NAMES => {
                        budgets.push((name, fields::Numbers::default()));
                        budgets.len() - 1
                    }
                    None => continue,
                };
                let known = &mut budgets[at].1;
                if budget {
                    (known.r, known.t) = (policy.numbers.r, policy.numbers.t);
                } else {
                    (known.q, known.w) = (policy.numbers.q, policy.numbers.w);
                }
            }
        }
        for (name, numbers) in &budgets {
            paces.learn(
                self.hash((2u8, target.server, *name)),
                sent,
                refused,
                *numbers,
            );
        }
        if refused {
            return;
        }
        for (name, word) in policies.iter_mut() {
            let Word::Wait(wait) = *word else { continue };
            // Only where a pace was made of the policy's quota (`q` and `w` above 0).
            let next_unit = budgets.iter().find(|(n, _)| n == name).and_then(|(_, b)| {
                let (q, w) = (b.q?, b.w?);
                (q > 0 && w > 0).then(|| w.div_ceil(q))
            });
            if next_unit.is_some_and(|seconds| wait.as_secs() <= seconds.max(1)) {
                *word = Word::Go;
            }
        }
    }

    /// Learns what the answer to a request sent as number `sent` to `target` says: of the
    /// target, and of each policy it names (none: the target keeps the names it knows).
    pub(crate) fn learn(&self, target: Target, sent: u64, word: Word, policies: &[(&str, Word)]) {
        let names: SmallVec<[(u128, Word); 2]> = policies
            .iter()
            .take(MAX_NAMES)
            .map(|(name, word)| (self.hash((2u8, target.server, *name)), *word))
            .collect();
        if names.is_empty() && word == Word::Nothing {
            return;
        }
        let now = Instant::now();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let learned = self.numbers.fetch_add(1, Ordering::SeqCst);
        for (policy, word) in &names {
            let mut wait = state.spent.get(policy).copied();
            if settle(&mut wait, *word, sent, now, learned) {
                match wait {
                    Some(wait) => {
                        if state.spent.len() >= MAX_TARGETS && !state.spent.contains_key(policy) {
                            forget_policies(&mut state.spent, now);
                        }
                        state.spent.insert(*policy, wait);
                    }
                    None => {
                        state.spent.remove(policy);
                    }
                }
            }
        }
        let Remembered { targets, spent } = &mut *state;
        if !targets.contains_key(&target.id) {
            // Nothing to remember of a target unknown that has no wait and names no policy.
            if names.is_empty() && !matches!(word, Word::Wait(w) if !w.is_zero()) {
                return;
            }
            if targets.len() >= MAX_TARGETS {
                forget_targets(targets, spent, now);
            }
        }
        let known = targets.entry(target.id).or_insert(Known {
            wait: None,
            policies: SmallVec::new(),
            answered: learned,
        });
        settle(&mut known.wait, word, sent, now, learned);
        if !names.is_empty() {
            known.policies.clear();
            for (policy, _) in &names {
                if !known.policies.contains(policy) {
                    known.policies.push(*policy);
                }
            }
        }
        known.answered = learned;
        if known.wait.is_none() && known.policies.is_empty() {
            targets.remove(&target.id);
        }
    }
}

/// Sets `wait` by what an answer to the request sent as number `sent` says; a wait learned
/// after the request was sent only grows. Whether it changed.
fn settle(wait: &mut Option<Wait>, word: Word, sent: u64, now: Instant, learned: u64) -> bool {
    let running = wait.filter(|w| w.until > now);
    let later = running.is_none_or(|w| sent > w.learned);
    let next = match word {
        Word::Nothing => return false,
        Word::Go => None,
        Word::Wait(left) => now.checked_add(left).filter(|_| !left.is_zero()),
    };
    let set = match (running, next) {
        (_, _) if later => next,
        (Some(w), Some(until)) if until > w.until => Some(until),
        _ => return false,
    };
    *wait = set.map(|until| Wait { until, learned });
    true
}

/// Forgets a quarter of `targets`: first those with no wait running, least recently answered
/// first, then those whose wait ends soonest.
fn forget_targets(targets: &mut HashMap<u128, Known>, spent: &HashMap<u128, Wait>, now: Instant) {
    let mut idle = Vec::new();
    let mut running = Vec::new();
    for (id, known) in targets.iter() {
        let until = known
            .policies
            .iter()
            .filter_map(|p| spent.get(p).map(|w| w.until))
            .chain(known.wait.map(|w| w.until))
            .max()
            .filter(|until| *until > now);
        match until {
            Some(until) => running.push((until, *id)),
            None => idle.push((known.answered, *id)),
        }
    }
    idle.sort_unstable();
    running.sort_unstable();
    let forget = targets.len() - MAX_TARGETS * 3 / 4;
    let order = idle
        .iter()
        .map(|(_, id)| id)
        .chain(running.iter().map(|(_, id)| id));
    for id in order.take(forget) {
        targets.remove(id);
    }
}

/// Forgets the spent policies whose wait is over, then the soonest to end, down to three
/// quarters of the bound.
fn forget_policies(spent: &mut HashMap<u128, Wait>, now: Instant) {
    spent.retain(|_, wait| wait.until > now);
    if spent.len() > MAX_TARGETS * 3 / 4 {
        let mut ends: Vec<(Instant, u128)> = spent.iter().map(|(id, w)| (w.until, *id)).collect();
        ends.sort_unstable();
        let forget = spent.len() - MAX_TARGETS * 3 / 4;
        for (_, id) in ends.into_iter().take(forget) {
            spent.remove(&id);
        }
    }
}

/// Whether a request is a gRPC call.
fn is_grpc<B>(request: &Request<B>) -> bool {
    crate::wire::is_grpc(request.headers())
}

/// A call not sent: the server asked to wait, and the wait is not over (or, with
/// [`Pacing`], the call's turn has not come).
#[derive(Debug)]
pub struct Throttled {
    wait: Duration,
    paced: bool,
    /// For a gRPC call: the status a tonic client reads from this error's source.
    #[cfg(feature = "tonic")]
    status: Option<tonic::Status>,
}

impl Throttled {
    pub(crate) fn new(wait: Duration, grpc: bool) -> Self {
        #[cfg(not(feature = "tonic"))]
        let _ = grpc;
        Throttled {
            wait,
            paced: false,
            #[cfg(feature = "tonic")]
            status: grpc.then(|| {
                tonic::Status::resource_exhausted(format!(
                    "not sent: the server asked to wait {} ms more",
                    wait.as_millis()
                ))
            }),
        }
    }

    /// A call whose turn comes in `wait`, by [`Pacing`].
    pub(crate) fn paced(wait: Duration, grpc: bool) -> Self {
        Throttled {
            paced: true,
            ..Throttled::new(wait, grpc)
        }
    }

    /// How long the server's wait has left (or, with [`Pacing`], until the call's turn).
    pub fn wait(&self) -> Duration {
        self.wait
    }

    /// Whether the call was held back by [`Pacing`] (its turn has not come) rather than by a
    /// wait the server asked for.
    pub fn is_paced(&self) -> bool {
        self.paced
    }
}

impl fmt::Display for Throttled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.paced {
            write!(
                f,
                "not sent: paced to the server's budget, its turn in {} ms",
                self.wait.as_millis()
            )
        } else {
            write!(
                f,
                "not sent: the server asked to wait, {} ms more",
                self.wait.as_millis()
            )
        }
    }
}

impl std::error::Error for Throttled {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        #[cfg(feature = "tonic")]
        if let Some(status) = &self.status {
            return Some(status);
        }
        None
    }
}

/// The error of a client behind [`HonourLimitsLayer`] or [`RetryAfterLayer`]: a call not sent,
/// or the inner client's error.
#[derive(Debug)]
pub enum ClientError<E> {
    /// Not sent: the server asked to wait.
    Throttled(Throttled),
    /// The inner client failed.
    Inner(E),
}

impl<E: fmt::Display> fmt::Display for ClientError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientError::Throttled(throttled) => throttled.fmt(f),
            ClientError::Inner(error) => error.fmt(f),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for ClientError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            // A tonic client finds its Status one step further, in the Throttled's source.
            ClientError::Throttled(throttled) => Some(throttled),
            ClientError::Inner(error) => Some(error),
        }
    }
}

/// Fails calls at once while their server has asked to wait; learns the waits from the
/// answers (see the [module](crate::client)).
#[derive(Clone, Debug, Default)]
pub struct HonourLimitsLayer {
    waits: Arc<Waits>,
}

impl HonourLimitsLayer {
    /// A layer with waits of its own: the services it makes share them.
    pub fn new() -> Self {
        HonourLimitsLayer::default()
    }

    /// Also paces calls to fit the budgets the server announces: a call that comes before its
    /// turn fails at once with [`Throttled`], whose [`wait`](Throttled::wait) is the time to
    /// its turn (see [pacing](crate::client#pacing)).
    pub fn pace(self, pacing: Pacing) -> Self {
        HonourLimitsLayer {
            waits: Arc::new(Waits::pacing(Some(pacing))),
        }
    }
}

impl<S> Layer<S> for HonourLimitsLayer {
    type Service = HonourLimits<S>;

    fn layer(&self, inner: S) -> HonourLimits<S> {
        HonourLimits {
            inner,
            waits: self.waits.clone(),
        }
    }
}

/// The service of [`HonourLimitsLayer`].
#[derive(Clone, Debug)]
pub struct HonourLimits<S> {
    inner: S,
    waits: Arc<Waits>,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for HonourLimits<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Response = Response<ClientBody<ResBody>>;
    type Error = ClientError<S::Error>;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(ClientError::Inner)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let target = self.waits.target_of(&request);
        let sent = self.waits.sent();
        let throttled = match self.waits.left(target) {
            Some(wait) => Some(Throttled::new(wait, is_grpc(&request))),
            None => self
                .waits
                .paced(target, sent)
                .map(|turn| Throttled::paced(turn, is_grpc(&request))),
        };
        if let Some(throttled) = throttled {
            return ResponseFuture {
                state: State::Throttled {
                    throttled: Some(throttled),
                },
            };
        }
        let watch = Watch {
            sent,
            waits: self.waits.clone(),
            target,
        };
        ResponseFuture {
            state: State::Sent {
                future: self.inner.call(request),
                watch: Some(watch),
            },
        }
    }
}

/// Where an answer's waits are recorded: the layer's waits, for the request's target.
pub(crate) struct Watch {
    pub(crate) waits: Arc<Waits>,
    pub(crate) target: Target,
    /// The request's number, drawn as it was sent.
    pub(crate) sent: u64,
}

impl Watch {
    /// Learns what the answer's head says; what it says of the call's target.
    pub(crate) fn head<B>(&self, response: &Response<B>) -> Word {
        let (status, headers) = (response.status(), response.headers());
        let word = signals::said_of_target(status, headers);
        // Any answer may say a policy is spent (r=0) for the next t seconds, or has budget; a
        // malformed field says nothing.
        let ratelimit = fields::read(headers, "ratelimit");
        let mut policies: SmallVec<[(&str, Word); 2]> = signals::policies(&ratelimit).collect();
        self.waits.learn_budgets(
            self.target,
            self.sent,
            status,
            headers,
            &ratelimit,
            &mut policies,
        );
        self.waits.learn(self.target, self.sent, word, &policies);
        word
    }

    /// Learns what a gRPC answer's trailers say.
    pub(crate) fn trailers(&self, trailers: &http::HeaderMap) {
        if let Some(word) = signals::said_by_grpc(trailers) {
            self.waits.learn(self.target, self.sent, word, &[]);
        }
    }

    /// The answer, its head learned already; a gRPC answer whose status is still to come is
    /// watched for the trailers.
    pub(crate) fn answered<B>(self, response: Response<B>) -> Response<ClientBody<B>> {
        let pending = crate::wire::is_grpc(response.headers())
            && !response.headers().contains_key("grpc-status");
        response.map(|body| ClientBody::new(body, pending.then_some(self)))
    }
}

pin_project! {
    /// The response future of [`HonourLimits`].
    pub struct ResponseFuture<F> {
        #[pin]
        state: State<F>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F> {
        Throttled { throttled: Option<Throttled> },
        Sent { #[pin] future: F, watch: Option<Watch> },
    }
}

impl<F, B, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ClientBody<B>>, ClientError<E>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Throttled { throttled } => Poll::Ready(Err(ClientError::Throttled(
                throttled
                    .take()
                    .expect("ResponseFuture polled after completion"),
            ))),
            StateProj::Sent { future, watch } => {
                let response = ready!(future.poll(cx)).map_err(ClientError::Inner)?;
                let watch = watch
                    .take()
                    .expect("ResponseFuture polled after completion");
                watch.head(&response);
                Poll::Ready(Ok(watch.answered(response)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(waits: &Waits, uri: &str) -> Target {
        waits.target_of(&Request::get(uri).body(()).unwrap())
    }

    const MINUTE: Word = Word::Wait(Duration::from_secs(60));

    #[test]
    fn a_target_is_its_authority_method_and_path() {
        let waits = Waits::default();
        let a = target(&waits, "http://a:1/x?q=1");
        waits.learn(a, waits.sent(), MINUTE, &[]);
        assert!(waits.left(target(&waits, "http://a:1/x")).is_some());
        assert!(waits.left(target(&waits, "http://a:1/y")).is_none());
        assert!(waits.left(target(&waits, "http://b:1/x")).is_none());
        let post = waits.target_of(&Request::post("http://a:1/x").body(()).unwrap());
        assert!(waits.left(post).is_none());
    }

    #[test]
    fn an_earlier_answer_only_lengthens_a_wait_a_later_one_sets_it() {
        let waits = Waits::default();
        let a = target(&waits, "http://a:1/x");
        let early = waits.sent();
        waits.learn(a, waits.sent(), MINUTE, &[]);
        waits.learn(a, early, Word::Go, &[]);
        waits.learn(a, early, Word::Wait(Duration::from_secs(1)), &[]);
        assert!(waits.left(a).unwrap() > Duration::from_secs(59));
        waits.learn(a, early, Word::Wait(Duration::from_secs(120)), &[]);
        assert!(waits.left(a).unwrap() > Duration::from_secs(119));
        waits.learn(a, waits.sent(), Word::Wait(Duration::from_secs(2)), &[]);
        assert!(waits.left(a).unwrap() <= Duration::from_secs(2));
        waits.learn(a, waits.sent(), Word::Go, &[]);
        assert_eq!(waits.left(a), None);
    }

    #[test]
    fn policies_are_per_server_and_hold_back_the_targets_that_named_them() {
        let waits = Waits::default();
        let (x, y) = (
            target(&waits, "http://a:1/x"),
            target(&waits, "http://a:1/y"),
        );
        let other = target(&waits, "http://b:1/x");
        waits.learn(y, waits.sent(), Word::Go, &[("p", Word::Go)]);
        waits.learn(other, waits.sent(), Word::Go, &[("p", Word::Go)]);
        waits.learn(x, waits.sent(), Word::Go, &[("p", MINUTE), ("q", Word::Go)]);
        assert!(waits.left(x).is_some() && waits.left(y).is_some());
        assert_eq!(waits.left(other), None, "another server's `p`");
        // An answer naming other policies only: `x` no longer names `p`.
        waits.learn(x, waits.sent(), Word::Go, &[("q", Word::Go)]);
        assert_eq!(waits.left(x), None);
        // An answer naming none keeps the names known.
        waits.learn(y, waits.sent(), Word::Go, &[]);
        assert!(waits.left(y).is_some());
    }

    #[test]
    fn nothing_is_remembered_of_targets_that_never_waited_nor_named_a_policy() {
        let waits = Waits::default();
        for n in 0..10 {
            let t = target(&waits, &format!("http://a:1/{n}"));
            waits.learn(t, waits.sent(), Word::Go, &[]);
            waits.learn(t, waits.sent(), Word::Wait(Duration::ZERO), &[]);
        }
        assert!(waits.state.lock().unwrap().targets.is_empty());
    }

    #[test]
    fn targets_and_spent_policies_are_bounded() {
        let waits = Waits::default();
        for n in 0..MAX_TARGETS * 3 {
            let t = target(&waits, &format!("http://a:1/{n}"));
            let name = format!("p{n}");
            waits.learn(t, waits.sent(), Word::Go, &[(&name, MINUTE)]);
        }
        let state = waits.state.lock().unwrap();
        assert!(state.targets.len() <= MAX_TARGETS);
        assert!(state.spent.len() <= MAX_TARGETS);
    }

    #[test]
    fn idle_targets_are_forgotten_before_waiting_ones() {
        let waits = Waits::default();
        let waiting = target(&waits, "http://a:1/waiting");
        waits.learn(waiting, waits.sent(), MINUTE, &[]);
        for n in 0..MAX_TARGETS * 2 {
            let t = target(&waits, &format!("http://a:1/{n}"));
            waits.learn(t, waits.sent(), Word::Go, &[("p", Word::Go)]);
        }
        assert!(waits.left(waiting).is_some());
    }
}
