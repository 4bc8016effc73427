//! Parsers of the forwarding headers: `X-Forwarded-For` and RFC 7239 `Forwarded`.
//!
//! ```
//! use std::net::IpAddr;
//! use tollgate::key::forwarded::{self, Node};
//!
//! // Entries come rightmost first: the nearest proxy's entry is the first one you see.
//! let mut xff = forwarded::x_forwarded_for(b"198.51.100.1, [2001:db8::7]:443, 10.0.0.2");
//! assert_eq!(xff.next(), Some(Node::Ip("10.0.0.2".parse().unwrap())));
//! assert_eq!(xff.next(), Some(Node::Ip("2001:db8::7".parse().unwrap())));
//! assert_eq!(xff.next(), Some(Node::Ip("198.51.100.1".parse().unwrap())));
//! assert_eq!(xff.next(), None);
//!
//! let fwd = forwarded::forwarded(br#"for=unknown, for="[2001:db8::1]:4711";proto=https, for=_hidden"#);
//! let nodes: Vec<Node> = fwd.collect();
//! assert_eq!(nodes, [Node::Obfuscated, Node::Ip("2001:db8::1".parse().unwrap()), Node::Unknown]);
//! ```
//!
//! These are pure functions over the bytes of one header line; [`x_forwarded_for_all`] and
//! [`forwarded_all`] walk every line of a request, last line first. They never allocate, never
//! panic, and each entry is scanned once, so the work is linear in the bytes actually read.
//! Scanning from the right is also what keeps a client's garbage harmless: the entries a
//! trusted proxy appended are read before (and without regard to) whatever the client wrote to
//! their left, unbalanced quotes included.
//!
//! # What an entry may be
//!
//! An IPv4 address, an IPv6 address (bare, or in brackets as `Forwarded` requires), either with
//! a port (`1.2.3.4:80`, `[::1]:443`, or an obfuscated `_port`), `unknown`, or an obfuscated
//! identifier (`_abc`, RFC 7239 section 6.3). IPv4-mapped IPv6 addresses come out as IPv4.
//! Anything else (host names, zone ids, entries longer than [`MAX_NODE_LEN`] bytes, quoted
//! strings with backslash escapes) is [`Node::Invalid`]. Empty entries (`a,,b`) and empty
//! `Forwarded` elements are skipped, as the list syntax of RFC 9110 allows.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use http::header::{GetAll, HeaderValue};
use http::{HeaderMap, HeaderName};

use super::canonical_ip;

/// `X-Forwarded-For`.
pub const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// `Forwarded` (RFC 7239).
pub const FORWARDED: HeaderName = http::header::FORWARDED;

/// Entries longer than this (after removing whitespace and quotes) are [`Node::Invalid`] without
/// being parsed: the longest address with a port, `[ffff:…:255.255.255.255]:65535`, is 53 bytes.
pub const MAX_NODE_LEN: usize = 64;

/// One hop of a forwarding header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Node {
    /// An address (any port removed; IPv4-mapped IPv6 as IPv4).
    Ip(IpAddr),
    /// `unknown`: the proxy did not know the address.
    Unknown,
    /// An obfuscated identifier such as `_hidden` (RFC 7239 section 6.3).
    Obfuscated,
    /// Anything else, including a `Forwarded` element without `for=` (or with two).
    Invalid,
}

impl Node {
    /// The address, if this node is one.
    pub fn ip(self) -> Option<IpAddr> {
        match self {
            Node::Ip(ip) => Some(ip),
            _ => None,
        }
    }
}

/// The entries of one `X-Forwarded-For` line, rightmost first.
pub fn x_forwarded_for(value: &[u8]) -> XForwardedFor<'_> {
    XForwardedFor { rest: Some(value) }
}

/// The `for=` nodes of the elements of one `Forwarded` line, rightmost first.
pub fn forwarded(value: &[u8]) -> Forwarded<'_> {
    Forwarded { rest: Some(value) }
}

