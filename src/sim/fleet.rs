//! [`run`]: a [`Plan`] made to happen — a fleet of replicas, each a real
//! [`RateLimitLayer`] over a real Redis store (standalone or cluster) whose connections reach
//! the simulated servers through [`Net`], in front of a handler that streams; clients that
//! send, read, leave and retry; the plan's faults at their times. What the handler admitted
//! and what the clients read is the [`Outcome`], which the invariants judge.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response};
use http_body_util::BodyExt;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower::util::BoxCloneService;
use tower::{Layer, ServiceExt};

use super::audit::Audit;
use super::facts::{Fact, Happened, Ledger};
use super::handler::Handler;
use super::network::{Net, NetEvent, Status, Weather};
use super::plan::{Charged, ClientPlan, Fault, Manner, Plan};
use super::rng::Rng;
use super::rules::{ACTUAL, CHARGED_STATUS, policy, rule};
use super::server::Servers;
use super::time::{SharedClock, SimTime, Skewed};
use crate::clock::Clock;
use crate::policy::{PolicyHandle, TenantFromHeader};
use crate::store::redis::simulated::Simulated;
use crate::store::{MemoryStore, RedisClusterStore, RedisStore, Store};
use crate::{FallbackShare, RateLimitLayer};

/// The server time the simulated runs start at (microseconds since the epoch): a Tuesday.
const EPOCH: u64 = 1_767_657_600_000_000;

/// How long a run waits for the streams still open once its clients stop.
const GRACE: Duration = Duration::from_secs(90);

/// How long a client waits for an answer before it counts the request as stuck.
const STUCK: Duration = Duration::from_secs(75);

/// What a run did, for the invariants.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    /// The server time of the start.
    pub(crate) start: u64,
    /// The server time of the end.
    pub(crate) end: u64,
    pub(crate) facts: Vec<Fact>,
    /// Each replica's life (server times), by id.
    pub(crate) lives: BTreeMap<u32, (u64, u64)>,
    /// The fewest replicas each replica counted while it lived (`None`: it never counted).
    pub(crate) counted: BTreeMap<u32, Option<u32>>,
    /// When each replica first counted the fleet (server time).
    pub(crate) first_counted: BTreeMap<u32, u64>,
    /// The restarts of a node without its data, at server times.
    pub(crate) wiped: Vec<u64>,
    /// The answers' statuses, counted.
    pub(crate) statuses: BTreeMap<u16, u64>,
    /// Requests never answered within [`STUCK`].
    pub(crate) stuck: u64,
    /// Tasks that panicked, with their messages.
    pub(crate) panics: Vec<String>,
    /// Errors tollgate's scripts raised on the servers.
    pub(crate) script_errors: Vec<String>,
    /// Rules the layer refused to build, with the reason (the plan was drawn anew for them).
    pub(crate) refused: Option<String>,
    /// Requests sent.
    pub(crate) requests: u64,
    /// What each call of the code did on the servers, in order.
    pub(crate) audits: Vec<Audit>,
    /// What the network lost, at server times.
    pub(crate) events: Vec<(u64, NetEvent)>,
}

type Replica = BoxCloneService<Request<Body>, Response<Body>, Infallible>;

/// A replica of the fleet: its service, and how many replicas its store counted.
struct Member {
    service: Replica,
    counted: Box<dyn Fn() -> Option<u32> + Send>,
    /// Holds its live policy, when the rules come from one.
    policy: Option<PolicyHandle>,
}

/// Runs `plan` on a runtime of its own: one thread, a paused clock.
pub(crate) fn run(plan: &Plan) -> Outcome {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a runtime");
    let outcome = runtime.block_on(run_here(plan));
    // The tasks still running (listeners, heartbeats, late replies) end with the runtime.
    runtime.shutdown_background();
    outcome
}

/// What the fleet shares: the network, the ledger, the plan.
#[derive(Clone)]
struct Fleet {
    plan: Arc<Plan>,
    net: Net,
    time: SimTime,
    ledger: Ledger,
    members: Arc<Mutex<BTreeMap<u32, Member>>>,
    outcome: Arc<Mutex<Outcome>>,
    requests: Arc<std::sync::atomic::AtomicU64>,
    /// The version of the policy in force (0 before any reload).
    version: Arc<std::sync::atomic::AtomicU32>,
}

