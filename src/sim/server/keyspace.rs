//! [`Keyspace`]: one simulated server's keys, and the commands tollgate sends that read or
//! write them, each as the Redis command reference says (strings, lists, sorted sets,
//! expiries in milliseconds on the server's clock).

use std::collections::{BTreeMap, VecDeque};

use super::reply::Reply;

/// A value.
#[derive(Clone, Debug)]
pub(crate) enum Value {
    Text(Vec<u8>),
    List(VecDeque<Vec<u8>>),
    /// Member to score.
    Sorted(BTreeMap<Vec<u8>, f64>),
}

#[derive(Clone, Debug)]
struct Entry {
    value: Value,
    /// When it expires (server milliseconds), if it does.
    expires_at: Option<u64>,
}

/// The keys of one server (or of one node's slots).
#[derive(Clone, Debug, Default)]
pub(crate) struct Keyspace {
    entries: BTreeMap<Vec<u8>, Entry>,
}

const WRONGTYPE: &str = "WRONGTYPE Operation against a key holding the wrong kind of value";

fn syntax() -> Reply {
    Reply::Error("ERR syntax error".into())
}

fn not_integer() -> Reply {
    Reply::Error("ERR value is not an integer or out of range".into())
}

fn number(arg: &[u8]) -> Option<i64> {
    std::str::from_utf8(arg).ok()?.parse().ok()
}

/// A score bound of `ZREMRANGEBYSCORE`: `-inf`, `+inf`, `n` or `(n` (exclusive).
fn bound(arg: &[u8]) -> Option<(f64, bool)> {
    let text = std::str::from_utf8(arg).ok()?;
    let (text, exclusive) = match text.strip_prefix('(') {
        Some(rest) => (rest, true),
        None => (text, false),
    };
    let value = match text {
        "-inf" => f64::NEG_INFINITY,
        "+inf" | "inf" => f64::INFINITY,
        other => other.parse().ok()?,
    };
    Some((value, exclusive))
}

/// A list index of `LINDEX`, `LRANGE`, `LTRIM` (negative from the end), as a position.
fn position(index: i64, len: usize) -> i64 {
    if index < 0 { len as i64 + index } else { index }
}

impl Keyspace {
    /// Whether `key` exists at `now` (milliseconds); an expired key is removed.
    fn live(&mut self, key: &[u8], now: u64) -> Option<&mut Entry> {
        let expired = self
            .entries
            .get(key)
            .is_some_and(|e| e.expires_at.is_some_and(|at| at <= now));
        if expired {
            self.entries.remove(key);
        }
        self.entries.get_mut(key)
    }

    /// Whether `key` holds a live value at `now` (milliseconds).
    pub(crate) fn contains(&self, key: &[u8], now: u64) -> bool {
        self.entries
            .get(key)
            .is_some_and(|e| e.expires_at.is_none_or(|at| at > now))
    }

    /// The value at `key`, if live (for the simulation's own reading of the state).
    pub(crate) fn value(&mut self, key: &[u8], now: u64) -> Option<Value> {
        self.live(key, now).map(|e| e.value.clone())
    }

    /// Removes every key for which `moves` says so, and gives them (a slot migrating).
    pub(crate) fn take(
        &mut self,
        mut moves: impl FnMut(&[u8]) -> bool,
    ) -> Vec<(Vec<u8>, Value, Option<u64>)> {
        let keys: Vec<Vec<u8>> = self.entries.keys().filter(|k| moves(k)).cloned().collect();
        keys.into_iter()
            .filter_map(|k| {
                let e = self.entries.remove(&k)?;
                Some((k, e.value, e.expires_at))
            })
            .collect()
    }

    /// Puts keys taken from another node.
    pub(crate) fn put(&mut self, entries: Vec<(Vec<u8>, Value, Option<u64>)>) {
        for (key, value, expires_at) in entries {
            self.entries.insert(key, Entry { value, expires_at });
        }
    }

