//! The simulated Redis: one server, or a cluster of primaries that own the 16,384 slots, each
//! answering a command atomically, as Redis does, with tollgate's own Lua run by a real Lua 5.1
//! ([`lua`]) over an in-memory [`Keyspace`]. Only the commands tollgate sends are served
//! (`redis_differential`-style tests against a real `redis-server` hold the two together:
//! `tests::the_simulated_server_answers_as_redis_does`).
//!
//! A cluster answers a command for a slot it does not own with `MOVED`, and one for a slot
//! migrating away with `ASK` (keys not here) or `TRYAGAIN` (some here, some not), as Redis
//! Cluster does; a slot moves whole, its keys with it.

pub(crate) mod keyspace;
pub(crate) mod lua;
pub(crate) mod reply;

use self::keyspace::Keyspace;
use self::lua::Engine;
use self::reply::Reply;
use crate::store::redis::simulated::slot;

/// The slots of a cluster.
pub(crate) const SLOTS: u16 = 16384;

/// One server: its keys and its code.
pub(crate) struct Node {
    pub(crate) keyspace: Keyspace,
    pub(crate) engine: Engine,
    /// Host and port, as clients reach it.
    pub(crate) host: String,
    pub(crate) port: u16,
}

/// A connection's own state on the server.
#[derive(Default)]
pub(crate) struct Session {
    /// `ASKING` was sent: the next command may use a slot being imported here.
    asking: bool,
}

/// A message published on a channel.
pub(crate) struct Published {
    pub(crate) channel: Vec<u8>,
    pub(crate) message: Vec<u8>,
}

/// The servers of a simulated deployment.
pub(crate) struct Servers {
    pub(crate) nodes: Vec<Node>,
    /// Whether it is a cluster (slots checked, `CLUSTER SLOTS` served).
    pub(crate) cluster: bool,
    /// Whether the servers have functions (Redis 7); without, only scripts (Redis 6.2).
    pub(crate) functions: bool,
    /// The owner of each slot (a cluster).
    owners: Vec<usize>,
    /// A slot migrating: (slot, from, to).
    migrating: Option<(u16, usize, usize)>,
    /// Errors the code itself raised (a defect of tollgate's, never expected).
    pub(crate) script_errors: Vec<String>,
}

/// The keys of a command, for the slot check: `FCALL name numkeys key...`, or the first argument
/// of a key command.
fn keys_of(name: &str, args: &[Vec<u8>]) -> Vec<Vec<u8>> {
    match name {
        "FCALL" | "EVALSHA" => {
            let n = args
                .get(1)
                .and_then(|n| std::str::from_utf8(n).ok())
                .and_then(|n| n.parse::<usize>().ok())
                .unwrap_or(0);
            args.iter().skip(2).take(n).cloned().collect()
        }
        "GET" | "SET" | "DEL" | "PEXPIRE" | "PTTL" | "TYPE" | "ZADD" | "ZREMRANGEBYSCORE"
        | "ZCARD" | "RPUSH" | "LLEN" | "LRANGE" => args.first().cloned().into_iter().collect(),
        _ => Vec::new(),
    }
}

impl Servers {
    /// One server (`cluster` false) or a cluster of `nodes` primaries, the slots shared in
    /// equal ranges; with or without functions.
    pub(crate) fn new(nodes: usize, cluster: bool, functions: bool) -> Servers {
        let nodes: Vec<Node> = (0..nodes)
            .map(|i| Node {
                keyspace: Keyspace::default(),
                engine: Engine::new(),
                host: format!("node-{i}"),
                port: 7000 + i as u16,
            })
            .collect();
        let n = nodes.len();
        let owners = (0..SLOTS as usize)
            .map(|s| s * n / SLOTS as usize)
            .collect();
        Servers {
            nodes,
            cluster,
            functions,
            owners,
            migrating: None,
            script_errors: Vec::new(),
        }
    }

    /// The node at `host:port`.
    pub(crate) fn node_at(&self, host: &str, port: u16) -> Option<usize> {
        self.nodes
            .iter()
            .position(|n| n.host == host && n.port == port)
    }

    /// The node that owns `slot`.
    pub(crate) fn owner(&self, slot: u16) -> usize {
        self.owners[usize::from(slot)]
    }

    /// Starts moving `slot` to node `to`: commands for its keys that are not on the old owner
    /// any more are asked of the new one (`ASK`).
    pub(crate) fn start_migration(&mut self, slot: u16, to: usize) {
        let from = self.owner(slot);
        if from != to && self.migrating.is_none() {
            self.migrating = Some((slot, from, to));
            // Half the keys go first: the others stay until the end.
            let mut half = false;
            let moved = self.nodes[from].keyspace.take(|k| {
                half = !half;
                self::slot(k) == slot && half
            });
            self.nodes[to].keyspace.put(moved);
        }
    }

    /// Ends the migration of the slot: every key on the new owner, which owns it.
    pub(crate) fn end_migration(&mut self) {
        if let Some((slot, from, to)) = self.migrating.take() {
            let moved = self.nodes[from].keyspace.take(|k| self::slot(k) == slot);
            self.nodes[to].keyspace.put(moved);
            self.owners[usize::from(slot)] = to;
        }
    }

