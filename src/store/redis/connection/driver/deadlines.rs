//! The connection's one timer: armed for the earliest time a check stops waiting, and the
//! checks and calls whose time ran out answered `Timeout` when it fires.

use super::*;

impl Driver {
    /// Arms the timer for `at`, unless it fires sooner.
    pub(super) fn arm_by(&mut self, at: Instant) {
        let sooner = match &self.timer {
            Some(timer) if self.armed => timer.deadline() <= at,
            _ => false,
        };
        if !sooner {
            self.arm(at);
        }
    }

    pub(super) fn arm(&mut self, at: Instant) {
        match &mut self.timer {
            Some(timer) => timer.as_mut().reset(at),
            None => self.timer = Some(Box::pin(tokio::time::sleep_until(at))),
        }
        self.armed = true;
    }

    /// Answers `Timeout` for the checks whose time ran out, when the timer says some may have;
    /// whether it fired (calls that timed out leave room for the checks queued).
    pub(super) fn deadlines(&mut self, cx: &mut Context<'_>) -> bool {
        let mut fired = false;
        while self.armed {
            let Some(timer) = &mut self.timer else {
                break;
            };
            if timer.as_mut().poll(cx).is_pending() {
                break;
            }
            fired = true;
            self.armed = false;
            if let Some(next) = self.expire(Instant::now()) {
                self.arm(next);
            }
        }
        fired
    }

    /// Times out the calls and the queued checks whose deadline is past `now`; the next
    /// deadline, if any.
    pub(super) fn expire(&mut self, now: Instant) -> Option<Instant> {
        let owner = self.owner();
        let mut next: Option<Instant> = None;
        let mut earliest = |at: Instant| next = Some(next.map_or(at, |n| n.min(at)));
        for sent in &mut self.sent {
            match sent {
                Sent::Checks(call) if call.timed_out => {
                    // Waited for until `late`, when a connection no handle holds may end.
                    if call.late > now {
                        earliest(call.late);
                    }
                }
                Sent::Checks(call) if call.budget > now => earliest(call.budget),
                Sent::Checks(call) => {
                    call.timed_out = true;
                    // No longer out: the checks queued behind it go without it.
                    self.calls_out -= 1;
                    self.shared.health.timed_out();
                    if let Some(owner) = &owner {
                        owner.report(call.permit, false, Some(&StoreError::Timeout));
                    }
                    for job in &mut call.jobs {
                        job.answer.fail(StoreError::Timeout);
                    }
                    if call.late > now {
                        earliest(call.late);
                    }
                }
                Sent::Load(load) => {
                    // The checks waiting for the code to load wait no longer than any other.
                    load.jobs.retain_mut(|job| {
                        if job.deadline > now {
                            earliest(job.deadline);
                            return true;
                        }
                        job.answer.fail(StoreError::Timeout);
                        false
                    });
                }
                Sent::Command(_) => {}
            }
        }
        let mut late = Vec::new();
        {
            let mut queue = self.shared.lock();
            let mut i = 0;
            while i < queue.work.len() {
                match &queue.work[i] {
                    Work::Check(job) if job.deadline <= now => {
                        late.extend(queue.work.remove(i));
                        self.shared.took(1);
                    }
                    Work::Check(job) => {
                        earliest(job.deadline);
                        i += 1;
                    }
                    Work::Command(_) => i += 1,
                }
            }
        }
        for work in late {
            if let Work::Check(mut job) = work {
                job.answer.fail(StoreError::Timeout);
            }
        }
        next
    }
}