impl Fleet {
    fn lock_outcome(&self) -> std::sync::MutexGuard<'_, Outcome> {
        self.outcome.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_members(&self) -> std::sync::MutexGuard<'_, BTreeMap<u32, Member>> {
        self.members.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts replica `id`: its store, its layer, its handler.
    fn join(&self, id: u32) -> Result<(), String> {
        let plan = &self.plan;
        let clock: Arc<dyn Clock> = Arc::new(Skewed {
            time: self.time,
            skew: plan.skews[id as usize],
        });
        let simulated = Simulated {
            network: self.net.for_replica(id),
            clock: clock.clone(),
        };
        let heartbeat = plan.heartbeats[id as usize];
        let handler = self.handler(id);
        let member = if plan.cluster {
            let store = RedisClusterStore::builder(self.net.urls())
                .simulated(simulated)
                .heartbeat(heartbeat)
                .build()
                .map_err(|e| e.to_string())?;
            self.member(store, clock, handler)?
        } else {
            let url = self.net.urls().remove(0);
            let store = RedisStore::builder(url)
                .simulated(simulated)
                .heartbeat(heartbeat)
                .build()
                .map_err(|e| e.to_string())?;
            self.member(store, clock, handler)?
        };
        self.lock_members().insert(id, member);
        let now = self.time.now();
        let mut outcome = self.lock_outcome();
        outcome.lives.insert(id, (now, u64::MAX));
        outcome.counted.insert(id, None);
        Ok(())
    }

    fn member<St: Store + Clone>(
        &self,
        store: St,
        clock: Arc<dyn Clock>,
        handler: Handler,
    ) -> Result<Member, String> {
        let builder = RateLimitLayer::builder();
        let builder = match &self.plan.policy {
            None => builder.rules(self.plan.rules.iter().map(rule)),
            Some(tiers) => {
                let version = self.version.load(std::sync::atomic::Ordering::SeqCst);
                builder
                    .policy_source(policy(&self.plan, tiers, version))
                    .tenant(TenantFromHeader::new("x-tenant"))
            }
        };
        let layer = builder
            .fallback_share(FallbackShare::per_replica().until_counted(self.plan.until_counted))
            .store(store.clone())
            .build()
            .map_err(|e| e.to_string())?;
        let handle = layer.policy_handle();
        let local = MemoryStore::builder()
            .clock(SharedClock(clock))
            .build()
            .map_err(|e| e.to_string())?;
        layer.engine().fallback.use_store(local);
        let service = layer
            .layer(tower::service_fn(move |request| {
                let handler = handler.clone();
                async move { Ok::<_, Infallible>(handler.serve(request).await) }
            }))
            .map_response(|response: Response<crate::ResponseBody<Body>>| response.map(Body::new));
        Ok(Member {
            service: BoxCloneService::new(service),
            counted: Box::new(move || store.replicas()),
            policy: handle,
        })
    }

