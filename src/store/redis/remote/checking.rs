//! [`Checking`]: the future of a check that Redis decides, written out rather than `async`, so
//! that a check queued on a connection costs one allocation and waits on its reply alone.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use super::future::CheckFuture;
use super::transport::{Sent, Transport, runtime};
use crate::Decision;
use crate::store::StoreError;
use crate::store::redis::late_reply::{Waiting, received};
use crate::store::redis::replica::Plan;
use crate::store::redis::script::Reply;

/// A check (its charges, and its reply when it comes, in a [`Waiting`]), sent when first polled
/// (or at once, for one that runs alone), and settled with the plan when its reply comes.
pub(crate) struct Checking<T> {
    transport: Arc<T>,
    /// Taken when the check is settled.
    plan: Option<Plan>,
    state: State,
}

enum State {
    /// Not sent yet: sent when first polled, on a Tokio runtime.
    Unsent {
        waiting: Waiting,
        now: Option<u64>,
    },
    Queued(Waiting),
    Deciding(CheckFuture<Reply>),
    Done,
}

impl<T: Transport> Checking<T> {
    /// The check `waiting` waits on, planned as `plan`: one that runs alone is sent now.
    pub(crate) fn new(
        transport: Arc<T>,
        plan: Plan,
        waiting: Waiting,
        now: Option<u64>,
        alone: bool,
    ) -> Self {
        let state = if alone {
            sent(transport.send(waiting, now, true))
        } else {
            State::Unsent { waiting, now }
        };
        Checking {
            transport,
            plan: Some(plan),
            state,
        }
    }

    fn settle(&mut self, reply: Result<Reply, StoreError>) -> Result<Decision, StoreError> {
        self.state = State::Done;
        // Settled where it lies (a plan is a few hundred bytes: a move copies it), then dropped.
        let decision = match &mut self.plan {
            Some(plan) => plan.settle(Some(reply)),
            None => Err(StoreError::Protocol(
                "a check polled after it answered".into(),
            )),
        };
        self.plan = None;
        decision
    }
}

fn sent(sent: Sent) -> State {
    match sent {
        Sent::Queued(waiting) => State::Queued(waiting),
        Sent::Deciding(future) => State::Deciding(future),
    }
}

impl<T: Transport> Future for Checking<T> {
    type Output = Result<Decision, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if let State::Unsent { .. } | State::Deciding(_) = this.state {
            // Polled where no runtime runs: refused before it takes a breaker's probe.
            if let Err(error) = runtime() {
                return Poll::Ready(this.settle(Err(error)));
            }
        }
        if let State::Unsent { .. } = this.state {
            let State::Unsent { waiting, now } = std::mem::replace(&mut this.state, State::Done)
            else {
                unreachable!("the state was unsent");
            };
            this.state = sent(this.transport.send(waiting, now, false));
        }
        let reply = match &mut this.state {
            State::Queued(waiting) => ready!(received(waiting, cx)),
            State::Deciding(future) => ready!(future.as_mut().poll(cx)),
            State::Unsent { .. } | State::Done => Err(StoreError::Protocol(
                "a check polled after it answered".into(),
            )),
        };
        Poll::Ready(this.settle(reply))
    }
}
