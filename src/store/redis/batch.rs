//! Batches: checks waiting for the same server go to it in one call.
//!
//! A check joins the queue; when fewer than `max_in_flight` calls are out, it leaves at once,
//! with whatever else is queued (so a lone check waits for nothing: no timer). While calls are
//! out, new checks queue, and each answered call takes the queue with it on its next trip: the
//! busier the server, the larger the batches, the fewer the calls. A batch holds at most
//! `max_batch` checks.

use std::sync::{Arc, Mutex};

/// The queue of one server.
#[derive(Debug)]
pub(crate) struct Batcher<J> {
    state: Mutex<State<J>>,
    max_in_flight: usize,
    max_batch: usize,
}

#[derive(Debug)]
struct State<J> {
    queued: Vec<J>,
    in_flight: usize,
}

impl<J> Batcher<J> {
    /// A queue that lets `max_in_flight` calls out at once (at least 1), each of at most
    /// `max_batch` checks (at least 1).
    pub(crate) fn new(max_in_flight: usize, max_batch: usize) -> Self {
        Batcher {
            state: Mutex::new(State {
                queued: Vec::new(),
                in_flight: 0,
            }),
            max_in_flight: max_in_flight.max(1),
            max_batch: max_batch.max(1),
        }
    }

    /// Queues `job`. When a call may go out now, the batch to send (this job among them) and
    /// the call's turn, which sends the batches that queue meanwhile until it is dropped.
    pub(crate) fn push(self: &Arc<Self>, job: J) -> Option<(Vec<J>, Turn<J>)> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.queued.push(job);
        if state.in_flight >= self.max_in_flight {
            return None;
        }
        state.in_flight += 1;
        let batch = self.take(&mut state);
        Some((
            batch,
            Turn {
                batcher: self.clone(),
                ended: false,
            },
        ))
    }

    fn take(&self, state: &mut State<J>) -> Vec<J> {
        if state.queued.len() <= self.max_batch {
            return std::mem::take(&mut state.queued);
        }
        let rest = state.queued.split_off(self.max_batch);
        std::mem::replace(&mut state.queued, rest)
    }
}

/// One call's turn to send: after each answered batch, [`next`](Turn::next) takes what queued
/// meanwhile, and ends the turn when nothing did (in the same step, so that no check can queue
/// unseen in between). Dropped before its end (the task that held it went away), it lets another
/// call out.
#[derive(Debug)]
pub(crate) struct Turn<J> {
    batcher: Arc<Batcher<J>>,
    ended: bool,
}

impl<J> Turn<J> {
    /// The checks that queued while this call was out; `None` ends the turn.
    pub(crate) fn next(&mut self) -> Option<Vec<J>> {
        let mut state = self.batcher.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.queued.is_empty() {
            if !self.ended {
                self.ended = true;
                state.in_flight -= 1;
            }
            return None;
        }
        Some(self.batcher.take(&mut state))
    }
}

impl<J> Drop for Turn<J> {
    fn drop(&mut self) {
        if !self.ended {
            let mut state = self.batcher.state.lock().unwrap_or_else(|p| p.into_inner());
            state.in_flight -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lone_check_leaves_at_once_and_later_ones_wait_for_the_next_trip() {
        let batcher = Arc::new(Batcher::new(1, 3));
        let (first, mut turn) = batcher.push(1).expect("nothing is out: it leaves");
        assert_eq!(first, [1]);
        for job in 2..=6 {
            assert!(batcher.push(job).is_none(), "a call is out: {job} waits");
        }
        assert_eq!(turn.next(), Some(vec![2, 3, 4]), "at most 3 per call");
        assert_eq!(turn.next(), Some(vec![5, 6]));
        assert_eq!(turn.next(), None);
        drop(turn);
        let (again, _turn) = batcher.push(7).expect("no call is out");
        assert_eq!(again, [7]);
    }

    #[test]
    fn calls_out_are_bounded() {
        let batcher = Arc::new(Batcher::new(2, 10));
        let a = batcher.push(1).unwrap();
        let mut b = batcher.push(2).unwrap();
        assert!(batcher.push(3).is_none());
        drop(a);
        // The queued check goes with the next trip of a call that is out.
        assert_eq!(b.1.next(), Some(vec![3]));
        assert_eq!(b.1.next(), None);
        // Both turns ended: the next check leaves at once.
        assert!(batcher.push(4).is_some());
    }
}