    /// Every replica installs the policy's next version.
    fn reload(&self) -> Result<(), String> {
        let Some(tiers) = &self.plan.policy else {
            return Ok(());
        };
        let version = self
            .version
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            + 1;
        let next = policy(&self.plan, tiers, version);
        for member in self.lock_members().values() {
            if let Some(handle) = &member.policy {
                handle.install(next.clone()).map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    }

    fn handler(&self, replica: u32) -> Handler {
        let metered = self
            .plan
            .rules
            .iter()
            .find_map(|r| r.meter.map(|(_, how)| how));
        Handler {
            ledger: self.ledger.clone(),
            replica,
            metered,
            rules: self.plan.rules.iter().map(|r| r.name.clone()).collect(),
        }
    }

    /// Stops replica `id`: `crash` cuts it off without a word (its leases and slots are never
    /// given back); else it leaves, its state dropped once its requests end.
    fn stop(&self, id: u32, crash: bool) {
        if crash {
            self.net.cut(id);
        }
        if self.lock_members().remove(&id).is_some() {
            let now = self.time.now();
            if let Some(life) = self.lock_outcome().lives.get_mut(&id) {
                life.1 = now;
            }
        }
    }

    /// A replica to send to, and its id, if any is there.
    fn pick(&self, rng: &mut Rng) -> Option<(u32, Replica)> {
        let members = self.lock_members();
        if members.is_empty() {
            return None;
        }
        let index = rng.between(0, members.len() as u64 - 1) as usize;
        members
            .iter()
            .nth(index)
            .map(|(id, m)| (*id, m.service.clone()))
    }

    /// Notes each replica's count of replicas.
    fn count(&self) {
        let counts: Vec<(u32, Option<u32>)> = self
            .lock_members()
            .iter()
            .map(|(id, m)| (*id, (m.counted)()))
            .collect();
        let now = self.time.now();
        let mut outcome = self.lock_outcome();
        for (id, count) in counts {
            if let Some(count) = count {
                outcome.first_counted.entry(id).or_insert(now);
                let fewest = outcome.counted.entry(id).or_insert(None);
                *fewest = Some(fewest.map_or(count, |f| f.min(count)));
            }
        }
    }
}

/// One client's requests, one at a time, until its plan's end.
async fn client(fleet: Fleet, index: usize, plan: ClientPlan, start: Instant) {
    let mut rng = Rng::new(fleet.plan.seed).fork(1000 + index as u64);
    // The responses' costs and statuses, from a stream of their own.
    let mut answers = Rng::new(fleet.plan.seed).fork(3000 + index as u64);
    let charged = fleet.plan.rules.iter().any(|r| r.charged.is_some());
    let most = fleet
        .plan
        .rules
        .iter()
        .filter(|r| r.charged == Some(Charged::Settle))
        .map(|r| r.cost * 2)
        .max()
        .unwrap_or(2);
    tokio::time::sleep_until(start + plan.from).await;
    while start.elapsed() < plan.until {
        let pause = rng.between(
            plan.pace.as_micros() as u64 / 2,
            plan.pace.as_micros() as u64 * 3 / 2,
        );
        tokio::time::sleep(Duration::from_micros(pause)).await;
        let Some((member, replica)) = fleet.pick(&mut rng) else {
            continue;
        };
        let id = fleet
            .requests
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            + 1;
        let tokens = if plan.max_tokens > 0 {
            rng.between(1, plan.max_tokens)
        } else {
            0
        };
        let mut request = Request::post("/v1/stream")
            .header("x-key", format!("k{}", plan.key))
            .header("x-tenant", format!("t{}", plan.key))
            .header("x-key-index", plan.key.to_string())
            .header("x-request", id.to_string())
            .header("x-tokens", tokens.to_string());
        if rng.chance(0.2) {
            request = request.header("x-forget", "1");
        }
        if charged {
            request = request.header(ACTUAL, answers.between(0, most).to_string());
            if answers.chance(0.5) {
                request = request.header("x-status", CHARGED_STATUS.to_string());
            }
        }
        let request = request.body(Body::empty()).expect("a request");
        let answered = tokio::time::timeout(STUCK, replica.oneshot(request)).await;
        let response = match answered {
            Err(_) => {
                fleet.lock_outcome().stuck += 1;
                continue;
            }
            Ok(Err(never)) => match never {},
            Ok(Ok(response)) => response,
        };
        let status = response.status().as_u16();
        *fleet.lock_outcome().statuses.entry(status).or_default() += 1;
        if status == 429 {
            let refused = Happened::Refused { replica: member };
            fleet.ledger.note(id, plan.key, refused);
        }
        if status == 429 || status == 503 {
            let after = response
                .headers()
                .get(http::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                .unwrap_or(1);
            let wait = match plan.manner {
                Manner::Polite => Duration::from_secs(after),
                _ => Duration::from_millis(rng.between(5, 200)),
            };
            // A wait past the client's end ends it: its task is not a request left unanswered.
            tokio::time::sleep_until((Instant::now() + wait).min(start + plan.until)).await;
            continue;
        }
        let leave_after = match plan.manner {
            Manner::Leaver => Some(rng.between(0, tokens.max(1))),
            _ => None,
        };
        let mut body = response.into_body();
        let mut read = 0u64;
        loop {
            if leave_after.is_some_and(|after| read >= after) {
                break;
            }
            let frame = match tokio::time::timeout(STUCK, body.frame()).await {
                Err(_) => {
                    fleet.lock_outcome().stuck += 1;
                    break;
                }
                Ok(None) | Ok(Some(Err(_))) => break,
                Ok(Some(Ok(frame))) => frame,
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            let units = data.windows(7).filter(|w| w == b"data: t").count() as u64;
            for _ in 0..units {
                fleet.ledger.note(id, plan.key, Happened::Unit);
            }
            read += units;
            if plan.manner == Manner::SlowReader {
                tokio::time::sleep(Duration::from_millis(rng.between(1, 60))).await;
            }
        }
        drop(body);
    }
}

/// Applies the plan's faults at their times.
async fn faults(fleet: Fleet, start: Instant) {
    for (at, fault) in fleet.plan.faults.clone() {
        tokio::time::sleep_until(start + at).await;
        match fault {
            Fault::Outage {
                node,
                status,
                lasting,
            } => {
                fleet.net.set_status(node, status, None);
                let net = fleet.net.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(lasting).await;
                    net.set_status(node, Status::Up, None);
                });
            }
            Fault::Restart { node, keep_data } => {
                fleet.net.restart(node, keep_data);
                if !keep_data {
                    let now = fleet.time.now();
                    fleet.lock_outcome().wiped.push(now);
                }
            }
            Fault::Weather { weather, lasting } => {
                fleet.net.set_weather(weather);
                let net = fleet.net.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(lasting).await;
                    net.set_weather(Weather::calm());
                });
            }
            Fault::DropConnections => fleet.net.drop_connections(None),
            Fault::DropSubscriptions => fleet.net.drop_subscriptions(),
            Fault::Reload => {
                if let Err(error) = fleet.reload() {
                    fleet.lock_outcome().refused = Some(error);
                }
            }
            Fault::Migrate { slot, to, lasting } => {
                fleet.net.start_migration(slot, to);
                let net = fleet.net.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(lasting).await;
                    net.end_migration();
                });
            }
            Fault::Crash { replica } => fleet.stop(replica, true),
            Fault::Leave { replica } => fleet.stop(replica, false),
            Fault::Join { replica } => {
                if let Err(error) = fleet.join(replica) {
                    fleet.lock_outcome().refused = Some(error);
                }
            }
        }
    }
}

