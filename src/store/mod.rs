//! How much they already did: the [`Store`] trait and its implementations.
//!
//! ```
//! use tollgate::Algorithm;
//! use tollgate::algorithm::Limits;
//! use tollgate::key::Key;
//! use tollgate::store::{Charge, MemoryStore, RuleSpec, Store};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let store = MemoryStore::new();
//! let one_per_second = Limits::new(1, 1_000_000, 1).unwrap();
//! let rule = RuleSpec::new("burst", Algorithm::TokenBucket, one_per_second).unwrap();
//! let key = Key::text("client-1");
//! let charge = [Charge { rule: &rule, key: &key, cost: 1 }];
//! assert!(store.check(&charge).await.unwrap().allowed());
//! assert!(!store.check(&charge).await.unwrap().allowed());
//! # }
//! ```
//!
//! # The contract
//!
//! * One [`check`](Store::check) evaluates **all** charges of a request atomically: either every
//!   rule admits and every rule is charged, or the request is denied and nothing is charged.
//! * Time comes from the store's own clock, never from the caller.
//! * Every key the store writes expires once its budget would be full again.
//! * For the same algorithm and the same sequence of (time, cost), every store gives the same
//!   outcomes as the reference model in [`algorithm`](crate::algorithm).
//! * A denied request is charged nothing, and every rule's outcome describes the budget as it
//!   stands ([`Algorithm::uncharged`](crate::Algorithm::uncharged)).
//!
//! # In process: `MemoryStore` (the default)
//!
//! ```
//! use tollgate::store::MemoryStore;
//! use tollgate::{ConfigError, Quota, RateLimitLayer, Rule};
//!
//! fn layers() -> Result<(RateLimitLayer, RateLimitLayer), ConfigError> {
//!     let store = MemoryStore::builder().max_keys(500_000).build()?;
//!     let api = RateLimitLayer::builder().rule(Rule::new("api", Quota::per_minute(100))).store(store.clone()).build()?;
//!     let admin = RateLimitLayer::builder().rule(Rule::new("admin", Quota::per_minute(10))).store(store).build()?;
//!     Ok((api, admin))
//! }
//! # layers().unwrap();
//! ```
//!
//! Sharded and bounded (1,000,000 keys by default; a full shard evicts the keys whose budget
//! will be full soonest, counted and logged). Keys expire once their budget is full again,
//! without a background task. Clones share state: one store can serve several layers. Each
//! replica has its own, though: behind a load balancer, use Redis.
//!
//! **A rule name is a budget.** Layers that share a store and a rule name share that budget, on
//! purpose or by accident, so `build()` refuses a rule whose name a living layer of the same
//! store uses with another quota or algorithm ("another layer of the same store uses this name
//! with another quota"). Give each budget its own name. The check sees the layers that share one
//! store value (and its clones): two stores built on the same Redis, or two replicas, are not
//! compared, so give them the same rules through their configuration.
//!
//! # Redis and Redis Cluster
//!
//! With the feature `redis` (on by default), [`RedisStore`] and [`RedisClusterStore`] keep the
//! budgets in Redis, shared by every replica: "100 per minute" means 100 per minute fleet-wide.
//!
//! ```no_run
//! use std::net::SocketAddr;
//! use std::time::Duration;
//! use axum::{Router, routing::get};
//! use tollgate::store::RedisStore;
//! use tollgate::{Algorithm, Quota, RateLimitLayer, Rule};
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = RedisStore::builder("redis://127.0.0.1:6379")
//!     .prefix("shop")                              // keys are shop:{client}:rule
//!     .pool_size(2)                                // connections at most (default 2)
//!     .connect_timeout(Duration::from_secs(1))     // default 1 s
//!     .response_timeout(Duration::from_millis(50)) // the budget of one check (default 100 ms)
//!     .build()?;                                   // connects in the background
//! let layer = RateLimitLayer::builder()
//!     .rule(Rule::new("burst", Quota::per_second(10).burst(20)))
//!     .rule(Rule::new("hourly", Quota::per_hour(1000)).algorithm(Algorithm::SlidingWindowCounter))
//!     .store(store)
//!     .build()?;
//! let app = Router::new().route("/", get(|| async { "hello" })).layer(layer);
//!
//! let listener = tokio::net::TcpListener::bind("0.0.0.0:3000").await?;
//! axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
//! # Ok(())
//! # }
//! ```
//!
//! **Budgets live as long as Redis keeps them.** A budget is a key in Redis and nothing else
//! holds it: a key Redis evicts (a `maxmemory` policy other than `noeviction`, such as
//! `allkeys-lru`), a server restarted without persistence (no RDB or AOF), a failover to a
//! replica that had not received the last writes, or a `FLUSHALL` gives the clients it
//! counted a full budget again. Keep them from eviction (`maxmemory-policy noeviction`; every
//! tollgate key has a TTL, so the `volatile-*` policies evict them first), and enable
//! persistence where a restart must not refill every budget.
//!
//! For a Redis Cluster, use [`RedisClusterStore::builder`] with the URLs of some of its nodes
//! instead (`RedisClusterStore::builder(["redis://node1:6379", "redis://node2:6379"])`);
//! everything else is the same. Valkey works as Redis does (Redis 6.2 or newer, or any Valkey).
//!
//! `cargo run --example replicas` shows why: three axum replicas behind a round-robin client,
//! 300 requests of one client against "100 per hour" (`REDIS_URL`, default
//! `redis://127.0.0.1:6379`):
//!
//! ```text
//! store=memory replicas=3 limit=100 sent=300 admitted=300
//! store=redis replicas=3 limit=100 sent=300 admitted=100
//! store=redis-lease replicas=3 limit=100 lease=10 sent=300 admitted=100
//! ```
//!
//! ## One atomic step per request
//!
//! A check is one call of tollgate's code in Redis, which reads the server's `TIME` once, checks
//! every rule of the request and, only when all of them admit it, charges them all. Nothing can
//! run between the read and the write, so concurrent requests from any number of replicas are
//! counted exactly, and a request denied by one rule is charged to none. The code mirrors the
//! reference model of [`algorithm`](crate::algorithm) decision for decision (a differential test
//! holds them together).
//!
//! The code is loaded once per server as a function library (Redis 7 and later, Valkey:
//! `FUNCTION LOAD`, then `FCALL` per call), so that a call runs only the check it asks for; a
//! server without functions (Redis 6.2) runs the same code as a script (`EVALSHA`). When the
//! server lost the code (restart, failover, `FUNCTION FLUSH`), the store loads it again and
//! sends the check once more, which is safe: it did not run.
//!
//! **Batches.** Concurrent checks of a [`RedisStore`] go to Redis together. A connection sends a
//! call when none of its calls is out; while one is, the checks that arrive wait for it and
//! leave together in the next (at most [`max_batch`][max_batch], default 64; a second call goes
//! early only when half a batch waits), each still all or nothing by itself, decided in order
//! with the server's time read once. A lone check leaves at once: no timer. A busy replica makes
//! a tenth or less of the calls, and the server spends less per decision: the checks of one hot
//! key in a call are decided as one run, the key read and written once, their answers told
//! once. A check whose caller stopped waiting is not sent. Each connection is driven by a task
//! of its own that writes a call once, reads the replies as they come (integers, read without
//! building values) and answers each check by its deadline. The cluster store pipelines its
//! calls per node (keys of one call must share a slot). A repeated charge (one rule and one key
//! twice in a check) is refused: merge its costs.
//!
//! A check is sent **at most once** otherwise. A connection that drops after the code ran but
//! before its reply arrived would, if sent again, charge twice (or refund twice, which would
//! over-admit), so a check whose reply is lost fails, and its rules' failure modes decide. The
//! cluster store routes checks itself (one pipelined connection per primary, its own slot
//! map) and follows `MOVED` / `ASK`, which say the script did not run.
//!
//! ## The deny cache
//!
//! When Redis denies a request, the store keeps its answer, and answers the same request (same
//! rules, keys and costs) itself until the sooner of the denying rule's retry-after and the
//! time its next unit comes back, with Redis's numbers aged by the time since: a client that
//! is already denied costs Redis nothing. The request's other rules, those that admitted it (a
//! global rule stacked over every tenant's), keep the numbers Redis last gave for them on this
//! replica (with the denial, or with a later request it admitted): a token-bucket or GCRA rule
//! (not leased, not split) for as long as the denial stands, its units coming back in the
//! answer as the reference model brings them back (spending by other replicas meanwhile is not
//! in them); a leased one shows the numbers its lease on this replica reports while it would
//! pay the request; another keeps them until its own next unit, when the next request asks
//! Redis again. Within that time Redis would deny it too (other
//! requests only spend), so the cache never denies what Redis would admit; its time is counted
//! from when the check was sent, before Redis read its clock. The exceptions are units given
//! back meanwhile: a cluster's cross-slot request that lost a race gives back what it took, and
//! a denial cached in that instant may last until its time; so may one of a key whose leased
//! units another replica gives back. A reset or a refund made through any store is told to the
//! others: it is published on `<prefix>:forget`, every store of the prefix listens on a
//! connection of its own, and a denial cached before a key was heard forgotten is not answered
//! again (the next request asks Redis), so another replica admits within one pub/sub hop after
//! the reset or refund returns. A message can be lost (the listening connection was down, and
//! then every cached denial is dropped when it is back): whatever Redis computed, a cached denial
//! is answered at most [`deny_cache_max_age`][deny_cache_max_age] (default 5 s), the bound of
//! its staleness then. A rule with other numbers (a policy that
//! changed) is a new rule to it, and an admitted request ends the denials of its keys. Bounded:
//! [`deny_cache`][deny_cache] keys (default 100,000; 0 turns it off). While
//! Redis is away, keys it denied stay denied until their time; other requests follow their
//! rules' failure modes.
//!
//! ## Leases and split keys
//!
//! For a hot key, [`Rule::lease`](crate::Rule::lease) lets each replica take up to `n` units in
//! the call that checks one request and spend them itself, and
//! [`Rule::split`](crate::Rule::split) spreads a key over `k` sub-keys in distinct hash tags
//! (distinct cluster slots):
//!
//! ```
//! use tollgate::store::RedisClusterStore;
//! use tollgate::{ConfigError, Quota, RateLimitLayer, Rule};
//!
//! fn hot(store: RedisClusterStore) -> Result<RateLimitLayer<RedisClusterStore>, ConfigError> {
//!     RateLimitLayer::builder()
//!         // Each replica takes up to 20 units at a time and spends them itself (for 1 s at most).
//!         .rule(Rule::new("search", Quota::per_second(1000)).lease(20))
//!         // 8 sub-keys in 8 hash tags: one tenant's traffic spread over the cluster's primaries.
//!         .rule(Rule::new("export", Quota::per_minute(800)).split(8))
//!         .store(store)
//!         .build()
//! }
//! ```
//!
//! * **Leases** ([`Rule::lease`](crate::Rule::lease)`(n)`, `.lease_ttl(..)`): the call that
//!   checks one request takes every unit there is up to `n` (at least the request's cost), and
//!   the replica spends the rest on the key's next requests; a refill is out one at a time per
//!   key. About one call per `n` requests. A key spent by many requests at once is refilled
//!   *ahead of need*: once fewer units are left than its requests asked for during the last
//!   refill's round trip (and half as much again), a request paid from the lease is answered at
//!   once and also asks Redis, in a task of its own on the Tokio runtime, for what the lease
//!   lacks, so the units rarely run out. Size `n` to more than twice what one replica spends of
//!   the key during a round trip (rate × round trip: 250 for 100,000 requests a second and
//!   1 ms); a smaller lease is refilled when it runs out, a whole lease per call, and the
//!   requests that find no unit while its refill is out go to Redis one by one. While Redis
//!   cannot be asked, units held are spent all the same.
//! * **Split keys** ([`Rule::split`](crate::Rule::split)`(k)`): each key becomes `k` sub-keys,
//!   `prefix:{identity~i}:rule`, each with `1/k` of the quota and burst; a replica gives a key's
//!   requests to its sub-keys in turn. Denials are cached per sub-key. An answer tells the
//!   sub-key's budget for the whole key (its remaining × `k`, its reset and window): a client
//!   may see `r=0` on a denial while other sub-keys still admit, and a `t` that is the
//!   sub-key's (for 8 a minute split in 4, 2 a minute each: 30 s).
//!
//! Their precision, next to the deny cache's:
//!
//! | | calls to Redis | never admits more than | may refuse early by | answers' numbers |
//! |---|---|---|---|---|
//! | deny cache (default) | none for a denied key until its retry-after | the budget | nothing | Redis's, aged |
//! | `lease(n)` | about one per `n` requests of a key spent one request at a time; for a key spent `d` units per round trip with `n ≥ 2 d + 1`, one per round trip at most, about one per `n − 1.5 d` requests when that is more; with a smaller `n`, one per `n` plus the requests that find no unit, one by one | the budget, as counted when each unit was charged; a unit is spent at most the lease's time to live (1 s) after its charge, never across a fixed or sliding-counter window, so over any period the fleet may spend up to the units held at its start on top | `(n − 1)` units per replica holding some | Redis's at the lease, with the units held counted as remaining |
//! | `split(k)` | one per request, spread over `k` slots | the budget (each sub-key has `1/k`, rounded down) | about `(k − 1) × R` requests' units with R replicas | the sub-key's, its remaining × `k` |
//!
//! The deny cache's "nothing" is exact up to time: a denial is cached until the retry-after
//! Redis computed, counted from the answer's arrival, so it may outlive Redis's own by the
//! answer's way back (well under a millisecond on a LAN); a reset or refund made on another
//! replica ends it once the message reaches it (the refund's answer, its `PUBLISH`, and the
//! push to the other replica: three trips, a few milliseconds at most on a LAN), or by the cap
//! ([`deny_cache_max_age`][deny_cache_max_age], default 5 s) when that
//! message is lost. While Redis cannot be asked, the rule's [`FailureMode`](crate::FailureMode)
//! answers instead.
//!
//! Leased units left when their time to live ends (never past the end of a fixed or
//! sliding-counter window, as the leased key's node counts time) go back into the window they
//! were charged in, for a fixed window or a sliding counter, with the key's next call from that
//! replica; for the other algorithms they are dropped (see [`Rule::lease`](crate::Rule::lease));
//! units a request took and did not spend go back only to the lease they came from, while it
//! lives. A refill whose reply is lost (a time-out, a client that went away) loses what it took.
//! A split key's request whose cost is more than a sub-key holds (possible only with a computed
//! cost) is never admitted. A rule is leased or split, not both. The memory store ignores both:
//! it has no round trip to save and no hot shard.
//!
//! ## Keys and values
//!
//! Each rule of each caller is one key, `prefix:{identity}:rule`: the identity (the sanitized
//! text of a [`Key`]) is the Redis Cluster hash tag, so all rules of one caller
//! live in one slot and one script can check them all. The prefix (default `tollgate`) lets
//! several applications or regions share one Redis. Every key expires when its budget is full
//! again (`PEXPIRE`, rounded up to the millisecond), and a key whose state is the same as no state
//! is deleted: memory follows active callers. Values are compact:
//!
//! | algorithm | value |
//! |---|---|
//! | token bucket | one integer: minus the time the bucket is full again |
//! | GCRA | one integer: the theoretical arrival time |
//! | fixed window | `start:count` |
//! | sliding window counter | `start:previous:current` |
//! | sliding window log | a list of at most `limit` times (one per admitted unit, at most 10,000) |
//!
//! A rule whose algorithm changed finds the old value unreadable and starts from no state, as the
//! model does. A token-bucket value holds the bucket as the model would have it at any time not
//! before its last charge; if the server's clock steps back, the tokens refilled since are not
//! counted until the clock catches up (the bucket is, briefly, stricter than the model).
//!
//! ## Cluster: rules of different callers
//!
//! When the rules of one request count different identities (a per-client rule and a
//! [`Global`](crate::key::Global) one), their keys can live in different slots, where no script
//! can reach them together. [`RedisClusterStore`] then groups the charges by slot and:
//!
//! 1. checks every group without charging (in parallel); if any rule denies, the request is denied
//!    and **nothing is charged**, as on one node;
//! 2. otherwise charges every group (in parallel), each group atomically;
//! 3. if a group now denies (another request took the last units between steps 1 and 2), the
//!    groups already charged are refunded, and the request is denied.
//!
//! So a denied request never keeps a charge, except when the check fails or times out between
//! steps 2 and 3: then the charges made stay until their keys expire. Requests whose rules all
//! count the same identity (or identities that hash to one slot) take the one-script path. The
//! standalone [`RedisStore`] always runs one script for all keys.
//!
//! ## Starting, failing, and time
//!
//! Both stores start without waiting for Redis: `build()` returns at once, the store connects
//! in the background and retries (every 100 ms at first, the wait doubling up to 2 s between
//! attempts), and until it has connected every check fails at once, so each
//! rule's [`FailureMode`](crate::FailureMode) decides (a replica starts and serves during a Redis
//! outage). `connect().await` waits for Redis instead, for services that must not start without
//! it. Connection errors name the server, without its password.
//!
//! Each check has a strict budget, `response_timeout` (default 100 ms): past it the check ends
//! with [`StoreError::Timeout`] (the script may still have run on the server). A refused or
//! dropped connection, a cluster that is down or a read-only replica give
//! [`StoreError::Unavailable`]. Errors are told apart by their kind, never by their text. A
//! [`CircuitBreaker`] (one per server; one per node of a cluster) stops asking a server that
//! keeps failing, so that requests do not each wait for the budget.
//!
//! ```
//! use tollgate::store::RedisStore;
//! use tollgate::{ConfigError, FailureMode, Quota, RateLimitLayer, Rule};
//!
//! fn resilient(redis_store: RedisStore) -> Result<RateLimitLayer<RedisStore>, ConfigError> {
//!     RateLimitLayer::builder()
//!         // 503 + Retry-After: 1 (gRPC: UNAVAILABLE) while the store is away.
//!         .rule(Rule::new("login", Quota::per_minute(5)).on_store_error(FailureMode::Closed))
//!         // Checked in the layer's own in-process limiter while the store is away.
//!         .rule(Rule::new("api", Quota::per_second(50)).on_store_error(FailureMode::Local))
//!         .store(redis_store)
//!         .on_store_error(FailureMode::Open) // the default for rules that say nothing
//!         .build()
//! }
//! ```
//!
//! When a check fails, each rule's [`FailureMode`](crate::FailureMode) decides: `Open` (the
//! default) skips the rule, `Closed` refuses the request, `Local` checks the rule in a local
//! limiter of the layer, with the usual answers, at this replica's share of the quota: the
//! stores count the replicas of their prefix with a heartbeat (`heartbeat`, default every
//! second), and while Redis is away each replica checks `1 / replicas` of each quota, by the
//! count last read (see [`FallbackShare`](crate::FallbackShare)). A check that ran out of time may still run once a slow
//! Redis catches up, so the requests let through meanwhile are counted there too (tested on a
//! paused Redis Cluster). Failures are logged at most once a minute at `error` level.
//!
//! The breaker opens after 5 failures in a row (`CircuitBreaker::after_failures(n)`, given to
//! the store builder with `.circuit_breaker(..)`); requests are then decided at once by their
//! failure modes for a cooldown of 1 s (`.cooldown(..)`), then one request probes the server
//! again; `CircuitBreaker::disabled()` turns it off. A server that answers at once, even with an
//! error, is not a reason to open it; a connection is replaced when it fails, or after three
//! time-outs in a row (one stall of the server times out every check in flight on it). On a
//! cluster, while one primary is down or failing over, only the checks of its slots are
//! decided without it. Run the cluster with `cluster-require-full-coverage no`, or Redis itself
//! refuses every slot (`CLUSTERDOWN`) until the failover completes (tested with `kill -9` on a
//! primary of a 3-primary, 3-replica cluster: the other slots answered every check).
//!
#![cfg_attr(
    feature = "redis",
    doc = "[max_batch]: RedisStoreBuilder::max_batch
