//! [`ClientIp`]: the client's address, read through the proxies you trust and no others.

use crate::throttle::Once;
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use http::request::Parts;
use http::{HeaderMap, HeaderName};
use ipnet::IpNet;

use super::forwarded::{self, FORWARDED, Node, X_FORWARDED_FOR};
use super::{Extracted, Key, KeyExtractor, PeerIp, canonical_ip};
use crate::ConfigError;

/// The most forwarding entries read per request, from the right.
///
/// A chain of more trusted proxies than this counts as "every hop trusted" and falls back to
/// the socket peer. This bounds the work per request whatever the header holds.
pub const MAX_HOPS: usize = 32;

/// Which header carries the client address when the peer is a trusted proxy.
///
/// Choose the one your proxy writes (and make it overwrite or append, never pass through,
/// headers of the other kinds). The others are ignored, so a client cannot add a header your
/// proxy does not touch.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ProxyHeader {
    /// `X-Forwarded-For` (the default): a list, proxies append.
    #[default]
    XForwardedFor,
    /// RFC 7239 `Forwarded`: a list of elements, the `for=` parameter of each.
    Forwarded,
    /// `X-Real-IP` (nginx `proxy_set_header X-Real-IP $remote_addr`): one address.
    XRealIp,
    /// `CF-Connecting-IP` (Cloudflare): one address.
    CfConnectingIp,
    /// `True-Client-IP` (Akamai, Cloudflare Enterprise): one address.
    TrueClientIp,
    /// `Fly-Client-IP` (Fly.io): one address.
    FlyClientIp,
    /// Another header that holds one address, set by your proxy.
    Single(HeaderName),
}

impl ProxyHeader {
    fn name(&self) -> HeaderName {
        match self {
            ProxyHeader::XForwardedFor => X_FORWARDED_FOR,
            ProxyHeader::Forwarded => FORWARDED,
            ProxyHeader::XRealIp => HeaderName::from_static("x-real-ip"),
            ProxyHeader::CfConnectingIp => HeaderName::from_static("cf-connecting-ip"),
            ProxyHeader::TrueClientIp => HeaderName::from_static("true-client-ip"),
            ProxyHeader::FlyClientIp => HeaderName::from_static("fly-client-ip"),
            ProxyHeader::Single(name) => name.clone(),
        }
    }
}

#[derive(Clone)]
enum Trust {
    Nobody,
    Networks(Arc<Networks>),
    Hops(usize),
}

/// Trusted networks as (network, mask) pairs, IPv4 and IPv6 apart.
#[derive(Debug, Default)]
struct Networks {
    v4: Vec<(u32, u32)>,
    v6: Vec<(u128, u128)>,
}

impl Networks {
    fn add(&mut self, net: IpNet) {
        // An IPv4-mapped network (::ffff:a.b.c.d/96+) is an IPv4 network. A NAT64 network
        // stays an IPv6 one: its addresses are IPv4 clients only when global.
        let net = super::identity::canonical_net(net);
        let bits = u32::from(net.prefix_len());
        match net {
            IpNet::V4(v4) => {
                let mask = u32::MAX.checked_shl(32 - bits).unwrap_or(0);
                self.v4.push((u32::from(v4.addr()) & mask, mask));
            }
            IpNet::V6(v6) => {
                let mask = u128::MAX.checked_shl(128 - bits).unwrap_or(0);
                self.v6.push((u128::from(v6.addr()) & mask, mask));
            }
        }
    }

