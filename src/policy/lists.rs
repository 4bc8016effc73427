//! [`Lists`]: a policy's allow and deny lists (addresses, networks, tenants, keys), and what
//! they say of a request's key or tenant.

use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use super::Tenant;
use super::model::Listed;
use crate::key::Key;

/// The allow and deny lists of a policy.
#[derive(Default)]
pub(crate) struct Lists {
    allow: ListSet,
    deny: ListSet,
}

#[derive(Default)]
struct ListSet {
    addresses: std::collections::HashSet<IpAddr, foldhash::fast::RandomState>,
    networks: Vec<IpNet>,
    tenants: std::collections::HashSet<Arc<str>, foldhash::fast::RandomState>,
    keys: std::collections::HashSet<Key, foldhash::fast::RandomState>,
}

impl ListSet {
    fn new(entries: &[Listed]) -> Self {
        let mut set = ListSet::default();
        for entry in entries {
            match entry {
                Listed::Network(net) if net.prefix_len() == net.max_prefix_len() => {
                    // As keys hold them: an IPv4-mapped address is its IPv4 address.
                    set.addresses.insert(crate::key::canonical_ip(net.addr()));
                }
                // As keys hold their clients: an IPv4-mapped network is its IPv4 network.
                Listed::Network(net) => set.networks.push(crate::key::canonical_net(*net)),
                Listed::Tenant(id) => {
                    set.tenants.insert(id.clone());
                }
                Listed::Key(key) => {
                    set.keys.insert(key.clone());
                }
            }
        }
        set
    }

    fn has_key_entries(&self) -> bool {
        !self.addresses.is_empty() || !self.networks.is_empty() || !self.keys.is_empty()
    }

    fn holds_key(&self, key: &Key) -> bool {
        if let Some(ip) = key.as_ip()
            && (self.addresses.contains(&ip) || self.networks.iter().any(|n| n.contains(&ip)))
        {
            return true;
        }
        self.keys.contains(key)
    }
}

/// What the lists say of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Listing {
    /// On the deny list: refused.
    Denied,
    /// On the allow list: not limited.
    Allowed,
    /// On neither.
    Unlisted,
}

impl Lists {
    pub(super) fn new(allow: &[Listed], deny: &[Listed]) -> Self {
        Lists {
            allow: ListSet::new(allow),
            deny: ListSet::new(deny),
        }
    }

    /// Whether the lists name keys or networks (then the layer's key is extracted for them).
    pub(crate) fn has_key_entries(&self) -> bool {
        self.allow.has_key_entries() || self.deny.has_key_entries()
    }

    /// Whether the lists name tenants.
    pub(crate) fn has_tenant_entries(&self) -> bool {
        !self.allow.tenants.is_empty() || !self.deny.tenants.is_empty()
    }

    /// The listing of the layer's key of a request.
    pub(crate) fn key(&self, key: &Key) -> Listing {
        if self.deny.holds_key(key) {
            Listing::Denied
        } else if self.allow.holds_key(key) {
            Listing::Allowed
        } else {
            Listing::Unlisted
        }
    }

    /// The listing of a tenant.
    pub(crate) fn tenant(&self, tenant: &Tenant) -> Listing {
        if self.deny.tenants.contains(tenant.id()) {
            Listing::Denied
        } else if self.allow.tenants.contains(tenant.id()) {
            Listing::Allowed
        } else {
            Listing::Unlisted
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;

    fn ip(text: &str) -> Key {
        Key::ip(text.parse::<IpAddr>().unwrap())
    }

    /// Keys hold an IPv4 client (IPv4-mapped or not) as its IPv4 address: an IPv4-mapped
    /// network on a list is its IPv4 network, or it would never match one.
    #[test]
    fn an_ipv4_mapped_network_lists_its_ipv4_clients() {
        let parse = |entries: &[&str]| -> Vec<Listed> {
            entries.iter().map(|entry| entry.parse().unwrap()).collect()
        };
        let deny = parse(&["::ffff:10.0.0.0/104", "::ffff:192.0.2.7"]);
        let allow = parse(&["::ffff:172.16.0.0/108"]);
        let lists = Lists::new(&allow, &deny);
        assert_eq!(lists.key(&ip("10.1.2.3")), Listing::Denied);
        assert_eq!(lists.key(&ip("::ffff:10.1.2.3")), Listing::Denied);
        assert_eq!(lists.key(&ip("192.0.2.7")), Listing::Denied);
        assert_eq!(lists.key(&ip("172.17.0.1")), Listing::Allowed);
        assert_eq!(lists.key(&ip("11.0.0.1")), Listing::Unlisted);

        // The whole IPv4-mapped range is every IPv4 client; one bit less is not a mapped network.
        let every_ipv4 = Lists::new(&[], &parse(&["::ffff:0:0/96"]));
        assert_eq!(every_ipv4.key(&ip("198.51.100.1")), Listing::Denied);
        let wider = Lists::new(&[], &parse(&["::ffff:0:0/95"]));
        assert_eq!(wider.key(&ip("198.51.100.1")), Listing::Unlisted);
    }
}