/// The `X-Forwarded-For` entries of every line of `headers`, rightmost first (the last line's
/// last entry first), as if the lines were joined in order with commas.
pub fn x_forwarded_for_all(headers: &HeaderMap) -> impl Iterator<Item = Node> + '_ {
    lines(headers.get_all(X_FORWARDED_FOR)).flat_map(|v| x_forwarded_for(v.as_bytes()))
}

/// The `Forwarded` nodes of every line of `headers`, rightmost first.
pub fn forwarded_all(headers: &HeaderMap) -> impl Iterator<Item = Node> + '_ {
    lines(headers.get_all(FORWARDED)).flat_map(|v| forwarded(v.as_bytes()))
}

fn lines(all: GetAll<'_, HeaderValue>) -> impl Iterator<Item = &HeaderValue> {
    all.into_iter().rev()
}

/// Iterator over one `X-Forwarded-For` line, rightmost entry first. See [`x_forwarded_for`].
#[derive(Clone, Debug)]
pub struct XForwardedFor<'a> {
    rest: Option<&'a [u8]>,
}

impl Iterator for XForwardedFor<'_> {
    type Item = Node;

    fn next(&mut self) -> Option<Node> {
        loop {
            let rest = self.rest?;
            let entry = match rest.iter().rposition(|&b| b == b',') {
                Some(comma) => {
                    self.rest = Some(&rest[..comma]);
                    &rest[comma + 1..]
                }
                None => {
                    self.rest = None;
                    rest
                }
            };
            let entry = trim(entry);
            if !entry.is_empty() {
                return Some(parse_node(entry));
            }
        }
    }
}

/// Iterator over one `Forwarded` line, rightmost element first, yielding each element's `for=`
/// node. See [`forwarded`].
#[derive(Clone, Debug)]
pub struct Forwarded<'a> {
    rest: Option<&'a [u8]>,
}

impl Iterator for Forwarded<'_> {
    type Item = Node;

    fn next(&mut self) -> Option<Node> {
        loop {
            let rest = self.rest?;
            let mut element = Element::default();
            let mut in_quote = false;
            let mut pair_end = rest.len();
            let mut i = rest.len();
            let mut boundary = None;
            while i > 0 {
                i -= 1;
                let b = rest[i];
                if in_quote {
                    if b == b'"' && !is_escaped(rest, i) {
                        in_quote = false;
                    }
                    continue;
                }
                match b {
                    b'"' => in_quote = true,
                    b';' => {
                        element.pair(&rest[i + 1..pair_end]);
                        pair_end = i;
                    }
                    b',' => {
                        boundary = Some(i);
                        break;
                    }
                    _ => {}
                }
            }
            match boundary {
                Some(comma) => {
                    element.pair(&rest[comma + 1..pair_end]);
                    self.rest = Some(&rest[..comma]);
                }
                None => {
                    self.rest = None;
                    if in_quote {
                        // An unbalanced quote: the whole remainder is one broken element.
                        return Some(Node::Invalid);
                    }
                    element.pair(&rest[..pair_end]);
                }
            }
            if element.pairs > 0 {
                return Some(element.node());
            }
        }
    }
}

/// Whether the quote at `i` is escaped by an odd run of backslashes before it.
fn is_escaped(bytes: &[u8], i: usize) -> bool {
    let run = bytes[..i].iter().rev().take_while(|&&b| b == b'\\').count();
    run % 2 == 1
}

#[derive(Default)]
struct Element<'a> {
    pairs: u32,
    fors: u32,
    value: &'a [u8],
}

impl<'a> Element<'a> {
    fn pair(&mut self, pair: &'a [u8]) {
        let pair = trim(pair);
        if pair.is_empty() {
            return;
        }
        self.pairs += 1;
        let Some(eq) = pair.iter().position(|&b| b == b'=') else {
            return;
        };
        if trim(&pair[..eq]).eq_ignore_ascii_case(b"for") {
            self.fors += 1;
            self.value = trim(&pair[eq + 1..]);
        }
    }

