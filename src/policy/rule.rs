use std::fmt;
use std::sync::Arc;

use std::time::Duration;

use super::key_spec::KeySpec;
use super::metering::Metering;
use super::outcome::{After, ChargeWhen, SettleFrom};
use super::{Cost, FailureMode, Quota, RuleMode};
use crate::algorithm::Limits;
use crate::key::{KeyExtractor, SharedExtractor};
use crate::store::RuleSpec;
use crate::{Algorithm, ConfigError};

/// One limit: a name, a [`Quota`], an [`Algorithm`], who it counts (a
/// [`KeyExtractor`]) and what a request [`Cost`]s.
///
/// ```
/// use tollgate::key::Global;
/// use tollgate::{Algorithm, Quota, Rule};
///
/// let rule = Rule::new("search", Quota::per_minute(60))
///     .algorithm(Algorithm::SlidingWindowCounter)
///     .key(Global)
///     .cost(2);
/// assert_eq!(rule.name(), "search");
/// ```
///
/// The name identifies the rule in headers, metrics and store keys: two layers that share a
/// store share a budget under the same rule name, and must give it the same quota and algorithm
/// (the layer's `build()` refuses otherwise). Names are 1 to 64 characters of
/// `A-Z a-z 0-9 - _ .`.
///
/// Without [`key`](Rule::key) the rule uses the layer's default extractor (the client's peer IP).
/// A request whose key the extractor cannot find is counted under one shared "unidentified" key
/// unless the rule says [`skip_unidentified`](Rule::skip_unidentified).
#[derive(Clone)]
pub struct Rule {
    pub(crate) name: String,
    pub(crate) quota: Quota,
    pub(crate) algorithm: Algorithm,
    pub(crate) key: Option<SharedExtractor>,
    /// The key as a rules file names it (wins over `key`).
    pub(crate) key_spec: Option<KeySpec>,
    pub(crate) cost: Cost,
    pub(crate) on_store_error: Option<FailureMode>,
    pub(crate) skip_unidentified: bool,
    pub(crate) mode: RuleMode,
    /// Units leased at once to each replica of a remote store, and their time to live.
    pub(crate) lease: Option<(u64, Duration)>,
    /// Sub-keys of each key in a remote store.
    pub(crate) split: Option<u16>,
    /// What the rule does once the response head is there.
    pub(crate) after: After,
    /// The longest hold of a concurrency rule, when set.
    pub(crate) max_hold: Option<Duration>,
    /// How a response's units are metered while it streams, when they are.
    pub(crate) meter: Option<Metering>,
    /// `meter_frames` or `meter_usage_trailer` without `meter`: refused when compiled.
    pub(crate) meter_without_chunk: bool,
}

/// How long leased units live, unless [`Rule::lease_ttl`] says otherwise.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(1);

/// The longest a request holds a [concurrency](Rule::concurrent) slot, unless
/// [`Rule::max_hold`] says otherwise.
pub const DEFAULT_MAX_HOLD: Duration = Duration::from_secs(60);

impl Rule {
    /// A token-bucket rule named `name` with `quota`.
    pub fn new(name: impl Into<String>, quota: Quota) -> Self {
        Rule {
            name: name.into(),
            quota,
            algorithm: Algorithm::default(),
            key: None,
            key_spec: None,
            cost: Cost::default(),
            on_store_error: None,
            skip_unidentified: false,
            mode: RuleMode::Enforce,
            lease: None,
            split: None,
            after: After::default(),
            max_hold: None,
            meter: None,
            meter_without_chunk: false,
        }
    }

