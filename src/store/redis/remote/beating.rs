//! The heartbeat task of a store: counts this replica among those of its prefix
//! ([`fleet`](super::super::fleet)) once an interval, off the request path, for as long as the
//! store lives.

use std::sync::{Arc, Weak};

use super::transport::Transport;

/// Starts the heartbeat of the store `transport` (once; not when its interval is zero), on the
/// current Tokio runtime.
pub(crate) fn keep_beating<T: Transport>(transport: &Arc<T>) {
    let fleet = &transport.parts().fleet;
    let Some(every) = fleet.to_start() else {
        return;
    };
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        fleet.not_started();
        return;
    };
    let weak: Weak<T> = Arc::downgrade(transport);
    runtime.spawn(async move {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let Some(transport) = weak.upgrade() else {
                return;
            };
            beat_once(&transport).await;
        }
    });
}

/// Counts the fleet once now, when the store has a heartbeat (its `connect`, so that a replica
/// that started with Redis there has a count before anything can fail).
pub(crate) async fn count_now<T: Transport>(transport: &Arc<T>) {
    if transport.parts().fleet.counts() {
        beat_once(transport).await;
    }
}

/// Beats once, and records the count.
async fn beat_once<T: Transport>(transport: &Arc<T>) {
    match transport.clone().beat().await {
        Ok(count) => {
            let count = u32::try_from(count).unwrap_or(u32::MAX);
            transport.parts().fleet.counted(count);
            #[cfg(feature = "metrics")]
            crate::telemetry::replicas(T::KIND, count.max(1));
        }
        // The count last read stands: it is what the fallback needs while Redis is away.
        Err(error) => tracing::debug!(%error, "tollgate: a heartbeat failed"),
    }
}