[deny_cache]: RedisStoreBuilder::deny_cache
[deny_cache_max_age]: RedisStoreBuilder::deny_cache_max_age
[`CircuitBreaker`]: crate::CircuitBreaker"
)]
#![cfg_attr(
    not(feature = "redis"),
    doc = "[`RedisStore`]: https://docs.rs/tollgate/latest/tollgate/store/struct.RedisStore.html
[`RedisClusterStore`]: https://docs.rs/tollgate/latest/tollgate/store/struct.RedisClusterStore.html
[`RedisClusterStore::builder`]: https://docs.rs/tollgate/latest/tollgate/store/struct.RedisClusterStore.html#method.builder
[max_batch]: https://docs.rs/tollgate/latest/tollgate/store/struct.RedisStoreBuilder.html#method.max_batch
[deny_cache]: https://docs.rs/tollgate/latest/tollgate/store/struct.RedisStoreBuilder.html#method.deny_cache
[deny_cache_max_age]: https://docs.rs/tollgate/latest/tollgate/store/struct.RedisStoreBuilder.html#method.deny_cache_max_age
[`CircuitBreaker`]: https://docs.rs/tollgate/latest/tollgate/struct.CircuitBreaker.html"
)]

#[cfg(feature = "redis")]
pub(crate) mod breaker;
mod memory;
#[cfg(feature = "redis")]
pub(crate) mod redis;
mod registry;
mod spec;
pub(crate) mod table;

