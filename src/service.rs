//! [`RateLimit`]: the service that checks every request before the inner service sees it.
//!
//! ```
//! use std::convert::Infallible;
//! use http::{Request, Response, StatusCode};
//! use tollgate::key::Global;
//! use tollgate::{Quota, RateLimitLayer, Rule};
//! use tower::{Layer, Service, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let layer = RateLimitLayer::builder().rule(Rule::new("one", Quota::per_hour(1)).key(Global)).build().unwrap();
//! let inner = service_fn(|_req: Request<String>| async {
//!     Ok::<_, Infallible>(Response::new(String::from("served")))
//! });
//! let mut service = layer.layer(inner);
//! let first = service.ready().await.unwrap().call(Request::new(String::new())).await.unwrap();
//! assert_eq!(first.status(), StatusCode::OK);
//! let second = service.ready().await.unwrap().call(Request::new(String::new())).await.unwrap();
//! assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
//! # }
//! ```

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use smallvec::SmallVec;
use tower_service::Service;

use crate::future::{Check, ResponseFuture, after_check};
use crate::key::{Extracted, Key, KeyFuture};
use crate::layer::Shared;
use crate::response::{ResponseBody, is_grpc};
use crate::store::{Charge, MemoryStore, Store};

/// Indices of the rules that applied to one request, in rule order.
pub(crate) type Applied = SmallVec<[u16; 4]>;

/// The rate-limiting service made by [`RateLimitLayer`](crate::RateLimitLayer).
///
/// The inner service is called only after every rule admitted the request; its error type is
/// kept as it is, so no `HandleErrorLayer` is needed.
pub struct RateLimit<S, St = MemoryStore> {
    inner: S,
    shared: Arc<Shared<St>>,
}

impl<S, St> RateLimit<S, St> {
    pub(crate) fn new(inner: S, shared: Arc<Shared<St>>) -> Self {
        RateLimit { inner, shared }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, St> Clone for RateLimit<S, St> {
    fn clone(&self) -> Self {
        RateLimit {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, St> fmt::Debug for RateLimit<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, St, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S, St>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    St: Store,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody, St>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The ready service goes with this request; a fresh clone waits for the next poll_ready.
        let clone = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, clone);

        let shared = &self.shared;
        let (parts, body) = request.into_parts();

        let mut keys = FoundKeys::new();
        let mut pending: SmallVec<[(u16, KeyFuture, u64); 1]> = SmallVec::new();
        if let [rule] = &*shared.rules {
            // The common case, one rule: no lists to build.
            let cost = rule.cost.of(&parts);
            match rule.key.extract(&parts) {
                Extracted::Ready(Some(key)) => {
                    let request = Request::from_parts(parts, body);
                    let check = Check::ask(
                        shared,
                        &[Charge {
                            rule: &rule.spec,
                            key: &key,
                            cost,
                        }],
                    );
                    let applied = Applied::from_buf_and_len([0; 4], 1);
                    let keys = shared.fallback.as_ref().map(|_| {
                        let mut keys = FoundKeys::new();
                        keys.push((0, key, cost));
                        keys
                    });
                    return respond(check, applied, keys, ready, request, shared);
                }
                Extracted::Ready(None) => warn_missing_key(shared, 0),
                Extracted::Pending(future) => pending.push((0, future, cost)),
            }
        } else {
            for (i, rule) in shared.rules.iter().enumerate() {
                let index = i as u16;
                match rule.key.extract(&parts) {
                    Extracted::Ready(Some(key)) => keys.push((index, key, rule.cost.of(&parts))),
                    Extracted::Ready(None) => warn_missing_key(shared, i),
                    Extracted::Pending(future) => {
                        pending.push((index, future, rule.cost.of(&parts)))
                    }
                }
            }
        }
        let request = Request::from_parts(parts, body);

        if pending.is_empty() {
            let (check, applied) = check_keys(shared, &keys);
            let keys = shared.fallback.is_some().then_some(keys);
            return respond(check, applied, keys, ready, request, shared);
        }

        let shared = shared.clone();
        let deferred = Box::pin(async move {
            for (index, future, cost) in pending {
                match future.await {
                    Some(key) => keys.push((index, key, cost)),
                    None => warn_missing_key(&shared, usize::from(index)),
                }
            }
            keys.sort_unstable_by_key(|(i, _, _)| *i);
            let (check, applied) = check_keys(&shared, &keys);
            let result = check.await;
            let keys = shared.fallback.as_ref().map(|_| Box::new(keys));
            (applied, keys, result)
        });
        ResponseFuture::deferred(deferred, ready, request, self.shared.clone())
    }
}

/// The response future of a request whose keys are known: when the store answered at once,
/// the inner service is called (or answered for) right away; otherwise the future waits for the
/// store. `keys` are kept for rules that may fall back to the local limiter.
fn respond<S, ReqBody, St>(
    check: Check<St::Future>,
    mut applied: Applied,
    keys: Option<FoundKeys>,
    service: S,
    request: Request<ReqBody>,
    shared: &Arc<Shared<St>>,
) -> ResponseFuture<S, ReqBody, St>
where
    S: Service<Request<ReqBody>>,
    St: Store,
{
    match check.into_decided() {
        Ok(result) => {
            let grpc = || is_grpc(request.headers());
            let next = after_check(shared, &mut applied, keys.as_ref(), result, grpc);
            ResponseFuture::decided(next, applied, service, request, shared.clone())
        }
        Err(check) => {
            let future = ResponseFuture::checking(check, applied, service, request, shared.clone());
            match keys {
                Some(keys) => future.keeping_keys(keys),
                None => future,
            }
        }
    }
}

/// Keys found for a request: the rule's index, the key, the cost.
pub(crate) type FoundKeys = SmallVec<[(u16, Key, u64); 2]>;

/// Asks the store about every rule that found a key, in rule order.
fn check_keys<St: Store>(shared: &Shared<St>, keys: &FoundKeys) -> (Check<St::Future>, Applied) {
    let charges: SmallVec<[Charge<'_>; 2]> = keys
        .iter()
        .map(|(i, key, cost)| Charge {
            rule: &shared.rules[usize::from(*i)].spec,
            key,
            cost: *cost,
        })
        .collect();
    let applied = keys.iter().map(|(i, _, _)| *i).collect();
    (Check::ask(shared, &charges), applied)
}

fn warn_missing_key<St>(shared: &Shared<St>, rule: usize) {
    if shared.warned_missing_key[rule].first() {
        tracing::warn!(
            rule = shared.rules[rule].spec.name(),
            "tollgate: the key extractor found no key for a request, so this rule did not apply to it \
             (for the peer IP, serve with into_make_service_with_connect_info::<SocketAddr>()); \
             reported once per rule"
        );
    }
}
