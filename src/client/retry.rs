//! [`RetryAfterLayer`]: wait what the server asked, plus jitter, and try again, within a
//! budget.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use http::{Request, Response};
use tower_layer::Layer;
use tower_service::Service;

use super::{ClientBody, ClientError, Draws, Pacing, Throttled, Waits, Watch, Word, is_grpc};

/// How a [`RetryAfterLayer`] retries.
#[derive(Clone, Copy, Debug)]
pub struct Retry {
    max_retries: u32,
    max_wait: Duration,
    jitter: f64,
    min_jitter: Duration,
    budget_ratio: f64,
    budget_per_second: f64,
    pacing: Option<Pacing>,
}

impl Default for Retry {
    fn default() -> Self {
        Retry::new()
    }
}

impl Retry {
    /// At most 2 retries of a call, none that would wait more than 30 s (plus its jitter), a
    /// jitter of up to half the server's delay (at least 100 ms), and a budget of 1 retry per
    /// 5 calls plus 1 a second.
    pub fn new() -> Self {
        Retry {
            max_retries: 2,
            max_wait: Duration::from_secs(30),
            jitter: 0.5,
            min_jitter: Duration::from_millis(100),
            budget_ratio: 0.2,
            budget_per_second: 1.0,
            pacing: None,
        }
    }

    /// Also paces calls to fit the budgets the server announces: a call waits for its turn
    /// (see [pacing](crate::client#pacing)) before it is sent.
    pub fn pace(mut self, pacing: Pacing) -> Self {
        self.pacing = Some(pacing);
        self
    }

    /// The most retries of one call (0: wait for a known wait, never retry an answer).
    pub fn max_retries(mut self, retries: u32) -> Self {
        self.max_retries = retries;
        self
    }

    /// The longest wait worth waiting: past it, the call fails (or its answer is returned).
    pub fn max_wait(mut self, wait: Duration) -> Self {
        self.max_wait = wait;
        self
    }

    /// The jitter window: a fraction of the server's delay (default 0.5), and at least
    /// `at_least` (default 100 ms). A retry comes at the delay plus a uniform random part of
    /// the window, never before the delay.
    pub fn jitter(mut self, fraction: f64, at_least: Duration) -> Self {
        self.jitter = if fraction.is_finite() {
            fraction.clamp(0.0, 10.0)
        } else {
            0.5
        };
        self.min_jitter = at_least.min(super::MAX_ANNOUNCED_WAIT);
        self
    }

    /// The retry budget: `ratio` retries per call sent (default 0.2), plus `per_second`
    /// (default 1) whatever the calls. A retry past the budget is not made: the answer goes
    /// back as it is.
    pub fn budget(mut self, ratio: f64, per_second: f64) -> Self {
        self.budget_ratio = if ratio.is_finite() {
            ratio.max(0.0)
        } else {
            0.2
        };
        self.budget_per_second = if per_second.is_finite() {
            per_second.max(0.0)
        } else {
            1.0
        };
        self
    }

    /// The longest a call waits for its turn, with pacing: the pacing's and `max_wait`, the
    /// shorter.
    fn longest_turn(&self) -> Duration {
        self.pacing
            .map_or(Duration::ZERO, |p| p.longest())
            .min(self.max_wait)
    }

    /// The jitter window of a delay.
    fn window(&self, delay: Duration) -> Duration {
        delay.mul_f64(self.jitter).max(self.min_jitter)
    }
}

/// Tokens for retries: each call sent adds `ratio`, time adds `per_second`; a retry takes one.
#[derive(Debug)]
struct Budget {
    tokens: f64,
    refilled: Instant,
}

/// Waits what the server asked, plus jitter, and retries (see the [module](crate::client)).
///
/// The refusals it retries are not hidden: [`retries`](RetryAfterLayer::retries) counts them,
/// and [`on_retry`](RetryAfterLayer::on_retry) is told of each.
#[derive(Clone, Debug)]
pub struct RetryAfterLayer {
    shared: Arc<RetryState>,
}

/// What is told of each retry.
type OnRetry = Arc<dyn Fn(&Retried) + Send + Sync>;

struct RetryState {
    retry: Retry,
    waits: Arc<Waits>,
    budget: Mutex<Budget>,
    /// Jitter draws.
    draws: Draws,
    /// The retries made, by every service of the layer.
    retries: AtomicU64,
    on_retry: Option<OnRetry>,
}

impl fmt::Debug for RetryState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryState")
            .field("retry", &self.retry)
            .field("retries", &self.retries)
            .field("on_retry", &self.on_retry.is_some())
            .finish_non_exhaustive()
    }
}

