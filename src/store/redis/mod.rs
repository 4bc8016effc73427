//! The Redis and Redis Cluster stores (feature `redis`). Their documentation is on
//! [`store`](crate::store#redis-and-redis-cluster).

mod access;
mod cluster;
mod connection;
mod error;
mod fleet;
mod forget;
mod health;
mod keys;
mod late_reply;
mod opening;
mod probe;
mod push;
mod remote;
mod replica;
mod resp;
mod script;
mod settings;
#[cfg(test)]
pub(crate) mod simulated;
mod standalone;
mod startup;

pub use cluster::{RedisClusterStore, RedisClusterStoreBuilder};
pub use error::ConnectError;
pub(crate) use script::wire;
pub use settings::DEFAULT_DENY_CACHE;
pub use standalone::{DEFAULT_MAX_BATCH, RedisStore, RedisStoreBuilder};
