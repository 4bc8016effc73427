//! [`Plan`]: one run of the fleet simulation, drawn from a seed — the topology, the rules
//! (every algorithm, costs, leases, split keys, metering by spends, frames or usage trailers,
//! delay and shadow rules, costs settled by the response or charged by its status, every
//! failure mode; or the same from a policy of two tiers, reloaded), the replicas and their lives, the clients and
//! their manners, and the faults, each at its time.
//!
//! A plan is plain data: the runner ([`super::fleet`]) makes it happen, the invariants
//! ([`super::invariants`]) judge what happened by it, and the shrinker removes parts of it.

use std::time::Duration;

use super::network::{Status, Weather};
use super::rng::Rng;

/// An algorithm of a rule, as the simulation picks it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    TokenBucket,
    Gcra,
    FixedWindow,
    SlidingWindowCounter,
    SlidingWindowLog,
    Concurrency,
}

/// How a metered rule learns the units a response spends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Metered {
    /// The handler spends from its `Meter` before each unit.
    Spends,
    /// The layer counts each data frame (one unit each).
    Frames,
    /// The handler reports its units in a trailer (when the stream ends in full).
    Trailer,
}

/// Says how a rule charges by its response, once the response head is there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Charged {
    /// `settle_from_header`: the cost is an estimate, settled to what the handler reports.
    Settle,
    /// `charge_on_status([401])`: a response of another status gets its units back.
    OnStatus,
}

/// What a rule does when the store fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OnError {
    Open,
    Closed,
    Local,
}

/// One rule of every replica's layer.
#[derive(Clone, Debug)]
pub(crate) struct RulePlan {
    pub(crate) name: String,
    pub(crate) kind: Kind,
    /// The quota (or the slots of a concurrency rule).
    pub(crate) limit: u64,
    pub(crate) period: Duration,
    /// The burst of a token bucket or GCRA (the limit when `None`).
    pub(crate) burst: Option<u64>,
    pub(crate) cost: u64,
    pub(crate) lease: Option<u64>,
    pub(crate) split: Option<u16>,
    /// The chunk and how the units are counted, for a metered rule.
    pub(crate) meter: Option<(u64, Metered)>,
    pub(crate) on_error: OnError,
    pub(crate) shadow: bool,
    pub(crate) delay: Option<Duration>,
    /// How the response settles the charge, when it does.
    pub(crate) charged: Option<Charged>,
}

impl RulePlan {
    /// Returns the rule as the `gold` tier of a policy has it: its own name, twice the quota
    /// (or the slots) and the burst.
    pub(crate) fn gold(&self) -> RulePlan {
        RulePlan {
            name: format!("g{}", self.name),
            limit: self.limit * 2,
            burst: self.burst.map(|b| b * 2),
            ..self.clone()
        }
    }

    /// The burst the rule enforces.
    pub(crate) fn burst(&self) -> u64 {
        match self.kind {
            Kind::TokenBucket | Kind::Gcra => self.burst.unwrap_or(self.limit),
            _ => self.limit,
        }
    }
}

/// How a client behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Manner {
    /// Waits what `Retry-After` says after a refusal.
    Polite,
    /// Retries soon after a refusal, whatever it said.
    Eager,
    /// Leaves a stream after a few frames.
    Leaver,
    /// Reads each frame slowly.
    SlowReader,
}

/// One client of the fleet.
#[derive(Clone, Debug)]
pub(crate) struct ClientPlan {
    pub(crate) key: u32,
    pub(crate) manner: Manner,
    /// The mean time between its requests.
    pub(crate) pace: Duration,
    /// The most units a streamed request asks for.
    pub(crate) max_tokens: u64,
    /// The first and the last request's time, from the start.
    pub(crate) from: Duration,
    pub(crate) until: Duration,
}

/// A fault, or a change of the fleet, at a time.
#[derive(Clone, Debug)]
pub(crate) enum Fault {
    /// A node stops answering (refuses, or swallows) for a while.
    Outage {
        node: usize,
        status: Status,
        lasting: Duration,
    },
    /// A node restarts, with or without its data.
    Restart { node: usize, keep_data: bool },
    /// The network's weather changes for a while.
    Weather { weather: Weather, lasting: Duration },
    /// Every connection drops.
    DropConnections,
    /// Every subscription drops.
    DropSubscriptions,
    /// Every replica installs the policy's next version (the same tiers, its rules in the
    /// other order).
    Reload,
    /// A slot of the cluster moves to another node (ASK, then MOVED).
    Migrate {
        slot: u16,
        to: usize,
        lasting: Duration,
    },
    /// A replica crashes: cut off for good, its leases and slots never given back.
    Crash { replica: u32 },
    /// A replica leaves cleanly (no more requests; its state is dropped).
    Leave { replica: u32 },
    /// A replica joins.
    Join { replica: u32 },
}

