//! The request path, from a request's head to its [`Ruling`]: the gate (allow and deny lists,
//! the tenant, preflights, load shedding), the keys, the check of the store, the verdict, the
//! delay loop, the fallback when the store fails, the settle after the response, the slots
//! given back, the reload wiring, and the one [`Driver`] that every face drives a decision
//! with.
//!
//! 0. The policy in force is taken (a snapshot: no lock), the lists are checked, the tenant
//!    is found, and the policy resolves which rules apply (`gate`).
//! 1. Each rule's extractor finds the request's key (`keys`).
//! 2. The store checks every key in one atomic step (`check`).
//! 3. Its answer becomes what follows (`next`, in the shapes of `ruling`): call the inner
//!    service, or answer for it. A store failure is decided by each rule's failure mode
//!    (`fallback`); a denial by shadow rules only admits the request, one by delay rules waits
//!    and checks again (`delay`); what answers show is decided by pure functions (`verdict`).
//! 4. After the response: charges settled (`settle`), slots given back (`slots`), a streamed
//!    response's budget metered and settled (`meter`); what a request that went away leaves
//!    to the store is made at once, or finished on a runtime (`detached`); every decision is
//!    told to the events (`events`).
//!
//! Nothing here knows about `Service`: the faces (`service`, `future`, `grpc`) call
//! [`Engine::decide`] and drive what it could not decide with the [`Driver`].

mod account;
mod check;
mod delay;
mod detached;
mod driver;
mod events;
mod fallback;
mod gate;
mod keys;
mod local;
mod meter;
mod next;
mod reload;
mod ruling;
mod settle;
mod slots;
mod spend;
mod state;
mod uses;
mod verdict;

pub(crate) use detached::finish_detached;
pub(crate) use driver::Driver;
pub(crate) use local::Local;
pub(crate) use meter::SpendFuture;
pub use meter::{Meter, Spend};
pub(crate) use ruling::{Admitted, Decide, Ruling};
pub(crate) use settle::report_settle;
pub(crate) use slots::Slots;
pub(crate) use state::{Engine, PolicyInForce};
#[cfg(feature = "tonic")]
pub(crate) use uses::Use;
