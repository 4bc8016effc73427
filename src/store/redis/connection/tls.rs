//! TLS over a connection's TCP stream (feature `tls`): rustls with the store's trusted CAs (or the
//! system's roots) and its client certificate, made once per store.

use std::io;
use std::sync::{Arc, OnceLock};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

/// The TLS settings of a store: whom it trusts and what it presents.
pub(crate) struct Tls {
    /// CA certificates (PEM) trusted in place of the system's roots.
    ca: Option<Vec<u8>>,
    /// The client certificate chain and its private key (PEM).
    client_cert: Option<(Vec<u8>, Vec<u8>)>,
    /// Made at the first connection that succeeds in making it (the system's roots are read
    /// then, once).
    config: OnceLock<Arc<ClientConfig>>,
}

impl Tls {
    /// Settings that trust `ca` (or the system's roots) and present `client_cert`, both PEM
    /// (checked by the builder).
    pub(crate) fn new(ca: Option<Vec<u8>>, client_cert: Option<(Vec<u8>, Vec<u8>)>) -> Self {
        Tls {
            ca,
            client_cert,
            config: OnceLock::new(),
        }
    }

    /// TLS over `tcp` to the server `host` names, whose certificate must name it.
    pub(crate) async fn connect(
        &self,
        host: &str,
        tcp: TcpStream,
    ) -> io::Result<TlsStream<TcpStream>> {
        let config = self.config()?;
        let name = ServerName::try_from(host.to_owned()).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{host:?} cannot name a TLS server ({e}); use its DNS name or IP address"),
            )
        })?;
        TlsConnector::from(config).connect(name, tcp).await
    }

    fn config(&self) -> io::Result<Arc<ClientConfig>> {
        if let Some(config) = self.config.get() {
            return Ok(config.clone());
        }
        // Not kept when it fails: a system whose roots could not be read is asked again.
        let config = Arc::new(self.make().map_err(io::Error::other)?);
        Ok(self.config.get_or_init(|| config).clone())
    }

    fn make(&self) -> Result<ClientConfig, String> {
        let mut roots = RootCertStore::empty();
        match &self.ca {
            Some(pem) => {
                for cert in CertificateDer::pem_slice_iter(pem) {
                    let cert = cert.map_err(|e| format!("tls_ca is not valid PEM: {e}"))?;
                    roots
                        .add(cert)
                        .map_err(|e| format!("tls_ca holds a certificate rustls refuses: {e}"))?;
                }
            }
            None => {
                let found = rustls_native_certs::load_native_certs();
                if found.certs.is_empty()
                    && let Some(error) = found.errors.first()
                {
                    return Err(format!(
                        "cannot read the system's root certificates ({error}); give the CA of \
                         the server with tls_ca"
                    ));
                }
                // Certificates the platform holds that rustls cannot use are left out.
                let _ = roots.add_parsable_certificates(found.certs);
            }
        }
        let builder = ClientConfig::builder().with_root_certificates(roots);
        match &self.client_cert {
            Some((chain, key)) => {
                let chain = CertificateDer::pem_slice_iter(chain)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| format!("tls_client_cert's certificate is not valid PEM: {e}"))?;
                let key = PrivateKeyDer::from_pem_slice(key)
                    .map_err(|e| format!("tls_client_cert's key is not a PEM private key: {e}"))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| format!("tls_client_cert was refused: {e}"))
            }
            None => Ok(builder.with_no_client_auth()),
        }
    }
}
