//! One call of tollgate's code outside the batches of checks: a peek, an adjustment, a reset, a
//! cluster's check (after `ASKING` when its slot is being migrated).

use std::borrow::Borrow;

use redis::{ErrorKind, RedisError, RedisResult, Value};

use super::handle::Connection;
use crate::store::redis::resp;
use crate::store::redis::script::{Form, Mode, Prepared, Program, Request, ServerForm, not_run};

impl Connection {
    /// Sends `requests` of `program`'s code in the server's form (`form`, updated when the server says
    /// otherwise), after `ASKING` when `asking` (a cluster's slot being migrated): once, and
    /// again only when the server answered that the code did not run (it lost it in a
    /// restart, a failover or a flush; or it has no functions after all).
    pub(crate) async fn call<P: Borrow<Prepared>>(
        &self,
        program: &Program,
        form: &ServerForm,
        mode: Mode,
        requests: &[Request<'_, P>],
        asking: bool,
    ) -> RedisResult<Value> {
        let send = |form: Form| {
            let mut bytes = Vec::with_capacity(256);
            if asking {
                bytes.extend_from_slice(&resp::command(&[b"ASKING"]));
            }
            program.encode(&mut bytes, form, mode, requests.iter().copied());
            async move {
                let mut replies = self.send(bytes, usize::from(asking), 1).await?;
                let reply = replies.pop().ok_or_else(|| {
                    RedisError::from((ErrorKind::UnexpectedReturnType, "no reply"))
                })?;
                reply.extract_error()
            }
        };
        match send(form.get()).await {
            Err(e) if not_run(&e) => {
                let loaded = program.reload(&mut self.clone(), form, &e).await?;
                send(loaded).await
            }
            result => result,
        }
    }
}
