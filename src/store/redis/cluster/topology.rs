//! The slot map of a cluster: which primary holds each of the 16384 slots, read with
//! `CLUSTER SLOTS`.

use std::sync::Arc;

use redis::Value;

use super::node::Node;
use crate::store::StoreError;

/// The number of Redis Cluster hash slots.
const SLOTS: usize = 16384;

/// Which node is the primary of each slot.
pub(super) struct Topology {
    /// Per slot, an index into `primaries`, or `NONE`.
    slots: Box<[u16]>,
    primaries: Vec<Arc<Node>>,
}

/// A slot no primary serves.
const NONE: u16 = u16::MAX;

impl Topology {
    /// The primary of `slot`, if one serves it.
    pub(super) fn primary(&self, slot: u16) -> Option<&Arc<Node>> {
        let index = *self.slots.get(usize::from(slot))?;
        self.primaries.get(usize::from(index))
    }

    /// Every primary.
    pub(super) fn primaries(&self) -> &[Arc<Node>] {
        &self.primaries
    }

    /// Whether both maps give every slot to the same node.
    pub(super) fn same_as(&self, other: &Topology) -> bool {
        fn addr(topology: &Topology, index: u16) -> Option<&str> {
            topology.primaries.get(usize::from(index)).map(|n| n.addr())
        }
        self.slots
            .iter()
            .zip(other.slots.iter())
            .all(|(&a, &b)| addr(self, a) == addr(other, b))
    }

    /// The map with `slot` served by `node` (after a `MOVED` that named it).
    pub(super) fn moved(&self, slot: u16, node: Arc<Node>) -> Topology {
        let mut primaries = self.primaries.clone();
        let index = match primaries.iter().position(|p| p.addr() == node.addr()) {
            Some(index) => index,
            None => {
                primaries.push(node);
                primaries.len() - 1
            }
        };
        let mut slots = self.slots.clone();
        // An index is a u16 below NONE; past that many primaries, the slot keeps its node.
        if let (Some(entry), Ok(index)) = (slots.get_mut(usize::from(slot)), u16::try_from(index))
            && index != NONE
        {
            *entry = index;
        }
        Topology { slots, primaries }
    }

    /// The map that a `CLUSTER SLOTS` reply describes; `asked` is the host of the node that
    /// answered (a primary listed without an address is that node). `node` gives the node of an
    /// address, creating it when it is new.
    pub(super) fn from_cluster_slots(
        reply: Value,
        asked: &str,
        mut node: impl FnMut(&str) -> Result<Arc<Node>, StoreError>,
    ) -> Result<Topology, StoreError> {
        let bad = |what: &str| {
            StoreError::Protocol(format!("CLUSTER SLOTS answered an unexpected {what}"))
        };
        let Value::Array(ranges) = reply else {
            return Err(bad("reply"));
        };
        let mut slots = vec![NONE; SLOTS].into_boxed_slice();
        let mut primaries: Vec<Arc<Node>> = Vec::new();
        for range in ranges {
            let Value::Array(items) = range else {
                return Err(bad("range"));
            };
            let (Some(start), Some(end), Some(Value::Array(primary))) =
                (items.first(), items.get(1), items.get(2))
            else {
                return Err(bad("range"));
            };
            let (start, end) = (integer(start), integer(end));
            let host = primary.first().and_then(text).ok_or_else(|| bad("host"))?;
            let port = primary.get(1).map(integer).ok_or_else(|| bad("port"))?;
            let (Some(start), Some(end), Some(port)) = (start, end, port) else {
                return Err(bad("number"));
            };
            if start < 0 || start > end || end >= SLOTS as i64 || !(1..=65535).contains(&port) {
                return Err(bad("slot range"));
            }
            // An empty host is the node that answered; "?" is a node whose address is unknown.
            let host = match host.as_str() {
                "" => asked.to_owned(),
                "?" => continue,
                _ => host,
            };
            let addr = format!("{host}:{port}");
            let index = match primaries.iter().position(|p| p.addr() == addr) {
                Some(index) => index,
                // An index is a u16 below NONE: no more primaries than that (a real cluster has
                // at most about a thousand).
                None if primaries.len() >= usize::from(NONE) => {
                    return Err(bad("number of primaries"));
                }
                None => {
                    primaries.push(node(&addr)?);
                    primaries.len() - 1
                }
            };
            let index = u16::try_from(index).map_err(|_| bad("number of primaries"))?;
            // 0 <= start <= end < SLOTS, checked above.
            for slot in &mut slots[start as usize..=end as usize] {
                *slot = index;
            }
        }
        if primaries.is_empty() {
            return Err(StoreError::Unavailable(
                "the cluster serves no slot (CLUSTER SLOTS is empty)".into(),
            ));
        }
        Ok(Topology { slots, primaries })
    }
}

fn integer(value: &Value) -> Option<i64> {
    match value {
        Value::Int(n) => Some(*n),
        _ => None,
    }
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(text) => Some(text.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use redis::{IntoConnectionInfo, Value};

    use super::*;
    use crate::CircuitBreaker;
    use crate::store::redis::connection::Target;

    fn node(addr: &str) -> Result<Arc<Node>, StoreError> {
        let template = "redis://127.0.0.1:7000".into_connection_info().unwrap();
        let targets = Target::new(
            &template,
            #[cfg(feature = "tls")]
            None,
        );
        let second = Duration::from_secs(1);
        let breaker = CircuitBreaker::default();
        Node::new(addr, &template, &targets, second, second, breaker).map(Arc::new)
    }

    fn range(start: i64, end: i64, port: i64) -> Value {
        Value::Array(vec![
            Value::Int(start),
            Value::Int(end),
            Value::Array(vec![
                Value::BulkString(b"127.0.0.1".to_vec()),
                Value::Int(port),
            ]),
        ])
    }

    #[test]
    fn a_map_of_every_slot_gives_each_its_primary() {
        let reply = Value::Array(vec![range(0, 8191, 7000), range(8192, 16383, 7001)]);
        let map = Topology::from_cluster_slots(reply, "127.0.0.1", node).unwrap();
        assert_eq!(map.primary(0).unwrap().addr(), "127.0.0.1:7000");
        assert_eq!(map.primary(8192).unwrap().addr(), "127.0.0.1:7001");
        assert_eq!(map.primaries().len(), 2);
    }

    /// A reply no Redis sends (a negative slot, one past the last) is refused as a protocol
    /// error: the slot map task never indexes out of the map with it.
    #[test]
    fn slots_outside_the_map_are_refused() {
        for (start, end) in [(-1, 100), (-5, -1), (0, 16384), (i64::MIN, 0), (100, 99)] {
            let reply = Value::Array(vec![range(start, end, 7000)]);
            match Topology::from_cluster_slots(reply, "127.0.0.1", node) {
                Err(StoreError::Protocol(message)) => {
                    assert!(message.contains("slot range"), "{start}..={end}: {message}")
                }
                Err(other) => panic!("{start}..={end}: {other}"),
                Ok(_) => panic!("{start}..={end}: a map"),
            }
        }
    }
}
