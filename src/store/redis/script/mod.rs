//! tollgate's code on a Redis server, the arguments of one call, and the decoding of its reply.
//!
//! The code is loaded once per server as a function library (Redis 7 and later: `FUNCTION
//! LOAD`, then one `FCALL` per call), so that a call runs only the check it asks for; servers
//! without functions (Redis 6.2, or `FUNCTION` renamed away) get the same code as a script
//! (`EVALSHA`), which defines every algorithm again on each call. One call checks a batch of
//! requests, each all or nothing by itself, with the server's time read once.

mod decode;

pub(crate) use decode::{Decoder, Reply, decode, numbers_of};

use std::borrow::Borrow;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, LazyLock};

use redis::aio::ConnectionLike;
use redis::{ErrorKind, RedisError, RedisResult, ServerErrorKind, Value};
use smallvec::SmallVec;

use super::keys::{self, KeyName};
use super::resp;
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
        self.load_form(conn, Form::Function).await
    }

    /// Loads the code in `form`, or in the script form where the server takes no function.
    async fn load_form<C: ConnectionLike>(&self, conn: &mut C, form: Form) -> RedisResult<Form> {
        let mut form = form;
        loop {
            let reply = conn
                .req_packed_command(&self.load_command(form))
                .await
                .and_then(Value::extract_error);
            match loaded(form, reply) {
                Loaded::Done => return Ok(form),
                Loaded::TryScript => form = Form::Script,
                Loaded::Failed(e) => return Err(e),
            }
        }
    }

    /// The command that loads the code in `form` (`FUNCTION LOAD`, `SCRIPT LOAD`).
    pub(crate) fn load_command(&self, form: Form) -> redis::Cmd {
        let mut cmd = match form {
            Form::Function => redis::cmd("FUNCTION"),
            Form::Script => redis::cmd("SCRIPT"),
        };
        cmd.arg("LOAD").arg(match form {
            Form::Function => &self.library,
            Form::Script => &self.script,
        });
        cmd
    }

    /// Writes the call of `requests` in `form` into `out` as one command: `FCALL` of the
    /// function, or `EVALSHA` of the script; says how its reply is read.
    pub(crate) fn encode<'a, P, I>(
        &self,
        out: &mut Vec<u8>,
        form: Form,
        mode: Mode,
        requests: I,
    ) -> Shape
    where
        P: Borrow<Prepared> + 'a,
        I: Iterator<Item = Request<'a, P>> + Clone,
    {
        use crate::decimal::len as digits;
        use resp::{array, bulk, bulk_integer, decimal};

        let count = requests.clone().count();
        // Batches charge: peeks, refunds, adjustments and resets are of one request.
        debug_assert!(count == 1 || mode == Mode::Charge);
        let single = count == 1 || mode.answers_time_only();
        // A batch of requests of one charge each, on the server's clock, needs no counts.
        let simple = requests
            .clone()
            .all(|r| r.charges.len() == 1 && r.now.is_none());
        // A batch of one charge each, all alike (one rule, one cost): its charge once.
        let shared = (!single && simple)
            .then(|| {
                let mut charges = requests.clone().map(|r| r.charges[0].borrow());
                let first = charges.next()?;
                charges
                    .all(|b| {
                        (first.cost, first.lease, first.give_back) == (b.cost, b.lease, b.give_back)
                            // One rule's charges share its descriptor: no need to read it.
                            && (Arc::ptr_eq(&first.descriptor, &b.descriptor)
                                || first.descriptor == b.descriptor)
                    })
                    .then_some(first)
            })
            .flatten();
        // …of a rule that runs: each key's requests in a row go as one run.
        let runs = shared.is_some_and(Prepared::runs);
        let keys: usize = if runs {
            runs_of(requests.clone().map(|r| r.charges[0].borrow())).count()
        } else {
            requests.clone().map(|r| r.charges.len()).sum()
        };
        let counts = if runs || !single && !simple {
            if runs { keys } else { count }
        } else {
            0
        };
        let charge_args = if shared.is_some() { 1 } else { keys };
        array(out, 4 + keys + counts + charge_args);
        match form {
            Form::Function => {
                bulk(out, b"FCALL");
                bulk(out, self.function.as_bytes());
            }
            Form::Script => {
                bulk(out, b"EVALSHA");
                bulk(out, self.sha.as_bytes());
            }
        }
        bulk_integer(out, keys as u64);
        if runs {
            for (first, _) in runs_of(requests.clone().map(|r| r.charges[0].borrow())) {
                bulk(out, first.key.as_bytes());
            }
        } else {
            for request in requests.clone() {
                for charge in request.charges {
                    bulk(out, charge.borrow().key.as_bytes());
                }
            }
        }
        // The mode: one request ("c", "p", "r<time>", each "@<time>" with an injected clock),
        // or a batch ("b"; "B" with counts; "R" of runs).
        let (letter, time) = match (mode, single) {
            (Mode::Charge, true) => (b'c', None),
            (Mode::Peek, true) => (b'p', None),
            (Mode::Refund(time), _) => (b'r', Some(time)),
            (Mode::Adjust(time), _) => (b'a', Some(time)),
            (Mode::Reset, _) => (b'x', None),
            (_, false) if runs => (b'R', None),
            (_, false) if simple => (b'b', None),
            (_, false) => (b'B', None),
        };
        let at = if single {
            requests.clone().next().and_then(|r| r.now)
        } else {
            None
        };
        let len = 1 + time.map_or(0, digits) + at.map_or(0, |at| 1 + digits(at));
        out.push(b'$');
        decimal(out, len as u64);
        out.extend_from_slice(b"\r\n");
        out.push(letter);
        if let Some(time) = time {
            decimal(out, time);
        }
        if let Some(at) = at {
            out.push(b'@');
            decimal(out, at);
        }
        out.extend_from_slice(b"\r\n");
        if let Some(shared) = shared {
            charge_argument(out, shared);
            if runs {
                for (_, run) in runs_of(requests.map(|r| r.charges[0].borrow())) {
                    bulk_integer(out, run as u64);
                }
                return Shape::Runs;
            }
            return Shape::Each;
        }
        for request in requests {
            if counts > 0 {
                let n = request.charges.len() as u64;
                let len = digits(n) + request.now.map_or(0, |at| 1 + digits(at));
                out.push(b'$');
                decimal(out, len as u64);
                out.extend_from_slice(b"\r\n");
                decimal(out, n);
                if let Some(at) = request.now {
                    out.push(b'@');
                    decimal(out, at);
                }
                out.extend_from_slice(b"\r\n");
            }
            for charge in request.charges {
                charge_argument(out, charge.borrow());
            }
        }
        Shape::Each
    }

    /// After an answer that says the code did not run ([`not_run`]): loads it again, in the
    /// form the server takes, and says which.
    pub(crate) async fn reload<C: ConnectionLike>(
        &self,
        conn: &mut C,
        form: &ServerForm,
        error: &RedisError,
    ) -> RedisResult<Form> {
        let loaded = self.load_form(conn, reload_form(form.get(), error)).await?;
        form.set(loaded);
        Ok(loaded)
    }
}