    /// A concurrency limit named `name`: at most `slots` requests of a key in flight at once
    /// ([`Algorithm::Concurrency`]). A request holds its slot (its [`cost`](Rule::cost), 1 by
    /// default) from admission until its response body ends or is dropped (a streamed body or
    /// a gRPC stream until its last frame; a client that disconnects frees it), and at most
    /// [`max_hold`](Rule::max_hold) (default [`DEFAULT_MAX_HOLD`], 60 s): a slot that is never
    /// given back (a replica that died) is free again then, and a response that outlives it
    /// no longer counts.
    ///
    /// ```
    /// use tollgate::{Quota, RateLimitLayer, Rule};
    ///
    /// // 20 concurrent expensive searches per client, and 100 searches a minute.
    /// let layer = RateLimitLayer::builder()
    ///     .rule(Rule::concurrent("searches-in-flight", 20))
    ///     .rule(Rule::new("searches", Quota::per_minute(100)))
    ///     .build()?;
    /// # Ok::<(), tollgate::ConfigError>(())
    /// ```
    ///
    /// A denied request waits for no slot: it is answered `429` with `Retry-After: 1` (a slot
    /// comes back when a response ends, which no store can foresee; sooner when a held slot's
    /// hold ends sooner; none when the request costs more slots than there are), `RateLimit-Policy: "name";q=20;qu="concurrent-requests"` and
    /// `RateLimit: "name";r=0`. Stacked with rate rules, all or nothing: a request a rate rule
    /// denies takes no slot, one denied a slot is charged to no rate rule.
    pub fn concurrent(name: impl Into<String>, slots: u64) -> Self {
        Rule::new(name, Quota::new(slots, DEFAULT_MAX_HOLD)).algorithm(Algorithm::Concurrency)
    }

    /// The longest a [concurrency](Rule::concurrent) slot is held (default
    /// [`DEFAULT_MAX_HOLD`]): longer than the longest response, so that a slot is given back by
    /// its response, not by its expiry. A replica that dies holding slots leaks them for this
    /// long. Only for concurrency rules.
    pub fn max_hold(mut self, hold: Duration) -> Self {
        self.quota = Quota::new(self.quota.limit(), hold);
        self.max_hold = Some(hold);
        self
    }

    /// Chooses the algorithm (default: [`Algorithm::TokenBucket`]).
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// Chooses who the rule counts.
    pub fn key<K: KeyExtractor>(mut self, extractor: K) -> Self {
        self.key = Some(Arc::new(extractor));
        self.key_spec = None;
        self
    }

    /// Sets what a request costs (default 1).
    pub fn cost(mut self, cost: impl Into<Cost>) -> Self {
        self.cost = cost.into();
        self
    }

    /// What to do for this rule when the store fails (default: the layer's
    /// [`on_store_error`](crate::RateLimitLayerBuilder::on_store_error)).
    pub fn on_store_error(mut self, mode: FailureMode) -> Self {
        self.on_store_error = Some(mode);
        self
    }

    /// Lets a request through this rule when its extractor finds no key.
    ///
    /// By default such requests are not unlimited: they share one budget under the key
    /// [`Key::unidentified`](crate::key::Key::unidentified), so that a missing header or peer
    /// address (a server that does not record it, a proxy that strips it) never turns the limit
    /// off. The first such request of each rule is reported through `tracing` with the fix to
    /// apply. Skip them only when another rule limits them, or when not being identified is
    /// itself a guarantee (an internal route that only authenticated callers reach).
    pub fn skip_unidentified(mut self) -> Self {
        self.skip_unidentified = true;
        self
    }

    /// Checks and charges the rule as if it were enforced, but admits what it would deny and
    /// says so instead (see [`RuleMode::Shadow`]).
    pub fn shadow(mut self) -> Self {
        self.mode = RuleMode::Shadow;
        self
    }

    /// Makes a request over the limit wait for its budget, up to `max`, instead of denying it
    /// (see [`RuleMode::Delay`]).
    pub fn delay(mut self, max: Duration) -> Self {
        self.mode = RuleMode::Delay { max };
        self
    }