/// A refusal a [`RetryAfterLayer`] retries, as told to its
/// [`on_retry`](RetryAfterLayer::on_retry) before it waits.
#[derive(Clone, Debug)]
pub struct Retried {
    status: http::StatusCode,
    grpc_status: Option<http::HeaderValue>,
    attempt: u32,
    wait: Duration,
}

impl Retried {
    /// Returns the HTTP status of the refusal (a 429 or a 503; a gRPC refusal is served 200).
    pub fn status(&self) -> http::StatusCode {
        self.status
    }

    /// Returns the `grpc-status` of a gRPC refusal (`8`, RESOURCE_EXHAUSTED, or `14`,
    /// UNAVAILABLE), `None` for an HTTP one.
    pub fn grpc_status(&self) -> Option<&http::HeaderValue> {
        self.grpc_status.as_ref()
    }

    /// Returns which retry of the call this is: 1 for the first.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Returns the wait the server asked for, which the retry waits plus its jitter.
    pub fn wait(&self) -> Duration {
        self.wait
    }
}

impl RetryAfterLayer {
    /// A layer that retries as `retry` says.
    pub fn new(retry: Retry) -> Self {
        RetryAfterLayer {
            shared: Arc::new(RetryState {
                retry,
                waits: Arc::new(Waits::pacing(retry.pacing)),
                budget: Mutex::new(Budget {
                    tokens: retry.budget_per_second,
                    refilled: Instant::now(),
                }),
                draws: Draws::default(),
                retries: AtomicU64::new(0),
                on_retry: None,
            }),
        }
    }

    /// Calls `report` with each refusal the layer's services retry, before they wait: a
    /// counter, a log line or a metric of the 429s a paced client still met. It runs on the
    /// request's task, so it must be quick and must not block.
    ///
    /// A layer has one: a second call replaces the first. Call it before the layer makes
    /// services: those made before keep what they had.
    pub fn on_retry(self, report: impl Fn(&Retried) + Send + Sync + 'static) -> Self {
        let shared = &self.shared;
        RetryAfterLayer {
            shared: Arc::new(RetryState {
                retry: shared.retry,
                waits: shared.waits.clone(),
                budget: Mutex::new(Budget {
                    tokens: shared.retry.budget_per_second,
                    refilled: Instant::now(),
                }),
                draws: Draws::default(),
                retries: AtomicU64::new(shared.retries.load(Ordering::Relaxed)),
                on_retry: Some(Arc::new(report)),
            }),
        }
    }

    /// Returns how many refusals the layer's services have retried, all of them together
    /// (the layer's clones and the services it made share the count).
    pub fn retries(&self) -> u64 {
        self.shared.retries.load(Ordering::Relaxed)
    }
}

impl<S> Layer<S> for RetryAfterLayer {
    type Service = RetryAfter<S>;

    fn layer(&self, inner: S) -> RetryAfter<S> {
        RetryAfter {
            inner,
            shared: self.shared.clone(),
        }
    }
}

impl<S> RetryAfter<S> {
    /// Returns how many refusals the services of this one's layer have retried (see
    /// [`RetryAfterLayer::retries`]).
    pub fn retries(&self) -> u64 {
        self.shared.retries.load(Ordering::Relaxed)
    }
}

impl RetryState {
    /// A refusal is retried: counted, and told.
    fn retried(
        &self,
        status: http::StatusCode,
        headers: &http::HeaderMap,
        attempt: u32,
        wait: Duration,
    ) {
        self.retries.fetch_add(1, Ordering::Relaxed);
        if let Some(report) = &self.on_retry {
            report(&Retried {
                status,
                grpc_status: headers.get("grpc-status").cloned(),
                attempt,
                wait,
            });
        }
    }

    /// A call is sent: the budget grows.
    fn sent(&self) {
        let mut budget = self.budget.lock().unwrap_or_else(|e| e.into_inner());
        self.refill(&mut budget);
        budget.tokens += self.retry.budget_ratio;
    }

