//! How a Redis store signs in and whom it trusts over TLS: the credentials and certificates
//! given to a builder, applied to the connection settings parsed from a URL.

use std::fmt;
use std::sync::Arc;

use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo, RedisError};

use super::connection::Target;
#[cfg(feature = "tls")]
use super::connection::Tls;
use super::error::{AtServer, store_error};
use crate::ConfigError;
use crate::store::StoreError;

/// What a builder was given, besides the URL, to reach its servers.
#[derive(Clone, Default)]
pub(super) struct Access {
    /// The ACL user and its password, in place of the URL's.
    pub(super) credentials: Option<(String, String)>,
    /// The CA certificates (PEM) trusted for `rediss://` servers, in place of the system's.
    #[cfg(feature = "tls")]
    pub(super) ca: Option<Vec<u8>>,
    /// The client certificate chain and its private key (PEM).
    #[cfg(feature = "tls")]
    pub(super) client_cert: Option<(Vec<u8>, Vec<u8>)>,
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut f = f.debug_struct("Access");
        f.field(
            "username",
            &self.credentials.as_ref().map(|(user, _)| user.as_str()),
        );
        #[cfg(feature = "tls")]
        f.field("tls_ca", &self.ca.is_some())
            .field("tls_client_cert", &self.client_cert.is_some());
        f.finish_non_exhaustive()
    }
}

impl Access {
    /// Whether a CA or a client certificate was given (which only a `rediss://` URL can use).
    fn has_tls_settings(&self) -> bool {
        #[cfg(feature = "tls")]
        {
            self.ca.is_some() || self.client_cert.is_some()
        }
        #[cfg(not(feature = "tls"))]
        {
            false
        }
    }

    /// `url` as it may be shown: without its password, and with the user of
    /// [`credentials`](Access::credentials) in place of its own.
    pub(super) fn shown(&self, url: &str) -> String {
        let shown = redact(url);
        let Some((user, _)) = &self.credentials else {
            return shown;
        };
        let Some((scheme, rest)) = shown.split_once("://") else {
            return shown;
        };
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, path) = rest.split_at(authority_end);
        let host = authority
            .rsplit_once('@')
            .map_or(authority, |(_, host)| host);
        format!("{scheme}://{user}:***@{host}{path}")
    }

    /// The connection settings of `url` (for errors, `store` names the builder), with the
    /// credentials and the TLS settings applied.
    pub(super) fn connection_info(
        &self,
        store: &str,
        url: &str,
    ) -> Result<ConnectionInfo, ConfigError> {
        let shown = self.shown(url);
        let tls = is_tls(url);
        let invalid = |why: &dyn fmt::Display| {
            ConfigError::new(format!(
                "{store}: the URL {shown} is not valid ({why}); use {}://host:port",
                if tls { "rediss" } else { "redis" }
            ))
        };
        if tls && !cfg!(feature = "tls") {
            return Err(ConfigError::new(format!(
                "{store}: the URL {shown} asks for TLS (rediss://), which needs tollgate's \
                 feature `tls`; enable it in Cargo.toml (tollgate = {{ features = [\"tls\"] }})"
            )));
        }
        let mut info = url.into_connection_info().map_err(|e| invalid(&e))?;
        match info.addr() {
            ConnectionAddr::Tcp(..) | ConnectionAddr::TcpTls { .. } => {}
            _ => return Err(invalid(&"only TCP addresses are supported")),
        }
        if let Some((username, password)) = &self.credentials {
            let redis = info
                .redis_settings()
                .clone()
                .set_username(username)
                .set_password(password);
            info = info.set_redis_settings(redis);
        }
        let over_tls = matches!(info.addr(), ConnectionAddr::TcpTls { .. });
        if self.has_tls_settings() && !over_tls {
            return Err(ConfigError::new(format!(
                "{store}: tls_ca or tls_client_cert is set but the URL {shown} is not TLS; use \
                 rediss://host:port"
            )));
        }
        #[cfg(feature = "tls")]
        if over_tls {
            info = self.with_tls(store, info)?;
        }
        Ok(info)
    }

    /// Where the connections of `info` go (as [`connection_info`](Self::connection_info) made
    /// it), and how: over TLS with the CA and client certificate given, for a `rediss://` URL.
    pub(super) fn target(&self, info: &ConnectionInfo) -> Result<Target, ConfigError> {
        #[cfg(feature = "tls")]
        {
            let tls = match info.addr() {
                ConnectionAddr::TcpTls { insecure: true, .. } => {
                    return Err(ConfigError::new(
                        "a rediss:// URL with #insecure (no check of the server's certificate) \
                         is not supported; give the server's CA with tls_ca",
                    ));
                }
                ConnectionAddr::TcpTls { .. } => Some(Arc::new(Tls::new(
                    self.ca.clone(),
                    self.client_cert.clone(),
                ))),
                _ => None,
            };
            Ok(Target::new(info, tls))
        }
        #[cfg(not(feature = "tls"))]
        Ok(Target::new(info))
    }

    /// `info` (a `rediss://` address) with the CA and client certificate, checked now so that
    /// a wrong file fails the build rather than every connection.
    #[cfg(feature = "tls")]
    fn with_tls(&self, store: &str, info: ConnectionInfo) -> Result<ConnectionInfo, ConfigError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};

        install_crypto_provider();
        let certificates = |what: &str, pem: &[u8]| -> Result<(), ConfigError> {
            let parsed: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(pem).collect();
            match parsed {
                Ok(certs) if !certs.is_empty() => Ok(()),
                Ok(_) => Err(ConfigError::new(format!(
                    "{store}: {what} holds no certificate; give PEM text (-----BEGIN \
                     CERTIFICATE-----)"
                ))),
                Err(e) => Err(ConfigError::new(format!(
                    "{store}: {what} is not valid PEM ({e}); give PEM text (-----BEGIN \
                     CERTIFICATE-----)"
                ))),
            }
        };
        if let Some(ca) = &self.ca {
            certificates("tls_ca", ca)?;
        }
        if let Some((cert, key)) = &self.client_cert {
            certificates("tls_client_cert's certificate", cert)?;
            PrivateKeyDer::from_pem_slice(key).map_err(|e| {
                ConfigError::new(format!(
                    "{store}: tls_client_cert's key is not a PEM private key ({e}); give an \
                     unencrypted PKCS#8, PKCS#1 or SEC1 key (-----BEGIN PRIVATE KEY-----)"
                ))
            })?;
        }
        if !self.has_tls_settings() {
            // The system's roots, and no client certificate: as parsed.
            return Ok(info);
        }
        let certificates = redis::TlsCertificates {
            client_tls: self
                .client_cert
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig {
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                }),
            root_cert: self.ca.clone(),
        };
        let client = redis::Client::build_with_tls(info, certificates).map_err(|e| {
            ConfigError::new(format!("{store}: the TLS settings are not valid ({e})"))
        })?;
        Ok(client.get_connection_info().clone())
    }
}

