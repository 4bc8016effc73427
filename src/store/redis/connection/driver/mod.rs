//! The task that owns a connection's stream: it takes the work its handles queue, writes the
//! checks that queued together as one call (while `max_calls` calls of checks are out, new checks
//! wait and go together in the next), reads the replies in order and hands each check its own,
//! and answers [`Timeout`](StoreError::Timeout) for checks whose time ran out, with one timer for
//! the whole connection.
//!
//! A check is written at most once: a call whose reply does not come in time is never sent
//! again, since the code may have run. Only an answer that says the code did not run (the server
//! lost it in a restart or a flush) sends its checks again, once, after the connection loaded
//! it (the load is written on the same stream, so the checks wait for it under their own
//! deadlines, as every check does).

mod deadlines;
mod reload;

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use redis::{RedisError, RedisResult, Value};
use smallvec::SmallVec;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::oneshot;
use tokio::time::{Instant, Sleep};

use super::job::{Command, Job, Work};
use super::shared::{Checks, Owner, Shared};
use super::stream::{self, Stream};
use crate::store::StoreError;
use crate::store::breaker::Permit;
use crate::store::redis::error::{is_demoted, is_server_answer, store_error};
use crate::store::redis::resp::{self, Frame, Integers};
use crate::store::redis::script::{self, Form, Loaded, Mode, Request, Shape};

/// Bytes read at a time at least (the buffer grows for longer replies).
const READ_CHUNK: usize = 4096;

/// Emptied lists of checks kept for the next calls.
const SPARE_LISTS: usize = 8;

/// A read buffer larger than this is let go once emptied (a large reply is rare).
const MAX_KEPT_INPUT: usize = 64 * 1024;

/// The longest reply read; a longer one ends the connection (no reply of a store comes near).
const MAX_REPLY: usize = 64 * 1024 * 1024;

/// The task of one connection.
pub(super) struct Driver {
    shared: Arc<Shared>,
    stream: Stream,
    checks: Option<Checks>,
    /// Bytes to write, from `written` on.
    out: Vec<u8>,
    written: usize,
    /// The stream needs a flush (TLS buffers what it encrypts).
    unflushed: bool,
    /// Bytes read: `input[start..filled]` is not yet a whole reply.
    input: Vec<u8>,
    start: usize,
    filled: usize,
    /// What was written, in order: the replies come in this order.
    sent: VecDeque<Sent>,
    /// Calls of checks in `sent` whose checks still wait (not timed out).
    calls_out: usize,
    /// The integers of a reply being read.
    numbers: Vec<i64>,
    /// Work taken from the queue, reused.
    taken: Vec<Work>,
    /// Lists of checks of calls answered, reused.
    spare: Vec<Vec<Job>>,
    /// The one timer: the earliest time a check's request stops waiting.
    timer: Option<Pin<Box<Sleep>>>,
    armed: bool,
    ended: bool,
}

/// What one write asked for.
enum Sent {
    Checks(Call),
    Command(Pending),
    Load(Reload),
}

/// The code loaded again in `form`, after an answer that said it did not run: `jobs` are sent
/// again once it is (those still waiting).
struct Reload {
    form: Form,
    jobs: Vec<Job>,
    permit: Permit,
}

/// One call of checks.
struct Call {
    jobs: Vec<Job>,
    /// The earliest deadline of its checks: all are answered `Timeout` then without a reply.
    budget: Instant,
    /// Until when its reply is waited for after that (a call that takes concurrency slots: a
    /// late reply gives them back); a connection no handle holds any more ends after it.
    late: Instant,
    /// The permit the breaker hears the call's outcome with.
    permit: Permit,
    /// Its checks were answered `Timeout` and the breaker told: a reply that comes now only
    /// gives back the slots it took.
    timed_out: bool,
    /// How its reply is read.
    shape: Shape,
}

/// Commands waiting for their replies.
struct Pending {
    skip: usize,
    left: usize,
    values: Vec<Value>,
    /// A reply that could not be read: the commands' answer.
    failed: Option<RedisError>,
    answer: oneshot::Sender<RedisResult<Vec<Value>>>,
}