pub use crate::error::StoreError;
pub use memory::{MemoryStore, MemoryStoreBuilder};
#[cfg(feature = "redis")]
pub use redis::{
    ConnectError, DEFAULT_DENY_CACHE, DEFAULT_MAX_BATCH, RedisClusterStore,
    RedisClusterStoreBuilder, RedisStore, RedisStoreBuilder,
};
pub use registry::RuleRegistry;
pub use spec::{Lease, MAX_LEASE_TTL, MAX_PARTS, RuleSpec};

use std::future::Future;
use std::pin::Pin;

use crate::Decision;
use crate::key::Key;

/// One rule to check for one request: the rule, the key it counts, and the cost.
#[derive(Clone, Copy, Debug)]
pub struct Charge<'a> {
    /// The rule.
    pub rule: &'a RuleSpec,
    /// Who is charged.
    pub key: &'a Key,
    /// How much (0 only looks).
    pub cost: u64,
}

/// A change to a charge already made: more units whatever the budget, or units given back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// Charge this many more units, whatever the budget: beyond it, a debt the next requests
    /// wait for ([`Algorithm::force`](crate::Algorithm::force)).
    Charge(u64),
    /// Give this many units back ([`Algorithm::refund`](crate::Algorithm::refund)).
    Refund(u64),
}