/// The error of opening a connection to `server`: [`store_error`]'s, with what to change when
/// TLS refused the server's certificate or the server refused the client's.
pub(super) fn connect_error(server: &Arc<str>, error: RedisError) -> StoreError {
    match tls_hint(&error) {
        Some(hint) => {
            StoreError::Unavailable(Box::new(AtServer::new(server, format!("{error}: {hint}"))))
        }
        None => store_error(server, error),
    }
}

/// `error`, with what to change when it is a refused TLS certificate: for logs.
pub(super) fn explained(error: &RedisError) -> String {
    match tls_hint(error) {
        Some(hint) => format!("{error}: {hint}"),
        None => error.to_string(),
    }
}

/// What to change for a TLS failure (by the type rustls gives it).
#[cfg(feature = "tls")]
fn tls_hint(error: &RedisError) -> Option<&'static str> {
    use rustls::{AlertDescription, CertificateError};

    type Shared = Arc<dyn std::error::Error + Send + Sync>;
    // redis-rs keeps an I/O error in an `Arc`, and tokio-rustls a TLS error in an I/O error.
    let source = std::error::Error::source(error)?;
    let io = match source.downcast_ref::<Shared>() {
        Some(shared) => shared.downcast_ref::<std::io::Error>(),
        None => source.downcast_ref::<std::io::Error>(),
    }?;
    let tls = io.get_ref()?.downcast_ref::<rustls::Error>()?;
    Some(match tls {
        rustls::Error::InvalidCertificate(
            CertificateError::UnknownIssuer | CertificateError::BadSignature,
        ) => {
            "the server's TLS certificate is not signed by a CA this store trusts (the \
             system's roots, or those given to tls_ca); give the CA that signed it with tls_ca"
        }
        rustls::Error::InvalidCertificate(
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
        ) => {
            "the server's TLS certificate does not name the host of the URL; connect to a \
             name the certificate gives (tls_ca does not change this)"
        }
        rustls::Error::InvalidCertificate(
            CertificateError::Expired | CertificateError::ExpiredContext { .. },
        ) => "the server's TLS certificate has expired (or this machine's clock is wrong)",
        rustls::Error::InvalidCertificate(_) => {
            "the server's TLS certificate was refused; check it, and the CA given to tls_ca"
        }
        rustls::Error::AlertReceived(
            AlertDescription::CertificateRequired
            | AlertDescription::BadCertificate
            | AlertDescription::UnknownCA
            | AlertDescription::CertificateUnknown
            | AlertDescription::HandshakeFailure,
        ) => {
            "the server refused this client's TLS certificate, or wants one; give one that \
             its CA signed with tls_client_cert"
        }
        _ => return None,
    })
}

#[cfg(not(feature = "tls"))]
fn tls_hint(_: &RedisError) -> Option<&'static str> {
    None
}

/// Whether `url` asks for TLS.
pub(super) fn is_tls(url: &str) -> bool {
    let scheme = url.split_once("://").map_or("", |(scheme, _)| scheme);
    scheme.eq_ignore_ascii_case("rediss") || scheme.eq_ignore_ascii_case("valkeys")
}

