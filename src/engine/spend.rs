//! The layer's [`Spender`]: a meter's chunks taken from the store, or from the fallback limiter
//! at the share of the request's admission, and its settle made where its chunks were taken.

use smallvec::SmallVec;

use super::local::Counted;
use super::meter::{Spender, Taking};
use super::settle::report_settle;
use super::state::Engine;
use crate::key::Key;
use crate::policy::snapshot::Snapshot;
use crate::runtime::Origin;
use crate::store::{Adjustment, Change, Charge, Store};

impl<St: Store> Spender for Engine<St> {
    fn take(
        &self,
        snapshot: &Snapshot,
        charges: &[(u16, Key, u64)],
        on_fallback: Option<Counted>,
    ) -> Taking {
        let charges: SmallVec<[Charge<'_>; 1]> = charges
            .iter()
            .map(|(rule, key, cost)| Charge {
                rule: &snapshot.rules[usize::from(*rule)].spec,
                key,
                cost: *cost,
            })
            .collect();
        if let Some(Counted(admitted)) = on_fallback
            && let Some(decision) =
                self.fallback
                    .decide_if_made(admitted, self.store.replicas(), &charges)
        {
            return Taking::Now(Ok(decision));
        }
        match self.store.check_now(&charges) {
            Some(answer) => Taking::Now(answer),
            None => Taking::Later(Box::pin(self.store.check(&charges))),
        }
    }

    fn settle_meter(
        &self,
        snapshot: &Snapshot,
        changes: &[(u16, Key, Change, u64)],
        on_fallback: Option<Counted>,
        origin: &Origin,
    ) {
        let adjustments: SmallVec<[Adjustment<'_>; 1]> = changes
            .iter()
            .map(|(rule, key, change, at)| Adjustment {
                rule: &snapshot.rules[usize::from(*rule)].spec,
                key,
                change: *change,
                charged_at: *at,
            })
            .collect();
        self.finish_adjust(
            on_fallback,
            &adjustments,
            report_settle,
            "a metered response settled outside a Tokio runtime",
            origin,
        );
    }
}
