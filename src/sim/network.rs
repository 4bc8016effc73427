//! [`Net`]: the simulated network between the replicas and the servers — connections as
//! in-memory pipes that the servers answer in RESP, with the faults a seed chooses: latency and
//! its spread, a call lost before it reaches the server (its connection drops) or applied and
//! its reply lost, connections dropped, a server that refuses connections, swallows them
//! (a black hole) or pauses, restarts with or without its data, pub/sub messages lost or late,
//! a slot migrating, and a replica cut off (a crash).
//!
//! Each connection is three tasks on the simulation's runtime: one reads the client's commands
//! (each arriving a latency later, in order), one executes each at its arrival, atomically (the
//! servers are one value behind a lock), one writes each reply a latency after (in order).

use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use tokio::time::{Duration, Instant};

use super::audit::{Audit, audit_call};
use super::rng::Rng;
use super::server::reply::command;
use super::server::{Servers, Session};
use super::time::SimTime;
use crate::store::redis::simulated::{Network, Opening, Push};

/// How a server takes connections and commands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    Up,
    /// Refuses connections; open ones are closed.
    Refusing,
    /// Answers nothing: dials never complete, commands wait.
    Blackhole,
}

/// The weather of the network: what every call risks, changed as a run goes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Weather {
    /// One-way latency, microseconds, between these.
    pub(crate) latency: (u64, u64),
    /// The chance that a call is lost before the server reads it (its connection drops).
    pub(crate) lose_request: f64,
    /// The chance that a call runs and its reply is lost (its connection drops).
    pub(crate) lose_reply: f64,
    /// The chance that a pub/sub message is lost.
    pub(crate) lose_message: f64,
    /// A pub/sub message's delay, microseconds, between these.
    pub(crate) message_delay: (u64, u64),
}

impl Weather {
    /// A calm network: a quarter to a millisecond each way, nothing lost.
    pub(crate) fn calm() -> Weather {
        Weather {
            latency: (250, 1000),
            lose_request: 0.0,
            lose_reply: 0.0,
            lose_message: 0.0,
            message_delay: (200, 1000),
        }
    }
}

/// What happened on the network, for a run's trace and its checks.
#[derive(Clone, Debug)]
#[allow(clippy::enum_variant_names, reason = "each is a loss")]
pub(crate) enum NetEvent {
    /// A call lost before the server read it.
    LostRequest { replica: u32, node: usize },
    /// A call applied whose reply was lost.
    LostReply { replica: u32, node: usize },
    /// A pub/sub message lost.
    LostMessage { replica: u32 },
}

impl std::fmt::Display for NetEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NetEvent::LostRequest { replica, node } => {
                write!(f, "a call of replica {replica} to node {node} lost")
            }
            NetEvent::LostReply { replica, node } => {
                write!(f, "the reply of node {node} to replica {replica} lost")
            }
            NetEvent::LostMessage { replica } => write!(f, "a message to replica {replica} lost"),
        }
    }
}

struct Link {
    node: usize,
    replica: u32,
    closed: Arc<Closer>,
}

/// Closes a connection from the network's side.
#[derive(Default)]
struct Closer {
    closed: AtomicBool,
    notify: tokio::sync::Notify,
}

impl Closer {
    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            if self.is_closed() {
                return;
            }
            notified.await;
        }
    }
}

struct Subscriber {
    node: usize,
    replica: u32,
    channel: Vec<u8>,
    sender: mpsc::Sender<Push>,
}

struct State {
    servers: Servers,
    rng: Rng,
    time: SimTime,
    status: Vec<watch::Sender<(Status, Option<Instant>)>>,
    /// Replicas cut off from every server (crashed), by id.
    cut: Vec<u32>,
    links: BTreeMap<u64, Link>,
    next_link: u64,
    subscribers: Vec<Subscriber>,
    weather: Weather,
    events: Vec<(u64, NetEvent)>,
    audits: Vec<Audit>,
}

/// The simulated network and its servers; clones share them.
#[derive(Clone)]
pub(crate) struct Net(Arc<Mutex<State>>);

