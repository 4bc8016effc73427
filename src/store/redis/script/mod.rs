//! tollgate's code on a Redis server, the arguments of one call, and the decoding of its reply.
//!
//! The code is loaded once per server as a function library (Redis 7 and later: `FUNCTION
//! LOAD`, then one `FCALL` per call), so that a call runs only the check it asks for; servers
//! without functions (Redis 6.2, or `FUNCTION` renamed away) get the same code as a script
//! (`EVALSHA`), which defines every algorithm again on each call. One call checks a batch of
//! requests, each all or nothing by itself, with the server's time read once.

use std::borrow::Borrow;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, LazyLock};

use redis::aio::ConnectionLike;
use redis::{Cmd, ErrorKind, RedisError, RedisResult, ServerErrorKind, Value};
use smallvec::SmallVec;

use super::keys;
use crate::Algorithm;
use crate::algorithm::{Limits, Outcome};
use crate::store::{Charge, StoreError};

/// The algorithms and the check, shared by every form of the code, in the order they are
/// concatenated.
macro_rules! body {
    () => {
        concat!(
            include_str!("common.lua"),
            include_str!("token_bucket.lua"),
            include_str!("gcra.lua"),
            include_str!("fixed_window.lua"),
            include_str!("sliding_log.lua"),
            include_str!("concurrency.lua"),
            include_str!("sliding_counter.lua"),
            include_str!("check.lua"),
        )
    };
}

/// The code with the server's `TIME` as its clock.
const SERVER_CLOCK_BODY: &str = concat!(include_str!("clock_server.lua"), body!());

/// The code of stores built with an injected clock: each request brings its time.
const ARGUMENT_CLOCK_BODY: &str = concat!(include_str!("clock_argument.lua"), body!());

/// The production code: the server's `TIME`.
pub(crate) static SERVER_CLOCK: LazyLock<Program> =
    LazyLock::new(|| Program::new(SERVER_CLOCK_BODY));

/// The code of stores built with an injected clock (tests and simulations).
pub(crate) static ARGUMENT_CLOCK: LazyLock<Program> =
    LazyLock::new(|| Program::new(ARGUMENT_CLOCK_BODY));

/// One version of tollgate's code, in both forms: a function library and a script.
#[derive(Debug)]
pub(crate) struct Program {
    /// `FUNCTION LOAD`'s argument: the library `tollgate_<sha>`, which registers the function
    /// of the same name. Names carry the code's hash, so that replicas of two versions of
    /// tollgate never replace each other's code during a rolling upgrade.
    library: String,
    function: String,
    /// The script form and its SHA-1, for `EVALSHA`.
    script: String,
    sha: String,
}

impl Program {
    fn new(body: &'static str) -> Self {
        let hash = redis::Script::new(body).get_hash().to_owned();
        let function = format!("tollgate_{}", &hash[..16]);
        let library = format!(
            "#!lua name={function}\n{body}\nredis.register_function('{function}', check)\n"
        );
        let script = format!(
            "{}{body}\nreturn check(KEYS, ARGV)\n",
            include_str!("eval_prelude.lua")
        );
        let sha = redis::Script::new(&script).get_hash().to_owned();
        Program {
            library,
            function,
            script,
            sha,
        }
    }

    /// The script form's source.
    pub(crate) fn script_source(&self) -> &str {
        &self.script
    }

    /// The function library's source.
    pub(crate) fn library_source(&self) -> &str {
        &self.library
    }

    /// The name of the function to `FCALL`.
    pub(crate) fn function_name(&self) -> &str {
        &self.function
    }

    /// Loads the code on a server: the function library, or the script where the server has no
    /// functions. Says which form the server runs.
    pub(crate) async fn load<C: ConnectionLike>(&self, conn: &mut C) -> RedisResult<Form> {
        let mut cmd = redis::cmd("FUNCTION");
        cmd.arg("LOAD").arg(&self.library);
        match cmd.query_async::<Value>(conn).await {
            Ok(_) => Ok(Form::Function),
            Err(e) if already_loaded(&e) => Ok(Form::Function),
            // No functions, or an account not allowed to load them: the script form.
            Err(e) if unknown_command(&e) || no_permission(&e) => {
                self.load_script(conn).await?;
                Ok(Form::Script)
            }
            Err(e) => Err(e),
        }
    }

    async fn load_script<C: ConnectionLike>(&self, conn: &mut C) -> RedisResult<()> {
        let mut cmd = redis::cmd("SCRIPT");
        cmd.arg("LOAD").arg(&self.script);
        cmd.query_async::<Value>(conn).await.map(drop)
    }