/// One [`Change`] to one rule's charge of one key.
#[derive(Clone, Copy, Debug)]
pub struct Adjustment<'a> {
    /// The rule.
    pub rule: &'a RuleSpec,
    /// Whose charge.
    pub key: &'a Key,
    /// What changes.
    pub change: Change,
    /// When the units given back were charged, on the store's clock
    /// ([`Decision::made_at`]); the window algorithms give back only to that window. 0: now
    /// (the current window).
    pub charged_at: u64,
}

/// The future of a store's operations outside the request path (see [`Store::adjust`]).
pub type StoreFuture<T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'static>>;

/// A future of `error`, at once.
fn unsupported<T: Send + 'static>(what: &'static str) -> StoreFuture<T> {
    Box::pin(std::future::ready(Err(StoreError::Unsupported(what))))
}

/// Where rate-limit state lives.
///
/// The future must not borrow from the arguments: a store copies what it needs.
pub trait Store: Send + Sync + 'static {
    /// The future of a check.
    type Future: Future<Output = Result<Decision, StoreError>> + Send + 'static;

    /// Checks and, when all admit, charges every charge of one request, atomically. The outcomes
    /// are in the order of `charges`.
    fn check(&self, charges: &[Charge<'_>]) -> Self::Future;

    /// The same check, answered at once by a store that never waits (the memory store), or
    /// `None` (the default) when the answer needs [`check`](Store::check)'s future.
    ///
    /// With an answer here, the layer calls the inner service (or answers for it) straight
    /// from `Service::call`, without a state machine around the store (unless a key extractor
    /// needs an asynchronous lookup first).
    fn check_now(&self, charges: &[Charge<'_>]) -> Option<Result<Decision, StoreError>> {
        let _ = charges;
        None
    }

    /// The rule names in use on this store, or `None` (the default) for a store that does not
    /// keep them. With a registry, a layer cannot give a rule name another quota than a living
    /// layer of the same store gives it (see [`RuleRegistry`]).
    fn registry(&self) -> Option<&RuleRegistry> {
        None
    }

    /// The store's kind, as metrics label it (`memory`, `redis`, `redis_cluster`; default
    /// `custom`). Bounded: never an address or a name given at run time.
    fn kind(&self) -> &'static str {
        "custom"
    }

    /// How many replicas share this store, as last counted, this one included; `None` (the
    /// default) for a store that does not count them. The Redis stores count the replicas of
    /// their prefix with a heartbeat (`RedisStoreBuilder::heartbeat`); the local fallback of a rule
    /// gives each replica its share of the quota by this count (see
    /// [`FallbackShare`](crate::FallbackShare)).
    fn replicas(&self) -> Option<u32> {
        None
    }

    /// Tells whether the store counts the replicas of its prefix ([`replicas`](Self::replicas)
    /// answers once it has): `false` (the default) for a store that never does, whose local
    /// fallback then assumes one replica unless told otherwise
    /// ([`FallbackShare::until_counted`](crate::FallbackShare::until_counted)).
    fn counts_replicas(&self) -> bool {
        false
    }

    /// Changes charges already made, each on its own (settling a cost known after the
    /// response, giving back a request's units). The stores of tollgate implement it; the
    /// default answers [`StoreError::Unsupported`].
    fn adjust(&self, adjustments: &[Adjustment<'_>]) -> StoreFuture<()> {
        let _ = adjustments;
        unsupported("adjust charges")
    }

    /// The same adjustments, made at once by a store that never waits (the memory store), or
    /// `None` (the default) when they need [`adjust`](Store::adjust)'s future.
    ///
    /// What a request leaves to the store when it goes away (its concurrency slots, a metered
    /// response's unspent chunk) is made here first, on the thread that drops it, which may
    /// run no Tokio runtime: it must not block. `Some` is final (the adjustments were made, or
    /// failed; [`adjust`](Store::adjust) is not tried), `None` means nothing was made.
    /// Otherwise [`adjust`](Store::adjust)'s future finishes on the Tokio runtime the request
    /// was served on (polled once where it is dropped, when that is on the same runtime). A store whose
    /// adjustments never wait should answer here, so that they are not left to a runtime that
    /// may have shut down. (Named apart from [`MemoryStore::adjust_now`], which makes them and
    /// returns nothing.)
    fn try_adjust_now(&self, adjustments: &[Adjustment<'_>]) -> Option<Result<(), StoreError>> {
        let _ = adjustments;
        None
    }

    /// Every charge's outcome as if it were checked now, charging nothing.
    fn peek(&self, charges: &[Charge<'_>]) -> StoreFuture<Decision> {
        let _ = charges;
        unsupported("peek")
    }

    /// Forgets every charge of these rules and keys: their next requests find a full budget.
    fn reset(&self, charges: &[Charge<'_>]) -> StoreFuture<()> {
        let _ = charges;
        unsupported("reset")
    }
}
