//! The Lua script: its source, the arguments of one call, and the decoding of its reply.

use redis::{Cmd, ErrorKind, RedisError, ServerErrorKind, Value};

use crate::Algorithm;
use crate::Decision;
use crate::algorithm::{Limits, Outcome};
use crate::store::{Charge, StoreError};

use super::keys;

/// The algorithms, shared by both script variants, in the order they are concatenated.
macro_rules! script_body {
    () => {
        concat!(
            include_str!("common.lua"),
            include_str!("token_bucket.lua"),
            include_str!("gcra.lua"),
            include_str!("fixed_window.lua"),
            include_str!("sliding_log.lua"),
            include_str!("sliding_counter.lua"),
            include_str!("check.lua"),
        )
    };
}

/// The production script: time from the server's `TIME`.
pub(crate) const SERVER_CLOCK_SOURCE: &str =
    concat!(include_str!("clock_server.lua"), script_body!());

/// The script of stores built with an injected clock: time from the arguments.
pub(crate) const ARGUMENT_CLOCK_SOURCE: &str =
    concat!(include_str!("clock_argument.lua"), script_body!());

/// A script and its SHA-1, as `EVALSHA` names it.
#[derive(Clone, Debug)]
pub(crate) struct Script {
    source: &'static str,
    sha: String,
}

impl Script {
    pub(crate) fn new(source: &'static str) -> Self {
        Script {
            source,
            sha: redis::Script::new(source).get_hash().to_owned(),
        }
    }

    /// `SCRIPT LOAD` of this script.
    pub(crate) fn load_command(&self) -> Cmd {
        let mut cmd = redis::cmd("SCRIPT");
        cmd.arg("LOAD").arg(self.source);
        cmd
    }
}

/// What one call of the script does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Check every charge; charge them all when all admit.
    Charge,
    /// Check only.
    Peek,
    /// Give back charges made at the given time (cross-slot compensation).
    Refund(u64),
}

/// One charge, owned: what the script needs, and what decoding its reply needs.
#[derive(Clone, Debug)]
pub(crate) struct Prepared {
    pub(crate) key: String,
    pub(crate) algorithm: Algorithm,
    pub(crate) limits: Limits,
    pub(crate) cost: u64,
}

impl Prepared {
    pub(crate) fn new(prefix: &str, charge: &Charge<'_>) -> Self {
        Prepared {
            key: keys::key_name(prefix, charge.key, charge.rule.name()),
            algorithm: charge.rule.algorithm(),
            limits: *charge.rule.limits(),
            cost: charge.cost,
        }
    }

    /// The Cluster slot of the key.
    pub(crate) fn slot(&self) -> u16 {
        keys::slot(self.key.as_bytes())
    }
}

/// The script's name for an algorithm.
fn code(algorithm: Algorithm) -> &'static str {
    match algorithm {
        Algorithm::TokenBucket => "tb",
        Algorithm::Gcra => "gcra",
        Algorithm::FixedWindow => "fw",
        Algorithm::SlidingWindowLog => "sl",
        Algorithm::SlidingWindowCounter => "sc",
    }
}

/// The `EVALSHA` of `charges` (all in one slot when the server is a cluster).
pub(crate) fn command<'a>(
    script: &Script,
    mode: Mode,
    now: Option<u64>,
    charges: impl ExactSizeIterator<Item = &'a Prepared> + Clone,
) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(&script.sha).arg(charges.len());
    for charge in charges.clone() {
        cmd.arg(&charge.key);
    }
    let (mode, at) = match mode {
        Mode::Charge => ("c", 0),
        Mode::Peek => ("p", 0),
        Mode::Refund(at) => ("r", at),
    };
    cmd.arg(mode).arg(now.unwrap_or(0)).arg(at);
    for charge in charges {
        let l = &charge.limits;
        cmd.arg(code(charge.algorithm))
            .arg(charge.cost)
            .arg(l.limit)
            .arg(l.period)
            .arg(l.burst)
            .arg(l.interval);
    }
    cmd
}

/// What one call answered: the server's time and one outcome per charge.
#[derive(Clone, Debug)]
pub(crate) struct Reply {
    pub(crate) now: u64,
    pub(crate) outcomes: Vec<Outcome>,
}

impl Reply {
    pub(crate) fn allowed(&self) -> bool {
        self.outcomes.iter().all(|o| o.allowed)
    }
}

/// Decodes the reply of a [`Mode::Charge`] or [`Mode::Peek`] call of `charges`.
pub(crate) fn decode<'a>(
    value: Value,
    charges: impl ExactSizeIterator<Item = &'a Prepared>,
) -> Result<Reply, StoreError> {
    let numbers: Vec<i64> = redis::from_redis_value(value)
        .map_err(|e| StoreError::Protocol(format!("the rate-limit script answered {e}")))?;
    let expected = 1 + 5 * charges.len();
    if numbers.len() != expected {
        return Err(StoreError::Protocol(format!(
            "the rate-limit script answered {} numbers, not {expected}",
            numbers.len()
        )));
    }
    let non_negative = |n: i64| {
        u64::try_from(n).map_err(|_| {
            StoreError::Protocol(format!("the rate-limit script answered a negative {n}"))
        })
    };
    let now = non_negative(numbers[0])?;
    let outcomes = charges
        .zip(numbers[1..].chunks_exact(5))
        .map(|(charge, n)| {
            Ok(Outcome {
                allowed: n[0] == 1,
                limit: charge.algorithm.capacity(&charge.limits),
                remaining: non_negative(n[1])?,
                reset: non_negative(n[2])?,
                retry_after: if n[3] == -1 {
                    u64::MAX
                } else {
                    non_negative(n[3])?
                },
                window: non_negative(n[4])?,
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    Ok(Reply { now, outcomes })
}

/// The decision of a request from the outcomes of each of its charges.
pub(crate) fn decision(outcomes: impl IntoIterator<Item = Outcome>) -> Decision {
    Decision::from_outcomes(outcomes)
}

/// Whether an error says the server lost the script (restart, failover, `SCRIPT FLUSH`).
pub(crate) fn is_no_script(error: &RedisError) -> bool {
    error.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
}
