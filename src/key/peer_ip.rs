use std::net::{IpAddr, SocketAddr};

use http::request::Parts;

use crate::throttle::Once;

use super::client_ip::hint_no_trust;
use super::{Extracted, Key, KeyExtractor};

/// The address of the socket peer: the client, or the last proxy in front of the service.
///
/// ```
/// use std::net::SocketAddr;
/// use tollgate::key::{Key, KeyExtractor, PeerIp};
///
/// let (mut parts, ()) = http::Request::new(()).into_parts();
/// parts.extensions.insert(SocketAddr::from(([203, 0, 113, 7], 40000)));
/// let key = PeerIp::new().extract(&parts).found().unwrap();
/// assert_eq!(key.to_string(), "203.0.113.7");
/// ```
///
/// It reads, in this order: axum's `ConnectInfo<SocketAddr>` (feature `axum`; serve with
/// `into_make_service_with_connect_info::<SocketAddr>()`), a `SocketAddr` request extension, and
/// tonic's `TcpConnectInfo` (feature `tonic`, on by default). IPv6 clients are grouped by their
/// /64 by default. With none of these present the key is missing: the request is counted under
/// the rule's shared [`Key::unidentified`] key, and the layer says so
/// once through `tracing`.
///
/// Forwarded headers are never read here: a client can write them. Behind a proxy, use
/// [`ClientIp`](super::ClientIp), which trusts only the proxy's own entries. When a request
/// carries `X-Forwarded-For` or `Forwarded` anyway, this is reported once per process through
/// `tracing`, as a hint that a proxy may need configuring.
#[derive(Clone, Copy, Debug)]
pub struct PeerIp {
    v6_prefix: u8,
}

impl PeerIp {
    /// The peer address, IPv6 grouped by /64.
    pub const fn new() -> Self {
        PeerIp { v6_prefix: 64 }
    }

    /// Groups IPv6 peers by their first `bits` bits (128: one key per address).
    pub const fn ipv6_prefix(mut self, bits: u8) -> Self {
        self.v6_prefix = if bits > 128 { 128 } else { bits };
        self
    }

    /// The peer address of a request, if the server recorded one.
    pub fn peer_addr(parts: &Parts) -> Option<IpAddr> {
        #[cfg(feature = "axum")]
        if let Some(info) = parts
            .extensions
            .get::<axum::extract::ConnectInfo<SocketAddr>>()
        {
            return Some(info.0.ip());
        }
        if let Some(addr) = parts.extensions.get::<SocketAddr>() {
            return Some(addr.ip());
        }
        #[cfg(feature = "tonic")]
        if let Some(info) = parts
            .extensions
            .get::<tonic::transport::server::TcpConnectInfo>()
        {
            return info.remote_addr().map(|addr| addr.ip());
        }
        None
    }
}

impl Default for PeerIp {
    fn default() -> Self {
        Self::new()
    }
}

/// Whether the "forwarding headers but no trusted proxy" hint was given by a `PeerIp`.
static HINTED: Once = Once::new();

impl KeyExtractor for PeerIp {
    fn extract(&self, parts: &Parts) -> Extracted {
        hint_no_trust(&parts.headers, &HINTED);
        Self::peer_addr(parts)
            .map(|ip| Key::ip_prefix(ip, self.v6_prefix))
            .into()
    }
}