/// Makes rustls's ring provider the process default, unless the application chose one: rustls
/// cannot pick one itself when more than one is built in (another dependency may bring
/// aws-lc-rs), and redis-rs asks for the default on every TLS connection.
#[cfg(feature = "tls")]
fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Another thread may install one first: theirs is kept.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// The address of a cluster node at `host:port`, over TLS as `template` is, with its
/// certificates.
pub(super) fn node_addr(template: &ConnectionInfo, host: &str, port: u16) -> ConnectionAddr {
    match template.addr() {
        ConnectionAddr::TcpTls {
            insecure,
            tls_params,
            ..
        } => ConnectionAddr::TcpTls {
            host: host.to_owned(),
            port,
            insecure: *insecure,
            tls_params: tls_params.clone(),
        },
        _ => ConnectionAddr::Tcp(host.to_owned(), port),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_replace_those_of_the_url() {
        let access = Access {
            credentials: Some(("app".into(), "p/a?s#s@".into())),
            ..Access::default()
        };
        let info = access
            .connection_info("Redis store", "redis://old:secret@127.0.0.1:7000/2")
            .unwrap();
        assert_eq!(info.redis_settings().username(), Some("app"));
        assert_eq!(info.redis_settings().password(), Some("p/a?s#s@"));
        assert_eq!(info.redis_settings().db(), 2);
        assert_eq!(
            access.shown("redis://old:secret@127.0.0.1:7000/2"),
            "redis://app:***@127.0.0.1:7000/2"
        );
        assert_eq!(
            Access::default().shown("redis://old:secret@127.0.0.1:7000/2"),
            "redis://old:***@127.0.0.1:7000/2"
        );
    }

    #[test]
    fn tls_settings_need_a_tls_url() {
        #[cfg(feature = "tls")]
        {
            let access = Access {
                ca: Some(b"-----BEGIN CERTIFICATE-----".to_vec()),
                ..Access::default()
            };
            let error = access
                .connection_info("Redis store", "redis://127.0.0.1:7000")
                .unwrap_err()
                .to_string();
            assert!(error.contains("use rediss://"), "{error}");
        }
        #[cfg(not(feature = "tls"))]
        {
            let error = Access::default()
                .connection_info("Redis store", "rediss://u:secret@127.0.0.1:7000")
                .unwrap_err()
                .to_string();
            assert!(error.contains("feature `tls`"), "{error}");
            assert!(!error.contains("secret"), "{error}");
        }
    }

    #[test]
    fn a_cluster_node_is_reached_as_the_first_url_is() {
        let plain = "redis://127.0.0.1:7000".into_connection_info().unwrap();
        assert_eq!(
            node_addr(&plain, "10.0.0.2", 7001),
            ConnectionAddr::Tcp("10.0.0.2".into(), 7001)
        );
        #[cfg(feature = "tls")]
        {
            let tls = "rediss://127.0.0.1:7000".into_connection_info().unwrap();
            assert!(matches!(
                node_addr(&tls, "10.0.0.2", 7001),
                ConnectionAddr::TcpTls { host, port: 7001, insecure: false, .. } if host == "10.0.0.2"
            ));
        }
    }
}

/// A Redis URL as it may be shown: without its password.
///
/// ```text
/// redis://user:secret@10.0.0.5:6379/2  →  redis://user:***@10.0.0.5:6379/2
/// ```
pub(crate) fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    // The user information ends at the last `@` of the authority; a password may hold `/`, `?`,
    // `#` or `@` itself (unencoded), so the last `@` whose left side has a `:` ends it too.
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let at = match rest[..authority_end].rfind('@') {
        Some(at) => Some(at),
        None => rest
            .rfind('@')
            .filter(|&at| rest[..at].contains(':') && !rest[..at].contains("://")),
    };
    match at {
        Some(at) => {
            let (userinfo, host) = (&rest[..at], &rest[at + 1..]);
            let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
            format!("{scheme}://{user}:***@{host}")
        }
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod redacted {
    use super::redact;

    #[test]
    fn urls_are_shown_without_their_password() {
        assert_eq!(redact("redis://10.0.0.5:6379"), "redis://10.0.0.5:6379");
        assert_eq!(
            redact("redis://user:secret@10.0.0.5:6379/2"),
            "redis://user:***@10.0.0.5:6379/2"
        );
        assert_eq!(
            redact("redis://:secret@host:1/0?x=y"),
            "redis://:***@host:1/0?x=y"
        );
        assert_eq!(redact("rediss://a:b:c@h"), "rediss://a:***@h");
        assert_eq!(redact("not a url"), "not a url");
        // Passwords with the characters that end an authority, unencoded.
        for password in ["pa/ss", "pa?ss", "pa#ss", "p@ss", "a/b?c#d@e"] {
            let shown = redact(&format!("redis://user:{password}@10.0.0.5:6379/1"));
            assert_eq!(shown, "redis://user:***@10.0.0.5:6379/1", "{password}");
        }
        assert_eq!(
            redact("redis://:pa/ss@host:1"),
            "redis://:***@host:1",
            "a password alone"
        );
    }
}
