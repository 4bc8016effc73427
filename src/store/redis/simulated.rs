//! The seam where the fleet simulation (`crate::sim`, tests only) takes the place of the
//! network: a [`Network`] opens a connection's byte stream instead of TCP, and carries the
//! pub/sub messages of forgotten keys instead of redis-rs's subscription. Everything above the
//! byte stream (the connection's task, batches, deadlines, the cluster's routing, the replica's
//! deny cache and leases) runs as it does against a real server; the real-Redis tests cover
//! what is below it (TCP, TLS, redis-rs's pub/sub).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;

use tokio::io::DuplexStream;
use tokio::sync::mpsc;

pub(crate) use super::keys::slot;
pub(crate) use super::push::Push;
use crate::clock::Clock;

/// The future of a dial or a subscription.
pub(crate) type Opening<T> = Pin<Box<dyn Future<Output = io::Result<T>> + Send>>;

/// A simulated network of Redis servers.
pub(crate) trait Network: Send + Sync + 'static {
    /// Opens a byte stream to the server at `host:port` (the simulation answers it in RESP).
    fn dial(&self, host: &str, port: u16) -> Opening<DuplexStream>;

    /// Subscribes to `channel` on the server at `host:port`: the messages it carries, until
    /// the link drops (then the receiver ends).
    fn subscribe(&self, host: &str, port: u16, channel: &str) -> Opening<mpsc::Receiver<Push>>;
}

/// What a store of a simulated fleet is given: its network, and the replica's own clock (the
/// server's clock is the network's: scripts read `TIME` as in production).
#[derive(Clone)]
pub(crate) struct Simulated {
    pub(crate) network: Arc<dyn Network>,
    pub(crate) clock: Arc<dyn Clock>,
}

/// The subscriber of a store on a simulated network: the servers of its clients, in turn.
pub(crate) struct Subscribing {
    pub(crate) network: Arc<dyn Network>,
    pub(crate) servers: Vec<(String, u16)>,
}