    /// `ip` must be canonical (IPv4-mapped addresses as IPv4).
    fn contains(&self, ip: IpAddr) -> bool {
        match ip {
            IpAddr::V4(v4) => {
                let ip = u32::from(v4);
                self.v4.iter().any(|&(net, mask)| ip & mask == net)
            }
            IpAddr::V6(v6) => {
                let ip = u128::from(v6);
                self.v6.iter().any(|&(net, mask)| ip & mask == net)
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.v4.is_empty() && self.v6.is_empty()
    }
}

/// The misconfiguration hints, each reported once per extractor.
#[derive(Default)]
struct Hints {
    untrusted: Once,
    all_trusted: Once,
    unusable: Once,
}

/// The client's IP address, read through the proxies you trust and no others.
///
/// ```
/// use std::net::SocketAddr;
/// use tollgate::key::{ClientIp, Key, KeyExtractor};
///
/// // Behind a load balancer in 10.0.0.0/8 that appends to X-Forwarded-For.
/// let client_ip = ClientIp::new().parse_trusted_proxies(["10.0.0.0/8"])?;
///
/// let (mut parts, ()) = http::Request::get("/")
///     .header("x-forwarded-for", "6.6.6.6, 203.0.113.7, 10.0.0.3") // 6.6.6.6: made up by the client
///     .body(())
///     .unwrap()
///     .into_parts();
/// parts.extensions.insert(SocketAddr::from(([10, 0, 0, 2], 41000))); // the load balancer
/// let key = client_ip.extract(&parts).found();
/// assert_eq!(key, Some(Key::ip("203.0.113.7".parse().unwrap())));
/// # Ok::<(), tollgate::ConfigError>(())
/// ```
///
/// # How the address is found
///
/// 1. The socket peer, as [`PeerIp`] finds it: axum's `ConnectInfo<SocketAddr>`, a `SocketAddr`
///    extension, or tonic's `TcpConnectInfo` (so gRPC needs no interceptor).
/// 2. If no proxy is trusted (the default), that is the client: forwarding headers are ignored.
/// 3. With [`trusted_proxies`](ClientIp::trusted_proxies) (a CIDR list): only if the peer is a
///    trusted proxy, the entries of the chosen header are read from the right, skipping trusted
///    addresses; the first untrusted one is the client. At most [`MAX_HOPS`] entries are read.
/// 4. With [`trusted_hops`](ClientIp::trusted_hops)`(n)`: the `n`th entry from the right.
/// 5. With a single-value header ([`ProxyHeader::XRealIp`], [`ProxyHeader::CfConnectingIp`],
///    …), chosen explicitly: its value (last line), if the peer is trusted. With a hop count the
///    peer cannot be checked, so the header is believed from any peer: choose a single-value
///    header with `trusted_hops` only when every request reaches the service through a proxy that
///    overwrites that header (the hop count itself says the service is never reached directly).
///
/// The leftmost entries are never used for their own sake: anything left of the entries your
/// proxies wrote was written by the client.
///
/// # When no address is found
///
/// The key falls back to the socket peer when the entry at the client's position is `unknown`,
/// obfuscated or malformed, when every entry is a trusted proxy, or when there are fewer entries
/// than trusted hops. Without a peer address (the server did not record one) the key is missing
/// and the request is counted under the rule's shared [`Key::unidentified`] key, which the layer
/// reports once. Nothing here panics.
///
/// Misconfigurations are reported once each through `tracing` (never on every request):
/// forwarding headers arriving while no proxy is trusted or from an untrusted peer, every hop
/// being trusted, and unusable client entries. Client addresses are not logged.
///
/// IPv4-mapped IPv6 addresses count as IPv4, for trust and for keys. IPv6 clients are grouped by
/// their /64 by default ([`ipv6_prefix`](ClientIp::ipv6_prefix)): one host is given a whole /64
/// and could otherwise rotate through it. IP keys do not allocate.
///
///
/// Cheap to clone; clones share their "reported once" state.
#[derive(Clone)]
pub struct ClientIp {
    trust: Trust,
    header: ProxyHeader,
    v6_prefix: u8,
    hints: Arc<Hints>,
}

impl ClientIp {
    /// The socket peer, no proxy trusted; IPv6 grouped by /64. Forwarding headers are ignored
    /// (reported once, as they suggest a proxy that is not configured).
    pub fn new() -> Self {
        ClientIp {
            trust: Trust::Nobody,
            header: ProxyHeader::XForwardedFor,
            v6_prefix: 64,
            hints: Arc::default(),
        }
    }

    /// Trusts the proxies in these networks (single addresses convert to /32 or /128): the
    /// client is the rightmost address of the chosen header that is not in them. Replaces any
    /// earlier trust setting; an empty list trusts nobody.
    ///
    /// ```
    /// use tollgate::key::{ClientIp, IpNet};
    ///
    /// let net: IpNet = "10.0.0.0/8".parse().unwrap();
    /// let ip: std::net::IpAddr = "192.0.2.10".parse().unwrap();
    /// let client_ip = ClientIp::new().trusted_proxies([net, ip.into()]);
    /// # let _ = client_ip;
    /// ```
    pub fn trusted_proxies<N: Into<IpNet>>(
        mut self,
        networks: impl IntoIterator<Item = N>,
    ) -> Self {
        let mut nets = Networks::default();
        for net in networks {
            nets.add(net.into());
        }
        self.trust = if nets.is_empty() {
            Trust::Nobody
        } else {
            Trust::Networks(Arc::new(nets))
        };
        self
    }

    /// [`trusted_proxies`](ClientIp::trusted_proxies) from text: CIDR networks (`10.0.0.0/8`,
    /// `2001:db8::/32`) or single addresses.
    ///
    /// # Errors
    ///
    /// An entry that is neither, with a message naming it.
    pub fn parse_trusted_proxies<S: AsRef<str>>(
        self,
        networks: impl IntoIterator<Item = S>,
    ) -> Result<Self, ConfigError> {
        let mut parsed = Vec::new();
        for text in networks {
            let text = text.as_ref().trim();
            let net = text
                .parse::<IpNet>()
                .or_else(|_| text.parse::<IpAddr>().map(IpNet::from))
                .map_err(|_| {
                    ConfigError::new(format!(
                        "trusted proxy {text:?} is not an IP network or address; \
                         write it like \"10.0.0.0/8\", \"2001:db8::/32\" or \"192.0.2.10\""
                    ))
                })?;
            parsed.push(net);
        }
        Ok(self.trusted_proxies(parsed))
    }

    /// Trusts the nearest `hops` proxies whatever their addresses: the client is the `hops`th
    /// entry from the right of the chosen header. 0 trusts nobody; at most [`MAX_HOPS`] (larger
    /// values count as [`MAX_HOPS`]).
    ///
    /// Use this only when every request reaches the service through exactly that many proxies:
    /// a client that can connect directly can then write the header itself. Prefer
    /// [`trusted_proxies`](ClientIp::trusted_proxies) when you know the proxies' networks.
    pub fn trusted_hops(mut self, hops: u8) -> Self {
        self.trust = match usize::from(hops) {
            0 => Trust::Nobody,
            n => Trust::Hops(n.min(MAX_HOPS)),
        };
        self
    }

    /// The header the trusted proxies write (default: [`ProxyHeader::XForwardedFor`]).
    pub fn header(mut self, header: ProxyHeader) -> Self {
        self.header = header;
        self
    }

    /// Groups IPv6 clients by their first `bits` bits (default 64; 128: one key per address;
    /// larger values count as 128).
    pub fn ipv6_prefix(mut self, bits: u8) -> Self {
        self.v6_prefix = bits.min(128);
        self
    }

    /// The client's full address for this request (not grouped by prefix), or `None` when the
    /// server recorded no peer address and no trusted header names one.
    pub fn client_addr(&self, parts: &Parts) -> Option<IpAddr> {
        self.resolve(PeerIp::peer_addr(parts), &parts.headers)
    }

    /// The client's full address from a peer address and request headers: the whole decision,
    /// without a request.
    ///
    /// ```
    /// use tollgate::key::ClientIp;
    ///
    /// let client_ip = ClientIp::new().trusted_hops(1);
    /// let mut headers = http::HeaderMap::new();
    /// headers.insert("x-forwarded-for", "1.1.1.1, 192.0.2.9".parse().unwrap());
    /// let peer = "10.0.0.1".parse().ok();
    /// assert_eq!(client_ip.resolve(peer, &headers), "192.0.2.9".parse().ok());
    /// ```
    pub fn resolve(&self, peer: Option<IpAddr>, headers: &HeaderMap) -> Option<IpAddr> {
        let peer = peer.map(canonical_ip);
        match &self.trust {
            Trust::Nobody => {
                if !self.hints.untrusted.done() {
                    hint_no_trust(headers, &self.hints.untrusted);
                }
                peer
            }
            Trust::Networks(nets) => {
                let peer = peer?;
                if !nets.contains(peer) {
                    if !self.hints.untrusted.done() {
                        self.hint_untrusted_peer(headers, peer);
                    }
                    return Some(peer);
                }
                let found = match &self.header {
                    ProxyHeader::XForwardedFor => {
                        self.rightmost_untrusted(nets, forwarded::x_forwarded_for_all(headers))
                    }
                    ProxyHeader::Forwarded => {
                        self.rightmost_untrusted(nets, forwarded::forwarded_all(headers))
                    }
                    single => self.single(headers, single),
                };
                Some(found.unwrap_or(peer))
            }
            Trust::Hops(hops) => {
                let found = match &self.header {
                    ProxyHeader::XForwardedFor => {
                        self.nth_hop(*hops, forwarded::x_forwarded_for_all(headers))
                    }
                    ProxyHeader::Forwarded => {
                        self.nth_hop(*hops, forwarded::forwarded_all(headers))
                    }
                    single => self.single(headers, single),
                };
                found.or(peer)
            }
        }
    }

    fn rightmost_untrusted(
        &self,
        nets: &Networks,
        nodes: impl Iterator<Item = Node>,
    ) -> Option<IpAddr> {
        let mut seen = false;
        for node in nodes.take(MAX_HOPS) {
            seen = true;
            match node {
                Node::Ip(ip) if nets.contains(ip) => {}
                Node::Ip(ip) => return Some(ip),
                node => {
                    self.hint_unusable(node);
                    return None;
                }
            }
        }
        if seen && self.hints.all_trusted.first() {
            tracing::warn!(
                header = %self.header.name(),
                "tollgate: every entry of a forwarding header (up to {MAX_HOPS}) is a trusted \
                 proxy, so the client address is unknown and the key falls back to the socket \
                 peer. If clients can be inside a trusted network, narrow trusted_proxies. \
                 Reported once."
            );
        }
        None
    }

    fn nth_hop(&self, hops: usize, mut nodes: impl Iterator<Item = Node>) -> Option<IpAddr> {
        match nodes.nth(hops - 1) {
            Some(Node::Ip(ip)) => Some(ip),
            Some(node) => {
                self.hint_unusable(node);
                None
            }
            None => {
                if self.hints.all_trusted.first() {
                    tracing::warn!(
                        header = %self.header.name(),
                        hops,
                        "tollgate: a request has fewer forwarding entries than trusted hops, so \
                         the key falls back to the socket peer. Check the hop count, and whether \
                         requests can reach the service without passing every proxy. Reported \
                         once."
                    );
                }
                None
            }
        }
    }

    fn single(&self, headers: &HeaderMap, header: &ProxyHeader) -> Option<IpAddr> {
        let value = headers.get_all(header.name()).into_iter().next_back()?;
        match forwarded::parse_node(value.as_bytes()) {
            Node::Ip(ip) => Some(ip),
            node => {
                self.hint_unusable(node);
                None
            }
        }
    }

    fn hint_unusable(&self, node: Node) {
        if self.hints.unusable.first() {
            let what = match node {
                Node::Unknown => "`unknown`",
                Node::Obfuscated => "an obfuscated identifier",
                _ => "not an IP address",
            };
            tracing::warn!(
                header = %self.header.name(),
                "tollgate: the client entry of a forwarding header is {what}, so the key falls \
                 back to the socket peer. Reported once."
            );
        }
    }

    fn hint_untrusted_peer(&self, headers: &HeaderMap, peer: IpAddr) {
        let name = self.header.name();
        if headers.contains_key(&name) && self.hints.untrusted.first() {
            // Infrastructure addresses help to fix the configuration; public ones may be
            // clients and are not logged.
            let peer = if is_internal(peer) {
                peer.to_string()
            } else {
                "a public address".to_owned()
            };
            tracing::warn!(
                header = %name,
                peer = %peer,
                "tollgate: a request carries a forwarding header but its socket peer is not a \
                 trusted proxy, so the header is ignored and the key is the peer. If that peer \
                 is your proxy, add its address or network to trusted_proxies. Reported once."
            );
        }
    }
}

/// Reports once, through `flag`, that forwarding headers arrive while no proxy is trusted.
pub(crate) fn hint_no_trust(headers: &HeaderMap, flag: &Once) {
    if !flag.done()
        && (headers.contains_key(X_FORWARDED_FOR) || headers.contains_key(FORWARDED))
        && flag.first()
    {
        tracing::warn!(
            "tollgate: a request carries X-Forwarded-For or Forwarded but no proxy is trusted, \
             so the header is ignored and the client IP is the socket peer. Behind a reverse \
             proxy, trust it: ClientIp::new().trusted_proxies([..]) or .trusted_hops(n). \
             Reported once."
        );
    }
}

/// Loopback, private, shared (CGNAT), link-local and unique-local addresses.
fn is_internal(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || (a == 100 && (64..128).contains(&b))
        }
        IpAddr::V6(v6) => {
            let first = v6.segments()[0];
            v6.is_loopback() || (first & 0xfe00) == 0xfc00 || (first & 0xffc0) == 0xfe80
        }
    }
}