    /// Forgets every key (a restart without data).
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
    }

    fn list(&mut self, key: &[u8], now: u64) -> Result<Option<&mut VecDeque<Vec<u8>>>, Reply> {
        match self.live(key, now) {
            None => Ok(None),
            Some(Entry {
                value: Value::List(list),
                ..
            }) => Ok(Some(list)),
            Some(_) => Err(Reply::Error(WRONGTYPE.into())),
        }
    }

    fn drop_if_empty(&mut self, key: &[u8]) {
        let empty = match self.entries.get(key).map(|e| &e.value) {
            Some(Value::List(l)) => l.is_empty(),
            Some(Value::Sorted(s)) => s.is_empty(),
            _ => false,
        };
        if empty {
            self.entries.remove(key);
        }
    }

    /// Runs one key command at server time `now` (milliseconds); `None` when `name` is not one.
    pub(crate) fn run(&mut self, name: &str, args: &[Vec<u8>], now: u64) -> Option<Reply> {
        let reply = match (name, args) {
            ("GET", [key]) => match self.live(key, now) {
                None => Reply::Nil,
                Some(Entry {
                    value: Value::Text(v),
                    ..
                }) => Reply::Bulk(v.clone()),
                Some(_) => Reply::Error(WRONGTYPE.into()),
            },
            ("MGET", keys) if !keys.is_empty() => Reply::Array(
                keys.iter()
                    .map(|key| match self.live(key, now) {
                        Some(Entry {
                            value: Value::Text(v),
                            ..
                        }) => Reply::Bulk(v.clone()),
                        _ => Reply::Nil,
                    })
                    .collect(),
            ),
            ("SET", [key, value, options @ ..]) => self.set(key, value, options, now),
            ("DEL", keys) if !keys.is_empty() => {
                let mut n = 0;
                for key in keys {
                    if self.live(key, now).is_some() {
                        self.entries.remove(key.as_slice());
                        n += 1;
                    }
                }
                Reply::Integer(n)
            }
            ("PEXPIRE", [key, ms]) => {
                let Some(ms) = number(ms) else {
                    return Some(not_integer());
                };
                match self.live(key, now) {
                    None => Reply::Integer(0),
                    Some(_) if ms <= 0 => {
                        self.entries.remove(key.as_slice());
                        Reply::Integer(1)
                    }
                    Some(entry) => {
                        entry.expires_at = Some(now + ms as u64);
                        Reply::Integer(1)
                    }
                }
            }
            ("PTTL", [key]) => match self.live(key, now) {
                None => Reply::Integer(-2),
                Some(Entry {
                    expires_at: None, ..
                }) => Reply::Integer(-1),
                Some(Entry {
                    expires_at: Some(at),
                    ..
                }) => Reply::Integer((*at - now) as i64),
            },
            ("TYPE", [key]) => Reply::Status(
                match self.live(key, now).map(|e| &e.value) {
                    None => "none",
                    Some(Value::Text(_)) => "string",
                    Some(Value::List(_)) => "list",
                    Some(Value::Sorted(_)) => "zset",
                }
                .into(),
            ),
            ("RPUSH", [key, values @ ..]) if !values.is_empty() => match self.list(key, now) {
                Err(e) => e,
                Ok(Some(list)) => {
                    list.extend(values.iter().cloned());
                    Reply::Integer(list.len() as i64)
                }
                Ok(None) => {
                    self.entries.insert(
                        key.clone(),
                        Entry {
                            value: Value::List(values.iter().cloned().collect()),
                            expires_at: None,
                        },
                    );
                    Reply::Integer(values.len() as i64)
                }
            },
            ("LLEN", [key]) => match self.list(key, now) {
                Err(e) => e,
                Ok(list) => Reply::Integer(list.map_or(0, |l| l.len() as i64)),
            },
            ("LINDEX", [key, index]) => {
                let Some(index) = number(index) else {
                    return Some(not_integer());
                };
                match self.list(key, now) {
                    Err(e) => e,
                    Ok(None) => Reply::Nil,
                    Ok(Some(list)) => {
                        let at = position(index, list.len());
                        match usize::try_from(at).ok().and_then(|at| list.get(at)) {
                            Some(v) => Reply::Bulk(v.clone()),
                            None => Reply::Nil,
                        }
                    }
                }
            }
            ("LRANGE", [key, start, stop]) => {
                let (Some(start), Some(stop)) = (number(start), number(stop)) else {
                    return Some(not_integer());
                };
                match self.list(key, now) {
                    Err(e) => e,
                    Ok(None) => Reply::Array(Vec::new()),
                    Ok(Some(list)) => {
                        let len = list.len() as i64;
                        let start = position(start, list.len()).max(0);
                        let stop = position(stop, list.len()).min(len - 1);
                        Reply::Array(if start > stop {
                            Vec::new()
                        } else {
                            (start..=stop)
                                .map(|i| Reply::Bulk(list[i as usize].clone()))
                                .collect()
                        })
                    }
                }
            }
            ("LTRIM", [key, start, stop]) => {
                let (Some(start), Some(stop)) = (number(start), number(stop)) else {
                    return Some(not_integer());
                };
                match self.list(key, now) {
                    Err(e) => e,
                    Ok(None) => Reply::ok(),
                    Ok(Some(list)) => {
                        let len = list.len() as i64;
                        let start = position(start, list.len()).max(0);
                        let stop = position(stop, list.len()).min(len - 1);
                        if start > stop || start >= len {
                            list.clear();
                        } else {
                            list.truncate(stop as usize + 1);
                            list.drain(..start as usize);
                        }
                        self.drop_if_empty(key);
                        Reply::ok()
                    }
                }
            }
            ("LINSERT", [key, place, pivot, value]) => {
                let before = match place.to_ascii_uppercase().as_slice() {
                    b"BEFORE" => true,
                    b"AFTER" => false,
                    _ => return Some(syntax()),
                };
                match self.list(key, now) {
                    Err(e) => e,
                    Ok(None) => Reply::Integer(0),
                    Ok(Some(list)) => match list.iter().position(|v| v == pivot) {
                        None => Reply::Integer(-1),
                        Some(at) => {
                            list.insert(if before { at } else { at + 1 }, value.clone());
                            Reply::Integer(list.len() as i64)
                        }
                    },
                }
            }
            ("LREM", [key, count, value]) => {
                let Some(count) = number(count) else {
                    return Some(not_integer());
                };
                match self.list(key, now) {
                    Err(e) => e,
                    Ok(None) => Reply::Integer(0),
                    Ok(Some(list)) => {
                        let mut removed = 0;
                        let limit = if count == 0 { i64::MAX } else { count.abs() };
                        if count >= 0 {
                            let mut i = 0;
                            while i < list.len() && removed < limit {
                                if list[i] == *value {
                                    list.remove(i);
                                    removed += 1;
                                } else {
                                    i += 1;
                                }
                            }
                        } else {
                            let mut i = list.len();
                            while i > 0 && removed < limit {
                                i -= 1;
                                if list[i] == *value {
                                    list.remove(i);
                                    removed += 1;
                                }
                            }
                        }
                        self.drop_if_empty(key);
                        Reply::Integer(removed)
                    }
                }
            }
            ("ZADD", [key, score, member]) => {
                let Some(score) = std::str::from_utf8(score)
                    .ok()
                    .and_then(|s| s.parse::<f64>().ok())
                else {
                    return Some(Reply::Error("ERR value is not a valid float".into()));
                };
                match self.live(key, now) {
                    Some(Entry {
                        value: Value::Sorted(set),
                        ..
                    }) => Reply::Integer(i64::from(set.insert(member.clone(), score).is_none())),
                    Some(_) => Reply::Error(WRONGTYPE.into()),
                    None => {
                        let mut set = BTreeMap::new();
                        set.insert(member.clone(), score);
                        self.entries.insert(
                            key.clone(),
                            Entry {
                                value: Value::Sorted(set),
                                expires_at: None,
                            },
                        );
                        Reply::Integer(1)
                    }
                }
            }
            ("ZREMRANGEBYSCORE", [key, min, max]) => {
                let (Some((min, min_open)), Some((max, max_open))) = (bound(min), bound(max))
                else {
                    return Some(Reply::Error("ERR min or max is not a float".into()));
                };
                match self.live(key, now) {
                    None => Reply::Integer(0),
                    Some(Entry {
                        value: Value::Sorted(set),
                        ..
                    }) => {
                        let before = set.len();
                        set.retain(|_, score| {
                            let above = if min_open {
                                *score > min
                            } else {
                                *score >= min
                            };
                            let below = if max_open {
                                *score < max
                            } else {
                                *score <= max
                            };
                            !(above && below)
                        });
                        let removed = before - set.len();
                        self.drop_if_empty(key);
                        Reply::Integer(removed as i64)
                    }
                    Some(_) => Reply::Error(WRONGTYPE.into()),
                }
            }
            ("ZCARD", [key]) => match self.live(key, now) {
                None => Reply::Integer(0),
                Some(Entry {
                    value: Value::Sorted(set),
                    ..
                }) => Reply::Integer(set.len() as i64),
                Some(_) => Reply::Error(WRONGTYPE.into()),
            },
            (
                "GET" | "MGET" | "SET" | "DEL" | "PEXPIRE" | "PTTL" | "TYPE" | "RPUSH" | "LLEN"
                | "LINDEX" | "LRANGE" | "LTRIM" | "LINSERT" | "LREM" | "ZADD" | "ZREMRANGEBYSCORE"
                | "ZCARD",
                _,
            ) => Reply::Error(format!(
                "ERR wrong number of arguments for '{}' command",
                name.to_ascii_lowercase()
            )),
            _ => return None,
        };
        Some(reply)
    }

    /// `SET key value [PX ms | KEEPTTL]`.
    fn set(&mut self, key: &[u8], value: &[u8], options: &[Vec<u8>], now: u64) -> Reply {
        let mut expires_at = None;
        let mut keep = false;
        let mut rest = options.iter();
        while let Some(option) = rest.next() {
            match option.to_ascii_uppercase().as_slice() {
                b"PX" => {
                    let Some(ms) = rest.next().and_then(|v| number(v)) else {
                        return syntax();
                    };
                    if ms <= 0 {
                        return Reply::Error("ERR invalid expire time in 'set' command".into());
                    }
                    expires_at = Some(now + ms as u64);
                }
                b"KEEPTTL" => keep = true,
                _ => return syntax(),
            }
        }
        if keep && expires_at.is_some() {
            return syntax();
        }
        if keep {
            expires_at = self.live(key, now).and_then(|e| e.expires_at);
        }
        self.entries.insert(
            key.to_vec(),
            Entry {
                value: Value::Text(value.to_vec()),
                expires_at,
            },
        );
        Reply::ok()
    }
}