    /// For a hot key on a remote store (Redis): each replica takes up to `units` of the key's
    /// budget in the one call that checks a request, and spends them on the key's next
    /// requests itself, for at most [`lease_ttl`](Rule::lease_ttl) (default 1 s) and never past
    /// the end of a fixed or sliding-counter window. A replica then asks Redis about once per
    /// `units` requests of a hot key (once its lease has grown, below) instead of once per
    /// request. A key spent by many requests
    /// at once is refilled ahead of need (on a Tokio runtime, in a task of its own) before its
    /// units run out; size `units` to more than twice what one replica spends of the key during
    /// a round trip to Redis (its request rate times the round trip): a smaller lease is
    /// refilled when it runs out, and requests that find no unit while its refill is out go to
    /// Redis one by one.
    ///
    /// A lease follows its key's demand on each replica: a key seen less than once per time to
    /// live there pays its cost alone (nothing is held); a key seen more often takes one unit
    /// more than its cost, then twice as many each time its lease runs out before its time, or
    /// what the last lease spent after one expired, up to `units`.
    ///
    /// The fleet never admits more than the shared budget as counted when units are charged:
    /// every unit is charged to Redis before it is spent, at most a time to live earlier (so
    /// over a period it may spend, on top, the units replicas held at its start). Units left
    /// unspent when a lease expires go back to the budget for a fixed window and a sliding
    /// counter (with the key's next call from that replica, into the window they were taken
    /// from if it still counts: exact, never twice). The fleet may refuse a request the budget
    /// would admit by at most `(units - 1)` units per replica that holds some of the key (or,
    /// for a fixed window or sliding counter, has some waiting to go back), plus, for the token
    /// bucket, GCRA and the sliding log, whose units cannot go back exactly and are dropped,
    /// the units of leases that expired unspent: none for a key seen less than once per time to
    /// live on a replica, none at a steady rate once its lease has settled, at most
    /// `(units - 1)` each time a key's demand on a replica falls.
    ///
    /// The answers' budget fields are Redis's at the lease, with the units still held here.
    /// The memory store ignores leases. A lease is 2 units or more, at most the rule's burst
    /// (token bucket, GCRA) or quota; a rule is leased or [split](Rule::split), not both.
    pub fn lease(mut self, units: u64) -> Self {
        let ttl = self.lease.map_or(DEFAULT_LEASE_TTL, |(_, ttl)| ttl);
        self.lease = Some((units, ttl));
        self
    }