/// The form to load after `error` said the code did not run on a server last seen running
/// `current`: the script form when the server has no `FCALL`, else the form it lost.
pub(crate) fn reload_form(current: Form, error: &RedisError) -> Form {
    match (current, unknown_command(error)) {
        (Form::Function, true) | (Form::Script, _) => Form::Script,
        (Form::Function, false) => Form::Function,
    }
}

/// What a server's answer to loading the code in some form means.
pub(crate) enum Loaded {
    /// Loaded (or already there).
    Done,
    /// No functions, or an account not allowed to load them: the script form instead.
    TryScript,
    Failed(RedisError),
}

/// What `reply` (error answers as errors) to loading the code in `form` means.
pub(crate) fn loaded(form: Form, reply: RedisResult<Value>) -> Loaded {
    match (form, reply) {
        (_, Ok(_)) => Loaded::Done,
        (Form::Function, Err(e)) if already_loaded(&e) => Loaded::Done,
        (Form::Function, Err(e)) if unknown_command(&e) || no_permission(&e) => Loaded::TryScript,
        (_, Err(e)) => Loaded::Failed(e),
    }
}

/// How the reply of a call is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shape {
    /// Four numbers per charge (five for a lease).
    Each,
    /// Per run of requests of one key in a row: see [`Decoder::next_of_run`].
    Runs,
}

