//! [`Held`]: the units this replica holds of one key's leases, and those of a refill that wait;
//! the key of a rule's leases.

use super::denial::aged;
use crate::algorithm::Outcome;
use crate::{Algorithm, Decision};

/// Units leased to this replica for one key.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Held {
    /// The units being spent, until `until`, of lease `generation`.
    pub(super) units: u64,
    pub(super) until: u64,
    /// Units of a refill ahead of need that came while `units` were left: spent once those are
    /// gone, until `next_until`.
    pub(super) next: u64,
    pub(super) next_until: u64,
    pub(super) algorithm: Algorithm,
    /// The outcome Redis reported at the last refill, and when it was sent (local microseconds).
    pub(super) outcome: Outcome,
    pub(super) at: u64,
    /// A refill is out: requests that find no unit here are charged to Redis one by one
    /// meanwhile.
    pub(super) refilling: bool,
    /// Fewer units left than this, the next request paid here sends a refill ahead of need:
    /// half as much again as the units the key's requests asked for while its last refill was
    /// out (paid here or not); 0 (no refill ahead) for a key spent one request at a time, for
    /// one that asked for more than `(n − 1) / 2` meanwhile, and after units expired unspent.
    pub(super) low_water: u64,
    /// The units asked of this lease since its refill went out.
    pub(super) demand: u64,
    /// The rule's lease: `n`, the most units taken at once (a replica holds at most `n − 1`).
    pub(super) size: u64,
    /// Counts the resets of the key: a refill sent before one brings no units after it.
    pub(super) resets: u64,
    /// Counts the leases of this key: units taken from one go back only to it, while it lives.
    pub(super) generation: u64,
    /// When (local microseconds) the key's last request was seen here: a key seen again
    /// within a lease's time to live is leased, one seen less often pays its cost alone.
    pub(super) seen: Option<u64>,
    /// The units of the lease being spent, as it came (the next refill of a lease spent
    /// before its time asks for twice as many), and what the last lease that ended spent (the
    /// size of the next after it).
    pub(super) taken: u64,
    pub(super) spent: u64,
    /// The rule's period, and when Redis charged [`units`](Held::units) and
    /// [`next`](Held::next) (on its clock), for a fixed or sliding-counter window whose units
    /// were all charged in one window: those left unspent go back into it. None: they are not
    /// given back.
    pub(super) period: u64,
    pub(super) charged: Option<u64>,
    pub(super) next_charged: Option<u64>,
    /// Units that expired unspent here, and when they were charged: given back to Redis with
    /// the key's next call.
    pub(super) returning: Option<(u64, u64)>,
}

/// Whether a request is paid from this replica's leases alone.
pub(super) enum Paid {
    Yes(Decision),
    /// The leases hold enough, and paying would send a refill ahead of need.
    AheadDue,
    /// A lease holds too little (or none is here).
    Short,
}

impl Held {
    /// Makes current the units that may pay `cost` at `now`: those of an expired lease are
    /// dropped, and a refill's units that wait take over, or join the units left when those
    /// are fewer than `cost` (until the sooner of both times).
    pub(super) fn roll(&mut self, now: u64, cost: u64) {
        if now < self.until && (self.units >= cost || self.next == 0) {
            return;
        }
        if now >= self.until {
            if self.taken > 0 {
                // What the lease spent: the size of the key's next.
                self.spent = self.taken.saturating_sub(self.units);
                self.taken = 0;
            }
            if self.units > 0 {
                // Units left unspent for a whole time to live: the key is no longer hot.
                self.low_water = 0;
                self.expire(self.units, self.charged);
            }
            self.units = 0;
            self.charged = None;
        }
        if self.next > 0 && now >= self.next_until {
            self.low_water = 0;
            self.expire(self.next, self.next_charged);
            self.next = 0;
        }
        if self.next == 0 {
            if self.units == 0 {
                // What was taken from the lease that ended never comes back.
                self.generation = self.generation.wrapping_add(1);
            }
            return;
        }
        if self.units > 0 {
            self.until = self.until.min(self.next_until);
            self.charged = self.one_window(self.charged, self.next_charged);
        } else {
            // Units taken from the lease that ended never come back to these.
            self.generation = self.generation.wrapping_add(1);
            self.until = self.next_until;
            self.charged = self.next_charged;
        }
        self.units += self.next;
        self.taken += self.next;
        self.next = 0;
    }

    /// Units that can no longer be spent here: given back to Redis with the key's next call,
    /// when they were all charged in one window of a fixed window or sliding counter (then
    /// exact: they go back into the window they were taken from, never spent); dropped
    /// otherwise. Units waiting to go back from another window are dropped.
    pub(super) fn expire(&mut self, units: u64, charged: Option<u64>) {
        let Some(at) = charged.filter(|_| units > 0) else {
            return;
        };
        self.returning = match self.returning {
            Some((waiting, when)) if self.one_window(Some(when), Some(at)).is_some() => {
                Some((waiting.saturating_add(units), when))
            }
            _ => Some((units, at)),
        };
    }

