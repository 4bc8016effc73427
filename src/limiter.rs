//! [`Limiter`]: a layer's budgets from your own code, off the request path.
//!
//! ```
//! use tollgate::key::Key;
//! use tollgate::{Quota, RateLimitLayer, Rule};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let layer = RateLimitLayer::builder()
//!     .rule(Rule::new("login", Quota::per_minute(5)))
//!     .build()?;
//! let limiter = layer.limiter();
//! let alice = Key::text("alice@example.com");
//! limiter.charge("login", &alice, 3).await?;
//! assert_eq!(limiter.peek("login", &alice).await?.remaining, 2);
//! // A successful login forgets the failures.
//! limiter.reset("login", &alice).await?;
//! assert_eq!(limiter.peek("login", &alice).await?.remaining, 5);
//! # Ok(())
//! # }
//! ```
//!
//! The same rules (by name, from the policy in force) and the same store as the layer's
//! requests, with the same atomicity: a charge is checked and made in one step, like a
//! request's, and a refund or a reset is one step of its own.

use std::fmt;
use std::sync::Arc;

use crate::Decision;
use crate::algorithm::Outcome;
use crate::engine::Engine;
use crate::key::Key;
use crate::store::{Adjustment, Change, Charge, RuleSpec, Store, StoreError};

/// A layer's budgets from your own code: see [`RateLimitLayer::limiter`](crate::RateLimitLayer::limiter).
pub struct Limiter<St> {
    pub(crate) engine: Arc<Engine<St>>,
}

impl<St> Clone for Limiter<St> {
    fn clone(&self) -> Self {
        Limiter {
            engine: self.engine.clone(),
        }
    }
}

impl<St> fmt::Debug for Limiter<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limiter").finish_non_exhaustive()
    }
}

/// Why a [`Limiter`] operation failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum LimiterError {
    /// The policy in force has no rule of this name.
    UnknownRule(String),
    /// The store failed.
    Store(StoreError),
}

impl fmt::Display for LimiterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LimiterError::UnknownRule(name) => write!(
                f,
                "no rule named \"{name}\" in the policy in force; use one of the layer's rule names"
            ),
            LimiterError::Store(error) => error.fmt(f),
        }
    }
}

impl std::error::Error for LimiterError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LimiterError::Store(error) => Some(error),
            LimiterError::UnknownRule(_) => None,
        }
    }
}

impl From<StoreError> for LimiterError {
    fn from(error: StoreError) -> Self {
        LimiterError::Store(error)
    }
}

impl<St: Store> Limiter<St> {
    fn rule(&self, name: &str) -> Result<Arc<RuleSpec>, LimiterError> {
        self.engine
            .snapshot()
            .rules
            .iter()
            .find(|r| r.spec.name() == name)
            .map(|r| r.spec.clone())
            .ok_or_else(|| LimiterError::UnknownRule(name.to_owned()))
    }

    /// The key `rule` counts a request by: its extractor run on the request's head, as the
    /// layer runs it (a request without one is counted under [`Key::unidentified`], unless the
    /// rule skips such requests: `None` then). `None` too for an extractor that needs an
    /// asynchronous lookup (its lookup is not run). How to address a request's budget from its
    /// handler.
    ///
    /// It reads the policy in force now, and does not resolve tiers or routes: it gives the
    /// rule's key whether or not the rule applied to this request.
    pub fn key_of(
        &self,
        rule: &str,
        parts: &http::request::Parts,
    ) -> Result<Option<Key>, LimiterError> {
        let snapshot = self.engine.snapshot();
        let compiled = snapshot
            .rules
            .iter()
            .find(|r| r.spec.name() == rule)
            .ok_or_else(|| LimiterError::UnknownRule(rule.to_owned()))?;
        Ok(match compiled.key.extract(parts) {
            crate::key::Extracted::Found(key) => Some(key),
            crate::key::Extracted::Missing => (!compiled.skip_unidentified).then(Key::unidentified),
            crate::key::Extracted::Pending(_) => None,
        })
    }

