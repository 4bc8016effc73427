//! Live policies: [`PolicySource`], [`FileSource`] and [`PolicyHandle`].
//!
//! ```no_run
//! use std::time::Duration;
//! use tollgate::RateLimitLayer;
//! use tollgate::policy::FileSource;
//!
//! // Reads tiers.toml now (a bad file fails the build), then checks it for changes every second.
//! let layer = RateLimitLayer::builder()
//!     .policy_source(FileSource::new("tiers.toml").interval(Duration::from_secs(1)))
//!     .build()?;
//! let handle = layer.policy_handle().expect("a layer with a source has a handle");
//! println!("policy {} in force", handle.version());
//! # Ok::<(), tollgate::ConfigError>(())
//! ```
//!
//! A layer reads its policy through a handle that is swapped atomically: a request takes the
//! policy in force when it arrives (no lock) and finishes under it, whatever happens meanwhile.
//! A policy that does not build (a syntax error, a rule that breaks one of the checks, a missing
//! file) is never installed: the policy in force stays, the error is logged once per bad version
//! (at `error`, target `tollgate::policy`), and [`PolicyHandle::rejected`] counts it once (a file
//! that stays missing is one bad version, however many times it is polled).
//!
//! Budgets live in the store under each rule's name, so a reload keeps the state of every rule
//! whose name and algorithm it keeps, and reads it with the new numbers at once. The window
//! algorithms keep counts: a client that used 40 of 50 this hour has 10 left, and none when the
//! quota is lowered to 30. Token bucket and GCRA keep the time at which the bucket is full again:
//! the client owes the same refill time under the new numbers (40 of 50 per minute is 48 s to
//! refill; at 30 per minute, a bucket of 30 that is full again in 48 s holds 6). A renamed rule
//! starts from a full budget; a rule whose algorithm changed starts again from no state (the
//! store cannot read the old algorithm's state), and so does, on Redis, a rule whose
//! [`split`](crate::Rule::split) was added, changed or removed (its budget lives in other keys
//! then; the memory store keeps a split rule's key whole, and its budget). A reload that starts
//! budgets again says which, at `warn` (target `tollgate::policy`).
//!
//! A layer whose rules are also checked per message ([`per_message`](crate::RateLimitLayer::per_message))
//! or by a tonic interceptor ([`interceptor`](crate::RateLimitLayer::interceptor)) refuses a
//! reload that brings in rules these cannot keep (rules that act after the response; for the
//! interceptor, delay rules too), as they are refused when made.

use std::error::Error;
use std::fmt;
#[cfg(feature = "toml")]
use std::hash::{BuildHasher, Hasher};
#[cfg(feature = "toml")]
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
#[cfg(feature = "toml")]
use std::time::SystemTime;

use arc_swap::ArcSwap;

use super::Policy;
use super::snapshot::{Compiler, Snapshot};
use crate::ConfigError;

/// Where a live policy comes from: a file (`FileSource`), a configuration service, a
/// database. The layer asks it once when it is built, then every [`interval`](Self::interval)
/// on a thread of its own (so a source may block), for as long as the layer lives.
///
/// A [`Policy`] is a source too: it never changes by itself, and
/// [`PolicyHandle::install`] replaces it from your code.
pub trait PolicySource: Send + 'static {
    /// The first policy. An error here fails the layer's `build()`.
    fn load(&mut self) -> Result<Policy, Box<dyn Error + Send + Sync>>;

    /// A new policy, `Ok(None)` when nothing changed, or an error (the policy in force stays).
    fn poll(&mut self) -> Result<Option<Policy>, Box<dyn Error + Send + Sync>>;

    /// How often to [`poll`](Self::poll); `None` (the default of [`Policy`]) never does.
    fn interval(&self) -> Option<Duration> {
        Some(Duration::from_secs(1))
    }
}

impl PolicySource for Policy {
    fn load(&mut self) -> Result<Policy, Box<dyn Error + Send + Sync>> {
        Ok(self.clone())
    }

    fn poll(&mut self) -> Result<Option<Policy>, Box<dyn Error + Send + Sync>> {
        Ok(None)
    }

    fn interval(&self) -> Option<Duration> {
        None
    }
}

/// The largest rules file [`FileSource`] reads.
#[cfg(feature = "toml")]
pub const MAX_FILE_LEN: u64 = 16 * 1024 * 1024;