/// Runs `plan` on the current (paused, one-thread) runtime.
async fn run_here(plan: &Plan) -> Outcome {
    let time = SimTime::starting_at(EPOCH + (plan.seed % 1_000) * 1_013_000);
    let nodes = if plan.cluster { 3 } else { 1 };
    let net = Net::new(
        Servers::new(nodes, plan.cluster, plan.functions),
        time,
        Rng::new(plan.seed).fork(1),
    );
    let fleet = Fleet {
        plan: Arc::new(plan.clone()),
        net: net.clone(),
        time,
        ledger: Ledger {
            facts: Arc::default(),
            time,
        },
        members: Arc::default(),
        outcome: Arc::default(),
        requests: Arc::default(),
        version: Arc::default(),
    };
    fleet.lock_outcome().start = time.now();
    for id in 0..plan.replicas {
        if let Err(error) = fleet.join(id) {
            let mut outcome = std::mem::take(&mut *fleet.lock_outcome());
            outcome.refused = Some(error);
            return outcome;
        }
    }
    let start = Instant::now();
    let mut tasks: Vec<JoinHandle<()>> = plan
        .clients
        .iter()
        .cloned()
        .enumerate()
        .map(|(index, client_plan)| tokio::spawn(client(fleet.clone(), index, client_plan, start)))
        .collect();
    tasks.push(tokio::spawn(faults(fleet.clone(), start)));
    let counter = {
        let fleet = fleet.clone();
        tokio::spawn(async move {
            loop {
                fleet.count();
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    };
    let deadline = start + plan.length + GRACE;
    let mut panics = Vec::new();
    for task in tasks {
        match tokio::time::timeout_at(deadline, task).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) if error.is_panic() => panics.push(panic_message(error.into_panic())),
            Ok(Err(_)) => {}
            Err(_) => fleet.lock_outcome().stuck += 1,
        }
    }
    counter.abort();
    // Let responses dropped last settle.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ids: Vec<u32> = fleet.lock_members().keys().copied().collect();
    for id in ids {
        fleet.stop(id, false);
    }
    let script_errors = net.script_errors();
    let facts = std::mem::take(&mut *fleet.ledger.facts.lock().unwrap_or_else(|p| p.into_inner()));
    let mut outcome = std::mem::take(&mut *fleet.lock_outcome());
    outcome.end = time.now();
    outcome.facts = facts;
    outcome.panics = panics;
    outcome.script_errors = script_errors;
    outcome.audits = net.take_audits();
    outcome.events = net.take_events();
    outcome.requests = fleet.requests.load(std::sync::atomic::Ordering::SeqCst);
    outcome
}

fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    if let Some(text) = panic.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = panic.downcast_ref::<String>() {
        text.clone()
    } else {
        "a panic".to_owned()
    }
}