/// One run of the fleet.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    pub(crate) seed: u64,
    pub(crate) cluster: bool,
    pub(crate) functions: bool,
    /// The replicas there at the start (ids `0..replicas`).
    pub(crate) replicas: u32,
    /// Each replica's heartbeat interval, by id (joins included).
    pub(crate) heartbeats: Vec<Duration>,
    /// Each replica's clock skew, microseconds, by id.
    pub(crate) skews: Vec<i64>,
    pub(crate) until_counted: u32,
    pub(crate) rules: Vec<RulePlan>,
    pub(crate) clients: Vec<ClientPlan>,
    /// The faults, by time from the start.
    pub(crate) faults: Vec<(Duration, Fault)>,
    /// How long the run lasts.
    pub(crate) length: Duration,
    /// The keys the clients use.
    pub(crate) keys: u32,
    /// The rules come from a policy, with tiers, when there is one.
    pub(crate) policy: Option<PolicyPlan>,
}

/// Describes a policy of two tiers: `base`, with the plan's rules (the default), and `gold`, with each
/// rule's [`gold`](RulePlan::gold) form, for the tenants of some keys.
#[derive(Clone, Debug)]
pub(crate) struct PolicyPlan {
    /// The keys whose tenant (`t<key>`) is on the gold tier.
    pub(crate) gold: Vec<u32>,
}

/// The most replicas a run has at once.
pub(crate) const MAX_REPLICAS: u32 = 12;

impl Plan {
    /// Draws a plan from `seed`.
    pub(crate) fn from_seed(seed: u64) -> Plan {
        let mut rng = Rng::new(seed);
        let cluster = rng.chance(0.4);
        let functions = rng.chance(0.5);
        let replicas = rng.between(1, 10) as u32;
        let length = Duration::from_secs(rng.between(20, 120));
        let keys = rng.between(1, 3) as u32;
        let mut rules = rules(&mut rng);
        // Drawn from a stream of their own: what the other streams draw stays as it was.
        charged_by_response(&mut Rng::new(seed).fork(2), &mut rules);
        let metered = rules.iter().any(|r| r.meter.is_some());
        let mut clients = Vec::new();
        for _ in 0..rng.between(2, 8) {
            let manner = *rng.pick(&[
                Manner::Polite,
                Manner::Eager,
                Manner::Eager,
                Manner::Leaver,
                Manner::SlowReader,
            ]);
            let from = Duration::from_millis(rng.between(0, length.as_millis() as u64 / 4));
            clients.push(ClientPlan {
                key: rng.between(0, keys as u64 - 1) as u32,
                manner,
                pace: Duration::from_millis(*rng.pick(&[5, 20, 50, 100, 400])),
                max_tokens: if metered { rng.between(1, 400) } else { 0 },
                from,
                until: length,
            });
        }
        let mut faults = Vec::new();
        let mut next_replica = replicas;
        let nodes = if cluster { 3 } else { 1 };
        for _ in 0..rng.between(0, 8) {
            let at = Duration::from_millis(rng.between(500, length.as_millis() as u64));
            let fault = match rng.between(0, 9) {
                0 | 1 => Fault::Outage {
                    node: rng.between(0, nodes - 1) as usize,
                    status: if rng.chance(0.5) {
                        Status::Refusing
                    } else {
                        Status::Blackhole
                    },
                    lasting: Duration::from_millis(rng.between(200, 20_000)),
                },
                2 => Fault::Restart {
                    node: rng.between(0, nodes - 1) as usize,
                    keep_data: rng.chance(0.5),
                },
                3 => Fault::Weather {
                    weather: weather(&mut rng),
                    lasting: Duration::from_millis(rng.between(500, 15_000)),
                },
                4 => Fault::DropConnections,
                5 => Fault::DropSubscriptions,
                6 if cluster => Fault::Migrate {
                    slot: rng.between(0, 16383) as u16,
                    to: rng.between(0, 2) as usize,
                    lasting: Duration::from_millis(rng.between(100, 5_000)),
                },
                7 if next_replica > 1 => Fault::Crash {
                    replica: rng.between(0, next_replica as u64 - 1) as u32,
                },
                8 if next_replica > 1 => Fault::Leave {
                    replica: rng.between(0, next_replica as u64 - 1) as u32,
                },
                _ if next_replica < MAX_REPLICAS => {
                    next_replica += 1;
                    Fault::Join {
                        replica: next_replica - 1,
                    }
                }
                _ => Fault::DropConnections,
            };
            faults.push((at, fault));
        }
        if rng.chance(0.35) {
            // A storm: every node away for a long while, the fleet on its fallbacks.
            let at = Duration::from_millis(rng.between(1_000, length.as_millis() as u64 / 2));
            let lasting = Duration::from_millis(rng.between(5_000, 60_000));
            let status = if rng.chance(0.5) {
                Status::Refusing
            } else {
                Status::Blackhole
            };
            for node in 0..nodes as usize {
                faults.push((
                    at,
                    Fault::Outage {
                        node,
                        status,
                        lasting,
                    },
                ));
            }
        }
        // Drawn from a stream of their own: what the other streams draw stays as it was.
        let mut policies = Rng::new(seed).fork(4);
        let policy = policies.chance(0.3).then(|| PolicyPlan {
            gold: (0..keys).filter(|_| policies.chance(0.5)).collect(),
        });
        if policy.is_some() {
            for _ in 0..policies.between(0, 3) {
                let at = Duration::from_millis(policies.between(500, length.as_millis() as u64));
                faults.push((at, Fault::Reload));
            }
        }
        faults.sort_by_key(|(at, _)| *at);
        let heartbeats = (0..MAX_REPLICAS)
            .map(|_| Duration::from_millis(*rng.pick(&[1_000, 1_000, 2_000, 5_000])))
            .collect();
        let skews = (0..MAX_REPLICAS)
            .map(|_| rng.between(0, 100_000) as i64 - 50_000)
            .collect();
        Plan {
            seed,
            cluster,
            functions,
            replicas,
            heartbeats,
            skews,
            until_counted: *rng.pick(&[1, 1, 2, 4, 8]),
            rules,
            clients,
            faults,
            length,
            keys,
            policy,
        }
    }