impl Driver {
    pub(super) fn new(shared: Arc<Shared>, stream: Stream, checks: Option<Checks>) -> Self {
        Driver {
            shared,
            stream,
            checks,
            out: Vec::with_capacity(READ_CHUNK),
            written: 0,
            unflushed: false,
            input: Vec::new(),
            start: 0,
            filled: 0,
            sent: VecDeque::new(),
            calls_out: 0,
            numbers: Vec::new(),
            taken: Vec::new(),
            spare: Vec::new(),
            timer: None,
            armed: false,
            ended: false,
        }
    }

    /// Reads what the stream has and answers the replies that are whole; whether it read.
    fn read(&mut self, cx: &mut Context<'_>) -> RedisResult<bool> {
        if self.filled == self.input.len() {
            if self.filled - self.start >= MAX_REPLY {
                return Err(stream::malformed());
            }
            if self.start > 0 {
                self.input.copy_within(self.start..self.filled, 0);
                self.filled -= self.start;
                self.start = 0;
            }
            if self.filled == self.input.len() {
                let size = (self.input.len() * 2).max(READ_CHUNK);
                self.input.resize(size, 0);
            }
        }
        let mut buf = ReadBuf::new(&mut self.input[self.filled..]);
        match Pin::new(&mut self.stream).poll_read(cx, &mut buf) {
            Poll::Pending => Ok(false),
            Poll::Ready(Err(error)) => Err(error.into()),
            Poll::Ready(Ok(())) => {
                let n = buf.filled().len();
                if n == 0 {
                    return Err(stream::closed());
                }
                self.filled += n;
                self.replies()?;
                Ok(true)
            }
        }
    }

    /// Answers every whole reply read.
    fn replies(&mut self) -> RedisResult<()> {
        while self.start < self.filled {
            let buf = &self.input[self.start..self.filled];
            match self.sent.front_mut() {
                None => {
                    // Nothing was asked: the stream is out of step.
                    return Err(stream::malformed());
                }
                Some(Sent::Checks(_)) => {
                    self.numbers.clear();
                    let reply = match resp::integers(buf, &mut self.numbers) {
                        Integers::Partial => break,
                        Integers::Whole(n) => {
                            self.start += n;
                            Ok(())
                        }
                        Integers::Other => {
                            match resp::frame(buf).map_err(|_| stream::malformed())? {
                                Frame::Partial => break,
                                Frame::Whole(n) => {
                                    let value = resp::value(&buf[..n]);
                                    self.start += n;
                                    Err(value.and_then(|v| v.extract_error()))
                                }
                            }
                        }
                    };
                    let Some(Sent::Checks(call)) = self.sent.pop_front() else {
                        unreachable!("the front was a call of checks");
                    };
                    if !call.timed_out {
                        self.calls_out -= 1;
                    }
                    self.shared.health.answered();
                    match reply {
                        Ok(()) => self.answered(call),
                        Err(reply) => self.refused(call, reply),
                    }
                }
                Some(Sent::Command(pending)) => {
                    let n = match resp::frame(buf).map_err(|_| stream::malformed())? {
                        Frame::Partial => break,
                        Frame::Whole(n) => n,
                    };
                    let value = resp::value(&buf[..n]);
                    self.start += n;
                    self.shared.health.answered();
                    if pending.skip > 0 {
                        pending.skip -= 1;
                        continue;
                    }
                    pending.left = pending.left.saturating_sub(1);
                    match value {
                        Ok(value) => pending.values.push(value),
                        // A reply redis-rs cannot read, framed all the same: the stream stays
                        // in step, the commands fail.
                        Err(error) => pending.failed = Some(error),
                    }
                    if pending.left == 0 {
                        let Some(Sent::Command(pending)) = self.sent.pop_front() else {
                            unreachable!("the front was a command");
                        };
                        let reply = match pending.failed {
                            Some(error) => Err(error),
                            None => Ok(pending.values),
                        };
                        let _ = pending.answer.send(reply);
                    }
                }
                Some(Sent::Load(_)) => {
                    let n = match resp::frame(buf).map_err(|_| stream::malformed())? {
                        Frame::Partial => break,
                        Frame::Whole(n) => n,
                    };
                    let reply = resp::value(&buf[..n]).and_then(Value::extract_error);
                    self.start += n;
                    self.shared.health.answered();
                    let Some(Sent::Load(load)) = self.sent.pop_front() else {
                        unreachable!("the front was a load");
                    };
                    self.loaded(load, reply);
                }
            }
        }
        if self.start == self.filled {
            self.start = 0;
            self.filled = 0;
            if self.input.len() > MAX_KEPT_INPUT {
                self.input = Vec::new();
            }
        }
        Ok(())
    }