    /// `CLUSTER SLOTS`: each range of slots of one owner, with the owner's address.
    fn cluster_slots(&self) -> Reply {
        let mut ranges = Vec::new();
        let mut start = 0u16;
        for s in 1..=SLOTS {
            if s == SLOTS || self.owners[usize::from(s)] != self.owners[usize::from(start)] {
                let node = &self.nodes[self.owners[usize::from(start)]];
                ranges.push(Reply::Array(vec![
                    Reply::Integer(i64::from(start)),
                    Reply::Integer(i64::from(s - 1)),
                    Reply::Array(vec![
                        Reply::Bulk(node.host.clone().into_bytes()),
                        Reply::Integer(i64::from(node.port)),
                        Reply::Bulk(format!("{:040}", node.port).into_bytes()),
                    ]),
                ]));
                start = s;
            }
        }
        Reply::Array(ranges)
    }

    /// Where a command of `keys` runs on node `at`: `Ok` here, or the redirection.
    fn route(
        &self,
        at: usize,
        keys: &[Vec<u8>],
        session: &mut Session,
        now_ms: u64,
    ) -> Result<(), Reply> {
        let asking = std::mem::take(&mut session.asking);
        if !self.cluster || keys.is_empty() {
            return Ok(());
        }
        let first = slot(&keys[0]);
        if keys.iter().any(|k| slot(k) != first) {
            return Err(Reply::Error(
                "CROSSSLOT Keys in request don't hash to the same slot".into(),
            ));
        }
        let node = |i: usize| format!("{}:{}", self.nodes[i].host, self.nodes[i].port);
        if let Some((slot, from, to)) = self.migrating
            && slot == first
        {
            if at == to && asking {
                return Ok(());
            }
            if at == from {
                let node_keys = &self.nodes[from].keyspace;
                let here = keys
                    .iter()
                    .filter(|k| node_keys.contains(k, now_ms))
                    .count();
                return if here == keys.len() {
                    Ok(())
                } else if here == 0 {
                    Err(Reply::Error(format!("ASK {slot} {}", node(to))))
                } else {
                    Err(Reply::Error(
                        "TRYAGAIN Multiple keys request during rehashing of slot".into(),
                    ))
                };
            }
        }
        let owner = self.owner(first);
        if owner != at {
            return Err(Reply::Error(format!("MOVED {first} {}", node(owner))));
        }
        Ok(())
    }

    /// Runs one command on node `at` at server time `now` (microseconds): its reply, and a
    /// message to publish, if it publishes one.
    pub(crate) fn execute(
        &mut self,
        at: usize,
        session: &mut Session,
        args: &[Vec<u8>],
        now: u64,
    ) -> (Reply, Option<Published>) {
        let Some(name) = args.first() else {
            return (Reply::Error("ERR empty command".into()), None);
        };
        let name = String::from_utf8_lossy(name).to_ascii_uppercase();
        let args = &args[1..];
        let keys = keys_of(&name, args);
        if let Err(redirect) = self.route(at, &keys, session, now / 1000) {
            return (redirect, None);
        }
        let unknown = |name: &str| {
            Reply::Error(format!(
                "ERR unknown command '{name}', with args beginning with: "
            ))
        };
        let reply = match (name.as_str(), args) {
            ("PING", []) => Reply::Status("PONG".into()),
            ("PING", [message]) => Reply::Bulk(message.clone()),
            ("AUTH", _) | ("SELECT", [_]) => Reply::ok(),
            ("ASKING", []) => {
                session.asking = true;
                Reply::ok()
            }
            ("TIME", []) => Reply::Array(vec![
                Reply::Bulk((now / 1_000_000).to_string().into_bytes()),
                Reply::Bulk((now % 1_000_000).to_string().into_bytes()),
            ]),
            ("CLUSTER", [sub]) if sub.eq_ignore_ascii_case(b"SLOTS") => {
                if self.cluster {
                    self.cluster_slots()
                } else {
                    Reply::Error("ERR This instance has cluster support disabled".into())
                }
            }
            ("PUBLISH", [channel, message]) => {
                return (
                    Reply::Integer(0),
                    Some(Published {
                        channel: channel.clone(),
                        message: message.clone(),
                    }),
                );
            }
            ("FUNCTION", [sub, code]) if sub.eq_ignore_ascii_case(b"LOAD") => {
                if self.functions {
                    self.nodes[at].engine.load_library(code)
                } else {
                    unknown("function")
                }
            }
            ("SCRIPT", [sub, code]) if sub.eq_ignore_ascii_case(b"LOAD") => {
                self.nodes[at].engine.load_script(code)
            }
            ("FCALL", [_, _, ..]) if !self.functions => unknown("fcall"),
            ("FCALL" | "EVALSHA", [f, _, rest @ ..]) => {
                let f = String::from_utf8_lossy(f).into_owned();
                let call_args = &rest[keys.len().min(rest.len())..];
                let node = &mut self.nodes[at];
                let keyspace = std::mem::take(&mut node.keyspace);
                let (reply, keyspace) =
                    node.engine
                        .call(name == "FCALL", &f, &keys, call_args, keyspace, now);
                node.keyspace = keyspace;
                if let Reply::Error(e) = &reply
                    && !e.starts_with("NOSCRIPT")
                    && !e.starts_with("ERR Function not found")
                {
                    self.script_errors.push(e.clone());
                }
                reply
            }
            _ => match self.nodes[at].keyspace.run(&name, args, now / 1000) {
                Some(reply) => reply,
                None => unknown(&name.to_ascii_lowercase()),
            },
        };
        (reply, None)
    }

    /// A restart of node `at`: with its data (and its functions, saved with it), or without.
    pub(crate) fn restart(&mut self, at: usize, keep_data: bool) {
        let node = &mut self.nodes[at];
        if !keep_data {
            node.keyspace.clear();
        }
        node.engine.flush(!keep_data);
    }
}
