//! [`Replica`]: what a replica decides without asking Redis: denials Redis made moments ago (the
//! deny cache), and units it leased (token leasing), for split keys too.
//!
//! **The deny cache.** When Redis denies a request, each of its charges is kept with the outcome
//! Redis computed and the local time the check was sent. Until the sooner of the denying rule's
//! retry-after and its window (the time until one more unit is there), the same request (same
//! rules, keys and costs) is denied here, with Redis's outcome aged by the time since: within
//! that time no unit comes back to the denying rule, so Redis would deny it too, with those
//! numbers (other requests only spend; a cluster's cross-slot refund is the exception). The
//! time is counted from when the check was *sent*, before Redis read its clock, so a cached
//! denial never outlives the one Redis computed. The rules that admitted the request keep
//! their numbers too: a token bucket's or GCRA's, not leased nor split, while the denial
//! stands, refreshed by any request this replica sends that they admit and aged by the
//! reference model (their outcome holds their whole state); a leased rule's are its lease's
//! here while it would pay the request; the others' last until their own next unit (refreshed
//! by admissions of the same cost). A
//! rule whose numbers change is a new rule here (its fingerprint changes), and an admitted
//! request ends the denials of its charges.
//!
//! **Leases.** A rule with a lease of `n` takes up to `n` units from Redis in the call that
//! checks one of its requests (every unit there is, up to the lease's size, at least the
//! request's cost: [`Algorithm::lease_take`](crate::Algorithm::lease_take)) and spends the rest
//! here, for at most the lease's time to live, and never past the end of a fixed or
//! sliding-counter window. While a refill is out, other requests of the key that find no unit
//! here are charged to Redis one by one.
//!
//! **A lease follows its key's demand.** A key whose last request here was a time to live ago
//! or more (or never) pays its cost alone: nothing is held, nothing expires. A key seen again
//! sooner is leased: one unit more than the cost at first; twice as many as the last lease took
//! when that ran out before its time; what the last lease spent when that expired; never more
//! than `n`. So at a steady rate a key's leases settle at what it spends per time to live and
//! expire with nothing left; units are left when its demand falls.
//!
//! **Unspent units go back** where that is exact
//! ([`Algorithm::lease_gives_back`](crate::Algorithm::lease_gives_back): a fixed window, a
//! sliding counter). Units that can no longer be spent here (their lease expired; or a reply or
//! a give-back would hold more than `n − 1`) go back to Redis with the key's next call, refunded
//! at the time they were charged: into the count of that window if it still counts, nothing
//! otherwise. Units of two windows never mix: units that would are not given back. A call that
//! fails may or may not have given them back: they are not sent again (never twice). A reset of
//! the key drops those waiting.
//!
//! **Refills ahead of need.** A refill counts the units the key's requests ask for while it is
//! out (paid here or not), `d`; with half as much again, that is the key's low-water mark. Once
//! fewer units than the mark would be left (those waiting included), the request paid here also
//! sends a refill ahead of need: Redis is asked, at cost 0, for every unit there is up to what
//! the lease lacks (`n − 1 −` those left; possibly none, so it never denies). The request is
//! answered at once (on a Tokio runtime: the call goes on in a task of its own, and what the
//! request spent never goes back), and the units the call brings wait until those left are
//! spent; a batch that joins units already waiting lives no longer than they do. So a key with
//! `n ≥ 2 d + 1` keeps units while its refills are out, with one call per round trip at most,
//! and about one per `n − 1.5 d` requests when that is more. A key spent one request at a time
//! (`d = 0`) has no mark and asks Redis once per lease; so has a key whose lease cannot hold
//! twice what is spent in a round trip (`2 d > n − 1`): refilled when it runs out, a whole lease
//! per call, with the requests that find no unit meanwhile sent to Redis one by one, it makes
//! fewer calls than refills ahead that would each bring less than was spent. When Redis cannot
//! be asked (its breaker open, not connected), units held here are spent all the same. When
//! units are left unspent at a lease's expiry, the key's mark goes back to 0. A request that
//! costs more than the units left takes them with those that wait (until
//! the sooner of both times); one that costs a whole lease or more goes to Redis alone. A reset
//! of the key drops its units, and those of a refill sent before it.
//!
//! The bound: every unit spent here was charged to Redis first and is spent once, so the fleet
//! never admits more than the shared budget as counted when the units were charged; a unit is
//! spent up to a lease's time to live after its charge, so over a period the fleet may spend,
//! on top of that period's budget, the units replicas held at its start. Units given back (a
//! request denied by another rule) return only to the lease they came from, while it lives (a
//! key's entry evicted and made again counts its leases apart from the old one's).
//! A replica holds at most `n − cost ≤ n − 1` units of a key after a refill (it asks for
//! `n − held` at most, and spends `cost − held` at once), and at most `n − 1` after a refill
//! ahead of need (it asks for `n − 1 − left` at most; what a reply or a give-back would bring
//! beyond `n − 1` is dropped), and only spends from there, so
//! while R replicas hold units (or, of a fixed window or sliding counter, units of an expired
//! lease that wait to go back with the key's next call) the fleet may refuse a request that the
//! budget would admit by at most `(n − 1) × R` units; plus, for each refill whose reply was lost
//! to a time-out or a client that went away, the units it took; plus, for the token bucket, GCRA
//! and the sliding log, the units that expired unspent (none for a key seen less than once per
//! time to live on a replica, none at a steady rate once its lease has settled; at most `n − 1`
//! each time a key's demand on a replica falls).

