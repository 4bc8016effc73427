//! [`Transport`]: what differs between the two Redis stores, how a call reaches Redis (one
//! server, or the primaries of a cluster); [`Remote`](super::Remote) does the rest once.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use super::future::CheckFuture;
use crate::store::redis::fleet::Fleet;
use crate::store::redis::forget;
use crate::store::redis::late_reply::Waiting;
use crate::store::redis::replica::Replica;
use crate::store::redis::script::{Mode, Prepared, Program, Reply};
use crate::store::redis::settings::Settings;
use crate::store::redis::startup::Startup;
use crate::store::{Charge, RuleRegistry, StoreError};
use crate::throttle::Every;

/// How a Redis store reaches Redis: [`Standalone`](super::super::standalone::Standalone) or
/// [`Cluster`](super::super::cluster::Cluster).
pub(crate) trait Transport: Send + Sync + Sized + 'static {
    /// The store's kind, as [`Store::kind`](crate::store::Store::kind) names it.
    const KIND: &'static str;

    /// What both transports hold alike: settings, the replica's denials and leases, rules.
    fn parts(&self) -> &Parts;

    /// Starts connecting in the background, unless connected (or trying).
    fn start(self: &Arc<Self>);

    /// Why no planned check can be sent now, if none can: the store has not connected yet (on
    /// one server, or its circuit breaker is open).
    fn unsendable(&self) -> Option<StoreError>;

    /// Why the check of `charges` cannot be sent now, if it cannot, asked before it is
    /// planned ([`Store::check_now`](crate::store::Store::check_now)); starts the transport.
    fn refusal(self: &Arc<Self>, charges: &[Charge<'_>]) -> Option<StoreError>;

    /// Whether the check of `prepared` runs to its end whatever its request does, which then
    /// waits for it (it is never answered ahead of its call from leases).
    fn runs_alone(&self, prepared: &[Prepared]) -> bool;

    /// Sends the check `waiting` waits on (the store's time, `now`, with an injected clock):
    /// queued on a connection, whose reply comes within the check's time budget, or a future
    /// that decides it (one [that runs alone](Self::runs_alone), `alone` as that said, is on
    /// its way already). Called on a Tokio runtime.
    fn send(self: &Arc<Self>, waiting: Waiting, now: Option<u64>, alone: bool) -> Sent;

    /// The reply to a peek of `prepared` (nothing charged), within a check's time budget.
    fn peek(
        self: Arc<Self>,
        prepared: Vec<Prepared>,
        now: Option<u64>,
    ) -> impl Future<Output = Result<Reply, StoreError>> + Send;

    /// One call of `charges` in `mode` outside the batches (on a cluster, one per slot),
    /// within a check's time budget.
    fn call(
        self: Arc<Self>,
        mode: Mode,
        now: Option<u64>,
        charges: Vec<Prepared>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Tells every replica that the keys of Redis names `names` were forgotten (a `PUBLISH` on
    /// the prefix's channel: [`forget`](super::super::forget)), within a check's time budget.
    fn publish(
        self: Arc<Self>,
        names: Vec<String>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Counts this replica among those of its prefix ([`fleet`](super::super::fleet)), within a
    /// check's time budget: the replicas counted.
    fn beat(self: Arc<Self>) -> impl Future<Output = Result<u64, StoreError>> + Send;
}

/// How a transport took a check.
pub(crate) enum Sent {
    /// Queued on a connection: the reply comes here, by the check's deadline.
    Queued(Waiting),
    /// To be decided by this future (a connection to open first, a cluster's slots).
    Deciding(CheckFuture<Reply>),
}

/// What both transports hold alike.
pub(crate) struct Parts {
    pub(crate) settings: Settings,
    /// The code to run.
    pub(crate) program: &'static Program,
    /// Denials and leases decided on this replica.
    pub(crate) replica: Arc<Replica>,
    /// The channel of keys forgotten by any replica.
    pub(crate) channel: String,
    pub(crate) registry: RuleRegistry,
    /// Whether the store has connected, and its background task.
    pub(crate) startup: Startup,
    /// When the background task last said it cannot reach Redis.
    pub(crate) warned: Every,
    /// This replica among those of its prefix.
    pub(crate) fleet: Fleet,
}

impl Parts {
    /// Listens on `clients` (one connection at a time) for the keys other replicas forgot.
    pub(crate) fn listen(&self, clients: Vec<redis::Client>) {
        let replica = Arc::downgrade(&self.replica);
        let channel = self.channel.clone();
        #[cfg(test)]
        if let Some(simulated) = &self.settings.simulated {
            let servers = clients
                .iter()
                .filter_map(|client| match client.get_connection_info().addr() {
                    redis::ConnectionAddr::Tcp(host, port) => Some((host.clone(), *port)),
                    _ => None,
                })
                .collect();
            let subscriber = crate::store::redis::simulated::Subscribing {
                network: simulated.network.clone(),
                servers,
            };
            forget::listen_through(replica, subscriber, channel, self.settings.connect_timeout);
            return;
        }
        forget::listen(replica, clients, channel, self.settings.connect_timeout);
    }

    /// Records that an attempt to connect failed with `error`: whether to say so (the first
    /// time, then at most once a minute).
    pub(crate) fn connect_failed(&self, error: &StoreError) -> bool {
        let first = self.startup.failed(error);
        // Both asked: the first attempt also starts the minute.
        let due = self.warned.due(crate::clock::unix_micros(), 60_000_000);
        first || due
    }

    /// Waits at most `budget` for the store to connect; the error names `servers`.
    pub(crate) async fn connected_within(
        &self,
        budget: std::time::Duration,
        servers: &str,
    ) -> Result<(), StoreError> {
        if self.startup.wait(budget).await {
            Ok(())
        } else {
            Err(self.startup.not_connected(servers))
        }
    }

    /// The `Debug` of the store `name`: what it connects to (`servers`, under `field`), its
    /// prefix, `more`, its time budget and whether it has connected.
    pub(crate) fn fmt_store(
        &self,
        f: &mut fmt::Formatter<'_>,
        name: &str,
        (field, servers): (&str, &str),
        more: &[(&str, &dyn fmt::Debug)],
    ) -> fmt::Result {
        let mut debug = f.debug_struct(name);
        debug
            .field(field, &servers)
            .field("prefix", &self.settings.prefix);
        for (name, value) in more {
            debug.field(name, value);
        }
        debug
            .field("response_timeout", &self.settings.response_timeout)
            .field("connected", &self.startup.is_connected())
            .finish_non_exhaustive()
    }

    /// The parts of a store configured with `settings`.
    pub(crate) fn new(settings: Settings) -> Self {
        Parts {
            program: settings.program(),
            replica: settings.replica(),
            channel: forget::channel(&settings.prefix),
            fleet: Fleet::new(&settings.prefix, settings.heartbeat),
            settings,
            registry: RuleRegistry::new(),
            startup: Startup::default(),
            warned: Every::default(),
        }
    }
}

/// The runtime a call runs on, or the error of one where no Tokio runtime runs (another
/// executor): a call's tasks and timers are the runtime's (which must enable its timers).
pub(crate) fn runtime() -> Result<tokio::runtime::Handle, StoreError> {
    tokio::runtime::Handle::try_current()
        .map_err(|_| StoreError::Unavailable("a Redis store's call outside a Tokio runtime".into()))
}
