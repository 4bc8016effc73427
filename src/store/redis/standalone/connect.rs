//! Connecting to the server and loading the code, in the background until it succeeds.

use std::sync::{Arc, Weak};

use super::Standalone;
use crate::store::StoreError;
use crate::store::redis::access;
use crate::store::redis::error::store_error;
use crate::store::redis::startup::{FIRST_RETRY_DELAY, MAX_RETRY_DELAY, Running};
use crate::store::redis::{forget, remote};

impl Standalone {
    /// The background task: connects and loads the code, retrying until it succeeds or the
    /// store is dropped.
    pub(super) async fn connect_in_background(store: Weak<Standalone>, _running: Running) {
        let mut delay = FIRST_RETRY_DELAY;
        loop {
            let Some(inner) = store.upgrade() else {
                return;
            };
            match inner.connect_once().await {
                Ok(()) => {
                    inner.parts.startup.connected();
                    tracing::info!(server = &*inner.server, "tollgate: connected to Redis");
                    match forget::client(inner.info.clone()) {
                        Ok(client) => inner.parts.listen(vec![client]),
                        Err(error) => tracing::warn!(
                            server = &*inner.server,
                            %error,
                            "tollgate: cannot listen for the keys other replicas forget"
                        ),
                    }
                    remote::keep_beating(&inner);
                    // The rest of the pool.
                    drop(inner.pick());
                    return;
                }
                Err(error) => {
                    // A store no one holds any more (a service exiting on a configuration
                    // error drops it while this attempt is out) has nothing to say of Redis.
                    if inner.parts.connect_failed(&error) && Arc::strong_count(&inner) > 1 {
                        tracing::warn!(
                            server = &*inner.server,
                            %error,
                            "tollgate: cannot reach Redis; retrying in the background, and until it \
                             answers each rule's FailureMode decides"
                        );
                    }
                }
            }
            drop(inner);
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(MAX_RETRY_DELAY);
        }
    }

    /// One attempt to reach Redis and load the code, within the connect timeout; the
    /// connection is the pool's first.
    pub(super) async fn connect_once(&self) -> Result<(), StoreError> {
        let attempt = async {
            let conn = self
                .open_connection()
                .await
                .map_err(|e| access::connect_error(&self.server, e))?;
            let form = self
                .parts
                .program
                .load(&mut conn.clone())
                .await
                .map_err(|e| store_error(&self.server, e))?;
            self.form.set(form);
            self.add(conn);
            Ok(())
        };
        tokio::time::timeout(self.parts.settings.connect_timeout, attempt)
            .await
            .unwrap_or(Err(StoreError::Timeout))
    }
}