    /// The call of `requests` in `form`: `FCALL` of the function, or `EVALSHA` of the script.
    pub(crate) fn command<P: Borrow<Prepared>>(
        &self,
        form: Form,
        mode: Mode,
        requests: &[Request<'_, P>],
    ) -> Cmd {
        // Batches charge: peeks, refunds, adjustments and resets are of one request.
        debug_assert!(requests.len() == 1 || mode == Mode::Charge);
        let mut cmd = match form {
            Form::Function => {
                let mut cmd = redis::cmd("FCALL");
                cmd.arg(&self.function);
                cmd
            }
            Form::Script => {
                let mut cmd = redis::cmd("EVALSHA");
                cmd.arg(&self.sha);
                cmd
            }
        };
        let keys: usize = requests.iter().map(|r| r.charges.len()).sum();
        cmd.arg(keys);
        for request in requests {
            for charge in request.charges {
                cmd.arg(&charge.borrow().key);
            }
        }
        // The mode: one request ("c", "p", "r<time>", each "@<time>" with an injected clock),
        // or a batch ("b", each request led by its count).
        let mut text = String::with_capacity(64);
        let at = |text: &mut String, now: Option<u64>| {
            if let Some(now) = now {
                let _ = write!(text, "@{now}");
            }
        };
        let single = requests.len() == 1 || mode.answers_time_only();
        // A batch of requests of one charge each, on the server's clock, needs no counts.
        let simple = requests
            .iter()
            .all(|r| r.charges.len() == 1 && r.now.is_none());
        match (mode, single) {
            (Mode::Charge, true) => text.push('c'),
            (Mode::Peek, true) => text.push('p'),
            (Mode::Refund(time), _) => {
                let _ = write!(text, "r{time}");
            }
            (Mode::Adjust(time), _) => {
                let _ = write!(text, "a{time}");
            }
            (Mode::Reset, _) => text.push('x'),
            (_, false) if simple => text.push('b'),
            (_, false) => text.push('B'),
        }
        if single {
            at(&mut text, requests.first().and_then(|r| r.now));
        }
        cmd.arg(text.as_str());
        // A batch of one charge each, all alike (one rule, one cost): its charge once.
        let alike = !single
            && simple
            && requests.windows(2).all(|pair| {
                let (a, b) = (pair[0].charges[0].borrow(), pair[1].charges[0].borrow());
                (a.cost, a.lease, a.give_back, &a.descriptor)
                    == (b.cost, b.lease, b.give_back, &b.descriptor)
            });
        for request in requests {
            if !single && !simple {
                text.clear();
                let _ = write!(text, "{}", request.charges.len());
                at(&mut text, request.now);
                cmd.arg(text.as_str());
            }
            for charge in request.charges {
                let charge = charge.borrow();
                text.clear();
                text.push_str(&charge.descriptor);
                keys::push_integer(&mut text, charge.cost);
                text.push(':');
                keys::push_integer(&mut text, charge.lease);
                if let Some((units, at)) = charge.give_back {
                    text.push(':');
                    keys::push_integer(&mut text, units);
                    text.push('@');
                    keys::push_integer(&mut text, at);
                }
                cmd.arg(text.as_str());
                if alike {
                    return cmd;
                }
            }
        }
        cmd
    }

    /// Sends `requests` on `conn` in the server's form (`form`, updated when the server says
    /// otherwise): once, and again only when the server answered that the code did not run
    /// (it lost it in a restart, a failover or a flush; or it has no functions after all).
    pub(crate) async fn call<C: ConnectionLike, P: Borrow<Prepared>>(
        &self,
        conn: &mut C,
        form: &ServerForm,
        mode: Mode,
        requests: &[Request<'_, P>],
    ) -> RedisResult<Value> {
        let result = self
            .command(form.get(), mode, requests)
            .query_async::<Value>(conn)
            .await;
        match result {
            Err(e) if not_run(&e) => {
                let loaded = self.reload(conn, form, &e).await?;
                self.command(loaded, mode, requests)
                    .query_async::<Value>(conn)
                    .await
            }
            result => result,
        }
    }

    /// After an answer that says the code did not run ([`not_run`]): loads it again, in the
    /// form the server takes, and says which.
    pub(crate) async fn reload<C: ConnectionLike>(
        &self,
        conn: &mut C,
        form: &ServerForm,
        error: &RedisError,
    ) -> RedisResult<Form> {
        let loaded = match (form.get(), unknown_command(error)) {
            // No FCALL here: the script form from now on.
            (Form::Function, true) | (Form::Script, _) => {
                self.load_script(conn).await?;
                Form::Script
            }
            (Form::Function, false) => self.load(conn).await?,
        };
        form.set(loaded);
        Ok(loaded)
    }
}

/// Which form of the code a server runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Form {
    /// `FCALL` (Redis 7 and later).
    Function,
    /// `EVALSHA`.
    Script,
}

/// The form a server was last seen to run (functions until it says otherwise).
#[derive(Debug, Default)]
pub(crate) struct ServerForm(AtomicU8);

impl ServerForm {
    pub(crate) fn get(&self) -> Form {
        match self.0.load(Ordering::Relaxed) {
            1 => Form::Script,
            _ => Form::Function,
        }
    }

