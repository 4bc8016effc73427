//! [`KeySpec`]: a rule's key written as text (`"tenant+route"`), as rules files write it.

use std::sync::Arc;

use crate::ConfigError;
use crate::key::{CombineShared, FromHeader, Global, Route, SharedExtractor};

use super::TenantKey;

/// A rule's key as a rules file names it: parts joined by `+`.
#[cfg_attr(not(feature = "toml"), allow(dead_code))]
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct KeySpec {
    parts: Vec<KeyPart>,
}

#[cfg_attr(not(feature = "toml"), allow(dead_code))]
#[derive(Clone, Debug, PartialEq, Eq)]
enum KeyPart {
    /// The layer's key (the peer IP by default).
    Ip,
    Tenant,
    Global,
    Route,
    MethodRoute,
    /// A header's value, hashed (it may be a secret).
    Header(http::HeaderName),
}

impl KeySpec {
    /// `ip`, `tenant`, `global`, `route`, `method-route`, `header:<name>`, or several joined by
    /// `+` (`tenant+route`).
    #[cfg_attr(not(feature = "toml"), allow(dead_code))]
    pub(crate) fn parse(text: &str) -> Result<Self, ConfigError> {
        let mut parts = Vec::new();
        for part in text.split('+').map(str::trim) {
            let part = match part {
                "ip" => KeyPart::Ip,
                "tenant" => KeyPart::Tenant,
                "global" => KeyPart::Global,
                "route" => KeyPart::Route,
                "method-route" => KeyPart::MethodRoute,
                _ => match part.strip_prefix("header:") {
                    Some(name) => KeyPart::Header(
                        http::HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                            ConfigError::new(format!("key {text:?}: {name:?} is not a header name"))
                        })?,
                    ),
                    None => {
                        return Err(ConfigError::new(format!(
                            "key {text:?}: {part:?} is not a key; use ip, tenant, global, route, \
                             method-route or header:<name>, or several joined by + (tenant+route)"
                        )));
                    }
                },
            };
            if parts.contains(&part) {
                return Err(ConfigError::new(format!(
                    "key {text:?} names {part:?} twice"
                )));
            }
            parts.push(part);
        }
        Ok(KeySpec { parts })
    }

    /// The extractor, with `layer_key` for `ip`.
    pub(crate) fn extractor(&self, layer_key: &SharedExtractor) -> SharedExtractor {
        let one = |part: &KeyPart| -> SharedExtractor {
            match part {
                KeyPart::Ip => layer_key.clone(),
                KeyPart::Tenant => Arc::new(TenantKey),
                KeyPart::Global => Arc::new(Global),
                KeyPart::Route => Arc::new(Route::new()),
                KeyPart::MethodRoute => Arc::new(Route::new().with_method()),
                KeyPart::Header(name) => Arc::new(FromHeader::new(name.clone()).hashed()),
            }
        };
        match &*self.parts {
            [part] => one(part),
            parts => Arc::new(CombineShared(parts.iter().map(one).collect())),
        }
    }
}
