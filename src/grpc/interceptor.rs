//! [`RateLimitInterceptor`]: a layer's rules as a tonic `Interceptor`, for stores that decide
//! at once.

use std::fmt;
use std::sync::Arc;

use http::HeaderValue;
use http::header::CONTENT_TYPE;
use tonic::metadata::MetadataMap;

use super::GrpcPath;
use crate::engine::{Decide, Driver, Engine, Ruling, Use};
use crate::store::{MemoryStore, Store};
use crate::throttle::Once;
use crate::{ConfigError, RateLimitLayer};

/// A store that decides every check at once, without waiting ([`Store::check_now`] always
/// answers): what a tonic interceptor, which cannot wait, needs.
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not decide at once: a tonic interceptor cannot wait for it",
    label = "an interceptor needs a store that decides at once, such as the memory store",
    note = "put the layer on the service instead, which works with every store: \
            `Server::builder().add_service(layer.layer(MyServiceServer::new(service)))`"
)]
pub trait DecidesAtOnce: Store {}

impl DecidesAtOnce for MemoryStore {}

/// A layer's rules checked by a tonic `Interceptor` (see the [module](crate::grpc)): made
/// by [`RateLimitLayer::interceptor`].
pub struct RateLimitInterceptor<St = MemoryStore> {
    engine: Arc<Engine<St>>,
}

impl<St> Clone for RateLimitInterceptor<St> {
    fn clone(&self) -> Self {
        RateLimitInterceptor {
            engine: self.engine.clone(),
        }
    }
}

impl<St> fmt::Debug for RateLimitInterceptor<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitInterceptor")
            .finish_non_exhaustive()
    }
}

impl<St> RateLimitLayer<St> {
    /// The layer's rules as a tonic `Interceptor`, for `MyServiceServer::with_interceptor`
    /// (see [`grpc`](crate::grpc) for what an interceptor can and cannot do). Rules that act
    /// after the response (concurrency limits, charges by outcome, settled costs) and delay
    /// rules, which wait, are refused: put the layer on the service for those. From then on, a
    /// reload of the layer's policy that would bring such rules in is refused too (the policy in
    /// force stays, and the error says why).
    ///
    /// ```compile_fail
    /// // A store that waits for a server cannot back an interceptor: the compiler says to put
    /// // the layer on the service instead.
    /// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
    /// let redis = tollgate::store::RedisStore::builder("redis://127.0.0.1:6379").connect().await?;
    /// let layer = tollgate::RateLimitLayer::builder()
    ///     .rule(tollgate::Rule::new("r", tollgate::Quota::per_second(5)))
    ///     .store(redis)
    ///     .build()?;
    /// let interceptor = layer.interceptor()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn interceptor(&self) -> Result<RateLimitInterceptor<St>, ConfigError>
    where
        St: DecidesAtOnce,
    {
        let engine = self.engine().clone();
        engine.adopt(Use::Interceptor)?;
        Ok(RateLimitInterceptor { engine })
    }
}

/// Said once: a call the interceptor could not decide at once went through.
static UNDECIDED: Once = Once::new();

/// Said once: the policy in force has rules an interceptor cannot keep.
static AFTER_RESPONSE: Once = Once::new();

impl<St: DecidesAtOnce> tonic::service::Interceptor for RateLimitInterceptor<St> {
    fn call(&mut self, request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let (metadata, extensions, ()) = request.into_parts();
        // A gRPC call's request line, as the layer would see it.
        let mut http = http::Request::new(());
        *http.method_mut() = http::Method::POST;
        *http.version_mut() = http::Version::HTTP_2;
        *http.headers_mut() = metadata.into_headers();
        *http.extensions_mut() = extensions;
        if let Some(GrpcPath(path)) = http.extensions().get::<GrpcPath>().cloned()
            && let Ok(uri) = http::Uri::builder().path_and_query(path).build()
        {
            *http.uri_mut() = uri;
        }
        // The answers are gRPC's, whatever the metadata says.
        let had_type = http
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        let (mut parts, ()) = http.into_parts();
        let span = crate::observe::span();
        // A store that decides at once decides here, a second check included (the enforced
        // rules alone, after a shadow rule's denial): ready at its first poll. A key or tenant
        // lookup is never polled only to be dropped: such a call goes through undecided.
        let (snapshot, decide) = self.engine.decide(&mut parts, &span);
        let ruling = match decide {
            Decide::Ready(ruling) => Some(ruling),
            Decide::Waiting(pending) if !pending.is_recheck() => None,
            Decide::Waiting(pending) => {
                let driver = Driver::new(pending, self.engine.clone(), snapshot.clone(), span);
                std::pin::pin!(driver).decide_now(&mut parts)
            }
        };
        match ruling {
            // A policy reloaded since the interceptor was made may hold slots or settle after
            // the response: nothing here can, so they are given back at once (said once).
            Some(Ruling::Call(admitted)) => {
                if admitted.holds_or_settles() && AFTER_RESPONSE.first() {
                    tracing::warn!(
                        "tollgate: the policy in force has rules that act after the response \
                         (concurrency, charges by outcome): a tonic interceptor cannot keep \
                         them; put the layer on the service"
                    );
                }
            }
            Some(Ruling::Answer { refusal, .. }) => {
                return Err(snapshot.answers.status(&refusal));
            }
            _ => {
                if UNDECIDED.first() {
                    tracing::warn!(
                        "tollgate: a tonic interceptor could not decide a call at once (a key \
                         or tenant lookup, or a delay rule's wait): it went through unlimited; \
                         put the layer on the service for such rules"
                    );
                }
            }
        }
        match had_type {
            Some(value) => parts.headers.insert(CONTENT_TYPE, value),
            None => parts.headers.remove(CONTENT_TYPE),
        };
        Ok(tonic::Request::from_parts(
            MetadataMap::from_headers(parts.headers),
            parts.extensions,
            (),
        ))
    }
}