    pub(crate) fn set(&self, form: Form) {
        self.0.store(
            match form {
                Form::Function => 0,
                Form::Script => 1,
            },
            Ordering::Relaxed,
        );
    }
}

/// Whether an answer says the code did not run: the server has no such function or script, or
/// no `FCALL` at all.
pub(crate) fn not_run(error: &RedisError) -> bool {
    is_no_script(error) || unknown_command(error) || function_not_found(error)
}

fn is_no_script(error: &RedisError) -> bool {
    error.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
}

fn function_not_found(error: &RedisError) -> bool {
    error.code() == Some("ERR")
        && error
            .detail()
            .is_some_and(|d| d.starts_with("Function not found"))
}

fn unknown_command(error: &RedisError) -> bool {
    error.code() == Some("ERR")
        && error
            .detail()
            .is_some_and(|d| d.starts_with("unknown command"))
}

fn no_permission(error: &RedisError) -> bool {
    error.code() == Some("NOPERM")
}

fn already_loaded(error: &RedisError) -> bool {
    error.detail().is_some_and(|d| d.contains("already exists"))
}

/// What one call does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Check every charge of each request; charge them all when all admit.
    Charge,
    /// Check only.
    Peek,
    /// Give back charges made at the given time (cross-slot compensation).
    Refund(u64),
    /// Adjust charges made at the given time: each charge's lease field says how (1 charge
    /// `cost` more whatever the budget, 0 give `cost` back).
    Adjust(u64),
    /// Forget the keys.
    Reset,
}

impl Mode {
    /// Whether the call answers only its time.
    pub(crate) fn answers_time_only(self) -> bool {
        matches!(self, Mode::Refund(_) | Mode::Adjust(_) | Mode::Reset)
    }
}

/// The charges that carry `adjustments`, grouped by the time they change (one call each).
pub(crate) fn adjustments(
    prefix: &str,
    adjustments: &[crate::store::Adjustment<'_>],
) -> Vec<(u64, Vec<Prepared>)> {
    let mut calls: Vec<(u64, Vec<Prepared>)> = Vec::new();
    for a in adjustments {
        let mut prepared = Prepared::new(
            prefix,
            &Charge {
                rule: a.rule,
                key: a.key,
                cost: 0,
            },
        );
        (prepared.cost, prepared.lease) = match a.change {
            crate::store::Change::Charge(units) => (units, 1),
            crate::store::Change::Refund(units) => (units, 0),
        };
        match calls.iter_mut().find(|(at, _)| *at == a.charged_at) {
            Some((_, charges)) => charges.push(prepared),
            None => calls.push((a.charged_at, vec![prepared])),
        }
    }
    calls
}

/// One request of a call: its time (with an injected clock) and its charges.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Request<'a, P> {
    pub(crate) now: Option<u64>,
    pub(crate) charges: &'a [P],
}

/// One charge, owned: what the code needs, and what decoding its reply needs.
#[derive(Clone, Debug)]
pub(crate) struct Prepared {
    pub(crate) key: String,
    pub(crate) algorithm: Algorithm,
    pub(crate) limits: Limits,
    /// `<algorithm>:<limit>:<period>:<burst>:<interval>:`, the start of the charge's argument.
    pub(crate) descriptor: Arc<str>,
    pub(crate) cost: u64,
    /// 0: charge `cost`; n > 0: take every unit there is up to n, at least `cost`.
    pub(crate) lease: u64,
    /// Units of a fixed or sliding-counter window leased here that expired unspent, and when
    /// they were charged: given back into that window (if it still counts) before the charge.
    pub(crate) give_back: Option<(u64, u64)>,
}

impl Prepared {
    pub(crate) fn new(prefix: &str, charge: &Charge<'_>) -> Self {
        Prepared {
            key: keys::key_name(prefix, charge.key, charge.rule.name()),
            algorithm: charge.rule.algorithm(),
            limits: *charge.rule.limits(),
            descriptor: charge.rule.wire().0.clone(),
            cost: charge.cost,
            lease: 0,
            give_back: None,
        }
    }

    /// The same charge, of a split rule's sub-key `part`.
    pub(crate) fn of_part(mut self, prefix: &str, charge: &Charge<'_>, part: u16) -> Self {
        self.key = keys::part_key_name(prefix, charge.key, Some(part), charge.rule.name());
        self.limits = *charge.rule.part_limits();
        self.descriptor = charge.rule.wire().1.clone();
        self
    }