/// A rules file in TOML (see [`Policy::from_toml`]), checked for changes every second by
/// default.
///
/// It polls rather than watches: one `stat` per interval costs nothing, needs no platform
/// notification API, and sees every way a file changes, including the symlink swaps with which
/// Kubernetes updates a mounted ConfigMap, which file watches miss. A change is read when the
/// file's modification time or size changed, or, on Unix, when the path leads to another file
/// (its device and inode) or the file's status changed (its `ctime`, which no copy keeps): a
/// file swapped in by a rename or a symlink swap is read even when archives and syncs kept
/// the old one's size and modification time. Elsewhere, the file is read at every poll. It is
/// installed when its content changed. Replace the file by renaming a complete one over it
/// (as deployments and most editors do): a file caught while it is being written is read again
/// at the next poll.
#[cfg(feature = "toml")]
#[derive(Debug)]
pub struct FileSource {
    path: PathBuf,
    interval: Duration,
    /// The file's identity, modification time and length at the last read.
    seen: Option<Seen>,
    /// Hash of the last content read.
    content: Option<u64>,
}

/// What tells one version of a rules file from another without reading it.
#[cfg(feature = "toml")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Seen {
    modified: SystemTime,
    len: u64,
    /// Device, inode and status-change time (seconds, nanoseconds), where the platform has them.
    identity: Option<(u64, u64, i64, i64)>,
}

#[cfg(feature = "toml")]
impl Seen {
    fn of(metadata: &std::fs::Metadata) -> Self {
        #[cfg(unix)]
        let identity = {
            use std::os::unix::fs::MetadataExt;
            Some((
                metadata.dev(),
                metadata.ino(),
                metadata.ctime(),
                metadata.ctime_nsec(),
            ))
        };
        #[cfg(not(unix))]
        let identity = None;
        Seen {
            modified: metadata.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            len: metadata.len(),
            identity,
        }
    }

    /// Whether the file is known to be the one seen: without its identity, never (it is read
    /// again, and installed only if its content changed).
    fn same(&self, other: &Seen) -> bool {
        self.identity.is_some() && self == other
    }
}

#[cfg(feature = "toml")]
impl FileSource {
    /// The file at `path`.
    pub fn new(path: impl AsRef<Path>) -> Self {
        FileSource {
            path: path.as_ref().to_owned(),
            interval: Duration::from_secs(1),
            seen: None,
            content: None,
        }
    }

    /// How often to check the file (default 1 s; at least 10 ms).
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval.max(Duration::from_millis(10));
        self
    }

    fn read(&mut self, force: bool) -> Result<Option<Policy>, Box<dyn Error + Send + Sync>> {
        let name = self.path.display().to_string();
        let metadata = std::fs::metadata(&self.path)
            .map_err(|e| ConfigError::new(format!("cannot read the rules file {name}: {e}")))?;
        let seen = Seen::of(&metadata);
        if !force && self.seen.is_some_and(|before| before.same(&seen)) {
            return Ok(None);
        }
        if metadata.len() > MAX_FILE_LEN {
            return Err(ConfigError::new(format!(
                "the rules file {name} holds {} bytes; a rules file holds at most {MAX_FILE_LEN}",
                metadata.len()
            ))
            .into());
        }
        let text = std::fs::read_to_string(&self.path)
            .map_err(|e| ConfigError::new(format!("cannot read the rules file {name}: {e}")))?;
        // A file still being written: read it again at the next poll (replace files by renaming
        // a complete one over them, and this never happens).
        let after = std::fs::metadata(&self.path).map(|m| Seen::of(&m)).ok();
        if after != Some(seen) || text.len() as u64 != seen.len {
            if force {
                return Err(ConfigError::new(format!(
                    "the rules file {name} changed while it was read; replace it by renaming a \
                     complete file over it"
                ))
                .into());
            }
            return Ok(None);
        }
        self.seen = Some(seen);
        let mut hasher = foldhash::fast::FixedState::with_seed(1).build_hasher();
        hasher.write(text.as_bytes());
        let content = hasher.finish();
        if !force && self.content == Some(content) {
            return Ok(None);
        }
        self.content = Some(content);
        Ok(Some(Policy::from_toml(&text, &name)?))
    }
}