    fn node(&self) -> Node {
        if self.fors != 1 {
            return Node::Invalid;
        }
        let value = self.value;
        match value {
            [b'"', inner @ .., b'"'] => {
                if inner.contains(&b'\\') {
                    Node::Invalid
                } else {
                    parse_node(inner)
                }
            }
            _ if value.contains(&b'"') => Node::Invalid,
            _ => parse_node(value),
        }
    }
}

/// Removes optional whitespace (spaces and tabs) from both ends.
fn trim(mut bytes: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = bytes {
        bytes = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = bytes {
        bytes = rest;
    }
    bytes
}

/// Parses one node: `X-Forwarded-For` entry or the (unquoted) value of a `Forwarded` `for=`.
///
/// ```
/// use tollgate::key::forwarded::{Node, parse_node};
///
/// assert_eq!(parse_node(b" 192.0.2.60:8080 "), Node::Ip("192.0.2.60".parse().unwrap()));
/// assert_eq!(parse_node(b"[::ffff:192.0.2.60]"), Node::Ip("192.0.2.60".parse().unwrap()));
/// assert_eq!(parse_node(b"UNKNOWN"), Node::Unknown);
/// assert_eq!(parse_node(b"_gazonk"), Node::Obfuscated);
/// assert_eq!(parse_node(b"example.com"), Node::Invalid);
/// ```
pub fn parse_node(node: &[u8]) -> Node {
    let node = trim(node);
    if node.is_empty() || node.len() > MAX_NODE_LEN {
        return Node::Invalid;
    }
    // The common case first: a bare IPv4 address.
    if let Some(v4) = parse_ipv4(node) {
        return Node::Ip(IpAddr::V4(v4));
    }
    let (name, port) = if node[0] == b'[' {
        match node.iter().position(|&b| b == b']') {
            Some(close) => (&node[..=close], &node[close + 1..]),
            None => return Node::Invalid,
        }
    } else {
        let colons = node.iter().filter(|&&b| b == b':').count();
        match colons {
            1 => {
                let colon = node.iter().position(|&b| b == b':').unwrap_or(node.len());
                (&node[..colon], &node[colon..])
            }
            _ => (node, &node[node.len()..]),
        }
    };
    if !valid_port(port) {
        return Node::Invalid;
    }
    match name {
        [b'[', inner @ .., b']'] => match parse_str::<Ipv6Addr>(inner) {
            Some(v6) => Node::Ip(canonical_ip(IpAddr::V6(v6))),
            None => Node::Invalid,
        },
        [b'_', rest @ ..] if !rest.is_empty() && rest.iter().all(|&b| is_obf_char(b)) => {
            Node::Obfuscated
        }
        _ if name.eq_ignore_ascii_case(b"unknown") => Node::Unknown,
        _ if name.contains(&b':') => match parse_str::<Ipv6Addr>(name) {
            Some(v6) => Node::Ip(canonical_ip(IpAddr::V6(v6))),
            None => Node::Invalid,
        },
        _ => match parse_ipv4(name) {
            Some(v4) => Node::Ip(IpAddr::V4(v4)),
            None => Node::Invalid,
        },
    }
}

/// Dotted-quad IPv4 as `Ipv4Addr::from_str` accepts it (four decimal octets of at most 255, no
/// leading zeros), without going through `str`: this is the hot path of every proxied request.
fn parse_ipv4(bytes: &[u8]) -> Option<Ipv4Addr> {
    let mut octets = [0u8; 4];
    let mut parts = bytes.split(|&b| b == b'.');
    for octet in &mut octets {
        let part = parts.next()?;
        if part.is_empty() || part.len() > 3 || (part.len() > 1 && part[0] == b'0') {
            return None;
        }
        let mut value: u16 = 0;
        for &digit in part {
            if !digit.is_ascii_digit() {
                return None;
            }
            value = value * 10 + u16::from(digit - b'0');
        }
        *octet = u8::try_from(value).ok()?;
    }
    if parts.next().is_some() {
        return None;
    }
    Some(Ipv4Addr::from(octets))
}

/// `""`, `:` and 1 to 5 digits, or `:_` and an obfuscated port.
fn valid_port(port: &[u8]) -> bool {
    match port {
        [] => true,
        [b':', b'_', rest @ ..] => !rest.is_empty() && rest.iter().all(|&b| is_obf_char(b)),
        [b':', digits @ ..] => {
            (1..=5).contains(&digits.len()) && digits.iter().all(u8::is_ascii_digit)
        }
        _ => false,
    }
}

fn is_obf_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')
}