    /// Returns the rule `index` of the plan as key `key` has it: its tier's form.
    pub(crate) fn rule_for(&self, index: usize, key: u32) -> RulePlan {
        let rule = &self.rules[index];
        match &self.policy {
            Some(policy) if policy.gold.contains(&key) => rule.gold(),
            _ => rule.clone(),
        }
    }
}

/// A network with losses, from `rng`.
fn weather(rng: &mut Rng) -> Weather {
    let low = rng.between(100, 2_000);
    Weather {
        latency: (low, low + rng.between(0, 20_000)),
        lose_request: *rng.pick(&[0.0, 0.01, 0.05]),
        lose_reply: *rng.pick(&[0.0, 0.01, 0.05]),
        lose_message: *rng.pick(&[0.0, 0.1, 0.5]),
        message_delay: (200, 200 + rng.between(0, 50_000)),
    }
}

/// Makes some plain rules charge by their response: settled to a reported cost, or charged
/// only for one status.
fn charged_by_response(rng: &mut Rng, rules: &mut [RulePlan]) {
    for rule in rules {
        let plain = rule.meter.is_none()
            && rule.kind != Kind::Concurrency
            && rule.lease.is_none()
            && rule.split.is_none()
            && rule.delay.is_none()
            && !rule.shadow;
        let chosen = rng.chance(0.3);
        let settle = rng.chance(0.5) && rule.kind != Kind::SlidingWindowLog;
        if plain && chosen {
            rule.charged = Some(if settle {
                Charged::Settle
            } else {
                Charged::OnStatus
            });
        }
    }
}

/// The rules of a plan: one to three.
fn rules(rng: &mut Rng) -> Vec<RulePlan> {
    let count = rng.between(1, 3);
    let mut rules = Vec::new();
    let mut metered = false;
    for index in 0..count {
        let kind = *rng.pick(&[
            Kind::TokenBucket,
            Kind::TokenBucket,
            Kind::Gcra,
            Kind::FixedWindow,
            Kind::FixedWindow,
            Kind::SlidingWindowCounter,
            Kind::SlidingWindowLog,
            Kind::Concurrency,
        ]);
        let period = Duration::from_secs(*rng.pick(&[1, 10, 60]));
        let on_error = *rng.pick(&[
            OnError::Open,
            OnError::Closed,
            OnError::Local,
            OnError::Local,
        ]);
        let meterable = !matches!(kind, Kind::SlidingWindowLog | Kind::Concurrency);
        let meter = if !metered && meterable && rng.chance(0.5) {
            metered = true;
            let how = *rng.pick(&[Metered::Spends, Metered::Frames, Metered::Trailer]);
            Some((rng.between(5, 200), how))
        } else {
            None
        };
        let limit = match (kind, meter) {
            (Kind::Concurrency, _) => rng.between(1, 8),
            (_, Some((chunk, _))) => chunk * rng.between(2, 60),
            _ => rng.between(3, 200),
        };
        let plain = meter.is_none() && kind != Kind::Concurrency;
        let cost = if plain && rng.chance(0.3) {
            rng.between(2, limit.clamp(2, 40))
        } else {
            1
        };
        let lease = (plain && limit >= 4 && rng.chance(0.2)).then(|| rng.between(2, limit / 2));
        let split = (plain && lease.is_none() && limit >= 8 && cost == 1 && rng.chance(0.15))
            .then(|| rng.between(2, 4) as u16);
        let burst = (matches!(kind, Kind::TokenBucket | Kind::Gcra) && rng.chance(0.3))
            .then(|| rng.between(cost.max(1), limit.max(cost) * 2));
        let shadow = plain && rng.chance(0.1);
        let delay = (plain && lease.is_none() && rng.chance(0.1))
            .then(|| Duration::from_millis(rng.between(10, 500)));
        // A rule's mode is the last one set, and the layer sets a delay after a shadow: a rule
        // drawn both is a delay rule.
        let shadow = shadow && delay.is_none();
        rules.push(RulePlan {
            name: format!("r{index}"),
            kind,
            limit,
            period,
            burst,
            cost,
            lease,
            split,
            meter,
            on_error,
            shadow,
            delay,
            charged: None,
        });
    }
    rules
}