    /// How long leased units may be spent (default [`DEFAULT_LEASE_TTL`], at most 60 s): the
    /// longest time between a unit's charge in Redis and its use. Only with [`lease`](Rule::lease).
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        let units = self.lease.map_or(0, |(units, _)| units);
        self.lease = Some((units, ttl));
        self
    }

    /// For a hot key on a remote store (Redis): each key becomes `parts` sub-keys, each with
    /// `1/parts` of the quota and the burst (rounded down), whose hash tags differ, so that a
    /// Redis Cluster spreads them over its primaries. Each request goes to one sub-key: a
    /// replica gives a key's requests to its sub-keys in turn (starting from one the key's hash
    /// chooses).
    ///
    /// The precision it costs: the fleet never admits more than the quota (the sub-keys' shares
    /// add up to at most it); a request is refused when its sub-key is spent though others are
    /// not, and with R replicas taking turns on their own, no sub-key is more than R requests
    /// ahead of another, so a key is refused at the earliest when about
    /// `(parts - 1) × R` units are left elsewhere. The answers report the sub-key's numbers for
    /// the whole key (its remaining times `parts`). Refused at build time when a sub-key would
    /// hold less than one unit, or a fixed cost more than a sub-key holds. The memory store
    /// keeps one key with the whole quota.
    pub fn split(mut self, parts: u16) -> Self {
        self.split = Some(parts);
        self
    }

    /// Charges only the requests whose response `when` matches; the others get their units back
    /// once their response head is there (see [`ChargeWhen`]). A request still reserves its
    /// units when it is admitted, so that concurrent requests are counted exactly.
    pub fn charge_when(mut self, when: ChargeWhen) -> Self {
        self.after.when = Some(when);
        self
    }

    /// Charges only responses of these statuses: `charge_on_status([401, 403])` counts failed
    /// logins, not logins.
    pub fn charge_on_status(self, statuses: impl IntoIterator<Item = u16>) -> Self {
        self.charge_when(ChargeWhen::status(statuses))
    }

    /// Takes the rule's [`cost`](Rule::cost) as an estimate, reserved when a request is
    /// admitted, and settles it at what the request really cost: the [`ActualCost`](crate::ActualCost) extension
    /// its handler set on the response. The layer charges the difference, or gives back what
    /// was not used, in one store call; past the budget, the key is in debt and its next
    /// requests wait (see [`algorithm::Algorithm::force`](crate::Algorithm::force)). A response
    /// without an `ActualCost` keeps the estimate, and so does a settle the store fails: what a
    /// request cost past its estimate is then never charged, so a fleet may deliver past its
    /// budget by exactly that, for the settles that failed (and, until a settle lands, by the
    /// excess of the responses being settled). Not for the sliding window log (one entry per
    /// unit cannot hold a debt), leased or split rules.
    pub fn settle(mut self) -> Self {
        self.after.settle = Some(SettleFrom::Extension);
        self
    }

    /// [`settle`](Rule::settle), reading the real cost from a response header holding a number
    /// (`x-tokens-used: 1234`), which the layer removes from the response.
    pub fn settle_from_header(mut self, name: http::HeaderName) -> Self {
        self.after.settle = Some(SettleFrom::Header(name));
        self
    }

    /// Meters the rule's units while the response streams, for costs known only as they are
    /// produced (an LLM's tokens): the layer takes `chunk` units from the store when it admits
    /// the request (the rule's cost is the chunk), and hands the handler a [`Meter`] in the
    /// request's extensions. The producer calls [`Meter::spend`] for the units it is about to
    /// generate;
    /// the meter takes the next `chunk` from the store when the ones it holds are spent, and
    /// when the store refuses it, [`Spend::Exhausted`] tells the producer to stop, and the
    /// layer ends the response at its next frame with the refusal (a final server-sent event,
    /// gRPC trailers, or trailers on other bodies: see [`Meter`]). When the response ends or
    /// is dropped (the client left), the charge is settled to the units spent, in one store
    /// call: unused units of the last chunk go back, units spent past it are charged (a debt).
    ///
    /// Every unit [spent](crate::Meter::spend) is taken from the store before it is generated,
    /// so what a fleet delivers on one key is the budget as the algorithm counts it (a token
    /// bucket's refill is budget: a fresh key of "20,000 a minute" delivers its burst of 20,000
    /// and 333 a second more, up to 22,666 in its first 8 s), plus, exactly:
    ///
    /// - per stream cut at its budget, the units of the one frame ([`meter_frames`](Rule::meter_frames))
    ///   or [record](crate::Meter::record) that crossed it, a debt the key then pays back;
    /// - per stream whose producer ignores [`Spend::Exhausted`], at most 64 data frames passed
    ///   on after the budget ended (the frames its producer made before it was told; a producer
    ///   that spends before each frame has paid for them); with `meter_frames`, none;
    /// - with [`meter_usage_trailer`](Rule::meter_usage_trailer), whatever the trailer's number
    ///   leaves out (the number is trusted; without a valid trailer the charge is the units taken
    ///   or spent, the more);
    /// - while the store fails and the rule fails open, every unit spent (not charged);
    /// - while the rule falls back to the local limiter, the fallback's bound (see
    ///   [`FallbackShare`](crate::FallbackShare)).
    ///
    /// Leases and split keys are refused on a metered rule: they add nothing. The other way,
    /// units held and not yet spent are not delivered: a stream takes its next chunk in the
    /// background when less than half of one is left, so each stream open on a key holds at most
    /// `chunk + ceil(chunk / 2)` unspent units, given back when it ends; a request is admitted,
    /// and a stream goes on, with what is left when that is less than a chunk (a first chunk of
    /// `min(chunk, remaining)`, the `r` a client was shown; when requests race for a key's last
    /// units, another may take part of that between the check that showed it and the check of
    /// the cut chunk, and the request is refused with less than a chunk left). Units spent but not delivered
    /// (frames in flight when a client leaves, or past the 64 passed on after the budget ended)
    /// are charged. A chunk costs one store call per `chunk` units: a few percent of the quota is
    /// the usual trade-off.
    ///
    /// ```
    /// use tollgate::key::FromHeader;
    /// use tollgate::{Quota, RateLimitLayer, Rule};
    ///
    /// // 10,000 tokens per minute per API key, taken 500 at a time as the answer streams.
    /// let layer = RateLimitLayer::builder()
    ///     .rule(
    ///         Rule::new("tokens", Quota::per_minute(10_000))
    ///             .key(FromHeader::new("x-api-key").hashed())
    ///             .meter(500),
    ///     )
    ///     .build()?;
    /// # Ok::<(), tollgate::ConfigError>(())
    /// ```
    ///
    /// Not for the sliding window log (it cannot hold a debt), concurrency, leased or split
    /// rules, rules that charge by the response (`charge_when`, `settle`), or shadow and delay
    /// rules. A store failure while a chunk is taken ends the stream (with a
    /// `temporary-reduced-capacity` refusal) unless the rule fails open: then the stream goes
    /// on, and the units it spends uncounted are not charged; a rule that falls back to the
    /// local limiter ends it too (the fallback decides new requests, not a stream's next
    /// chunk). A request admitted while the store failed open has no meter: take it as
    /// `Option<Extension<Meter>>`. The rule's [`cost`](Rule::cost) is replaced by the chunk.
    ///
    /// [`Meter`]: crate::Meter
    /// [`Meter::spend`]: crate::Meter::spend
    /// [`Spend::Exhausted`]: crate::Spend::Exhausted
    pub fn meter(mut self, chunk: u64) -> Self {
        match &mut self.meter {
            Some(metering) => metering.chunk = chunk,
            None => self.meter = Some(Metering::new(chunk)),
        }
        self
    }

    /// For a handler that cannot be changed: the layer counts each data frame of a
    /// [metered](Rule::meter) response with `units` as it passes, taking the next chunk before
    /// another frame passes when they go past the units held. The frame that crosses the budget
    /// is delivered (a debt of at most its units) and the stream ends after it with the
    /// refusal. The charge is what was delivered; no frame passes uncounted. A handler that also spends from its
    /// [`Meter`](crate::Meter) is counted twice: use one or the other.
    ///
    /// ```
    /// use tollgate::{Quota, Rule};
    ///
    /// // Each server-sent event of the response is a token.
    /// let tokens = Rule::new("tokens", Quota::per_minute(10_000))
    ///     .meter(500)
    ///     .meter_frames(|frame: &[u8]| frame.windows(6).filter(|w| w == b"data: ").count() as u64);
    /// # let _ = tokens;
    /// ```
    pub fn meter_frames(mut self, units: impl Fn(&[u8]) -> u64 + Send + Sync + 'static) -> Self {
        match &mut self.meter {
            Some(metering) => metering.frames = Some(Arc::new(units)),
            None => self.meter_without_chunk = true,
        }
        self
    }

    /// For a service that reports what it used at the end (a gRPC or HTTP/2 trailer such as
    /// `x-usage-tokens: 1234`): the charge of a [metered](Rule::meter) response is settled to
    /// that number, which the layer removes from the trailers. The number is trusted: it must
    /// come from your service, not from a client or an upstream you do not control. The trailer
    /// corrects a reserved charge: the chunks the meter took (the admission's, and more as the
    /// handler's [`Meter`](crate::Meter) or [frames](Rule::meter_frames) spend, which still stop
    /// the stream at the budget) are charged until it is read, and a response that ends or is
    /// dropped without a valid trailer (missing, not a number, or the client left first) is
    /// charged the units taken or spent, the more: at least its first chunk (`min(chunk,
    /// remaining)` at admission), never 0.
    /// With the trailer, the charge is its number, up or down.
    ///
    /// The bound: with neither spends nor frames, nothing stops a stream before its end, so a
    /// key's fleet may deliver past its budget by the units of its open streams beyond their
    /// first chunks. Once a trailer is settled its units are charged whatever the budget, a
    /// debt the next requests wait for: a token bucket or GCRA repays it at the rule's rate; a
    /// window or log counts it in the window it is charged in, which ends with its units past
    /// the limit.
    pub fn meter_usage_trailer(mut self, name: http::HeaderName) -> Self {
        match &mut self.meter {
            Some(metering) => metering.usage_trailer = Some(name),
            None => self.meter_without_chunk = true,
        }
        self
    }

    /// What the rule does with a request over its limit (default [`RuleMode::Enforce`]).
    pub fn mode(&self) -> RuleMode {
        self.mode
    }

    /// The rule's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The rule's quota.
    pub fn quota(&self) -> &Quota {
        &self.quota
    }

    /// Whether `other` is the same rule: the same name, numbers, algorithm, mode and failure
    /// mode, and the same key extractor and cost function (the same values, cloned).
    pub(crate) fn same_as(&self, other: &Rule) -> bool {
        let same_key = match (&self.key, &other.key) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        let same_cost = match (&self.cost, &other.cost) {
            (Cost::Fixed(a), Cost::Fixed(b)) => a == b,
            (Cost::Dynamic(a), Cost::Dynamic(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        self.name == other.name
            && self.quota == other.quota
            && self.algorithm == other.algorithm
            && self.on_store_error == other.on_store_error
            && self.skip_unidentified == other.skip_unidentified
            && self.mode == other.mode
            && self.lease == other.lease
            && self.split == other.split
            && self.after.same_as(&other.after)
            && self.max_hold == other.max_hold
            && match (&self.meter, &other.meter) {
                (None, None) => true,
                (Some(a), Some(b)) => a.same_as(b),
                _ => false,
            }
            && same_key
            && self.key_spec == other.key_spec
            && same_cost
    }

    /// Validates the rule and fixes its key extractor.
    pub(crate) fn compile(
        self,
        default_key: &SharedExtractor,
        layer_key: &SharedExtractor,
        default_failure: FailureMode,
    ) -> Result<CompiledRule, ConfigError> {
        let name = self.name;
        let quota = self.quota;
        let concurrency = self.algorithm.is_concurrency();
        if self.max_hold.is_some() && !concurrency {
            return Err(ConfigError::in_rule(
                &name,
                "max_hold is the longest hold of a concurrency rule; use Rule::concurrent, or \
                 remove .max_hold(..)",
            ));
        }
        if concurrency && quota.period() < Duration::from_secs(1) {
            return Err(ConfigError::in_rule(
                &name,
                format_args!(
                    "a slot is held at most {:?}; give it at least 1 s (longer than the longest \
                     response)",
                    quota.period()
                ),
            ));
        }
        if concurrency && matches!(self.mode, RuleMode::Delay { .. }) {
            return Err(ConfigError::in_rule(
                &name,
                "a concurrency rule cannot delay: a slot comes back when some response ends, \
                 which no wait can foresee; remove .delay(..) (a denied request gets 429 with \
                 Retry-After: 1)",
            ));
        }
        if concurrency && (!self.after.is_empty() || self.lease.is_some() || self.split.is_some()) {
            return Err(ConfigError::in_rule(
                &name,
                "a concurrency rule's slot is given back when the response ends: it cannot also \
                 charge by the response (charge_when, settle), be leased or split",
            ));
        }
        if quota.burst_size().is_some() && !self.algorithm.has_burst() {
            return Err(ConfigError::in_rule(
                &name,
                format_args!(
                    "{} has no burst; remove .burst(..) or use Algorithm::TokenBucket or Algorithm::Gcra",
                    self.algorithm
                ),
            ));
        }
        let period = u64::try_from(quota.period().as_micros()).unwrap_or(u64::MAX);
        let limits = Limits::new(
            quota.limit(),
            period,
            quota.burst_size().unwrap_or(quota.limit()),
        )
        .map_err(|e| ConfigError::in_rule(&name, e))?;
        if let Cost::Fixed(cost) = self.cost {
            let capacity = self.algorithm.capacity(&limits);
            if cost > capacity {
                return Err(ConfigError::in_rule(
                    &name,
                    format_args!(
                        "a request costs {cost} but the rule never holds more than {capacity}; \
                         lower the cost or raise the quota{}",
                        if self.algorithm.has_burst() {
                            " or burst"
                        } else {
                            ""
                        }
                    ),
                ));
            }
        }
        if let RuleMode::Delay { max } = self.mode
            && (max.is_zero() || max > MAX_DELAY)
        {
            return Err(ConfigError::in_rule(
                &name,
                format_args!(
                    "a delay rule waits at most {max:?}; give it a maximum between 1 ms and {} s",
                    MAX_DELAY.as_secs()
                ),
            ));
        }
        if !self.after.is_empty() && (self.lease.is_some() || self.split.is_some()) {
            return Err(ConfigError::in_rule(
                &name,
                "charge_when and settle give units back to the key that was charged: not for a \
                 leased or split rule (whose units live on a replica or a sub-key)",
            ));
        }
        if self.after.settle.is_some() && self.algorithm == Algorithm::SlidingWindowLog {
            return Err(ConfigError::in_rule(
                &name,
                "a sliding window log keeps one entry per unit and cannot hold a debt: settle a \
                 rule of another algorithm (Algorithm::SlidingWindowCounter is close to it)",
            ));
        }
        let mut cost = self.cost;
        if self.meter_without_chunk {
            return Err(ConfigError::in_rule(
                &name,
                "meter_frames and meter_usage_trailer count a metered rule's units: call \
                 .meter(chunk) before them",
            ));
        }
        if let Some(chunk) = self.meter.as_ref().map(|m| m.chunk) {
            let refused = if concurrency
                || self.lease.is_some()
                || self.split.is_some()
                || !self.after.is_empty()
            {
                Some("a concurrency, leased or split rule, or one that charges by the response")
            } else if self.algorithm == Algorithm::SlidingWindowLog {
                Some("a sliding window log (it keeps one entry per unit and cannot hold a debt)")
            } else if self.mode != RuleMode::Enforce {
                Some("a shadow or delay rule")
            } else {
                None
            };
            if let Some(what) = refused {
                return Err(ConfigError::in_rule(
                    &name,
                    format_args!("meter(..) is not for {what}; remove .meter(..)"),
                ));
            }
            let capacity = self.algorithm.capacity(&limits);
            if chunk == 0 || chunk > capacity {
                return Err(ConfigError::in_rule(
                    &name,
                    format_args!(
                        "a meter's chunk is between 1 and the most the rule ever holds \
                         ({capacity}); got {chunk}"
                    ),
                ));
            }
            cost = Cost::Fixed(chunk);
        }
        let mut spec = RuleSpec::new(name, self.algorithm, limits)?;
        if let Some((units, ttl)) = self.lease {
            spec = spec.with_lease(units, ttl)?;
        }
        if let Some(parts) = self.split {
            spec = spec.with_parts(parts)?;
            if let Cost::Fixed(fixed) = &cost {
                let cost = *fixed;
                let capacity = self.algorithm.capacity(spec.part_limits());
                if cost > capacity {
                    return Err(ConfigError::in_rule(
                        spec.name(),
                        format_args!(
                            "a request costs {cost} but each of its {parts} sub-keys holds at \
                             most {capacity}; split into fewer, or lower the cost"
                        ),
                    ));
                }
            }
        }
        Ok(CompiledRule {
            spec: Arc::new(spec),
            key: match (self.key_spec, self.key) {
                (Some(spec), _) => spec.extractor(layer_key),
                (None, Some(key)) => key,
                (None, None) => default_key.clone(),
            },
            cost,
            on_store_error: self.on_store_error.unwrap_or(default_failure),
            skip_unidentified: self.skip_unidentified,
            mode: self.mode,
            after: (!self.after.is_empty()).then(|| Arc::new(self.after)),
            meter: self.meter,
        })
    }
}

impl fmt::Debug for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rule")
            .field("name", &self.name)
            .field("quota", &self.quota)
            .field("algorithm", &self.algorithm)
            .field("cost", &self.cost)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

/// A rule ready to run: its spec, its key extractor and its cost.
#[derive(Clone)]
pub(crate) struct CompiledRule {
    pub(crate) spec: Arc<RuleSpec>,
    pub(crate) key: SharedExtractor,
    pub(crate) cost: Cost,
    pub(crate) on_store_error: FailureMode,
    pub(crate) skip_unidentified: bool,
    pub(crate) mode: RuleMode,
    /// What it does once the response head is there, if anything.
    pub(crate) after: Option<Arc<After>>,
    /// How the response's units are metered while it streams, when they are.
    pub(crate) meter: Option<Metering>,
}

/// The longest a [`RuleMode::Delay`] rule may make a request wait.
pub(crate) const MAX_DELAY: Duration = Duration::from_secs(60);