/// Appends one charge's argument: `<descriptor><cost>:<lease>[:<units>@<at>]`.
fn charge_argument(out: &mut Vec<u8>, charge: &Prepared) {
    use crate::decimal::len as digits;
    use resp::decimal;

    let mut len = charge.descriptor.len() + digits(charge.cost) + 1 + digits(charge.lease);
    if let Some((units, at)) = charge.give_back {
        len += 2 + digits(units) + digits(at);
    }
    out.push(b'$');
    decimal(out, len as u64);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(charge.descriptor.as_bytes());
    decimal(out, charge.cost);
    out.push(b':');
    decimal(out, charge.lease);
    if let Some((units, at)) = charge.give_back {
        out.push(b':');
        decimal(out, units);
        out.push(b'@');
        decimal(out, at);
    }
    out.extend_from_slice(b"\r\n");
}

/// The runs of `charges`: each charge that starts one (its key differs from the one before)
/// and how many charges in a row have its key.
pub(crate) fn runs_of<'a>(
    charges: impl Iterator<Item = &'a Prepared> + Clone,
) -> impl Iterator<Item = (&'a Prepared, usize)> {
    let mut rest = charges.peekable();
    std::iter::from_fn(move || {
        let first = rest.next()?;
        let mut run = 1;
        while rest.next_if(|next| next.key == first.key).is_some() {
            run += 1;
        }
        Some((first, run))
    })
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
#[derive(Debug)]
pub(crate) struct Request<'a, P> {
    pub(crate) now: Option<u64>,
    pub(crate) charges: &'a [P],
}

impl<P> Clone for Request<'_, P> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<P> Copy for Request<'_, P> {}

/// The charges of one check, held inline when there is one (most checks): the check's one
/// allocation holds them with its reply (see `late_reply`).
pub(crate) type Charges = smallvec::SmallVec<[Prepared; 1]>;

/// One charge, owned: what the code needs, and what decoding its reply needs.
#[derive(Clone, Debug)]
pub(crate) struct Prepared {
    pub(crate) key: KeyName,
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
    /// The charge of a whole key.
    pub(crate) fn new(prefix: &str, charge: &Charge<'_>) -> Self {
        let (whole, _) = charge.rule.wire();
        Self::of(prefix, charge, None, *charge.rule.limits(), whole)
    }

    /// The charge of a split rule's sub-key `part`.
    pub(crate) fn of_part(prefix: &str, charge: &Charge<'_>, part: u16) -> Self {
        let (_, sub_key) = charge.rule.wire();
        Self::of(
            prefix,
            charge,
            Some(part),
            *charge.rule.part_limits(),
            sub_key,
        )
    }

    /// The charge of the whole key or of sub-key `part`, with its limits and their descriptor.
    fn of(
        prefix: &str,
        charge: &Charge<'_>,
        part: Option<u16>,
        limits: Limits,
        descriptor: &Arc<str>,
    ) -> Self {
        Prepared {
            key: KeyName::new(prefix, charge.key, part, charge.rule.name()),
            algorithm: charge.rule.algorithm(),
            limits,
            descriptor: descriptor.clone(),
            cost: charge.cost,
            lease: 0,
            give_back: None,
        }
    }

    /// Whether requests of this charge in a row on one key go as one run ("R"): an algorithm
    /// whose state is one number, no lease, no give-back, a cost within the capacity.
    pub(crate) fn runs(&self) -> bool {
        matches!(self.algorithm, Algorithm::TokenBucket | Algorithm::Gcra)
            && self.lease == 0
            && self.give_back.is_none()
            && self.cost <= self.algorithm.capacity(&self.limits)
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
