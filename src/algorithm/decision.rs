//! [`Decision`]: what a store decided for one request.

use smallvec::SmallVec;

use crate::algorithm::{MICROS_PER_SECOND, Outcome};

/// The verdict on one request: one [`Outcome`] per rule checked, in the order the rules were
/// given to the store. The request is admitted only when every rule admits it.
///
/// ```
/// use tollgate::Decision;
/// use tollgate::algorithm::Outcome;
///
/// let decision = Decision::from_outcomes([
///     Outcome { allowed: true, limit: 10, remaining: 9, reset: 100_000, retry_after: 0, window: 100_000 },
///     Outcome { allowed: false, limit: 1000, remaining: 0, reset: 3_600_000_000, retry_after: 1_500_000, window: 1_500_000 },
/// ]);
/// assert!(!decision.allowed());
/// assert_eq!(decision.retry_after_micros(), Some(1_500_000));
/// assert_eq!(decision.retry_after_seconds(), Some(2)); // rounded up, never 0
/// ```
#[derive(Clone, Debug, Default)]
pub struct Decision {
    outcomes: SmallVec<[Outcome; 2]>,
    source: DecisionSource,
    /// When it was made, on the store's clock (0: not known).
    made_at: u64,
    /// When each outcome's charge was made, when they differ (a cluster's nodes, each on its
    /// own clock). Boxed twice so that the field is one word: a decision of 128 bytes is moved
    /// without a call to `memcpy`, and it moves several times on every request.
    times: Option<Box<Box<[u64]>>>,
}

/// Two decisions are equal when their outcomes are: where they were made does not change them.
impl PartialEq for Decision {
    fn eq(&self, other: &Self) -> bool {
        self.outcomes == other.outcomes
    }
}

impl Eq for Decision {}

/// Where a [`Decision`] was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DecisionSource {
    /// By the store (the default).
    #[default]
    Store,
    /// By a remote store's local deny cache: the store denied these keys moments ago, and
    /// would until the retry-after it computed.
    DenyCache,
    /// From units a remote store leased to this replica.
    Lease,
}

impl Decision {
    /// A decision made of these outcomes.
    pub fn from_outcomes(outcomes: impl IntoIterator<Item = Outcome>) -> Self {
        Decision {
            outcomes: outcomes.into_iter().collect(),
            source: DecisionSource::Store,
            made_at: 0,
            times: None,
        }
    }

    /// A decision made of these outcomes, moved in as they are (no collecting).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn of_outcomes(outcomes: SmallVec<[Outcome; 2]>) -> Self {
        Decision {
            outcomes,
            source: DecisionSource::Store,
            made_at: 0,
            times: None,
        }
    }

    /// A decision on one rule.
    #[inline]
    pub fn single(outcome: Outcome) -> Self {
        Self::single_at(outcome, 0)
    }

    /// The decision of one rule made at `micros` on the store's clock, built in place (the
    /// memory store's every decision).
    pub(crate) fn single_at(outcome: Outcome, micros: u64) -> Self {
        Decision {
            outcomes: SmallVec::from_buf_and_len([outcome, Outcome::default()], 1),
            source: DecisionSource::Store,
            made_at: micros,
            times: None,
        }
    }

    /// The same decision, made at `source`.
    pub fn made_by(mut self, source: DecisionSource) -> Self {
        self.source = source;
        self
    }

    /// Where the decision was made.
    pub fn source(&self) -> DecisionSource {
        self.source
    }

    /// The same decision, made at `micros` on the store's clock.
    pub fn made_at_time(mut self, micros: u64) -> Self {
        self.made_at = micros;
        self
    }

    /// When the decision was made, in microseconds on the store's clock (0 when the store did
    /// not say): what [`Adjustment::charged_at`](crate::store::Adjustment::charged_at) takes.
    pub fn made_at(&self) -> u64 {
        self.made_at
    }

    /// The same decision, its `i`-th charge made at `times[i]` (stores whose charges of one
    /// request are made on several clocks: the nodes of a cluster).
    pub fn charged_at_times(mut self, times: impl Into<Box<[u64]>>) -> Self {
        self.times = Some(Box::new(times.into()));
        self
    }

    /// When the charge of the `i`-th outcome was made, on its store's clock:
    /// [`made_at`](Decision::made_at) unless the store said otherwise.
    pub fn charged_at(&self, i: usize) -> u64 {
        self.times
            .as_ref()
            .and_then(|times| times.get(i).copied())
            .unwrap_or(self.made_at)
    }

    /// Adds the outcome of the next rule.
    pub fn push(&mut self, outcome: Outcome) {
        self.outcomes.push(outcome);
    }

    /// Whether every rule admits the request (true when no rule applied).
    #[inline]
    pub fn allowed(&self) -> bool {
        self.outcomes.iter().all(|o| o.allowed)
    }

    /// The outcome of each rule, in order.
    #[inline]
    pub fn outcomes(&self) -> &[Outcome] {
        &self.outcomes
    }

    /// The outcome of the `i`-th rule, to change (a charge settled after the response).
    pub(crate) fn outcome_mut(&mut self, i: usize) -> Option<&mut Outcome> {
        self.outcomes.get_mut(i)
    }

    /// For a denied request, microseconds until every denying rule would admit it; `None` when
    /// admitted or when it can never be admitted (a cost above a rule's capacity).
    pub fn retry_after_micros(&self) -> Option<u64> {
        let wait = self
            .outcomes
            .iter()
            .filter(|o| !o.allowed)
            .map(|o| o.retry_after)
            .max()?;
        (wait != u64::MAX).then_some(wait)
    }

    /// [`retry_after_micros`](Decision::retry_after_micros) in whole seconds, rounded up and at
    /// least 1: the value of `Retry-After`.
    pub fn retry_after_seconds(&self) -> Option<u64> {
        self.retry_after_micros()
            .map(|micros| micros.div_ceil(MICROS_PER_SECOND).max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::Decision;
    use crate::algorithm::Outcome;

    #[test]
    fn a_decision_fits_in_128_bytes_and_keeps_the_times_of_a_clusters_charges() {
        // Larger, and every move of a decision on the request path is a call to `memcpy`.
        assert!(std::mem::size_of::<Decision>() <= 128);
        let decision = Decision::from_outcomes([Outcome::default(), Outcome::default()])
            .made_at_time(5)
            .charged_at_times(vec![7, 9]);
        assert_eq!(
            (0..3).map(|i| decision.charged_at(i)).collect::<Vec<_>>(),
            [7, 9, 5]
        );
    }
}