fn parse_str<T: std::str::FromStr>(bytes: &[u8]) -> Option<T> {
    std::str::from_utf8(bytes).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Node {
        Node::Ip(s.parse().unwrap())
    }

    #[test]
    fn xff_entries_rightmost_first_skipping_empty_ones() {
        let nodes: Vec<Node> = x_forwarded_for(b" ,1.1.1.1,, 2.2.2.2 ,\t3.3.3.3:80 , ").collect();
        assert_eq!(nodes, [ip("3.3.3.3"), ip("2.2.2.2"), ip("1.1.1.1")]);
        assert_eq!(x_forwarded_for(b"").count(), 0);
        assert_eq!(x_forwarded_for(b" , ,").count(), 0);
    }

    #[test]
    fn nodes() {
        assert_eq!(parse_node(b"2001:db8::1"), ip("2001:db8::1"));
        assert_eq!(parse_node(b"[2001:db8::1]:65535"), ip("2001:db8::1"));
        assert_eq!(parse_node(b"[2001:db8::1]:_p0rt"), ip("2001:db8::1"));
        assert_eq!(parse_node(b"[2001:db8::1]:"), Node::Invalid);
        assert_eq!(parse_node(b"[2001:db8::1]:123456"), Node::Invalid);
        assert_eq!(parse_node(b"[2001:db8::1"), Node::Invalid);
        assert_eq!(parse_node(b"[1.2.3.4]"), Node::Invalid);
        assert_eq!(parse_node(b"1.2.3.4:x"), Node::Invalid);
        assert_eq!(parse_node(b"01.2.3.4"), Node::Invalid);
        assert_eq!(parse_node(b"1.2.3"), Node::Invalid);
        assert_eq!(parse_node(b"fe80::1%eth0"), Node::Invalid);
        assert_eq!(parse_node(b"::ffff:10.0.0.1"), ip("10.0.0.1"));
        assert_eq!(parse_node(b"unknown:80"), Node::Unknown);
        assert_eq!(parse_node(b"_a.b-c_d:_x"), Node::Obfuscated);
        assert_eq!(parse_node(b"_"), Node::Invalid);
        assert_eq!(parse_node(b"_a b"), Node::Invalid);
        assert_eq!(parse_node("1.2.3.4\u{e9}".as_bytes()), Node::Invalid);
        assert_eq!(parse_node(&[b'1'; 65]), Node::Invalid);
    }

    #[test]
    fn ipv4_parser_agrees_with_std() {
        let samples = [
            "0.0.0.0",
            "255.255.255.255",
            "1.2.3.4",
            "256.1.1.1",
            "01.1.1.1",
            "1.1.1",
            "1.1.1.1.1",
            "1..1.1",
            "",
            ".",
            "1.1.1.1.",
            "+1.1.1.1",
            "1.1.1.a",
            "999.1.1.1",
            "10.0.0.00",
            "0.0.0.01",
        ];
        for s in samples {
            assert_eq!(
                parse_ipv4(s.as_bytes()),
                s.parse::<Ipv4Addr>().ok(),
                "{s:?}"
            );
        }
        for n in 0..=300u32 {
            for s in [
                format!("{n}.0.0.0"),
                format!("0{n}.1.1.1"),
                format!("1.1.1.{n}"),
            ] {
                assert_eq!(
                    parse_ipv4(s.as_bytes()),
                    s.parse::<Ipv4Addr>().ok(),
                    "{s:?}"
                );
            }
        }
    }

    #[test]
    fn forwarded_elements() {
        let nodes: Vec<Node> = forwarded(
            br#"for=192.0.2.43, for="[2001:db8:cafe::17]:4711";by=_p, proto=https;for=198.51.100.17;by="a,b;c""#,
        )
        .collect();
        assert_eq!(
            nodes,
            [
                ip("198.51.100.17"),
                ip("2001:db8:cafe::17"),
                ip("192.0.2.43")
            ]
        );
        // Case-insensitive names, whitespace around pairs.
        assert_eq!(
            forwarded(b" For = 1.2.3.4 ").collect::<Vec<_>>(),
            [ip("1.2.3.4")]
        );
        // No for=, two for=, escapes, stray quotes.
        assert_eq!(forwarded(b"by=1.2.3.4").next(), Some(Node::Invalid));
        assert_eq!(
            forwarded(b"for=1.2.3.4;for=5.6.7.8").next(),
            Some(Node::Invalid)
        );
        assert_eq!(forwarded(br#"for="\[::1\]""#).next(), Some(Node::Invalid));
        assert_eq!(forwarded(br#"for=1.2"3.4"#).next(), Some(Node::Invalid));
        // An escaped quote inside a quoted string does not end it.
        let nodes: Vec<Node> = forwarded(br#"for=1.1.1.1;ext="a\",b", for=2.2.2.2"#).collect();
        assert_eq!(nodes, [ip("2.2.2.2"), ip("1.1.1.1")]);
        // Empty elements are skipped.
        assert_eq!(forwarded(b" , ,for=1.2.3.4,,").count(), 1);
    }

    #[test]
    fn a_clients_unbalanced_quote_cannot_swallow_the_proxys_entry() {
        let mut nodes = forwarded(br#"for="1.2.3.4, for=203.0.113.9"#);
        assert_eq!(nodes.next(), Some(ip("203.0.113.9")));
        assert_eq!(nodes.next(), Some(Node::Invalid));
        assert_eq!(nodes.next(), None);
    }

    #[test]
    fn many_lines_are_read_last_first() {
        let mut headers = HeaderMap::new();
        headers.append(
            X_FORWARDED_FOR,
            HeaderValue::from_static("1.1.1.1, 2.2.2.2"),
        );
        headers.append(X_FORWARDED_FOR, HeaderValue::from_static("3.3.3.3"));
        headers.append(FORWARDED, HeaderValue::from_static("for=4.4.4.4"));
        headers.append(
            FORWARDED,
            HeaderValue::from_static("for=5.5.5.5, for=6.6.6.6"),
        );
        let xff: Vec<Node> = x_forwarded_for_all(&headers).collect();
        assert_eq!(xff, [ip("3.3.3.3"), ip("2.2.2.2"), ip("1.1.1.1")]);
        let fwd: Vec<Node> = forwarded_all(&headers).collect();
        assert_eq!(fwd, [ip("6.6.6.6"), ip("5.5.5.5"), ip("4.4.4.4")]);
    }

    #[test]
    fn ten_thousand_entries_are_read_one_by_one() {
        let header = vec!["192.0.2.1"; 10_000].join(", ");
        assert_eq!(x_forwarded_for(header.as_bytes()).count(), 10_000);
        let header = vec!["for=192.0.2.1"; 10_000].join(", ");
        assert_eq!(forwarded(header.as_bytes()).count(), 10_000);
    }
}