    /// Takes a retry from the budget, if there is one.
    fn take_retry(&self) -> bool {
        let mut budget = self.budget.lock().unwrap_or_else(|e| e.into_inner());
        self.refill(&mut budget);
        if budget.tokens >= 1.0 {
            budget.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    fn refill(&self, budget: &mut Budget) {
        let now = Instant::now();
        let elapsed = now.duration_since(budget.refilled).as_secs_f64();
        budget.refilled = now;
        // At most 10 s of refill banked.
        let cap = (self.retry.budget_per_second * 10.0).max(1.0) + self.retry.budget_ratio * 100.0;
        budget.tokens = (budget.tokens + elapsed * self.retry.budget_per_second).min(cap);
    }

    /// The delay plus a uniform random part of its jitter window.
    fn jittered(&self, delay: Duration) -> Duration {
        delay + self.retry.window(delay).mul_f64(self.draws.unit())
    }
}

/// The service of [`RetryAfterLayer`]. Requests are cloned for their retries: their body must
/// be `Clone` (`Full<Bytes>`, `Empty`, `String`…).
#[derive(Clone, Debug)]
pub struct RetryAfter<S> {
    inner: S,
    shared: Arc<RetryState>,
}

/// The response future of [`RetryAfter`].
pub type RetryFuture<R, E> = Pin<Box<dyn Future<Output = Result<R, ClientError<E>>> + Send>>;

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RetryAfter<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    ReqBody: Clone + Send + 'static,
    ResBody: Send + 'static,
{
    type Response = Response<ClientBody<ResBody>>;
    type Error = ClientError<S::Error>;
    type Future = RetryFuture<Self::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(ClientError::Inner)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The ready service goes with this call; retries use clones made ready again.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        Box::pin(async move {
            let target = shared.waits.target_of(&request);
            let grpc = is_grpc(&request);
            let retry = shared.retry;
            let mut retries = 0;
            let mut ready = true;
            loop {
                // A wait the server asked for: waited (with jitter), or the call fails.
                if let Some(left) = shared.waits.left(target) {
                    if left > retry.max_wait {
                        return Err(ClientError::Throttled(Throttled::new(left, grpc)));
                    }
                    // The ready service holds what readiness reserved (a buffer's place, a
                    // concurrency permit): let it go while waiting, be ready again after.
                    if ready {
                        inner = inner.clone();
                        ready = false;
                    }
                    tokio::time::sleep(shared.jittered(left)).await;
                }
                // With pacing, the call's turn: waited for (its jitter is in it), unless it is
                // further away than the call may wait.
                let sent = shared.waits.sent();
                if let Some(turn) = shared.waits.paced(target, sent) {
                    if turn > retry.longest_turn() {
                        return Err(ClientError::Throttled(Throttled::paced(turn, grpc)));
                    }
                    if ready {
                        inner = inner.clone();
                        ready = false;
                    }
                    tokio::time::sleep(turn).await;
                    continue;
                }
                if !ready {
                    std::future::poll_fn(|cx| inner.poll_ready(cx))
                        .await
                        .map_err(ClientError::Inner)?;
                }
                ready = false;
                // The budget grows with calls, not with their retries.
                if retries == 0 {
                    shared.sent();
                }
                let watch = Watch {
                    sent,
                    waits: shared.waits.clone(),
                    target,
                };
                let response = inner
                    .call(clone_request(&request))
                    .await
                    .map_err(ClientError::Inner)?;
                // Learned here (with the trailers of a gRPC answer, later): the next calls wait.
                let word = watch.head(&response);
                // Refused: a 429 or a 503, or a gRPC call ended RESOURCE_EXHAUSTED or UNAVAILABLE
                // in the head (a trailers-only answer).
                let refused = response.status() == http::StatusCode::TOO_MANY_REQUESTS
                    || response.status() == http::StatusCode::SERVICE_UNAVAILABLE
                    || response
                        .headers()
                        .get("grpc-status")
                        .is_some_and(|s| s == "8" || s == "14");
                // The delay of a refusal: what the target waits now (its own wait, or a spent
                // policy it named), or a wait of 0 it was told.
                let told = match word {
                    Word::Wait(wait) => Some(wait),
                    _ => None,
                };
                let Some(wait) = shared.waits.left(target).or(told).filter(|_| refused) else {
                    return Ok(watch.answered(response));
                };
                if retries >= retry.max_retries || wait > retry.max_wait || !shared.take_retry() {
                    return Ok(watch.answered(response));
                }
                retries += 1;
                shared.retried(response.status(), response.headers(), retries, wait);
                drop(response);
                tokio::time::sleep(shared.jittered(wait)).await;
            }
        })
    }
}

fn clone_request<B: Clone>(request: &Request<B>) -> Request<B> {
    let mut clone = Request::new(request.body().clone());
    *clone.method_mut() = request.method().clone();
    *clone.uri_mut() = request.uri().clone();
    *clone.version_mut() = request.version();
    *clone.headers_mut() = request.headers().clone();
    *clone.extensions_mut() = request.extensions().clone();
    clone
}
