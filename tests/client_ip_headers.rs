//! The client-IP table: spoof attempts, malformed values, several header lines, quoted IPv6
//! with ports, obfuscated nodes, `unknown`, IPv4-mapped IPv6, empty entries, whitespace, and
//! `Forwarded` mixed with `X-Forwarded-For`, each with the key it must give.

use std::net::{IpAddr, SocketAddr};

use http::HeaderValue;
use tollgate::key::{ClientIp, Extracted, KeyExtractor, ProxyHeader};

const TRUSTED_PEER: &str = "10.0.0.1";
const UNTRUSTED_PEER: &str = "203.0.113.50";
const CLIENT: &str = "198.51.100.7";

fn cidr() -> ClientIp {
    ClientIp::new()
        .parse_trusted_proxies(["10.0.0.0/8", "127.0.0.0/8", "2001:db8:ffff::/48"])
        .unwrap()
}

fn cidr_forwarded() -> ClientIp {
    cidr().header(ProxyHeader::Forwarded)
}

struct Case {
    name: &'static str,
    extractor: ClientIp,
    peer: &'static str,
    headers: Vec<(&'static str, String)>,
    want: String,
}

fn case(
    name: &'static str,
    extractor: ClientIp,
    peer: &'static str,
    headers: &[(&'static str, &str)],
    want: &str,
) -> Case {
    Case {
        name,
        extractor,
        peer,
        headers: headers.iter().map(|(n, v)| (*n, (*v).to_owned())).collect(),
        want: want.to_owned(),
    }
}

const XFF: &str = "x-forwarded-for";
const FWD: &str = "forwarded";

fn cases() -> Vec<Case> {
    let many_trusted = {
        let mut entries = vec![CLIENT.to_owned()];
        entries.extend((0..33).map(|i| format!("10.0.1.{i}")));
        entries.join(", ")
    };
    vec![
        // Spoof attempts.
        case(
            "no trust: X-Forwarded-For ignored",
            ClientIp::new(),
            UNTRUSTED_PEER,
            &[(XFF, "1.2.3.4")],
            UNTRUSTED_PEER,
        ),
        case(
            "no trust: Forwarded ignored",
            ClientIp::new(),
            UNTRUSTED_PEER,
            &[(FWD, "for=1.2.3.4")],
            UNTRUSTED_PEER,
        ),
        case(
            "untrusted peer: X-Forwarded-For ignored",
            cidr(),
            UNTRUSTED_PEER,
            &[(XFF, "1.2.3.4")],
            UNTRUSTED_PEER,
        ),
        case(
            "untrusted peer: X-Real-IP ignored",
            cidr().header(ProxyHeader::XRealIp),
            UNTRUSTED_PEER,
            &[("x-real-ip", "1.2.3.4")],
            UNTRUSTED_PEER,
        ),
        case(
            "prepended entry is not the client",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "1.2.3.4, 198.51.100.7")],
            CLIENT,
        ),
        case(
            "prepended trusted-looking entry",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "10.9.9.9, 198.51.100.7")],
            CLIENT,
        ),
        case(
            "many prepended entries",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "6.6.6.6, 7.7.7.7, 8.8.8.8, 198.51.100.7")],
            CLIENT,
        ),
        case(
            "two trusted proxies",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "1.2.3.4, 198.51.100.7, 10.0.0.5")],
            CLIENT,
        ),
        case(
            "client line, then proxy line",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "1.2.3.4"), (XFF, "198.51.100.7")],
            CLIENT,
        ),
        case(
            "lines joined in order",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "198.51.100.7"), (XFF, "10.0.0.5, 10.0.0.6")],
            CLIENT,
        ),
        case(
            "X-Real-IP not chosen: ignored",
            cidr(),
            TRUSTED_PEER,
            &[("x-real-ip", "1.2.3.4")],
            TRUSTED_PEER,
        ),
        case(
            "client's Forwarded ignored in X-Forwarded-For mode",
            cidr(),
            TRUSTED_PEER,
            &[(FWD, "for=1.2.3.4"), (XFF, "198.51.100.7")],
            CLIENT,
        ),
        case(
            "client's X-Forwarded-For ignored in Forwarded mode",
            cidr_forwarded(),
            TRUSTED_PEER,
            &[(XFF, "1.2.3.4"), (FWD, "for=198.51.100.7")],
            CLIENT,
        ),
        case(
            "Forwarded mode, only a client X-Forwarded-For",
            cidr_forwarded(),
            TRUSTED_PEER,
            &[(XFF, "1.2.3.4")],
            TRUSTED_PEER,
        ),
        case(
            "Forwarded: client's unbalanced quote",
            cidr_forwarded(),
            TRUSTED_PEER,
            &[(FWD, "for=\"1.2.3.4, for=198.51.100.7")],
            CLIENT,
        ),
        case(
            "Forwarded: client's element then proxy line",
            cidr_forwarded(),
            TRUSTED_PEER,
            &[
                (FWD, "for=1.2.3.4"),
                (FWD, "for=198.51.100.7, for=10.0.0.5"),
            ],
            CLIENT,
        ),
        // No usable entry: the peer.
        case(
            "trusted peer, no header",
            cidr(),
            TRUSTED_PEER,
            &[],
            TRUSTED_PEER,
        ),
        case(
            "every hop trusted",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "10.0.0.7, 10.0.0.5")],
            TRUSTED_PEER,
        ),
        case(
            "more trusted hops than read",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, &many_trusted)],
            TRUSTED_PEER,
        ),
        case(
            "empty header",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "")],
            TRUSTED_PEER,
        ),
        case(
            "only commas and spaces",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, " , ,\t,")],
            TRUSTED_PEER,
        ),
        // Malformed values.
        case(
            "garbage",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "garbage")],
            TRUSTED_PEER,
        ),
        case(
            "garbage at the client's position",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "198.51.100.7, garbage")],
            TRUSTED_PEER,
        ),
        case(
            "garbage left of the client",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "garbage, \"x, 198.51.100.7")],
            CLIENT,
        ),
        case(
            "leading zeros",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "01.02.03.04")],
            TRUSTED_PEER,
        ),
        case(
            "five octets",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "1.2.3.4.5")],
            TRUSTED_PEER,
        ),
        case(
            "host name",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "example.com")],
            TRUSTED_PEER,
        ),
        case(
            "IPv6 zone id",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "fe80::1%eth0")],
            TRUSTED_PEER,
        ),
        case(
            "overlong entry",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, &format!("1.2.3.4:{}", "9".repeat(70)))],
            TRUSTED_PEER,
        ),
        case(
            "X-Real-IP with a list",
            cidr().header(ProxyHeader::XRealIp),
            TRUSTED_PEER,
            &[("x-real-ip", "1.2.3.4, 5.6.7.8")],
            TRUSTED_PEER,
        ),
        // Ports, empty entries, whitespace.
        case(
            "IPv4 with port",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "198.51.100.7:5555")],
            CLIENT,
        ),
        case(
            "empty entries",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, ",,198.51.100.7,,")],
            CLIENT,
        ),
        case(
            "whitespace and tabs",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, " \t198.51.100.7\t ")],
            CLIENT,
        ),
        case(
            "bracketed IPv6 with port",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "[2001:db8:1:2::9]:443")],
            "2001:db8:1:2::",
        ),
        // unknown and obfuscated.
        case(
            "unknown",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "unknown")],
            TRUSTED_PEER,
        ),
        case(
            "unknown at the client's position",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "198.51.100.7, unknown")],
            TRUSTED_PEER,
        ),
        case(
            "Forwarded obfuscated node",
            cidr_forwarded(),
            TRUSTED_PEER,
            &[(FWD, "for=_hidden")],
            TRUSTED_PEER,
        ),
        case(
            "Forwarded obfuscated node with port",
            cidr_forwarded(),
            TRUSTED_PEER,
            &[(FWD, "for=\"_hidden:_port\", for=198.51.100.7")],
            CLIENT,
        ),
        case(
            "Forwarded unknown",
            cidr_forwarded(),
            TRUSTED_PEER,
            &[(FWD, "for=unknown")],
            TRUSTED_PEER,
        ),
        // IPv4-mapped IPv6 and IPv6 grouping.
        case(
            "IPv4-mapped client",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "::ffff:198.51.100.7")],
            CLIENT,
        ),
        case(
            "IPv4-mapped trusted proxy",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "198.51.100.7, ::ffff:10.0.0.5")],
            CLIENT,
        ),
        case(
            "IPv4-mapped trusted peer",
            cidr(),
            "::ffff:10.0.0.1",
            &[(XFF, "198.51.100.7")],
            CLIENT,
        ),
        case(
            "IPv4-mapped untrusted peer",
            ClientIp::new(),
            "::ffff:203.0.113.50",
            &[],
            UNTRUSTED_PEER,
        ),
        case(
            "IPv6 client grouped by /64",
            cidr(),
            TRUSTED_PEER,
            &[(XFF, "2001:db8:1:2:aaaa::1")],
            "2001:db8:1:2::",
        ),
        case(
            "IPv6 client, /128",
            cidr().ipv6_prefix(128),
            TRUSTED_PEER,
            &[(XFF, "2001:db8:1:2:aaaa::1")],
            "2001:db8:1:2:aaaa::1",
        ),
        case(
            "IPv6 trusted peer",
            cidr(),
            "2001:db8:ffff::1",
            &[(XFF, "198.51.100.7")],
            CLIENT,
        ),
        case(
            "IPv6 untrusted peer grouped",
            cidr(),
            "2001:db8:1:2::77",
            &[(XFF, "198.51.100.7")],
            "2001:db8:1:2::",
        ),
        // Forwarded syntax.
        case(
            "Forwarded quoted IPv6 with port",
            cidr_forwarded(),
            TRUSTED_PEER,
            &[(FWD, "for=\"[2001:db8:cafe::17]:4711\"")],
            "2001:db8:cafe::",
        ),
        case(
            "Forwarded several elements",
            cidr_forwarded(),
            TRUSTED_PEER,
            &[(
                FWD,
                "for=1.2.3.4, for=198.51.100.7;proto=https, for=10.0.0.5",
            )],
            CLIENT,
        ),
        case(
            "Forwarded case-insensitive names",
            cidr_forwarded(),
            TRUSTED_PEER,
            &[(FWD, "For=198.51.100.7;Proto=https")],
            CLIENT,
        ),
        case(
            "Forwarded quoted commas in other parameters",
            cidr_forwarded(),
            TRUSTED_PEER,
            &[(FWD, "for=198.51.100.7;by=\"[2001:db8::1]\";host=\"a,b;c\"")],
            CLIENT,
        ),
        case(
            "Forwarded quoted IPv4",
            cidr_forwarded(),
            TRUSTED_PEER,
            &[(FWD, "for=\"198.51.100.7\"")],
            CLIENT,
        ),
        case(
            "Forwarded element without for",
            cidr_forwarded(),
            TRUSTED_PEER,
            &[(FWD, "proto=https")],
            TRUSTED_PEER,
        ),
        case(
            "Forwarded element with two for",
            cidr_forwarded(),
            TRUSTED_PEER,
            &[(FWD, "for=1.2.3.4;for=198.51.100.7")],
            TRUSTED_PEER,
        ),
        case(
            "Forwarded escaped quote",
            cidr_forwarded(),
            TRUSTED_PEER,
            &[(FWD, "for=\"\\\"1.2.3.4\"")],
            TRUSTED_PEER,
        ),
        case(
            "Forwarded empty elements",
            cidr_forwarded(),
            TRUSTED_PEER,
            &[(FWD, ", ,for=198.51.100.7, ,")],
            CLIENT,
        ),
        // Hop count.
        case(
            "one hop",
            ClientIp::new().trusted_hops(1),
            UNTRUSTED_PEER,
            &[(XFF, "1.2.3.4, 198.51.100.7")],
            CLIENT,
        ),
        case(
            "two hops",
            ClientIp::new().trusted_hops(2),
            TRUSTED_PEER,
            &[(XFF, "1.2.3.4, 198.51.100.7, 10.0.0.5")],
            CLIENT,
        ),
        case(
            "two hops, empty entries",
            ClientIp::new().trusted_hops(2),
            TRUSTED_PEER,
            &[(XFF, "1.2.3.4, 198.51.100.7, , 10.0.0.5")],
            CLIENT,
        ),
        case(
            "fewer entries than hops",
            ClientIp::new().trusted_hops(2),
            TRUSTED_PEER,
            &[(XFF, "198.51.100.7")],
            TRUSTED_PEER,
        ),
        case(
            "hops over lines",
            ClientIp::new().trusted_hops(2),
            TRUSTED_PEER,
            &[(XFF, "198.51.100.7"), (XFF, "10.0.0.5")],
            CLIENT,
        ),
        case(
            "one hop, Forwarded IPv6",
            ClientIp::new()
                .trusted_hops(1)
                .header(ProxyHeader::Forwarded),
            TRUSTED_PEER,
            &[(FWD, "for=1.2.3.4, for=\"[2001:db8::5]\"")],
            "2001:db8::",
        ),
        case(
            "one hop, unknown",
            ClientIp::new().trusted_hops(1),
            TRUSTED_PEER,
            &[(XFF, "1.2.3.4, unknown")],
            TRUSTED_PEER,
        ),
        // Single-value headers.
        case(
            "X-Real-IP from a trusted peer",
            cidr().header(ProxyHeader::XRealIp),
            TRUSTED_PEER,
            &[("x-real-ip", CLIENT)],
            CLIENT,
        ),
        case(
            "X-Real-IP: last line wins",
            cidr().header(ProxyHeader::XRealIp),
            TRUSTED_PEER,
            &[("x-real-ip", "1.2.3.4"), ("x-real-ip", CLIENT)],
            CLIENT,
        ),
        case(
            "CF-Connecting-IP IPv6",
            cidr().header(ProxyHeader::CfConnectingIp),
            TRUSTED_PEER,
            &[("cf-connecting-ip", "2001:db8:1:2:3:4:5:6")],
            "2001:db8:1:2::",
        ),
        case(
            "True-Client-IP",
            cidr().header(ProxyHeader::TrueClientIp),
            TRUSTED_PEER,
            &[("true-client-ip", CLIENT)],
            CLIENT,
        ),
        case(
            "Fly-Client-IP",
            cidr().header(ProxyHeader::FlyClientIp),
            TRUSTED_PEER,
            &[("fly-client-ip", CLIENT)],
            CLIENT,
        ),
        case(
            "custom single header",
            cidr().header(ProxyHeader::Single(http::HeaderName::from_static(
                "x-client",
            ))),
            TRUSTED_PEER,
            &[("x-client", CLIENT)],
            CLIENT,
        ),
        case(
            "single header absent",
            cidr().header(ProxyHeader::FlyClientIp),
            TRUSTED_PEER,
            &[(XFF, "1.2.3.4")],
            TRUSTED_PEER,
        ),
    ]
}