mod denial;
mod deny;
mod held;
mod lease;
mod plan;
mod split;
mod table;
#[cfg(test)]
mod tests;
mod tombstones;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};

use self::denial::Denial;
use self::held::{Held, Paid};
use self::table::Table;
use crate::Decision;
use crate::clock::Clock;
use crate::store::Charge;

pub(crate) use plan::Plan;

/// The local decisions of one store.
pub(crate) struct Replica {
    clock: Arc<dyn Clock>,
    /// The store's key prefix, to name the keys that other replicas forget.
    prefix: Arc<str>,
    /// The longest a denial is answered here (local microseconds), whatever Redis computed.
    max_age: u64,
    denials: Table<Denial>,
    /// Keys forgotten by a replica (heard over pub/sub), by a hash of their Redis name: when
    /// it was heard (local microseconds). Kept for `max_age`, the life of any denial cached
    /// before.
    tombstones: Mutex<HashMap<u64, u64, foldhash::fast::RandomState>>,
    /// How many tombstones there are: none, the common case, is read without a lock.
    tombstone_count: AtomicUsize,
    /// When the tombstones are next pruned (local microseconds).
    next_prune: AtomicU64,
    /// When every key was last taken as forgotten (local microseconds; 0: never).
    forgot_all_at: AtomicU64,
    leases: Table<Held>,
    /// Numbers the lease entries made: an entry's generations start at its number times
    /// 2³², so that one made again after its key's was evicted never counts a generation of
    /// the old one (whose give-backs may still come).
    entries: AtomicU64,
    /// The next sub-key of each split key.
    parts: Table<u16>,
}

impl Replica {
    /// The local decisions of a store of keys named with `prefix`, on `clock`, with at most
    /// `denials` cached denials (0: none), each answered for at most `max_age`, and `leases`
    /// leased keys.
    pub(crate) fn new(
        clock: Arc<dyn Clock>,
        prefix: Arc<str>,
        denials: usize,
        max_age: std::time::Duration,
        leases: usize,
    ) -> Self {
        Replica {
            clock,
            prefix,
            max_age: u64::try_from(max_age.as_micros()).unwrap_or(u64::MAX),
            denials: Table::new(denials),
            tombstones: Mutex::default(),
            tombstone_count: AtomicUsize::new(0),
            next_prune: AtomicU64::new(0),
            forgot_all_at: AtomicU64::new(0),
            parts: Table::new(leases),
            leases: Table::new(leases),
            entries: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        self.clock.now_micros()
    }

    /// The decision of a request that needs no call to Redis: a denial Redis made moments ago,
    /// or every charge paid from this replica's leases. With `ahead`, a request whose payment
    /// would send a refill ahead of need is left to [`plan`](Replica::plan); without (Redis
    /// cannot be asked now), it is paid here all the same.
    pub(crate) fn answer(&self, charges: &[Charge<'_>], ahead: bool) -> Option<Decision> {
        // A split key's sub-key is chosen when the check is planned.
        if charges.is_empty() || charges.iter().any(|c| c.rule.parts() > 1) {
            return None;
        }
        // Units held here were charged before Redis denied anything since: spent first.
        if !self.leases.is_empty() && charges.iter().all(|c| c.rule.lease().is_some()) {
            match self.paid_by_leases(charges, ahead) {
                Paid::Yes(decision) => return Some(decision),
                // Paid with a refill ahead of need: planned.
                Paid::AheadDue => return None,
                Paid::Short => {}
            }
        }
        if !self.denials.is_empty() {
            return self.cached_denial(charges);
        }
        None
    }
}