impl Net {
    /// A network to `servers`, on `time`, its chances drawn from `rng`.
    pub(crate) fn new(servers: Servers, time: SimTime, rng: Rng) -> Net {
        let status = (0..servers.nodes.len())
            .map(|_| watch::channel((Status::Up, None)).0)
            .collect();
        Net(Arc::new(Mutex::new(State {
            servers,
            rng,
            time,
            status,
            cut: Vec::new(),
            links: BTreeMap::new(),
            next_link: 0,
            subscribers: Vec::new(),
            weather: Weather::calm(),
            events: Vec::new(),
            audits: Vec::new(),
        })))
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The network as replica `replica` reaches it.
    pub(crate) fn for_replica(&self, replica: u32) -> Arc<dyn Network> {
        Arc::new(Reach {
            net: self.clone(),
            replica,
        })
    }

    /// The URLs of the servers (of the cluster's nodes).
    pub(crate) fn urls(&self) -> Vec<String> {
        let state = self.state();
        state
            .servers
            .nodes
            .iter()
            .map(|n| format!("redis://{}:{}", n.host, n.port))
            .collect()
    }

    pub(crate) fn set_weather(&self, weather: Weather) {
        self.state().weather = weather;
    }

    /// Sets node `node`'s status (closing its connections and subscriptions unless it is up),
    /// paused until `until` if given.
    pub(crate) fn set_status(&self, node: usize, status: Status, paused_until: Option<Instant>) {
        let mut state = self.state();
        if status == Status::Refusing {
            close_node(&mut state, node);
        }
        if status == Status::Blackhole {
            // Its subscriptions hear nothing more.
            state.subscribers.retain(|s| s.node != node);
        }
        state.status[node].send_replace((status, paused_until));
    }

    /// Restarts node `node` (its connections closed), with or without its data.
    pub(crate) fn restart(&self, node: usize, keep_data: bool) {
        let mut state = self.state();
        close_node(&mut state, node);
        state.servers.restart(node, keep_data);
    }

    /// Drops every connection of node `node`, or of every node.
    pub(crate) fn drop_connections(&self, node: Option<usize>) {
        let mut state = self.state();
        let nodes = state.servers.nodes.len();
        for n in 0..nodes {
            if node.is_none_or(|node| node == n) {
                close_node(&mut state, n);
            }
        }
    }

    /// Drops the subscriptions of every replica (their listeners subscribe again).
    pub(crate) fn drop_subscriptions(&self) {
        self.state().subscribers.clear();
    }

    /// Cuts replica `replica` off for good (a crash): its connections and subscriptions close,
    /// and it reaches nothing again.
    pub(crate) fn cut(&self, replica: u32) {
        let mut state = self.state();
        state.cut.push(replica);
        for link in state.links.values() {
            if link.replica == replica {
                link.closed.close();
            }
        }
        state.links.retain(|_, l| l.replica != replica);
        state.subscribers.retain(|s| s.replica != replica);
    }

    /// Starts moving `slot` to node `to` (a cluster).
    pub(crate) fn start_migration(&self, slot: u16, to: usize) {
        self.state().servers.start_migration(slot, to);
    }

    /// Ends the migration under way, if any.
    pub(crate) fn end_migration(&self) {
        self.state().servers.end_migration();
    }

    /// The audits of the calls made so far, taken.
    pub(crate) fn take_audits(&self) -> Vec<Audit> {
        std::mem::take(&mut self.state().audits)
    }

    /// The network's events so far, taken.
    pub(crate) fn take_events(&self) -> Vec<(u64, NetEvent)> {
        std::mem::take(&mut self.state().events)
    }

    /// The errors tollgate's code raised on the servers.
    pub(crate) fn script_errors(&self) -> Vec<String> {
        self.state().servers.script_errors.clone()
    }

    /// A latency drawn from the weather.
    fn latency(state: &mut State) -> Duration {
        let (low, high) = state.weather.latency;
        Duration::from_micros(state.rng.between(low, high.max(low)))
    }
}

/// Closes node `node`'s connections and subscriptions.
fn close_node(state: &mut State, node: usize) {
    for link in state.links.values() {
        if link.node == node {
            link.closed.close();
        }
    }
    state.links.retain(|_, l| l.node != node);
    state.subscribers.retain(|s| s.node != node);
}

/// The network as one replica reaches it.
struct Reach {
    net: Net,
    replica: u32,
}

/// Opens a link of `replica` to the server at `host:port`, a round trip later: its node, or
/// the refusal (a black hole never answers).
async fn opened(net: &Net, host: &str, port: u16, replica: u32) -> io::Result<usize> {
    let (node, status, delay) = {
        let mut state = net.state();
        let node = state.servers.node_at(host, port).ok_or_else(|| {
            io::Error::new(io::ErrorKind::NotFound, format!("no server {host}:{port}"))
        })?;
        let status = if state.cut.contains(&replica) {
            Status::Refusing
        } else {
            state.status[node].borrow().0
        };
        (node, status, Net::latency(&mut state) * 2)
    };
    tokio::time::sleep(delay).await;
    match status {
        Status::Refusing => Err(io::Error::new(
            io::ErrorKind::ConnectionRefused,
            "connection refused",
        )),
        Status::Blackhole => std::future::pending().await,
        Status::Up => Ok(node),
    }
}

impl Network for Reach {
    fn dial(&self, host: &str, port: u16) -> Opening<tokio::io::DuplexStream> {
        let net = self.net.clone();
        let replica = self.replica;
        let (host, port) = (host.to_owned(), port);
        Box::pin(async move {
            let node = opened(&net, &host, port, replica).await?;
            let (client, server) = tokio::io::duplex(1 << 16);
            let closed = Arc::new(Closer::default());
            {
                let mut state = net.state();
                if state.cut.contains(&replica) {
                    return Err(io::ErrorKind::ConnectionRefused.into());
                }
                let id = state.next_link;
                state.next_link += 1;
                let link = Link {
                    node,
                    replica,
                    closed: closed.clone(),
                };
                state.links.insert(id, link);
            }
            serve(net, node, replica, server, closed);
            Ok(client)
        })
    }