#[cfg(feature = "toml")]
impl PolicySource for FileSource {
    fn load(&mut self) -> Result<Policy, Box<dyn Error + Send + Sync>> {
        self.read(true)?
            .ok_or_else(|| ConfigError::new("the rules file was not read").into())
    }

    fn poll(&mut self) -> Result<Option<Policy>, Box<dyn Error + Send + Sync>> {
        self.read(false)
    }

    fn interval(&self) -> Option<Duration> {
        Some(self.interval)
    }
}

/// Registers a snapshot's rules on the layer's store (the layer implements it).
pub(crate) trait Registrar: Send + Sync {
    fn register(&self, snapshot: &Snapshot) -> Result<(), ConfigError>;

    /// Whether the store keeps a split rule's budget in sub-keys (the memory store does not).
    fn splits_keys(&self) -> bool;
}

/// The rules of `new` whose budget starts full again after `old`: renamed rules aside, those
/// whose algorithm changed, and when the store splits keys, those whose split changed. Each
/// as `"name" (was …, now …)`.
fn restarted(old: &Snapshot, new: &Snapshot, splits_keys: bool) -> Vec<String> {
    let split = |parts: u16| match parts {
        1 => "not split".to_owned(),
        n => format!("split into {n}"),
    };
    let mut restarted = Vec::new();
    for rule in new.rules.iter() {
        let Some(before) = old.rules.iter().find(|r| r.spec.name() == rule.spec.name()) else {
            continue;
        };
        let (was, now) = (&before.spec, &rule.spec);
        if was.algorithm() != now.algorithm() {
            restarted.push(format!(
                "\"{}\" (was {}, now {})",
                now.name(),
                was.algorithm(),
                now.algorithm()
            ));
        } else if splits_keys && was.parts() != now.parts() {
            restarted.push(format!(
                "\"{}\" (was {}, now {})",
                now.name(),
                split(was.parts()),
                split(now.parts())
            ));
        }
    }
    restarted
}

/// The live policy of a layer.
pub(crate) struct Live {
    pub(crate) current: ArcSwap<Snapshot>,
    compiler: Compiler,
    registrar: Mutex<Option<Weak<dyn Registrar>>>,
    /// Held while a policy is compiled, registered and swapped in: two installs at once could
    /// otherwise leave in force a policy other than the one the store's registry holds.
    installing: Mutex<()>,
    /// The thread that polls the source, woken to stop when the layer is dropped.
    watcher: Mutex<Option<std::thread::Thread>>,
    installed: AtomicU64,
    rejected: AtomicU64,
    /// The last error logged, so that a bad version is logged once.
    last_error: Mutex<Option<String>>,
}

impl Live {
    pub(crate) fn new(snapshot: Snapshot, compiler: Compiler) -> Self {
        Live {
            current: ArcSwap::from_pointee(snapshot),
            compiler,
            registrar: Mutex::new(None),
            installing: Mutex::new(()),
            watcher: Mutex::new(None),
            installed: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            last_error: Mutex::new(None),
        }
    }

    /// Connects the live policy to the layer that registers its rules.
    pub(crate) fn connect(&self, registrar: Weak<dyn Registrar>) {
        *self.registrar.lock().unwrap_or_else(|p| p.into_inner()) = Some(registrar);
    }

    fn registrar(&self) -> Option<Arc<dyn Registrar>> {
        self.registrar
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .and_then(Weak::upgrade)
    }

    /// Compiles, registers and installs `policy`, or keeps the one in force.
    fn install(&self, policy: &Policy) -> Result<(), ConfigError> {
        let installing = self.installing.lock().unwrap_or_else(|p| p.into_inner());
        let result = Snapshot::compile(policy, &self.compiler).and_then(|snapshot| {
            let registrar = self
                .registrar()
                .ok_or_else(|| ConfigError::new("the layer of this policy was dropped"))?;
            registrar.register(&snapshot)?;
            let restarted = restarted(&self.current.load(), &snapshot, registrar.splits_keys());
            self.current.store(Arc::new(snapshot));
            Ok(restarted)
        });
        drop(installing);
        match &result {
            Ok(restarted) => {
                if !restarted.is_empty() {
                    tracing::warn!(
                        target: "tollgate::policy",
                        version = policy.version(),
                        "tollgate: the policy installed starts the budgets of these rules full \
                         again, as the store cannot carry their state over: {}",
                        restarted.join(", ")
                    );
                }
                self.installed.fetch_add(1, Ordering::Relaxed);
                #[cfg(feature = "metrics")]
                crate::telemetry::reload("installed");
                *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = None;
                tracing::info!(
                    target: "tollgate::policy",
                    version = policy.version(),
                    "tollgate: policy installed"
                );
            }
            Err(error) => self.reject(&error.to_string()),
        }
        result.map(drop)
    }

