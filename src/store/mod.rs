//! How much they already did: the [`Store`] trait and its implementations.
//!
//! ```
//! use tollgate::algorithm::Algorithm;
//! use tollgate::key::Key;
//! use tollgate::policy::{Quota, Rule};
//! use tollgate::store::{Charge, MemoryStore, Store};
//! # use tollgate::algorithm::Limits;
//! # use tollgate::policy::RuleSpec;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let store = MemoryStore::new();
//! let rule = RuleSpec::new("burst", Algorithm::TokenBucket, Limits::new(1, 1_000_000, 1).unwrap());
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

mod error;
mod memory;
#[cfg(feature = "redis")]
pub mod redis;

#[cfg(feature = "redis")]
pub use self::redis::{RedisClusterStore, RedisStore};
pub use error::StoreError;
pub use memory::{MemoryStore, MemoryStoreBuilder};

use std::future::Future;

use crate::decision::Decision;
use crate::key::Key;
use crate::policy::RuleSpec;

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
}
