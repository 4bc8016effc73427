//! [`Audit`]: what one call of tollgate's code did to each key, read by the simulation beside
//! the code rather than from it: the call's arguments parsed by the wire format that
//! `check.lua` documents, and each key's units in use before and after (at the call's one
//! server time), from the values the algorithms store (`src/store/redis/mod.rs`, "Keys and
//! values"). A charge adds exactly its cost to the units in use; a refund may find fewer there
//! (the budget refilled since), so refunds are counted as asked.

use super::server::Servers;
use super::server::keyspace::Value;
use super::server::reply::Reply;

/// One charge's descriptor: `<algorithm>:<limit>:<period>:<burst>:<interval>:<cost>:<lease>`,
/// with a lease's give-back `:<units>@<time>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Descriptor {
    pub(crate) algorithm: String,
    pub(crate) limit: u64,
    pub(crate) period: u64,
    pub(crate) burst: u64,
    pub(crate) interval: u64,
    pub(crate) cost: u64,
    pub(crate) lease: u64,
    pub(crate) give_back: Option<(u64, u64)>,
}

impl Descriptor {
    fn parse(text: &[u8]) -> Option<Descriptor> {
        let text = std::str::from_utf8(text).ok()?;
        let (main, give_back) = match text.split_once('@') {
            Some((head, at)) => {
                let (head, units) = head.rsplit_once(':')?;
                (head, Some((units.parse().ok()?, at.parse().ok()?)))
            }
            None => (text, None),
        };
        let mut parts = main.split(':');
        let algorithm = parts.next()?.to_owned();
        let mut n = || parts.next()?.parse::<u64>().ok();
        Some(Descriptor {
            algorithm,
            limit: n()?,
            period: n()?,
            burst: n()?,
            interval: n()?,
            cost: n()?,
            lease: n()?,
            give_back,
        })
    }
}

/// What a call did to one key.
#[derive(Clone, Debug)]
pub(crate) struct KeyAudit {
    pub(crate) key: Vec<u8>,
    pub(crate) descriptor: Descriptor,
    /// Units in use before the call, and after.
    pub(crate) before: f64,
    pub(crate) after: f64,
}

/// What one call did.
#[derive(Clone, Debug)]
pub(crate) struct Audit {
    /// Server time of the call.
    pub(crate) at: u64,
    pub(crate) node: usize,
    /// The mode's letter: `c` `p` `r` `a` `x` `B` `b` `R`.
    pub(crate) mode: u8,
    pub(crate) keys: Vec<KeyAudit>,
    /// The call answered an error.
    pub(crate) failed: bool,
}

/// The descriptor of each key of a call's arguments (`args` after the keys), by the wire
/// format; `None` when the arguments do not read as it says.
fn descriptors(keys: usize, args: &[Vec<u8>]) -> Option<(u8, Vec<Descriptor>)> {
    let mode = *args.first()?.first()?;
    let rest = &args[1..];
    let each = |texts: &[Vec<u8>]| {
        texts
            .iter()
            .map(|t| Descriptor::parse(t))
            .collect::<Option<Vec<_>>>()
    };
    let descriptors = match mode {
        b'c' | b'p' | b'r' | b'a' | b'x' => each(rest)?,
        b'b' if rest.len() == 1 && keys > 1 => vec![Descriptor::parse(&rest[0])?; keys],
        b'b' => each(rest)?,
        b'R' => vec![Descriptor::parse(rest.first()?)?; keys],
        b'B' => {
            let mut out = Vec::new();
            let mut at = 0;
            while at < rest.len() {
                let count = std::str::from_utf8(&rest[at]).ok()?;
                let n: usize = count.split('@').next()?.parse().ok()?;
                out.extend(each(rest.get(at + 1..at + 1 + n)?)?);
                at += 1 + n;
            }
            out
        }
        _ => return None,
    };
    (descriptors.len() == keys).then_some((mode, descriptors))
}

