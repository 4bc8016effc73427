//! Reading a call's reply: the integers of each request's outcomes, in the order the call
//! wrote its requests, runs of one hot key included.

use super::*;

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

/// The numbers a [`Mode::Charge`] or [`Mode::Peek`] call answers for `charges`: four per
/// charge, five for a lease.
pub(crate) fn numbers_of<P: Borrow<Prepared>>(charges: &[P]) -> usize {
    charges
        .iter()
        .map(|p| if p.borrow().lease > 0 { 5 } else { 4 })
        .sum()
}

fn unsigned(n: i64) -> Result<u64, StoreError> {
    u64::try_from(n)
        .map_err(|_| StoreError::Protocol(format!("the rate-limit code answered a negative {n}")))
}

/// Reads the reply of a [`Mode::Charge`] or [`Mode::Peek`] call, request after request: the
/// call's time, then four numbers per charge (five for a lease).
pub(crate) struct Decoder<'a> {
    now: u64,
    rest: &'a [i64],
    /// The run being read, of a call of runs ([`Shape::Runs`]).
    run: Option<Run>,
}

/// The answers of one run: `admitted` requests in a row admitted, the first of them answered
/// `first` (remaining, reset, window), then the others denied, answered `denied`.
struct Run {
    left: usize,
    index: u64,
    admitted: u64,
    first: [u64; 3],
    denied: Outcome,
}

impl<'a> Decoder<'a> {
    /// The reply `numbers` of a call whose charges answer `expected` numbers in all
    /// ([`numbers_of`]).
    pub(crate) fn new(numbers: &'a [i64], expected: usize) -> Result<Self, StoreError> {
        if numbers.len() != 1 + expected {
            return Err(StoreError::Protocol(format!(
                "the rate-limit code answered {} numbers, not {}",
                numbers.len(),
                1 + expected
            )));
        }
        Ok(Decoder {
            now: unsigned(numbers[0])?,
            rest: &numbers[1..],
            run: None,
        })
    }

    /// The reply `numbers` of a call of runs ([`Shape::Runs`]) of `runs` requests each: the
    /// numbers of each run are counted before any is read.
    pub(crate) fn of_runs(numbers: &'a [i64], runs: &[usize]) -> Result<Self, StoreError> {
        let mut at = 1;
        for &run in runs {
            let admitted = numbers.get(at).copied().map(unsigned).transpose()?;
            let Some(admitted) = admitted.filter(|&admitted| admitted <= run as u64) else {
                return Err(StoreError::Protocol(format!(
                    "the rate-limit code answered no run of {run} requests at number {at}"
                )));
            };
            at += 1 + if admitted > 0 { 3 } else { 0 } + if admitted < run as u64 { 4 } else { 0 };
        }
        if at != numbers.len() {
            return Err(StoreError::Protocol(format!(
                "the rate-limit code answered {} numbers, not {at}",
                numbers.len()
            )));
        }
        Ok(Decoder {
            now: unsigned(numbers[0])?,
            rest: &numbers[1..],
            run: None,
        })
    }

    /// The next `n` numbers of the reply.
    fn take(&mut self, n: usize) -> Result<&'a [i64], StoreError> {
        if self.rest.len() < n {
            return Err(StoreError::Protocol(
                "the rate-limit code answered too few numbers".into(),
            ));
        }
        let (taken, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(taken)
    }

