//! [`RuleMode`]: whether a rule denies, only watches, or makes a request wait.

use std::time::Duration;

/// What a rule does with a request over its limit.
///
/// ```
/// use std::time::Duration;
/// use tollgate::{Quota, Rule, RuleMode};
///
/// let dark_launch = Rule::new("new-limit", Quota::per_minute(10)).shadow();
/// assert_eq!(dark_launch.mode(), RuleMode::Shadow);
/// let smoothed = Rule::new("smooth", Quota::per_second(5)).delay(Duration::from_secs(2));
/// assert_eq!(smoothed.mode(), RuleMode::Delay { max: Duration::from_secs(2) });
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RuleMode {
    /// Denies it (the default).
    #[default]
    Enforce,
    /// Admits it, and says that the rule would have denied it (a `tracing` event at `info`,
    /// target `tollgate::shadow`). The rule is checked and charged as if it were enforced, so
    /// its budget is what it would be in force; it adds no budget fields to answers, and never
    /// makes another rule's charge fail. How teams roll out a new limit.
    Shadow,
    /// Makes it wait until its budget should be there, then checks it again, and lets it
    /// through when admitted: bursts are smoothed at the cost of latency. A request that would
    /// wait longer than `max` (counted from its first denial) is denied at once, as by
    /// [`Enforce`](RuleMode::Enforce). Waiting requests hold no reservation: several that wait
    /// for the same unit wake together and one takes it, the others wait again while `max`
    /// allows, and are denied when it runs out. The wait holds no lock and no store connection,
    /// ends when the request is cancelled, needs tokio's timer (without a runtime the request is
    /// denied), and the number of requests waiting in one layer is bounded
    /// ([`max_waiting`](crate::RateLimitLayerBuilder::max_waiting)).
    Delay {
        /// The longest a request waits.
        max: Duration,
    },
}
