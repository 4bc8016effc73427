//! A check's charges grouped by slot, and the groups' replies put back in the order of the
//! charges.

use smallvec::SmallVec;

use crate::algorithm::Outcome;
use crate::store::StoreError;
use crate::store::redis::script::{Prepared, Reply};

/// The decision of a request that a group denied. A group that could not answer reports its
/// rules as if their keys were new: the request is denied whatever they say.
pub(super) fn denial(
    prepared: &[Prepared],
    groups: &[(u16, Vec<usize>)],
    group_charges: &[Vec<&Prepared>],
    replies: Vec<Result<Reply, StoreError>>,
) -> Reply {
    let replies: Vec<Reply> = replies
        .into_iter()
        .zip(group_charges)
        .map(|(reply, charges)| {
            reply.unwrap_or_else(|_| Reply {
                now: 0,
                outcomes: charges
                    .iter()
                    .map(|p| p.algorithm.check(&p.limits, None, 0, 0))
                    .collect(),
                taken: smallvec::smallvec![0; charges.len()],
                times: None,
            })
        })
        .collect();
    scatter(prepared.len(), groups, &replies)
}

/// The charges' indices grouped by slot, in slot order.
pub(super) fn groups(prepared: &[Prepared]) -> Vec<(u16, Vec<usize>)> {
    let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
    for (i, charge) in prepared.iter().enumerate() {
        let slot = charge.slot();
        match groups.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, indices)) => indices.push(i),
            None => groups.push((slot, vec![i])),
        }
    }
    groups.sort_unstable_by_key(|(slot, _)| *slot);
    groups
}

/// The outcomes of each group's reply (and the units each charge took), back in the order of
/// the charges; the time of the first group.
pub(super) fn scatter(len: usize, groups: &[(u16, Vec<usize>)], replies: &[Reply]) -> Reply {
    let mut outcomes: SmallVec<[Outcome; 2]> = smallvec::smallvec![Outcome::default(); len];
    let mut taken: SmallVec<[u64; 2]> = smallvec::smallvec![0; len];
    // Each node has its own clock: the time of each charge is its node's.
    let mut times = vec![0; len];
    for ((_, indices), reply) in groups.iter().zip(replies) {
        for ((&i, outcome), &units) in indices.iter().zip(&reply.outcomes).zip(&reply.taken) {
            outcomes[i] = *outcome;
            taken[i] = units;
            times[i] = reply.now;
        }
    }
    Reply {
        now: replies.first().map_or(0, |r| r.now),
        outcomes,
        taken,
        times: Some(times.into()),
    }
}
