//! [`RuleRegistry`]: the rule names in use on one store, so that two layers cannot give one name
//! two quotas.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use super::RuleSpec;
use crate::algorithm::Limits;
use crate::{Algorithm, ConfigError};

/// The rules that the living layers of one store use, by name.
///
/// A rule's name is its budget in the store: two layers that share a store and a rule name share
/// that budget. That is useful on purpose (one "api" budget over several routers) and a trap by
/// accident ("default" at 100 per minute on one route and at 2 per minute on another would
/// spend one budget under two quotas). So a layer may only use a name that the store's other
/// living layers use with the same algorithm and numbers; a name is free again once every layer
/// that used it is dropped.
///
/// The memory and Redis stores hold one ([`Store::registry`](super::Store::registry)); a store
/// of your own can hold one too. It sees the layers of one process: replicas that share a Redis
/// must be given the same rules by their configuration.
#[derive(Debug, Default)]
pub struct RuleRegistry {
    rules: Mutex<HashMap<Arc<str>, Entry>>,
}

#[derive(Debug)]
struct Entry {
    algorithm: Algorithm,
    limits: Limits,
    /// The layers that use it; the name is free once all are gone.
    holders: Vec<Weak<()>>,
}

impl RuleRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Replaces the rules that `holder` registered with `rules`, all or none (a layer whose
    /// policy was reloaded): names it no longer uses are released, and the numbers of the names
    /// only it uses may change.
    ///
    /// # Errors
    ///
    /// A rule whose name another living layer uses with another algorithm or other numbers.
    pub fn replace<'a>(
        &self,
        rules: impl IntoIterator<Item = &'a RuleSpec> + Clone,
        holder: &Arc<()>,
    ) -> Result<(), ConfigError> {
        let mut registered = self.rules.lock().unwrap_or_else(|p| p.into_inner());
        let is_holder = |h: &Weak<()>| std::ptr::eq(h.as_ptr(), Arc::as_ptr(holder));
        check_free(&mut registered, rules.clone(), |h| !is_holder(h))?;
        for entry in registered.values_mut() {
            entry
                .holders
                .retain(|h| h.strong_count() > 0 && !is_holder(h));
        }
        registered.retain(|_, entry| !entry.holders.is_empty());
        insert(&mut registered, rules, holder);
        Ok(())
    }

    /// Registers `rules` for the layer that holds `holder`, all or none.
    ///
    /// # Errors
    ///
    /// A rule whose name a living layer uses with another algorithm or other numbers.
    pub fn register<'a>(
        &self,
        rules: impl IntoIterator<Item = &'a RuleSpec> + Clone,
        holder: &Arc<()>,
    ) -> Result<(), ConfigError> {
        let mut registered = self.rules.lock().unwrap_or_else(|p| p.into_inner());
        check_free(&mut registered, rules.clone(), |_| true)?;
        insert(&mut registered, rules, holder);
        Ok(())
    }
}

/// Fails on the first of `rules` whose name a living holder that `counts` uses with another
/// algorithm or other numbers (the holders that are gone are dropped on the way).
fn check_free<'a>(
    registered: &mut HashMap<Arc<str>, Entry>,
    rules: impl IntoIterator<Item = &'a RuleSpec>,
    counts: impl Fn(&Weak<()>) -> bool,
) -> Result<(), ConfigError> {
    for rule in rules {
        let Some(entry) = registered.get_mut(rule.name()) else {
            continue;
        };
        entry.holders.retain(|h| h.strong_count() > 0);
        let others = entry.holders.iter().any(&counts);
        if others && (entry.algorithm != rule.algorithm() || entry.limits != *rule.limits()) {
            return Err(conflict(rule.name()));
        }
    }
    Ok(())
}

fn conflict(name: &str) -> ConfigError {
    ConfigError::in_rule(
        name,
        "another layer of the same store uses this name with another quota or algorithm, and \
         one name is one budget in a store; give this rule another name, or both the same quota",
    )
}

/// Adds `holder` to the entries of `rules` (their numbers are set when no one else holds them).
fn insert<'a>(
    registered: &mut HashMap<Arc<str>, Entry>,
    rules: impl IntoIterator<Item = &'a RuleSpec>,
    holder: &Arc<()>,
) {
    for rule in rules {
        let entry = registered
            .entry(rule.name().into())
            .or_insert_with(|| Entry {
                algorithm: rule.algorithm(),
                limits: *rule.limits(),
                holders: Vec::new(),
            });
        entry.holders.retain(|h| h.strong_count() > 0);
        if entry.holders.is_empty() {
            entry.algorithm = rule.algorithm();
            entry.limits = *rule.limits();
        }
        entry.holders.push(Arc::downgrade(holder));
    }
}