fn run(case: &Case) -> Option<String> {
    let mut request = http::Request::get("/");
    for (name, value) in &case.headers {
        request = request.header(*name, HeaderValue::from_str(value).unwrap());
    }
    let (mut parts, ()) = request.body(()).unwrap().into_parts();
    let peer: IpAddr = case.peer.parse().unwrap();
    parts.extensions.insert(SocketAddr::new(peer, 40000));
    let key = match case.extractor.extract(&parts) {
        Extracted::Found(key) => key,
        Extracted::Missing => return None,
        Extracted::Pending(_) => panic!("client IP is synchronous"),
    };
    assert!(
        key.as_ip().is_some(),
        "{}: not an IP key: {key:?}",
        case.name
    );
    Some(key.to_string())
}

#[test]
fn header_table() {
    let cases = cases();
    assert!(cases.len() >= 40, "{} cases", cases.len());
    let mut failures = Vec::new();
    for case in &cases {
        let got = run(case);
        if got.as_deref() != Some(case.want.as_str()) {
            failures.push(format!("{}: got {got:?}, want {:?}", case.name, case.want));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    println!("{} header cases passed", cases.len());
}

#[test]
fn ten_thousand_entries_stop_at_the_client() {
    let mut entries: Vec<String> = (0..10_000)
        .map(|i| format!("192.0.{}.{}", i / 256 % 256, i % 256))
        .collect();
    entries.push(CLIENT.to_owned());
    entries.push("10.0.0.5".to_owned());
    let header = entries.join(", ");
    let c = case("10k", cidr(), TRUSTED_PEER, &[(XFF, &header)], CLIENT);
    assert_eq!(run(&c).as_deref(), Some(CLIENT));
    // Every entry trusted: at most MAX_HOPS are read, then the peer.
    let header = vec!["10.0.0.9"; 10_000].join(",");
    let c = case(
        "10k trusted",
        cidr(),
        TRUSTED_PEER,
        &[(XFF, &header)],
        TRUSTED_PEER,
    );
    assert_eq!(run(&c).as_deref(), Some(TRUSTED_PEER));
    let header = vec!["for=10.0.0.9"; 10_000].join(",");
    let c = case(
        "10k Forwarded",
        cidr_forwarded(),
        TRUSTED_PEER,
        &[(FWD, &header)],
        TRUSTED_PEER,
    );
    assert_eq!(run(&c).as_deref(), Some(TRUSTED_PEER));
}

#[test]
fn no_peer_no_key_in_cidr_mode() {
    let (parts, ()) = http::Request::get("/")
        .header(XFF, CLIENT)
        .body(())
        .unwrap()
        .into_parts();
    assert!(matches!(cidr().extract(&parts), Extracted::Missing));
    // A hop count does not need the peer.
    let key = ClientIp::new().trusted_hops(1).extract(&parts).found();
    assert_eq!(key.map(|k| k.to_string()).as_deref(), Some(CLIENT));
}
