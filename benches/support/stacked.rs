//! Stacked rules over a million clients, shared by `benches/memory_store.rs` and
//! `benches/instructions.rs`: one token bucket per client IP; then the README's stack, that rule
//! plus a token bucket for everyone (`Global`); then four, with a daily fixed window per client
//! and for everyone.

use tollgate::Algorithm;
use tollgate::algorithm::Limits;
use tollgate::key::Key;
use tollgate::store::{Charge, MemoryStore, RuleSpec, Store};

/// The clients: 1,000,000 IPv4 addresses.
pub const CLIENTS: u32 = 1_000_000;

/// A store holding every client's keys for `rules` stacked rules (1, 2 or 4), the rules, and
/// the client keys. Every decision admits and charges every rule, and no key is full again
/// (so none expires) while a run lasts: the decisions find their keys, as a busy service does.
pub fn stacked(rules: usize) -> (MemoryStore, Vec<RuleSpec>, Vec<Key>) {
    const DAY: u64 = 86_400_000_000;
    // A client may spend 10 (a run charges each at most twice); one comes back a day later.
    let per_client = Limits::new(1, DAY, 10).expect("valid limits");
    // 10^9 a day for everyone together.
    let everyone = Limits::new(1_000_000_000, DAY, 1_000_000_000).expect("valid limits");
    let all = [
        RuleSpec::new("per-ip", Algorithm::TokenBucket, per_client),
        RuleSpec::new("everyone", Algorithm::TokenBucket, everyone),
        RuleSpec::new("per-ip-daily", Algorithm::FixedWindow, everyone),
        RuleSpec::new("everyone-daily", Algorithm::FixedWindow, everyone),
    ];
    let specs: Vec<RuleSpec> = all
        .into_iter()
        .take(rules)
        .map(|spec| spec.expect("valid rule"))
        .collect();
    // Room for every key: two per-IP rules hold 2,000,000 keys; nothing is evicted.
    let store = MemoryStore::builder()
        .max_keys(4_000_000)
        .build()
        .expect("valid store");
    let keys: Vec<Key> = (0..CLIENTS)
        .map(|i| Key::ip(std::net::Ipv4Addr::from(0x0a00_0000 + i * 7).into()))
        .collect();
    for key in &keys {
        decide(&store, &specs, key);
    }
    (store, specs, keys)
}

/// One decision for `client`: the per-IP rules count the client, the others `Global`. The
/// charges are on the stack, as the layer's are.
pub fn decide(store: &MemoryStore, rules: &[RuleSpec], client: &Key) -> bool {
    let global = Key::global();
    let charges: [Charge<'_>; 4] = std::array::from_fn(|i| {
        let rule = &rules[i.min(rules.len() - 1)];
        Charge {
            rule,
            key: if i % 2 == 0 { client } else { &global },
            cost: 1,
        }
    });
    store
        .check(&charges[..rules.len()])
        .into_inner()
        .is_ok_and(|decision| decision.allowed())
}
