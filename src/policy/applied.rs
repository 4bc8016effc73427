//! What a request's resolved rules come to: the rules that applied to it, and each one's key
//! and cost, in rule order. They travel from the check to the answer and the events.

use smallvec::SmallVec;

use crate::key::Key;

/// Indices of the rules that applied to one request, in rule order.
pub(crate) type Applied = SmallVec<[u16; 4]>;

/// Keys found for a request: the rule's index, the key, the cost.
pub(crate) type FoundKeys = SmallVec<[(u16, Key, u64); 2]>;
