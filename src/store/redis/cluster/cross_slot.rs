//! Checks whose charges live in several slots: check all, charge all, refund on a lost race;
//! and the calls outside the batches, one per slot.

use tokio::time::Instant;

use futures_util::future::join_all;
use smallvec::SmallVec;

use super::Cluster;
use super::deadline::Deadline;
use super::groups::{denial, groups, scatter};
use crate::store::StoreError;
use crate::store::redis::script::{Mode, Prepared, Reply};

impl Cluster {
    pub(super) async fn check_slots(
        &self,
        prepared: &[Prepared],
        now: Option<u64>,
        deadline: Deadline,
    ) -> Result<Reply, StoreError> {
        let Some(first) = prepared.first() else {
            return Ok(Reply {
                now: now.unwrap_or(0),
                outcomes: SmallVec::new(),
                taken: SmallVec::new(),
                times: None,
            });
        };
        let slot = first.slot();
        if prepared.iter().all(|p| p.slot() == slot) {
            let charges: Vec<&Prepared> = prepared.iter().collect();
            return self
                .reply(slot, Mode::Charge, now, &charges, deadline)
                .await;
        }
        self.check_across_slots(prepared, now, deadline).await
    }

    /// Charges in several slots: check all, charge all, refund on a lost race.
    pub(super) async fn check_across_slots(
        &self,
        prepared: &[Prepared],
        now: Option<u64>,
        deadline: Deadline,
    ) -> Result<Reply, StoreError> {
        let groups = groups(prepared);
        let group_charges: Vec<Vec<&Prepared>> = groups
            .iter()
            .map(|(_, indices)| indices.iter().map(|&i| &prepared[i]).collect())
            .collect();

        // 1. Check every group without charging: a denied request charges nothing. A group that
        // denies decides, even when another could not answer.
        let peeks = join_all(
            groups
                .iter()
                .zip(&group_charges)
                .map(|((slot, _), charges)| self.reply(*slot, Mode::Peek, now, charges, deadline)),
        )
        .await;
        if peeks.iter().any(|r| r.as_ref().is_ok_and(|r| !r.allowed())) {
            return Ok(denial(prepared, &groups, &group_charges, peeks));
        }
        let peeks = peeks
            .into_iter()
            .collect::<Result<Vec<Reply>, StoreError>>()?;

        // A check out of budget charges nothing more: its request is decided without it.
        if Instant::now() >= deadline.budget {
            return Err(StoreError::Timeout);
        }

        // 2. Charge every group, each atomically.
        let charged = join_all(
            groups
                .iter()
                .zip(&group_charges)
                .map(|((slot, _), charges)| {
                    self.reply(*slot, Mode::Charge, now, charges, deadline)
                }),
        )
        .await;
        if charged.iter().all(|r| r.as_ref().is_ok_and(Reply::allowed)) {
            let replies: Vec<Reply> = charged.into_iter().flatten().collect();
            return Ok(scatter(prepared.len(), &groups, &replies));
        }

        // 3. A group denied (a concurrent request took the last units) or failed: give back what
        // the other groups took (a lease, all it took). The refunds get a budget of their own:
        // they repair.
        let refund_deadline = Instant::now() + self.parts.settings.response_timeout;
        let to_refund: Vec<(u16, u64, Vec<Prepared>)> = groups
            .iter()
            .zip(&group_charges)
            .zip(&charged)
            .filter_map(|(((slot, _), charges), reply)| match reply {
                Ok(reply) if reply.allowed() => Some((
                    *slot,
                    reply.now,
                    charges
                        .iter()
                        .zip(&reply.taken)
                        .map(|(charge, &taken)| Prepared {
                            cost: taken,
                            lease: 0,
                            ..(*charge).clone()
                        })
                        .collect(),
                )),
                _ => None,
            })
            .collect();
        let refunds = to_refund.iter().map(|(slot, at, charges)| async move {
            let charges: Vec<&Prepared> = charges.iter().collect();
            self.call(
                *slot,
                Mode::Refund(*at),
                now,
                &charges,
                refund_deadline.into(),
            )
            .await
        });
        for result in join_all(refunds).await {
            if let Err(e) = result {
                tracing::warn!(
                    error = %e,
                    "tollgate: could not refund a cross-slot charge; it stays until its key expires"
                );
            }
        }
        // Denied by a group: every rule reports its budget uncharged (the groups that were
        // charged and refunded report what their peek saw). Without a denial, a failure.
        if !charged
            .iter()
            .any(|r| r.as_ref().is_ok_and(|r| !r.allowed()))
        {
            let error = charged.into_iter().find_map(Result::err);
            return Err(error.unwrap_or(StoreError::Timeout));
        }
        let replies = charged
            .into_iter()
            .zip(peeks)
            .map(|(reply, peek)| match reply {
                Ok(reply) if reply.allowed() => Ok(peek),
                other => other,
            })
            .collect();
        Ok(denial(prepared, &groups, &group_charges, replies))
    }

    /// One call of `mode` per slot of `charges` (each stands alone: adjustments, resets).
    pub(super) async fn each_slot(
        &self,
        mode: Mode,
        now: Option<u64>,
        charges: &[Prepared],
    ) -> Result<(), StoreError> {
        if !self.parts.startup.is_connected() {
            return Err(self.parts.startup.not_connected(&self.servers));
        }
        // Every slot is tried at once, whatever the others answer: each change stands alone.
        let deadline = Instant::now() + self.parts.settings.response_timeout;
        let groups: Vec<(u16, Vec<&Prepared>)> = groups(charges)
            .into_iter()
            .map(|(slot, indices)| (slot, indices.iter().map(|&i| &charges[i]).collect()))
            .collect();
        let results = join_all(
            groups
                .iter()
                .map(|(slot, group)| self.call(*slot, mode, now, group, deadline.into())),
        )
        .await;
        results.into_iter().collect::<Result<Vec<_>, _>>().map(drop)
    }
}