    /// The reply of the next request of a call of runs: of `charge`, in a run of `run`
    /// requests in a row of its key (the numbers of a run are read by its first request).
    /// A run answers the number admitted, the first admitted request's remaining, reset and
    /// window, the first denied request's four numbers: at one time, each later request
    /// admitted has `cost` less remaining and a reset `cost` intervals later (a token bucket's
    /// and GCRA's state moves by `cost` intervals per request), and each later one denied
    /// the same numbers (a denial changes nothing).
    pub(crate) fn next_of_run(
        &mut self,
        charge: &Prepared,
        run: usize,
    ) -> Result<Reply, StoreError> {
        let limit = charge.algorithm.capacity(&charge.limits);
        if self.run.as_ref().is_none_or(|r| r.left == 0) {
            let admitted = unsigned(self.take(1)?[0])?;
            if admitted > run as u64 {
                return Err(StoreError::Protocol(format!(
                    "the rate-limit code admitted {admitted} requests of a run of {run}"
                )));
            }
            let mut first = [0; 3];
            if admitted > 0 {
                for (value, &n) in first.iter_mut().zip(self.take(3)?) {
                    *value = unsigned(n)?;
                }
            }
            let mut denied = Outcome::default();
            if admitted < run as u64 {
                let n = self.take(4)?;
                denied = Outcome {
                    allowed: false,
                    limit,
                    remaining: unsigned(n[0])?,
                    reset: unsigned(n[1])?,
                    retry_after: match n[2] {
                        -1 => u64::MAX,
                        retry => unsigned(retry)?,
                    },
                    window: unsigned(n[3])?,
                };
            }
            self.run = Some(Run {
                left: run,
                index: 0,
                admitted,
                first,
                denied,
            });
        }
        let Some(state) = &mut self.run else {
            unreachable!("a run was read");
        };
        let i = state.index;
        state.index += 1;
        state.left -= 1;
        let (outcome, taken) = if i < state.admitted {
            let [remaining, reset, window] = state.first;
            let spent = i.saturating_mul(charge.cost);
            let outcome = Outcome {
                allowed: true,
                limit,
                remaining: remaining.saturating_sub(spent),
                reset: reset.saturating_add(spent.saturating_mul(charge.limits.interval)),
                retry_after: 0,
                window,
            };
            (outcome, charge.cost)
        } else {
            (state.denied, 0)
        };
        Ok(Reply {
            now: self.now,
            outcomes: smallvec::smallvec![outcome],
            taken: smallvec::smallvec![taken],
            times: None,
        })
    }

    /// The reply of the next request: `charges`, at `now` (with an injected clock).
    pub(crate) fn next<P: Borrow<Prepared>>(
        &mut self,
        now: Option<u64>,
        charges: &[P],
    ) -> Result<Reply, StoreError> {
        let mut outcomes = SmallVec::with_capacity(charges.len());
        let mut taken = SmallVec::with_capacity(charges.len());
        for charge in charges {
            let charge = charge.borrow();
            let per_charge = if charge.lease > 0 { 5 } else { 4 };
            if self.rest.len() < per_charge {
                return Err(StoreError::Protocol(
                    "the rate-limit code answered too few numbers".into(),
                ));
            }
            let (n, tail) = self.rest.split_at(per_charge);
            self.rest = tail;
            let retry_after = match n[2] {
                -1 => u64::MAX,
                retry => unsigned(retry)?,
            };
            outcomes.push(Outcome {
                allowed: retry_after == 0,
                limit: charge.algorithm.capacity(&charge.limits),
                remaining: unsigned(n[0])?,
                reset: unsigned(n[1])?,
                retry_after,
                window: unsigned(n[3])?,
            });
            taken.push(match n.get(4) {
                Some(&taken) => unsigned(taken)?,
                None if retry_after == 0 => charge.cost,
                None => 0,
            });
        }
        Ok(Reply {
            now: now.unwrap_or(self.now),
            outcomes,
            taken,
            times: None,
        })
    }
}

/// Decodes the reply of a [`Mode::Charge`] or [`Mode::Peek`] call of `requests`, read by
/// redis-rs: the call's time, then four numbers per charge (five for a lease).
pub(crate) fn decode<P: Borrow<Prepared>>(
    value: Value,
    requests: &[Request<'_, P>],
) -> Result<Vec<Reply>, StoreError> {
    let numbers = items(&value)?
        .iter()
        .map(integer)
        .collect::<Result<Vec<i64>, _>>()?;
    let expected = requests.iter().map(|r| numbers_of(r.charges)).sum();
    let mut decoder = Decoder::new(&numbers, expected)?;
    requests
        .iter()
        .map(|request| decoder.next(request.now, request.charges))
        .collect()
}