    /// Runs `f` while no policy is being installed.
    #[cfg_attr(not(feature = "tonic"), allow(dead_code))]
    pub(crate) fn while_installing<R>(&self, f: impl FnOnce() -> R) -> R {
        let _installing = self.installing.lock().unwrap_or_else(|p| p.into_inner());
        f()
    }

    /// Counts and logs a policy that was not installed, once per bad version: the same error
    /// again (a missing file, polled every interval) is neither counted nor logged again.
    fn reject(&self, error: &str) {
        let mut last = self.last_error.lock().unwrap_or_else(|p| p.into_inner());
        if last.as_deref() != Some(error) {
            self.rejected.fetch_add(1, Ordering::Relaxed);
            #[cfg(feature = "metrics")]
            crate::telemetry::reload("rejected");
            tracing::error!(
                target: "tollgate::policy",
                version_in_force = &*self.current.load().version,
                "tollgate: policy not installed, the one in force stays: {error}"
            );
            *last = Some(error.to_owned());
        }
    }

    /// Polls `source` every `interval` (at least 10 ms) on a thread of its own, until the layer
    /// is dropped.
    pub(crate) fn watch(self: &Arc<Self>, mut source: Box<dyn PolicySource>, interval: Duration) {
        let interval = interval.max(Duration::from_millis(10));
        let live = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("tollgate-policy".into())
            .spawn(move || {
                loop {
                    // Woken early when the layer is dropped (see `stop`).
                    std::thread::park_timeout(interval);
                    let Some(live) = live.upgrade() else { return };
                    if live.registrar().is_none() {
                        return;
                    }
                    let polled =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| source.poll()));
                    match polled {
                        Ok(Ok(None)) => {}
                        Ok(Ok(Some(policy))) => {
                            let _ = live.install(&policy);
                        }
                        Ok(Err(error)) => live.reject(&error.to_string()),
                        Err(_) => live.reject("the policy source panicked"),
                    }
                }
            });
        match spawned {
            Ok(handle) => {
                *self.watcher.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some(handle.thread().clone());
            }
            Err(error) => tracing::error!(
                target: "tollgate::policy",
                %error,
                "tollgate: cannot start the thread that reloads the policy; it stays as it is"
            ),
        }
    }

    /// Wakes the polling thread, which stops once the layer is gone.
    pub(crate) fn stop(&self) {
        if let Some(thread) = &*self.watcher.lock().unwrap_or_else(|p| p.into_inner()) {
            thread.unpark();
        }
    }
}

/// The live policy of a layer built with a
/// [`policy_source`](crate::RateLimitLayerBuilder::policy_source): which version is in force,
/// how many reloads failed, and [`install`](Self::install) to replace it from code.
#[derive(Clone)]
pub struct PolicyHandle {
    pub(crate) live: Arc<Live>,
}

impl PolicyHandle {
    /// The version of the policy in force.
    pub fn version(&self) -> String {
        self.live.current.load().version.to_string()
    }

    /// Installs `policy` if it builds; otherwise the policy in force stays, and the error says
    /// why (it is also logged and counted as the source's errors are).
    pub fn install(&self, policy: Policy) -> Result<(), ConfigError> {
        self.live.install(&policy)
    }

    /// How many policies were installed after the first.
    pub fn installed(&self) -> u64 {
        self.live.installed.load(Ordering::Relaxed)
    }

    /// How many bad versions (policies that did not build, failed reads of the source) left the
    /// policy in force: each is counted once, however often it is read again.
    pub fn rejected(&self) -> u64 {
        self.live.rejected.load(Ordering::Relaxed)
    }
}

impl fmt::Debug for PolicyHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PolicyHandle")
            .field("version", &self.version())
            .field("installed", &self.installed())
            .field("rejected", &self.rejected())
            .finish()
    }
}