    fn subscribe(&self, host: &str, port: u16, channel: &str) -> Opening<mpsc::Receiver<Push>> {
        let net = self.net.clone();
        let replica = self.replica;
        let (host, port, channel) = (host.to_owned(), port, channel.as_bytes().to_vec());
        Box::pin(async move {
            let node = opened(&net, &host, port, replica).await?;
            let (sender, receiver) = mpsc::channel(4096);
            let mut state = net.state();
            if state.cut.contains(&replica) {
                return Err(io::ErrorKind::ConnectionRefused.into());
            }
            state.subscribers.push(Subscriber {
                node,
                replica,
                channel,
                sender,
            });
            Ok(receiver)
        })
    }
}

/// Answers one connection to node `node` of replica `replica` until either side closes it.
fn serve(
    net: Net,
    node: usize,
    replica: u32,
    stream: tokio::io::DuplexStream,
    closed: Arc<Closer>,
) {
    let (mut read, mut write) = tokio::io::split(stream);
    let (arrivals, mut arrived) = mpsc::unbounded_channel::<(Instant, Vec<Vec<u8>>)>();
    let (replies, mut replied) = mpsc::unbounded_channel::<(Instant, Option<Vec<u8>>)>();
    // Reads the client's commands, each arriving a latency after it was read (in order).
    let reader_closed = closed.clone();
    let reader_net = net.clone();
    tokio::spawn(async move {
        let mut buf = Vec::new();
        let mut chunk = vec![0u8; 8192];
        let mut last = Instant::now();
        loop {
            let n = tokio::select! {
                biased;
                () = reader_closed.wait() => return,
                n = read.read(&mut chunk) => match n {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                },
            };
            buf.extend_from_slice(&chunk[..n]);
            loop {
                match command(&buf) {
                    Ok(Some((args, used))) => {
                        buf.drain(..used);
                        let latency = Net::latency(&mut reader_net.state());
                        last = last.max(Instant::now() + latency);
                        if arrivals.send((last, args)).is_err() {
                            return;
                        }
                    }
                    Ok(None) => break,
                    Err(_) => {
                        reader_closed.close();
                        return;
                    }
                }
            }
        }
    });
    // Executes each command at its arrival, atomically, and sends its reply on.
    let executor_closed = closed.clone();
    tokio::spawn(async move {
        let mut session = Session::default();
        let mut last_reply = Instant::now();
        let mut status = net.state().status[node].subscribe();
        while let Some((at, args)) = arrived.recv().await {
            tokio::select! {
                biased;
                () = executor_closed.wait() => return,
                () = tokio::time::sleep_until(at) => {}
            }
            // A server that swallows or pauses holds the command until it answers again.
            loop {
                let (now_status, paused) = *status.borrow_and_update();
                let paused = paused.filter(|until| *until > Instant::now());
                match (now_status, paused) {
                    (Status::Up, None) => break,
                    (Status::Refusing, _) => {
                        executor_closed.close();
                        return;
                    }
                    (_, Some(until)) => {
                        tokio::select! {
                            biased;
                            () = executor_closed.wait() => return,
                            _ = status.changed() => {}
                            () = tokio::time::sleep_until(until) => {}
                        }
                    }
                    (Status::Blackhole, None) => {
                        tokio::select! {
                            biased;
                            () = executor_closed.wait() => return,
                            _ = status.changed() => {}
                        }
                    }
                }
            }
            if executor_closed.is_closed() {
                return;
            }
            let (bytes, latency) = {
                let mut state = net.state();
                let lose_request = state.weather.lose_request;
                if state.rng.chance(lose_request) {
                    let now = state.time.now();
                    state
                        .events
                        .push((now, NetEvent::LostRequest { replica, node }));
                    drop(state);
                    let _ = replies.send((Instant::now(), None));
                    return;
                }
                let now = state.time.now();
                let state = &mut *state;
                let before = audit_call(&mut state.servers, node, &args, now);
                let (reply, published) = state.servers.execute(node, &mut session, &args, now);
                if let Some(before) = before {
                    let after = before.after(&mut state.servers, node, now, &reply);
                    state.audits.push(after);
                }
                if let Some(published) = published {
                    publish(state, published);
                }
                let lose_reply = state.weather.lose_reply;
                let lost = state.rng.chance(lose_reply);
                if lost {
                    state
                        .events
                        .push((now, NetEvent::LostReply { replica, node }));
                }
                let latency = Net::latency(state);
                let mut bytes = Vec::new();
                reply.write(&mut bytes);
                (if lost { None } else { Some(bytes) }, latency)
            };
            last_reply = last_reply.max(Instant::now() + latency);
            let end = bytes.is_none();
            if replies.send((last_reply, bytes)).is_err() || end {
                return;
            }
        }
    });
    // Writes each reply at its time, in order; a lost one closes the connection.
    tokio::spawn(async move {
        while let Some((at, bytes)) = replied.recv().await {
            tokio::select! {
                biased;
                () = closed.wait() => return,
                () = tokio::time::sleep_until(at) => {}
            }
            let Some(bytes) = bytes else {
                closed.close();
                return;
            };
            if write.write_all(&bytes).await.is_err() {
                return;
            }
        }
        // Every reply written and the client gone.
        closed.close();
    });
}

/// Delivers a published message to every subscriber of its channel, each after a delay, or
/// loses it.
fn publish(state: &mut State, published: super::server::Published) {
    state.subscribers.retain(|s| !s.sender.is_closed());
    let now = state.time.now();
    let mut deliveries = Vec::new();
    for subscriber in &state.subscribers {
        if subscriber.channel != published.channel {
            continue;
        }
        deliveries.push((subscriber.replica, subscriber.sender.clone()));
    }
    for (replica, sender) in deliveries {
        let lose_message = state.weather.lose_message;
        if state.rng.chance(lose_message) {
            state.events.push((now, NetEvent::LostMessage { replica }));
            continue;
        }
        let (low, high) = state.weather.message_delay;
        let delay = Duration::from_micros(state.rng.between(low, high.max(low)));
        let message = published.message.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = sender.try_send(Push::Message(message));
        });
    }
}
