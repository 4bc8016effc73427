//! Fuzzes the forwarding-header parsers and the client-IP decision.
//!
//! The input is split at newlines into header lines (bytes a header value cannot hold become
//! spaces), used as `X-Forwarded-For`, `Forwarded` and `X-Real-IP`. Besides "never panics", it
//! checks that:
//!
//! * with trusted proxies and a list header, the client is the peer or an untrusted address;
//! * whatever the lines hold, an entry a trusted proxy appends after them is the client (the
//!   client's prefix never changes the key);
//! * a text key made of the input is bounded and free of braces, whitespace and control
//!   characters.

#![no_main]

use std::net::IpAddr;

use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;
use tollgate::key::forwarded::{self, Node};
use tollgate::key::{ClientIp, Key, MAX_TEXT_KEY_LEN, ProxyHeader};

const CLIENT: &str = "198.51.100.7";

fn sanitize(line: &[u8]) -> HeaderValue {
    let bytes: Vec<u8> = line
        .iter()
        .map(|&b| {
            if b == b'\t' || (b >= 0x20 && b != 0x7f) {
                b
            } else {
                b' '
            }
        })
        .collect();
    HeaderValue::from_bytes(&bytes).expect("sanitized header value")
}

fn headers(lines: &[HeaderValue], suffix: Option<(&str, &str)>) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, extra) in [
        ("x-forwarded-for", suffix.map(|s| s.0)),
        ("forwarded", suffix.map(|s| s.1)),
    ] {
        let mut lines = lines.to_vec();
        if let Some(extra) = extra {
            match lines.last_mut() {
                Some(last) => {
                    let mut joined = last.as_bytes().to_vec();
                    joined.extend_from_slice(b", ");
                    joined.extend_from_slice(extra.as_bytes());
                    *last = HeaderValue::from_bytes(&joined).unwrap();
                }
                None => lines.push(HeaderValue::from_str(extra).unwrap()),
            }
        }
        for line in lines {
            map.append(name, line);
        }
    }
    if let Some(line) = lines.first() {
        map.append("x-real-ip", line.clone());
    }
    map
}

fn trusted(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.octets()[0] == 10,
        IpAddr::V6(v6) => v6.segments()[0] >> 8 == 0xfd,
    }
}

fuzz_target!(|data: &[u8]| {
    let lines: Vec<HeaderValue> = data.split(|&b| b == b'\n').take(8).map(sanitize).collect();

    for line in &lines {
        let bytes = line.as_bytes();
        let xff = forwarded::x_forwarded_for(bytes).count();
        let fwd = forwarded::forwarded(bytes).count();
        // Each entry or element is at least one byte and one separator.
        assert!(xff <= bytes.len() / 2 + 1 && fwd <= bytes.len() / 2 + 1);
        if let Node::Ip(ip) = forwarded::parse_node(bytes) {
            assert_eq!(ip, ip.to_canonical());
        }
    }

    let cidr = ClientIp::new()
        .parse_trusted_proxies(["10.0.0.0/8", "fd00::/8"])
        .unwrap();
    let extractors = [
        cidr.clone(),
        cidr.clone().header(ProxyHeader::Forwarded),
        cidr.clone().header(ProxyHeader::XRealIp),
        ClientIp::new().trusted_hops(1),
        ClientIp::new()
            .trusted_hops(3)
            .header(ProxyHeader::Forwarded),
        ClientIp::new(),
    ];
    let peer: IpAddr = "10.0.0.1".parse().unwrap();
    let plain = headers(&lines, None);
    for (i, extractor) in extractors.iter().enumerate() {
        let found = extractor
            .resolve(Some(peer), &plain)
            .expect("a peer always gives a key");
        // The list headers never name a trusted proxy as the client (a single-value header may:
        // the proxy set it to whatever address it saw).
        if i < 2 {
            assert!(
                found == peer || !trusted(found),
                "trusted address {found} taken as client"
            );
        }
    }

    // A trusted proxy appends the client: the client's lines must not matter.
    let client: IpAddr = CLIENT.parse().unwrap();
    let appended = headers(&lines, Some((CLIENT, "for=198.51.100.7")));
    for extractor in [
        cidr.clone(),
        cidr.clone().header(ProxyHeader::Forwarded),
        ClientIp::new().trusted_hops(1),
        ClientIp::new()
            .trusted_hops(1)
            .header(ProxyHeader::Forwarded),
    ] {
        assert_eq!(extractor.resolve(Some(peer), &appended), Some(client));
    }

    // Text keys are bounded and safe inside a Redis Cluster hash tag.
    let key = Key::text(String::from_utf8_lossy(data));
    let text = key.to_string();
    assert!(text.len() <= MAX_TEXT_KEY_LEN);
    assert!(
        !text
            .chars()
            .any(|c| matches!(c, '{' | '}' | '|' | '~') || c.is_control() || c.is_whitespace())
    );
    assert!(text.parse::<IpAddr>().is_err() && text != "global");
});