    fn owner(&self) -> Option<Arc<dyn Owner>> {
        self.checks
            .as_ref()
            .and_then(|checks| checks.owner.upgrade())
    }

    /// A call of checks answered with integers (in `numbers`): each check gets its reply.
    fn answered(&mut self, mut call: Call) {
        let owner = self.owner();
        // Runs: how many checks each has (most calls have one or a few).
        let runs: SmallVec<[usize; 4]> = match call.shape {
            Shape::Each => SmallVec::new(),
            Shape::Runs => script::runs_of(call.jobs.iter().map(|job| &job.charges()[0]))
                .map(|(_, run)| run)
                .collect(),
        };
        let decoder = match call.shape {
            Shape::Each => {
                let expected = call
                    .jobs
                    .iter()
                    .map(|j| script::numbers_of(j.charges()))
                    .sum();
                script::Decoder::new(&self.numbers, expected)
            }
            Shape::Runs => script::Decoder::of_runs(&self.numbers, &runs),
        };
        let mut decoder = match decoder {
            Ok(decoder) => decoder,
            Err(error) => return self.failed_call(call, owner, true, error),
        };
        if !call.timed_out
            && let Some(owner) = &owner
        {
            owner.report(call.permit, true, None);
        }
        let mut runs = runs
            .into_iter()
            .flat_map(|run| std::iter::repeat_n(run, run));
        for job in call.jobs.drain(..) {
            let reply = match runs.next() {
                Some(run) => decoder.next_of_run(&job.charges()[0], run),
                None => decoder.next(job.now, job.charges()),
            };
            deliver(&owner, job, reply);
        }
        self.recycle(call.jobs);
    }

    /// Every check of `call` fails with `error`; the breaker hears whether the server answered.
    fn failed_call(
        &mut self,
        mut call: Call,
        owner: Option<Arc<dyn Owner>>,
        answered: bool,
        error: StoreError,
    ) {
        if !call.timed_out
            && let Some(owner) = &owner
        {
            owner.report(call.permit, answered, Some(&error));
        }
        for job in call.jobs.drain(..) {
            deliver(&owner, job, Err(error.duplicate()));
        }
        self.recycle(call.jobs);
    }

