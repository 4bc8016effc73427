//! A call whose answer says the code did not run (the server lost it in a restart or a flush):
//! the code is loaded again on the same stream and the call's checks sent again, once.

use super::*;
use crate::store::redis::error::refuses_every_command;

impl Driver {
    /// A call of checks answered with something else: an error (the code did not run, the
    /// server refused) or an answer of another shape.
    pub(super) fn refused(&mut self, call: Call, reply: RedisResult<Value>) {
        let owner = self.owner();
        let error = match reply {
            Err(error) => error,
            Ok(value) => {
                let error = StoreError::Protocol(format!(
                    "{}: the rate-limit code answered {value:?}, not an array of integers",
                    self.shared.server
                ));
                return self.failed_call(call, owner, true, error);
            }
        };
        if script::not_run(&error) && !call.timed_out && call.jobs.iter().all(|j| !j.resent) {
            return self.reload(call, error);
        }
        let answered = if is_demoted(&error) {
            // The server became a replica: a new connection finds the primary.
            self.shared.health.broke();
            true
        } else {
            // `LOADING` or `BUSY` come at once, but refuse every check: the server is not
            // back.
            is_server_answer(&error) && !refuses_every_command(&error)
        };
        let error = store_error(&self.shared.server, error);
        self.failed_call(call, owner, answered, error);
    }

    /// The server lost the code (or has no functions): it is loaded again on this stream (in
    /// the form the server takes), and the checks of `call` go first in the queue once it is.
    /// The calls written after the one that failed fail alike: their checks wait for the same
    /// load.
    pub(super) fn reload(&mut self, mut call: Call, error: RedisError) {
        let Some(checks) = &self.checks else {
            return self.recycle(call.jobs);
        };
        let form = script::reload_form(checks.form.get(), &error);
        for job in &mut call.jobs {
            job.resent = true;
        }
        let waiting = self.sent.iter_mut().find_map(|sent| match sent {
            Sent::Load(load) => Some(load),
            _ => None,
        });
        match waiting {
            Some(load) => {
                load.jobs.append(&mut call.jobs);
                self.recycle(call.jobs);
            }
            None => self.load(form, call.jobs, call.permit),
        }
    }

    /// Writes the load of the code in `form`; `jobs` are sent again once it is.
    pub(super) fn load(&mut self, form: Form, jobs: Vec<Job>, permit: Permit) {
        let Some(checks) = &self.checks else {
            return self.recycle(jobs);
        };
        let earliest = jobs.iter().map(|job| job.deadline).min();
        self.out
            .extend(checks.program.load_command(form).get_packed_command());
        self.sent
            .push_back(Sent::Load(Reload { form, jobs, permit }));
        if let Some(at) = earliest {
            self.arm_by(at);
        }
    }

    /// The server answered the load of `load`: its checks go again, first in the queue; or
    /// the script form is loaded where the server takes no function; or they fail.
    pub(super) fn loaded(&mut self, load: Reload, reply: RedisResult<Value>) {
        let Reload {
            form,
            mut jobs,
            permit,
        } = load;
        // Those whose requests stopped waiting meanwhile go no further.
        jobs.retain(|job| !job.answer.is_closed());
        match script::loaded(form, reply) {
            Loaded::Done => {
                if let Some(checks) = &self.checks {
                    checks.form.set(form);
                }
                if let Err(jobs) = self.shared.push_front(jobs) {
                    let owner = self.owner();
                    let error = store_error(&self.shared.server, stream::closed());
                    for job in jobs {
                        deliver(&owner, job, Err(error.duplicate()));
                    }
                }
            }
            Loaded::TryScript => self.load(Form::Script, jobs, permit),
            Loaded::Failed(error) => {
                let owner = self.owner();
                let answered = is_server_answer(&error) && !refuses_every_command(&error);
                let error = store_error(&self.shared.server, error);
                if let Some(owner) = &owner {
                    owner.report(permit, answered, Some(&error));
                }
                for job in jobs {
                    deliver(&owner, job, Err(error.duplicate()));
                }
            }
        }
    }
}