    /// The budget of `rule` for `key`, charging nothing.
    pub async fn peek(&self, rule: &str, key: &Key) -> Result<Outcome, LimiterError> {
        let spec = self.rule(rule)?;
        let charge = [Charge {
            rule: &spec,
            key,
            cost: 0,
        }];
        let decision = self.engine.store.peek(&charge).await?;
        first(decision)
    }

    /// Checks and charges `cost` to `rule` for `key`, as a request would be: charged only when
    /// admitted. The decision says which, with the budget.
    pub async fn charge(&self, rule: &str, key: &Key, cost: u64) -> Result<Decision, LimiterError> {
        let spec = self.rule(rule)?;
        let charge = [Charge {
            rule: &spec,
            key,
            cost,
        }];
        Ok(self.engine.store.check(&charge).await?)
    }

    /// Gives `cost` units back to `rule` for `key` (to the current window, for the window
    /// algorithms). A concurrency rule's slots go back with [`give_back`](Self::give_back),
    /// which knows when they were taken: this refuses them.
    pub async fn refund(&self, rule: &str, key: &Key, cost: u64) -> Result<(), LimiterError> {
        if self.rule(rule)?.algorithm().is_concurrency() {
            return Err(LimiterError::Store(StoreError::Unsupported(
                "refund of a concurrency rule; give the slots back with Limiter::give_back and \
                 the decision of their charge",
            )));
        }
        self.adjust(rule, key, Change::Refund(cost)).await
    }

    /// Gives back the `cost` slots of a concurrency rule that [`charge`](Self::charge) took
    /// with `charged`, its decision (given up here, so that it is given back once): a job
    /// outside the request path holds slots as a request does, from its charge until this call
    /// (or until the rule's longest hold). `cost` is the charge's.
    pub async fn give_back(
        &self,
        rule: &str,
        key: &Key,
        cost: u64,
        charged: Decision,
    ) -> Result<(), LimiterError> {
        let spec = self.rule(rule)?;
        if !spec.algorithm().is_concurrency() {
            return Err(LimiterError::Store(StoreError::Unsupported(
                "give_back of a rule that is not a concurrency rule; use Limiter::refund",
            )));
        }
        if !charged.allowed() {
            return Ok(());
        }
        let adjustment = [Adjustment {
            rule: &spec,
            key,
            change: Change::Refund(cost),
            charged_at: charged.charged_at(0),
        }];
        Ok(self.engine.store.adjust(&adjustment).await?)
    }

    /// Charges `cost` units to `rule` for `key` whatever its budget: past it, the key is in
    /// debt and its next requests wait (a cost learned later, a penalty).
    pub async fn force(&self, rule: &str, key: &Key, cost: u64) -> Result<(), LimiterError> {
        if self.rule(rule)?.algorithm().is_concurrency() {
            return Err(LimiterError::Store(StoreError::Unsupported(
                "force on a concurrency rule (slots no one could give back); use \
                 Limiter::charge and Limiter::give_back",
            )));
        }
        self.adjust(rule, key, Change::Charge(cost)).await
    }

    async fn adjust(&self, rule: &str, key: &Key, change: Change) -> Result<(), LimiterError> {
        let spec = self.rule(rule)?;
        let adjustment = [Adjustment {
            rule: &spec,
            key,
            change,
            charged_at: 0,
        }];
        Ok(self.engine.store.adjust(&adjustment).await?)
    }

    /// Forgets every charge of `rule` for `key`: its next request finds a full budget (after a
    /// successful login, a solved captcha, a new billing cycle).
    pub async fn reset(&self, rule: &str, key: &Key) -> Result<(), LimiterError> {
        let spec = self.rule(rule)?;
        let charge = [Charge {
            rule: &spec,
            key,
            cost: 0,
        }];
        Ok(self.engine.store.reset(&charge).await?)
    }
}

fn first(decision: Decision) -> Result<Outcome, LimiterError> {
    decision.outcomes().first().copied().ok_or_else(|| {
        LimiterError::Store(StoreError::Protocol("the store answered no outcome".into()))
    })
}
