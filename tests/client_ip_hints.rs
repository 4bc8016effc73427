//! Misconfiguration hints: said once through `tracing`, not on every request, and without the
//! client addresses.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tollgate::key::{ClientIp, KeyExtractor, PeerIp};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

/// Collects the text of WARN events.
#[derive(Clone, Default)]
struct Warnings(Arc<Mutex<Vec<String>>>);

struct Text(String);

impl Visit for Text {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!("{}={value:?} ", field.name()));
    }
}

impl Subscriber for Warnings {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        *metadata.level() <= Level::WARN
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut text = Text(String::new());
        event.record(&mut text);
        self.0.lock().unwrap().push(text.0);
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

fn warnings(f: impl FnOnce()) -> Vec<String> {
    let warnings = Warnings::default();
    tracing::subscriber::with_default(warnings.clone(), f);
    warnings.0.lock().unwrap().clone()
}

fn extract_n(extractor: &impl KeyExtractor, peer: [u8; 4], headers: &[(&str, &str)], n: usize) {
    for _ in 0..n {
        let mut request = http::Request::get("/");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let (mut parts, ()) = request.body(()).unwrap().into_parts();
        parts.extensions.insert(SocketAddr::from((peer, 1234)));
        assert!(extractor.extract(&parts).found().is_some());
    }
}

fn cidr() -> ClientIp {
    ClientIp::new()
        .parse_trusted_proxies(["10.0.0.0/8"])
        .unwrap()
}

fn assert_once_without_clients(warnings: &[String], about: &str) {
    assert_eq!(warnings.len(), 1, "{warnings:#?}");
    assert!(warnings[0].contains(about), "{}", warnings[0]);
    for client in ["198.51.100.7", "6.6.6.6"] {
        assert!(
            !warnings[0].contains(client),
            "logged a client address: {}",
            warnings[0]
        );
    }
}

#[test]
fn forwarded_headers_with_no_trusted_proxy() {
    let w = warnings(|| {
        let extractor = ClientIp::new();
        extract_n(&extractor, [192, 0, 2, 1], &[], 5);
        extract_n(
            &extractor,
            [192, 0, 2, 1],
            &[("x-forwarded-for", "6.6.6.6")],
            10,
        );
    });
    assert_once_without_clients(&w, "no proxy is trusted");
    // PeerIp gives the same hint, once per process.
    let w = warnings(|| {
        extract_n(
            &PeerIp::new(),
            [192, 0, 2, 1],
            &[("forwarded", "for=6.6.6.6")],
            10,
        )
    });
    assert_once_without_clients(&w, "no proxy is trusted");
}

#[test]
fn forwarded_headers_from_an_untrusted_peer() {
    let w = warnings(|| {
        extract_n(
            &cidr(),
            [192, 168, 1, 9],
            &[("x-forwarded-for", "6.6.6.6")],
            10,
        )
    });
    assert_once_without_clients(&w, "not a trusted proxy");
    // An internal peer address is named, as it helps to fix the list.
    assert!(w[0].contains("192.168.1.9"), "{}", w[0]);
    // A public one is not.
    let w = warnings(|| {
        extract_n(
            &cidr(),
            [203, 0, 113, 5],
            &[("x-forwarded-for", "6.6.6.6")],
            3,
        )
    });
    assert!(!w[0].contains("203.0.113.5"), "{}", w[0]);
}

#[test]
fn every_hop_trusted() {
    let w = warnings(|| {
        extract_n(
            &cidr(),
            [10, 0, 0, 1],
            &[("x-forwarded-for", "10.1.1.1, 10.2.2.2")],
            10,
        )
    });
    assert_once_without_clients(&w, "every entry");
    let w = warnings(|| {
        extract_n(
            &ClientIp::new().trusted_hops(3),
            [10, 0, 0, 1],
            &[("x-forwarded-for", "198.51.100.7")],
            10,
        )
    });
    assert_once_without_clients(&w, "fewer forwarding entries than trusted hops");
}

#[test]
fn unusable_client_entries() {
    let w = warnings(|| {
        extract_n(
            &cidr(),
            [10, 0, 0, 1],
            &[("x-forwarded-for", "6.6.6.6, unknown")],
            10,
        )
    });
    assert_once_without_clients(&w, "`unknown`");
}

#[test]
fn a_correct_configuration_says_nothing() {
    let w = warnings(|| {
        extract_n(
            &cidr(),
            [10, 0, 0, 1],
            &[("x-forwarded-for", "6.6.6.6, 198.51.100.7")],
            10,
        );
        extract_n(&cidr(), [10, 0, 0, 1], &[], 10);
        extract_n(&cidr(), [198, 51, 100, 7], &[], 10);
    });
    assert!(w.is_empty(), "{w:#?}");
}

/// Sends `n` requests from the proxy at 10.0.0.1 for the client 198.51.100.7, through `layer`,
/// with the tenant header when `tenant` is given.
fn through_proxy(layer: &tollgate::RateLimitLayer, tenant: Option<&str>, n: usize) {
    use tower::{Layer, ServiceExt};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    for _ in 0..n {
        let service = layer.layer(tower::service_fn(|_: http::Request<()>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(()))
        }));
        let mut request = http::Request::get("/").header("x-forwarded-for", "198.51.100.7");
        if let Some(tenant) = tenant {
            request = request.header("x-api-key", tenant);
        }
        let mut request = request.body(()).unwrap();
        request
            .extensions_mut()
            .insert(SocketAddr::from(([10, 0, 0, 1], 1234)));
        let response = runtime.block_on(service.oneshot(request)).unwrap();
        assert!(response.status().is_success() || response.status() == 429);
    }
}

fn tenant_layer(key: Option<ClientIp>) -> tollgate::RateLimitLayer {
    use tollgate::policy::{Policy, Tenant, TenantFromHeader, Tier};
    use tollgate::{Quota, Rule};
    let builder = tollgate::RateLimitLayer::builder()
        .policy(
            Policy::new("v1")
                .tier(Tier::new("free").rule(Rule::new("free", Quota::per_minute(1000))))
                .default_tier("free"),
        )
        .tenant(TenantFromHeader::new("x-api-key").lookup(|key: &str| Some(Tenant::new(key))));
    match key {
        Some(key) => builder.key(key),
        None => builder,
    }
    .build()
    .unwrap()
}

#[test]
fn requests_without_a_tenant_behind_a_proxy_counted_by_the_peer() {
    // A tenant layer without a key: its requests without a tenant are counted by the proxy's
    // address, one budget for every anonymous client.
    let layer = tenant_layer(None);
    let w = warnings(|| {
        // Requests with a tenant are counted by it: nothing to say yet.
        through_proxy(&layer, Some("acme"), 3);
        through_proxy(&layer, None, 10);
    });
    assert_once_without_clients(&w, "without a tenant");
    assert!(
        w[0].contains(".key(ClientIp"),
        "says what to change: {}",
        w[0]
    );
    // Once per layer.
    let w = warnings(|| through_proxy(&layer, None, 3));
    assert!(w.is_empty(), "{w:#?}");
    // The right setup: the layer's key reads the client through the proxy.
    let w = warnings(|| {
        let layer = tenant_layer(Some(cidr()));
        through_proxy(&layer, Some("acme"), 3);
        through_proxy(&layer, None, 10);
    });
    assert!(w.is_empty(), "{w:#?}");
}
