//! What a request's resolved rules come to: the rules that applied to it ([`RuleIndices`]),
//! and each one with the request's key and cost ([`Applied`]), in rule order. They travel from
//! the check to the answer and the events.

use smallvec::SmallVec;

use crate::key::Key;

/// Indices of the rules that applied to one request, in rule order.
pub(crate) type RuleIndices = SmallVec<[u16; 4]>;

/// One rule applied to a request: the rule (its index in the snapshot), the request's key for
/// it, and the request's cost.
#[derive(Clone, Debug)]
pub(crate) struct Applied {
    pub(crate) rule: u16,
    pub(crate) key: Key,
    pub(crate) cost: u64,
}

/// The rules applied to a request, with their keys and costs, in rule order.
pub(crate) type AppliedRules = SmallVec<[Applied; 2]>;