    /// Takes the work queued: commands are written at once (ahead of checks that wait for
    /// room); a call of checks (at most `max_batch`) leaves when none is out, or, up to
    /// `max_calls` out, when half a call's worth waits: while a call is out, the checks that
    /// come wait for it to come back and go together, unless there are many. Whether it took
    /// any.
    fn take_work(&mut self, cx: &mut Context<'_>) -> bool {
        let (max_calls, max_batch) = self
            .checks
            .as_ref()
            .map_or((0, 1), |c| (c.max_calls, c.max_batch));
        let half = (max_batch / 2).max(1);
        let mut taken = std::mem::take(&mut self.taken);
        {
            let mut queue = self.shared.lock();
            let mut calls = self.calls_out;
            let mut waiting = self.shared.queued.load(Ordering::Relaxed);
            let mut room = 0;
            while calls < max_calls && waiting > 0 && (calls == 0 || waiting >= half) {
                let call = waiting.min(max_batch);
                room += call;
                waiting -= call;
                calls += 1;
            }
            let mut checks_taken = 0;
            while let Some(front) = queue.work.front() {
                match front {
                    Work::Check(_) if checks_taken == room => break,
                    Work::Check(_) => checks_taken += 1,
                    Work::Command(_) => queue.commands -= 1,
                }
                taken.extend(queue.work.pop_front());
            }
            if queue.commands > 0 {
                // Commands behind checks that wait for room: taken ahead of them (a command
                // and a check are independent; the checks keep their order).
                let mut i = 0;
                while i < queue.work.len() {
                    if let Work::Command(_) = queue.work[i] {
                        taken.extend(queue.work.remove(i));
                        queue.commands -= 1;
                    } else {
                        i += 1;
                    }
                }
            }
            self.shared.took(checks_taken);
            // The next check wakes the driver when it may leave at once (no call out), or when
            // it makes half a call's worth with room for another call.
            queue.wants_checks = calls == 0;
            queue.wake_at = if calls < max_calls { half } else { 0 };
            match &queue.waker {
                Some(waker) if waker.will_wake(cx.waker()) => {}
                _ => queue.waker = Some(cx.waker().clone()),
            }
        }
        let took = !taken.is_empty();
        let mut batch: Vec<Job> = self.spare.pop().unwrap_or_default();
        let now = if took { Some(Instant::now()) } else { None };
        for work in taken.drain(..) {
            match work {
                // Written at once, before the checks taken with it.
                Work::Command(command) => self.command(command),
                Work::Check(job) => {
                    batch.push(job);
                    if batch.len() == max_batch {
                        let next = self.spare.pop().unwrap_or_default();
                        self.call_of(std::mem::replace(&mut batch, next), now);
                    }
                }
            }
        }
        self.call_of(batch, now);
        self.taken = taken;
        took
    }

    fn command(&mut self, command: Command) {
        if command.answer.is_closed() {
            return;
        }
        self.out.extend_from_slice(&command.bytes);
        self.sent.push_back(Sent::Command(Pending {
            skip: command.skip,
            left: command.count,
            values: Vec::with_capacity(command.count),
            failed: None,
            answer: command.answer,
        }));
    }

    /// Writes one call of the checks of `jobs` whose requests still wait.
    fn call_of(&mut self, mut jobs: Vec<Job>, now: Option<Instant>) {
        let (Some(checks), Some(now)) = (&self.checks, now) else {
            return self.recycle(jobs);
        };
        jobs.retain_mut(|job| {
            if job.answer.is_closed() {
                return false;
            }
            if job.deadline <= now {
                job.answer.fail(StoreError::Timeout);
                return false;
            }
            true
        });
        let (Some(budget), Some(last)) = (jobs.iter().map(|j| j.deadline).min(), jobs.last())
        else {
            return self.recycle(jobs);
        };
        let permit = last.permit;
        // A call that takes concurrency slots waits longer for its reply than its checks do
        // (a late reply gives them back).
        let late = if jobs.iter().any(|job| job.answer.holds_slots()) {
            budget + checks.late_wait
        } else {
            budget
        };
        let requests = jobs.iter().map(|job| Request {
            now: job.now,
            charges: job.charges(),
        });
        let shape = checks
            .program
            .encode(&mut self.out, checks.form.get(), Mode::Charge, requests);
        self.sent.push_back(Sent::Checks(Call {
            jobs,
            budget,
            late,
            permit,
            timed_out: false,
            shape,
        }));
        self.calls_out += 1;
        self.arm_by(budget);
    }

    /// Keeps an emptied list of checks for a later call (a call's list is allocated once).
    fn recycle(&mut self, mut jobs: Vec<Job>) {
        jobs.clear();
        if self.spare.len() < SPARE_LISTS && jobs.capacity() > 0 {
            self.spare.push(jobs);
        }
    }

    /// Writes what is to be written; whether it wrote.
    fn write(&mut self, cx: &mut Context<'_>) -> RedisResult<bool> {
        let mut wrote = false;
        while self.written < self.out.len() {
            match Pin::new(&mut self.stream).poll_write(cx, &self.out[self.written..]) {
                Poll::Pending => break,
                Poll::Ready(Ok(0)) => return Err(stream::closed()),
                Poll::Ready(Ok(n)) => {
                    self.written += n;
                    wrote = true;
                    self.unflushed = true;
                }
                Poll::Ready(Err(error)) => return Err(error.into()),
            }
        }
        if self.written == self.out.len() {
            self.out.clear();
            self.written = 0;
        }
        if self.unflushed {
            match Pin::new(&mut self.stream).poll_flush(cx) {
                Poll::Ready(Ok(())) => self.unflushed = false,
                Poll::Ready(Err(error)) => return Err(error.into()),
                Poll::Pending => {}
            }
        }
        Ok(wrote)
    }