/// The units in use of a key holding `value` at `now`, as its algorithm counts them.
pub(crate) fn in_use(value: Option<&Value>, d: &Descriptor, now: u64) -> f64 {
    let text = |v: &Value| match v {
        Value::Text(t) => std::str::from_utf8(t).ok().map(str::to_owned),
        _ => None,
    };
    let integers =
        |v: &Value| -> Option<Vec<i64>> { text(v)?.split(':').map(|p| p.parse().ok()).collect() };
    let Some(value) = value else { return 0.0 };
    let interval = d.interval.max(1) as f64;
    let window = |start: i64| start as u64 == now - now % d.period.max(1);
    match d.algorithm.as_str() {
        "tb" => match integers(value).as_deref() {
            Some([v]) if *v < 0 => ((-*v) as f64 - now as f64).max(0.0) / interval,
            _ => 0.0,
        },
        "gcra" => match integers(value).as_deref() {
            Some([v]) if *v > 0 => (*v as f64 - now as f64).max(0.0) / interval,
            _ => 0.0,
        },
        "fw" => match integers(value).as_deref() {
            Some([start, count]) if window(*start) => *count as f64,
            _ => 0.0,
        },
        "sc" => match integers(value).as_deref() {
            Some([start, previous, current]) if window(*start) => (*previous + *current) as f64,
            Some([start, _, current])
                if (*start as u64).saturating_add(d.period) == now - now % d.period.max(1) =>
            {
                *current as f64
            }
            _ => 0.0,
        },
        "sl" | "cc" => match value {
            Value::List(entries) => entries
                .iter()
                .filter_map(|e| std::str::from_utf8(e).ok()?.parse::<u64>().ok())
                .filter(|t| t.saturating_add(d.period) > now)
                .count() as f64,
            _ => 0.0,
        },
        _ => 0.0,
    }
}

/// A call being audited: its keys' descriptors and units in use before it ran.
pub(crate) struct Before {
    node: usize,
    mode: u8,
    keys: Vec<(Vec<u8>, Descriptor, f64)>,
}

/// Reads, before `args` (a command) runs on node `node` at `now`, what the audit needs: `None`
/// for a command that is not a call of the code.
pub(crate) fn audit_call(
    servers: &mut Servers,
    node: usize,
    args: &[Vec<u8>],
    now: u64,
) -> Option<Before> {
    let name = args.first()?;
    if !name.eq_ignore_ascii_case(b"FCALL") && !name.eq_ignore_ascii_case(b"EVALSHA") {
        return None;
    }
    let n: usize = std::str::from_utf8(args.get(2)?).ok()?.parse().ok()?;
    let keys = args.get(3..3 + n)?;
    let (mode, descriptors) = descriptors(n, args.get(3 + n..)?)?;
    let keyspace = &mut servers.nodes.get_mut(node)?.keyspace;
    let keys = keys
        .iter()
        .zip(descriptors)
        .map(|(key, d)| {
            let used = in_use(keyspace.value(key, now / 1000).as_ref(), &d, now);
            (key.clone(), d, used)
        })
        .collect();
    Some(Before { node, mode, keys })
}

impl Before {
    /// The audit of the call, once it ran and answered `reply`.
    pub(crate) fn after(
        self,
        servers: &mut Servers,
        node: usize,
        now: u64,
        reply: &Reply,
    ) -> Audit {
        let keyspace = &mut servers.nodes[node].keyspace;
        let keys = self
            .keys
            .into_iter()
            .map(|(key, descriptor, before)| {
                let after = in_use(keyspace.value(&key, now / 1000).as_ref(), &descriptor, now);
                KeyAudit {
                    key,
                    descriptor,
                    before,
                    after,
                }
            })
            .collect();
        Audit {
            at: now,
            node: self.node,
            mode: self.mode,
            keys,
            failed: reply.is_error(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_read_as_the_wire_format_says() {
        let d = Descriptor::parse(b"tb:10:1000000:10:100000:1:0").unwrap();
        assert_eq!(
            (d.limit, d.interval, d.cost, d.give_back),
            (10, 100_000, 1, None)
        );
        let d = Descriptor::parse(b"fw:10:1000000:10:100000:0:5:3@1700000000000000").unwrap();
        assert_eq!(
            (d.lease, d.give_back),
            (5, Some((3, 1_700_000_000_000_000)))
        );
        let args: Vec<Vec<u8>> = [
            "B",
            "1",
            "tb:1:1:1:1:1:0",
            "2@5",
            "fw:1:1:1:1:1:0",
            "fw:1:1:1:1:2:0",
        ]
        .iter()
        .map(|s| s.as_bytes().to_vec())
        .collect();
        let (mode, ds) = descriptors(3, &args).unwrap();
        assert_eq!(mode, b'B');
        assert_eq!(ds[2].cost, 2);
    }
}