    /// The time of a charge that stands for both `a` and `b`: one of them, when both were in
    /// one window of the rule.
    pub(super) fn one_window(&self, a: Option<u64>, b: Option<u64>) -> Option<u64> {
        match (a, b) {
            (Some(a), Some(b)) if a / self.period == b / self.period => Some(a),
            _ => None,
        }
    }

    /// Whether a charge of `cost` is paid from these units at `now` (made current): a lease
    /// pays costs below its size, and a charge of 0 only while it lives.
    pub(super) fn pays(&mut self, now: u64, cost: u64) -> bool {
        self.roll(now, cost);
        cost < self.size && self.units >= cost && now < self.until
    }

    /// The low-water mark after a refill: what the key's requests asked for while it was out,
    /// and a half more. A lease that cannot hold twice that (more than half of it spent in a
    /// round trip) gets none: refilled when it runs out, a whole lease at a time, it makes
    /// fewer calls than refills ahead that would each bring less than was spent meanwhile.
    pub(super) fn settle_demand(&mut self) {
        self.low_water = if self.demand.saturating_mul(2) > self.size.saturating_sub(1) {
            0
        } else {
            self.demand + self.demand / 2
        };
    }

    /// Units of a refill ahead of need, spendable until `until`: they wait behind the units
    /// held (joining those already waiting, until the sooner of both times), and take over a
    /// lease that ended; never more than `n − 1` held in all (the rest is dropped).
    pub(super) fn wait(&mut self, units: u64, until: u64, now: u64, charged: Option<u64>) {
        if now >= self.next_until {
            self.expire(self.next, self.next_charged);
            self.next = 0;
        }
        let live = if now < self.until { self.units } else { 0 };
        let room = self
            .size
            .saturating_sub(1)
            .saturating_sub(live.saturating_add(self.next));
        (self.next_until, self.next_charged) = if self.next > 0 {
            (
                self.next_until.min(until),
                self.one_window(self.next_charged, charged),
            )
        } else {
            (until, charged)
        };
        let kept = units.min(room);
        self.expire(units - kept, charged);
        self.next += kept;
        self.roll(now, 0);
    }

    /// Spends `cost` units of [`units`](Held::units), counted in the demand on a refill out.
    pub(super) fn pay(&mut self, cost: u64) {
        self.units -= cost;
        if self.refilling {
            self.demand = self.demand.saturating_add(cost);
        }
    }

    /// Units given back to [`units`](Held::units), never past `n − 1` held in all (what would
    /// go beyond is dropped).
    pub(super) fn take_back(&mut self, units: u64) {
        if self.refilling {
            // Not spent after all: not asked for.
            self.demand = self.demand.saturating_sub(units);
        }
        let room = self
            .size
            .saturating_sub(1)
            .saturating_sub(self.units.saturating_add(self.next));
        let kept = units.min(room);
        self.expire(units - kept, self.charged);
        self.units += kept;
    }

    /// The units a refill ahead of need asks for when a request of `cost` is paid from
    /// [`units`](Held::units) (0: none is due): none is out, and fewer than the low-water mark
    /// would be left (with the units waiting); what the lease then lacks, keeping at most
    /// `n − 1`.
    pub(super) fn ahead(&self, cost: u64) -> u64 {
        let left = self.units.saturating_sub(cost).saturating_add(self.next);
        if cost == 0 || self.refilling || left >= self.low_water {
            return 0;
        }
        self.size.saturating_sub(1).saturating_sub(left)
    }

    /// The outcome of a request paid from this lease: what Redis reported, aged, with the units
    /// still held here counted as remaining.
    pub(super) fn spent(&self, now: u64) -> Outcome {
        self.spent_after(now, 0)
    }

    /// [`spent`](Held::spent) as it would be once `cost` more is paid here.
    pub(super) fn spent_after(&self, now: u64, cost: u64) -> Outcome {
        let mut outcome = aged(self.outcome, now.saturating_sub(self.at), self.algorithm);
        outcome.allowed = true;
        outcome.retry_after = 0;
        // Saturating: the units come from Redis's replies, which are not trusted to be sane.
        outcome.remaining = outcome
            .remaining
            .saturating_add(self.units.saturating_sub(cost))
            .saturating_add(self.next)
            .min(outcome.limit);
        outcome
    }
}

/// The key of a rule's leases: its fingerprint and its lease's size (a new size is a new lease).
pub(super) fn lease_key(rule: &crate::store::RuleSpec) -> u64 {
    let units = rule.lease().map_or(0, |lease| lease.units);
    (rule.fingerprint() ^ units.rotate_left(32)).wrapping_mul(0xff51_afd7_ed55_8ccd)
}