impl Default for ClientIp {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for ClientIp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("ClientIp");
        match &self.trust {
            Trust::Nobody => d.field("trusted", &"nobody"),
            Trust::Networks(nets) => d.field("trusted_networks", &(nets.v4.len() + nets.v6.len())),
            Trust::Hops(hops) => d.field("trusted_hops", hops),
        };
        d.field("header", &self.header)
            .field("ipv6_prefix", &self.v6_prefix)
            .finish()
    }
}

impl KeyExtractor for ClientIp {
    fn extract(&self, parts: &Parts) -> Extracted {
        self.client_addr(parts)
            .map(|ip| Key::ip_prefix(ip, self.v6_prefix))
            .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn networks_match_canonical_addresses() {
        let mut nets = Networks::default();
        nets.add("10.0.0.0/8".parse().unwrap());
        nets.add("::ffff:192.168.0.0/112".parse().unwrap());
        nets.add("2001:db8::/32".parse().unwrap());
        assert!(nets.contains("10.1.2.3".parse().unwrap()));
        assert!(nets.contains("192.168.7.7".parse().unwrap()));
        assert!(nets.contains("2001:db8:ffff::1".parse().unwrap()));
        assert!(!nets.contains("2001:db9::1".parse().unwrap()));
        let mut none = Networks::default();
        none.add("10.0.0.1/32".parse().unwrap());
        assert!(!none.contains("10.0.0.2".parse().unwrap()));
        assert!(none.contains("10.0.0.1".parse().unwrap()));
    }

    #[test]
    fn internal_addresses() {
        for ip in [
            "127.0.0.1",
            "10.1.1.1",
            "172.16.0.1",
            "192.168.1.1",
            "100.64.0.1",
            "::1",
            "fd00::1",
            "fe80::1",
        ] {
            assert!(is_internal(ip.parse().unwrap()), "{ip}");
        }
        for ip in ["8.8.8.8", "100.128.0.1", "2001:db8::1"] {
            assert!(!is_internal(ip.parse().unwrap()), "{ip}");
        }
    }

    #[test]
    fn bad_trusted_proxy_is_a_config_error() {
        let err = ClientIp::new()
            .parse_trusted_proxies(["10.0.0.0/33"])
            .unwrap_err();
        assert!(err.to_string().contains("10.0.0.0/33"), "{err}");
        assert!(
            ClientIp::new()
                .parse_trusted_proxies([" 192.0.2.1 ", "::1/128"])
                .is_ok()
        );
    }
}
