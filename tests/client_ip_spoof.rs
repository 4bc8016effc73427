//! Whatever a client prepends to `X-Forwarded-For` or `Forwarded` (entries, garbage, unbalanced
//! quotes, extra header lines), the key a trusted-proxy configuration extracts does not change.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use http::HeaderValue;
use proptest::prelude::*;
use tollgate::key::{ClientIp, Extracted, Key, KeyExtractor, ProxyHeader};

#[derive(Clone, Copy, Debug)]
enum Mode {
    CidrXff,
    CidrForwarded,
    HopsXff,
    HopsForwarded,
}

impl Mode {
    fn forwarded(self) -> bool {
        matches!(self, Mode::CidrForwarded | Mode::HopsForwarded)
    }

    fn extractor(self, proxies: usize) -> ClientIp {
        let cidr = || {
            ClientIp::new()
                .parse_trusted_proxies(["10.0.0.0/8", "fd00::/8"])
                .unwrap()
        };
        let hops = || ClientIp::new().trusted_hops(proxies as u8);
        match self {
            Mode::CidrXff => cidr(),
            Mode::CidrForwarded => cidr().header(ProxyHeader::Forwarded),
            Mode::HopsXff => hops(),
            Mode::HopsForwarded => hops().header(ProxyHeader::Forwarded),
        }
    }
}

fn is_trusted(ip: IpAddr) -> bool {
    match ip.to_canonical() {
        IpAddr::V4(v4) => v4.octets()[0] == 10,
        IpAddr::V6(v6) => v6.segments()[0] >> 8 == 0xfd,
    }
}

fn client_ip() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        any::<[u8; 4]>().prop_map(|o| IpAddr::V4(Ipv4Addr::from(o))),
        any::<[u16; 8]>().prop_map(|s| IpAddr::V6(Ipv6Addr::from(s))),
    ]
    .prop_filter("untrusted", |ip| !is_trusted(*ip))
}

fn proxy_ip() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        any::<[u8; 3]>().prop_map(|[a, b, c]| IpAddr::V4(Ipv4Addr::new(10, a, b, c))),
        any::<[u16; 7]>().prop_map(|s| {
            IpAddr::V6(Ipv6Addr::new(
                0xfd00, s[0], s[1], s[2], s[3], s[4], s[5], s[6],
            ))
        }),
    ]
}

/// What a client may write in a header line: header-ish tokens and arbitrary legal bytes.
fn client_line() -> impl Strategy<Value = Vec<u8>> {
    let token = prop_oneof![
        Just(b",".to_vec()),
        Just(b", ".to_vec()),
        Just(b";".to_vec()),
        Just(b"\"".to_vec()),
        Just(b"\\".to_vec()),
        Just(b"for=".to_vec()),
        Just(b"unknown".to_vec()),
        Just(b"_obf".to_vec()),
        Just(b"[".to_vec()),
        Just(b"]:80".to_vec()),
        Just(b" \t".to_vec()),
        any::<[u8; 4]>().prop_map(|o| Ipv4Addr::from(o).to_string().into_bytes()),
        proxy_ip().prop_map(|ip| ip.to_string().into_bytes()),
        proptest::collection::vec(prop_oneof![0x20u8..0x7f, Just(b'\t'), 0x80u8..=0xff], 1..12),
    ];
    proptest::collection::vec(token, 0..12).prop_map(|tokens| tokens.concat())
}

/// How a proxy writes the address it saw.
fn entry(ip: IpAddr, forwarded: bool, port: Option<u16>) -> String {
    match (forwarded, ip, port) {
        (false, ip, _) => ip.to_string(),
        (true, IpAddr::V4(v4), None) => format!("for={v4}"),
        (true, IpAddr::V4(v4), Some(port)) => format!("for=\"{v4}:{port}\""),
        (true, IpAddr::V6(v6), None) => format!("for=\"[{v6}]\""),
        (true, IpAddr::V6(v6), Some(port)) => format!("for=\"[{v6}]:{port}\";proto=https"),
    }
}

/// The header lines after a chain of proxies: the first saw the client, each next one the one
/// before. A proxy either appends to the last line (nginx joins lines, then appends) or adds a
/// line of its own (HAProxy).
fn chain(
    client_lines: &[Vec<u8>],
    hops: &[(IpAddr, bool, Option<u16>)],
    forwarded: bool,
) -> Vec<Vec<u8>> {
    let mut lines: Vec<Vec<u8>> = client_lines.to_vec();
    for &(ip, new_line, port) in hops {
        let entry = entry(ip, forwarded, port).into_bytes();
        if new_line || lines.is_empty() {
            lines.push(entry);
        } else {
            let joined = lines.join(&b", "[..]);
            let mut line = joined;
            line.extend_from_slice(b", ");
            line.extend_from_slice(&entry);
            lines = vec![line];
        }
    }
    lines
}

fn extract(extractor: &ClientIp, header: &str, lines: &[Vec<u8>], peer: IpAddr) -> Option<Key> {
    let mut request = http::Request::get("/");
    for line in lines {
        request = request.header(header, HeaderValue::from_bytes(line).unwrap());
    }
    let (mut parts, ()) = request.body(()).unwrap().into_parts();
    parts.extensions.insert(SocketAddr::new(peer, 443));
    match extractor.extract(&parts) {
        Extracted::Found(key) => Some(key),
        Extracted::Missing => None,
        Extracted::Pending(_) => panic!("client IP is synchronous"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn prepended_entries_never_change_the_key(
        mode in prop_oneof![Just(Mode::CidrXff), Just(Mode::CidrForwarded), Just(Mode::HopsXff), Just(Mode::HopsForwarded)],
        client in client_ip(),
        proxies in proptest::collection::vec((proxy_ip(), any::<bool>(), proptest::option::of(any::<u16>())), 1..5),
        client_lines in proptest::collection::vec(client_line(), 0..4),
    ) {
        let forwarded = mode.forwarded();
        let header = if forwarded { "forwarded" } else { "x-forwarded-for" };
        // Proxy i appends the address it saw: the client for the first, proxy i-1 for the next.
        let mut hops = Vec::new();
        let mut seen = client;
        for &(proxy, new_line, port) in &proxies {
            hops.push((seen, new_line, port));
            seen = proxy;
        }
        let peer = seen;
        let extractor = mode.extractor(proxies.len());

        let honest = extract(&extractor, header, &chain(&[], &hops, forwarded), peer);
        let attacked = extract(&extractor, header, &chain(&client_lines, &hops, forwarded), peer);
        let want = Key::ip_prefix(client, 64);
        prop_assert_eq!(honest.as_ref(), Some(&want));
        prop_assert_eq!(attacked.as_ref(), Some(&want));
    }
}