    /// The Cluster slot of the key.
    pub(crate) fn slot(&self) -> u16 {
        keys::slot(self.key.as_bytes())
    }
}

/// The start of a charge's argument for a rule with these numbers:
/// `<algorithm>:<limit>:<period>:<burst>:<interval>:` (the rule keeps it, made once).
pub(crate) fn wire(algorithm: Algorithm, limits: &Limits) -> Arc<str> {
    format!(
        "{}:{}:{}:{}:{}:",
        code(algorithm),
        limits.limit,
        limits.period,
        limits.burst,
        limits.interval
    )
    .into()
}

/// The code's name for an algorithm.
fn code(algorithm: Algorithm) -> &'static str {
    match algorithm {
        Algorithm::TokenBucket => "tb",
        Algorithm::Gcra => "gcra",
        Algorithm::FixedWindow => "fw",
        Algorithm::SlidingWindowLog => "sl",
        Algorithm::Concurrency => "cc",
        Algorithm::SlidingWindowCounter => "sc",
    }
}

/// What one call answered for one request: the server's time, one outcome per charge, and the
/// units each charge took.
#[derive(Clone, Debug)]
pub(crate) struct Reply {
    pub(crate) now: u64,
    pub(crate) outcomes: SmallVec<[Outcome; 2]>,
    /// The units each charge took: its cost when admitted, up to its lease for a lease.
    pub(crate) taken: SmallVec<[u64; 2]>,
    /// The time of each charge, when they were made by several calls (a cluster's slots).
    pub(crate) times: Option<Box<[u64]>>,
}

impl Reply {
    pub(crate) fn allowed(&self) -> bool {
        self.outcomes.iter().all(|o| o.allowed)
    }
}

/// The items of a reply: an array (of integers, read one by one with [`integer`]).
fn items(value: &Value) -> Result<&[Value], StoreError> {
    match value {
        Value::Array(items) => Ok(items),
        other => Err(StoreError::Protocol(format!(
            "the rate-limit code answered {other:?}, not an array of integers"
        ))),
    }
}

/// One item of a reply, an integer.
fn integer(item: &Value) -> Result<i64, StoreError> {
    match item {
        Value::Int(n) => Ok(*n),
        other => Err(StoreError::Protocol(format!(
            "the rate-limit code answered {other:?}, not an integer"
        ))),
    }
}

/// Decodes the reply of a [`Mode::Charge`] or [`Mode::Peek`] call of `requests`: the call's
/// time, then four numbers per charge (five for a lease).
pub(crate) fn decode<P: Borrow<Prepared>>(
    value: Value,
    requests: &[Request<'_, P>],
) -> Result<Vec<Reply>, StoreError> {
    let numbers = items(&value)?;
    let per_charge = |p: &Prepared| if p.lease > 0 { 5 } else { 4 };
    let expected: usize = 1 + requests
        .iter()
        .flat_map(|r| r.charges.iter())
        .map(|p| per_charge(p.borrow()))
        .sum::<usize>();
    if numbers.len() != expected {
        return Err(StoreError::Protocol(format!(
            "the rate-limit code answered {} numbers, not {expected}",
            numbers.len()
        )));
    }
    let unsigned = |n: i64| {
        u64::try_from(n).map_err(|_| {
            StoreError::Protocol(format!("the rate-limit code answered a negative {n}"))
        })
    };
    let non_negative = |item: &Value| unsigned(integer(item)?);
    let now = non_negative(&numbers[0])?;
    let mut rest = &numbers[1..];
    let mut replies = Vec::with_capacity(requests.len());
    for request in requests {
        let mut outcomes = SmallVec::with_capacity(request.charges.len());
        let mut taken = SmallVec::with_capacity(request.charges.len());
        for charge in request.charges {
            let charge = charge.borrow();
            let (n, tail) = rest.split_at(per_charge(charge));
            rest = tail;
            let retry_after = match integer(&n[2])? {
                -1 => u64::MAX,
                retry => unsigned(retry)?,
            };
            outcomes.push(Outcome {
                allowed: retry_after == 0,
                limit: charge.algorithm.capacity(&charge.limits),
                remaining: non_negative(&n[0])?,
                reset: non_negative(&n[1])?,
                retry_after,
                window: non_negative(&n[3])?,
            });
            taken.push(match n.get(4) {
                Some(taken) => non_negative(taken)?,
                None if retry_after == 0 => charge.cost,
                None => 0,
            });
        }
        replies.push(Reply {
            now: request.now.unwrap_or(now),
            outcomes,
            taken,
            times: None,
        });
    }
    Ok(replies)
}