    /// Whether the driver may end: no handle is left, nothing is queued, and nothing it sent
    /// is owed: every call timed out and past the time its reply was waited for (or the link
    /// went silent: its health broke), every command's caller gone, no check waiting for a
    /// load.
    fn finished(&self) -> bool {
        if self.shared.handles.load(Ordering::Acquire) > 0 {
            return false;
        }
        if !self.shared.lock().work.is_empty() {
            return false;
        }
        let broken = self.shared.health.is_broken();
        let now = Instant::now();
        self.sent.iter().all(|sent| match sent {
            Sent::Checks(call) => call.timed_out && (broken || call.late <= now),
            Sent::Command(pending) => pending.answer.is_closed(),
            Sent::Load(load) => load.jobs.is_empty(),
        })
    }

    /// Ends the connection: everything queued or owed fails with `error`.
    fn end(&mut self, error: RedisError) {
        if self.ended {
            return;
        }
        self.ended = true;
        self.shared.health.broke();
        self.shared.ended.store(true, Ordering::Release);
        let queued = {
            let mut queue = self.shared.lock();
            queue.commands = 0;
            std::mem::take(&mut queue.work)
        };
        self.shared.queued.store(0, Ordering::Relaxed);
        let owner = self.owner();
        let failure = store_error(&self.shared.server, error.clone());
        for sent in self.sent.drain(..) {
            match sent {
                Sent::Checks(call) => {
                    if !call.timed_out
                        && let Some(owner) = &owner
                    {
                        owner.report(call.permit, false, Some(&failure));
                    }
                    for job in call.jobs {
                        deliver(&owner, job, Err(failure.duplicate()));
                    }
                }
                Sent::Load(load) => {
                    if let Some(owner) = &owner {
                        owner.report(load.permit, false, Some(&failure));
                    }
                    for job in load.jobs {
                        deliver(&owner, job, Err(failure.duplicate()));
                    }
                }
                Sent::Command(pending) => {
                    let _ = pending.answer.send(Err(error.clone()));
                }
            }
        }
        // Checks never written go to another connection, where there is one.
        let mut unsent = Vec::new();
        for work in queued {
            match work {
                Work::Check(job) => unsent.push(job),
                Work::Command(command) => {
                    let _ = command.answer.send(Err(error.clone()));
                }
            }
        }
        if !unsent.is_empty() {
            if let Some(owner) = &owner {
                unsent = owner.retry(unsent);
            }
            for job in unsent {
                deliver(&owner, job, Err(failure.duplicate()));
            }
        }
    }
}

/// Gives `reply` to the request of `job`; a reply whose request stopped waiting gives back the
/// concurrency slots it took.
fn deliver(owner: &Option<Arc<dyn Owner>>, mut job: Job, reply: Result<script::Reply, StoreError>) {
    let now = job.now;
    job.answer.send(reply, || {
        owner.as_ref().and_then(|owner| owner.give_back(now))
    });
}

impl Future for Driver {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        loop {
            let mut progress = match this.read(cx) {
                Ok(read) => read,
                Err(error) => {
                    this.end(error);
                    return Poll::Ready(());
                }
            };
            progress |= this.take_work(cx);
            match this.write(cx) {
                Ok(wrote) => progress |= wrote,
                Err(error) => {
                    this.end(error);
                    return Poll::Ready(());
                }
            }
            progress |= this.deadlines(cx);
            if this.finished() {
                this.end(stream::closed());
                return Poll::Ready(());
            }
            if !progress {
                return Poll::Pending;
            }
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // Dropped with its runtime: nothing it holds is answered any more.
        self.end(RedisError::from(std::io::Error::other(
            "the runtime that ran the connection ended",
        )));
    }
}
