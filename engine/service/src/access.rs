//! Access control of the HTTP API: bearer tokens (kept in the service config as SHA-256
//! digests, never in clear), roles, job ownership, per-token rate limits, and the service
//! policy of which programs a job spec may start.
//!
//! Without tokens the service is open (every caller is the admin `local`): that is the
//! single-user, loopback-only mode; `serve` refuses a non-loopback address in it unless told
//! explicitly.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use job::spec::{FieldError, JobSpec};

mod programs;

/// What a token may do. Ordered: each role may do what the ones before it may.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Read its owner's jobs, their events and trajectories, the cluster view.
    Read,
    /// Also submit jobs (owned by the token's name) and cancel its owner's jobs.
    Submit,
    /// Everything, on every owner's jobs.
    Admin,
}

/// One token of the service config: `{ name = "alice", role = "submit", sha256 = "…" }`.
/// Tokens sharing a name act for the same owner (e.g. a read token for a dashboard and a
/// submit token for CI).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenEntry {
    pub name: String,
    pub role: Role,
    /// Hex SHA-256 of the token (`rollarc token` prints one).
    pub sha256: String,
}

/// Who may read `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MetricsAccess {
    /// A token with at least the `read` role (open when the service has no tokens).
    #[default]
    Token,
    /// Anyone (e.g. a Prometheus scraper without credentials on a private network).
    Open,
}

/// Token bucket per token: `burst` requests at once, refilled at `per_second`.
#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimit {
    pub per_second: f64,
    pub burst: u32,
}

/// `[access]` of the service config.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessConfig {
    #[serde(default)]
    pub tokens: Vec<TokenEntry>,
    #[serde(default)]
    pub metrics: MetricsAccess,
    /// Requests per token (one shared bucket when the service has no tokens); over it: 429.
    #[serde(default)]
    pub rate_limit: Option<RateLimit>,
}

/// `[policy]` of the service config: which programs a job spec may start.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProgramPolicy {
    /// Executables a spec may name: an external environment's `command[0]`, the `python` of
    /// a `reasoning_gym` or `gymnasium` environment, a `command` function's `command`, the
    /// `code` function's `python`. An entry matches the name as
    /// written or the same file after `PATH` lookup and symlinks. Absent: any program when
    /// the service has no tokens, none when it has.
    #[serde(default)]
    pub executables: Option<Vec<String>>,
    /// Whether a spec may run programs outside the sandbox: `sandbox = "none"` on an
    /// environment or the `code` function, and `command` functions (which run as plain
    /// processes). Absent: allowed when the service has no tokens, denied when it has.
    #[serde(default)]
    pub allow_unsandboxed: Option<bool>,
    /// Host directories a spec may make readable inside the sandbox (`readable_paths` of an
    /// environment or of the `code` function, a gymnasium environment's `python_path`) and
    /// the dataset files a task may read (`tasks[].dataset.path`): a listed directory and
    /// what is below it.
    /// Absent: any when the service has no tokens, none when it has. The data directory is
    /// never bound whatever this says.
    #[serde(default)]
    pub readable_paths: Option<Vec<String>>,
    /// Whether a spec may make the service call out over the network: `http` functions (any
    /// URL) and the `judge` function's `endpoint` and `api_key_env` (a variable of the
    /// service's environment sent as a bearer token). Absent: allowed when the service has
    /// no tokens, denied when it has.
    #[serde(default)]
    pub allow_network_functions: Option<bool>,
}

/// A problem with the access configuration.
#[derive(Debug, thiserror::Error)]
pub enum AccessConfigError {
    #[error("access.tokens[{index}].sha256 must be 64 hex digits (the SHA-256 of the token)")]
    BadDigest { index: usize },
    #[error("access.tokens[{index}].name must be 1–64 characters of [A-Za-z0-9_.@-]")]
    BadName { index: usize },
    #[error("access.tokens[{index}] repeats the digest of an earlier token")]
    Duplicate { index: usize },
    #[error("access.rate_limit needs per_second > 0 (finite) and burst >= 1")]
    BadRateLimit,
}

/// The caller of a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    /// Owner name of the jobs this caller submits.
    pub name: String,
    pub role: Role,
    /// Key of the caller's rate-limit bucket (the token's digest; empty when open).
    bucket: String,
}

impl Principal {
    /// Whether this caller may see (and, with `submit`, cancel) a job of `owner`.
    pub fn owns(&self, owner: Option<&str>) -> bool {
        self.role == Role::Admin || owner == Some(self.name.as_str())
    }

    /// The owner recorded for a job this caller submits (none in open mode).
    pub fn owner(&self) -> Option<&str> {
        (!self.bucket.is_empty()).then_some(self.name.as_str())
    }
}

/// Why a request is refused.
#[derive(Debug, PartialEq)]
pub enum Denied {
    /// No or an unknown token: 401.
    Unauthenticated(&'static str),
    /// Over the token's rate: 429, retry after this many seconds.
    RateLimited { retry_after_s: u64 },
}

/// The access state of a running service.
pub struct Access {
    tokens: HashMap<String, (String, Role)>,
    metrics: MetricsAccess,
    limiter: Option<Limiter>,
    policy: ProgramPolicy,
    /// Event streams open now (bounded: [`MAX_STREAMS_PER_OWNER`] per owner, and the owners
    /// are those of the config plus `local`).
    streams: Mutex<Streams>,
    /// Failed authentications per client address ([`FAILED_AUTH_RATE`]).
    failures: Limiter,
}

/// The client address of a request, as the connection loop saw it (a request extension).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClientAddr(pub std::net::IpAddr);

/// Event streams one owner may hold open at once (each holds a connection for as long as
/// its job runs: without a cap one token could take every connection of the server).
pub const MAX_STREAMS_PER_OWNER: usize = 32;

/// Event streams one client address may hold open at once, per owner. With no tokens every
/// caller is the same owner: this keeps one client from taking the owner's whole share.
pub const MAX_STREAMS_PER_ADDRESS: usize = 8;

/// Requests with a missing or unknown token that one client address may make: a burst of
/// 20, then 2 a second; past it 429 instead of 401 (guessing tokens, or a misconfigured
/// client hammering the service).
pub const FAILED_AUTH_RATE: RateLimit = RateLimit {
    per_second: 2.0,
    burst: 20,
};

/// Client addresses whose failed authentications are remembered at once; past it the
/// address idle longest is forgotten.
const MAX_TRACKED_ADDRESSES: usize = 4096;

/// The open event streams: each with its owner, client address and a token that ends it.
#[derive(Default)]
struct Streams {
    next: u64,
    open: Vec<OpenStream>,
}

struct OpenStream {
    id: u64,
    owner: String,
    client: Option<std::net::IpAddr>,
    end: tokio_util::sync::CancellationToken,
}

/// One open event stream, counted against its owner and client address until dropped. Its
/// [`StreamGuard::ended`] fires when a newer stream of the same owner took its place.
pub struct StreamGuard {
    access: std::sync::Arc<Access>,
    id: u64,
    end: tokio_util::sync::CancellationToken,
}

impl StreamGuard {
    /// Cancelled when the stream was evicted by a newer one.
    pub fn ended(&self) -> &tokio_util::sync::CancellationToken {
        &self.end
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let mut s = self
            .access
            .streams
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        s.open.retain(|o| o.id != self.id);
    }
}

impl Access {
    /// No tokens, no policy limits: every caller is the admin `local`.
    pub fn open() -> Self {
        Self {
            tokens: HashMap::new(),
            metrics: MetricsAccess::Open,
            limiter: None,
            streams: Mutex::new(Streams::default()),
            failures: Limiter::new(FAILED_AUTH_RATE),
            policy: ProgramPolicy::default(),
        }
    }

    pub fn new(cfg: &AccessConfig, policy: ProgramPolicy) -> Result<Self, AccessConfigError> {
        let mut tokens = HashMap::new();
        for (index, t) in cfg.tokens.iter().enumerate() {
            let digest = t.sha256.to_ascii_lowercase();
            if digest.len() != 64 || !digest.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(AccessConfigError::BadDigest { index });
            }
            let name_ok = (1..=64).contains(&t.name.len())
                && t.name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_.@-".contains(&b));
            if !name_ok {
                return Err(AccessConfigError::BadName { index });
            }
            if tokens.insert(digest, (t.name.clone(), t.role)).is_some() {
                return Err(AccessConfigError::Duplicate { index });
            }
        }
        let limiter = match cfg.rate_limit {
            Some(r) if !(r.per_second.is_finite() && r.per_second > 0.0 && r.burst >= 1) => {
                return Err(AccessConfigError::BadRateLimit);
            }
            Some(r) => Some(Limiter::new(r)),
            None => None,
        };
        Ok(Self {
            tokens,
            metrics: cfg.metrics,
            limiter,
            streams: Mutex::new(Streams::default()),
            failures: Limiter::new(FAILED_AUTH_RATE),
            policy,
        })
    }

    /// Whether callers must present a token.
    pub fn enabled(&self) -> bool {
        !self.tokens.is_empty()
    }

    pub fn metrics_open(&self) -> bool {
        !self.enabled() || self.metrics == MetricsAccess::Open
    }

    /// The caller behind an `Authorization` header value (none: no header), after its rate
    /// limit.
    pub fn authenticate(&self, authorization: Option<&str>) -> Result<Principal, Denied> {
        self.authenticate_from(authorization, None)
    }

    /// [`Access::authenticate`] for a request from `client`: a missing or unknown token
    /// counts against the address's [`FAILED_AUTH_RATE`], and past it the answer is 429.
    pub fn authenticate_from(
        &self,
        authorization: Option<&str>,
        client: Option<std::net::IpAddr>,
    ) -> Result<Principal, Denied> {
        match self.identify(authorization) {
            Err(Denied::Unauthenticated(why)) => {
                let key = client.map_or_else(|| "unknown".to_string(), |ip| ip.to_string());
                self.failures.take_bounded(&key, MAX_TRACKED_ADDRESSES)?;
                Err(Denied::Unauthenticated(why))
            }
            other => other,
        }
    }

    fn identify(&self, authorization: Option<&str>) -> Result<Principal, Denied> {
        let principal = if self.enabled() {
            let token = authorization
                .ok_or(Denied::Unauthenticated("missing bearer token"))?
                // The scheme is case-insensitive (RFC 9110).
                .split_once(' ')
                .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
                .map(|(_, t)| t.trim())
                .filter(|t| !t.is_empty())
                .ok_or(Denied::Unauthenticated(
                    "the Authorization header must read `Bearer <token>`",
                ))?;
            let digest = hash_token(token);
            let (name, role) = self
                .tokens
                .get(&digest)
                .ok_or(Denied::Unauthenticated("unknown token"))?;
            Principal {
                name: name.clone(),
                role: *role,
                bucket: digest,
            }
        } else {
            Principal {
                name: "local".into(),
                role: Role::Admin,
                bucket: String::new(),
            }
        };
        if let Some(l) = &self.limiter {
            l.take(&principal.bucket)?;
        }
        Ok(principal)
    }

    /// Counts an event stream against `p`'s owner and `client`'s address. Where one of them
    /// is at its cap ([`MAX_STREAMS_PER_ADDRESS`], [`MAX_STREAMS_PER_OWNER`]) the oldest
    /// stream in the way ends: of this address, or else of the owner's address that holds
    /// the most. A dashboard that opens a stream is never locked out by others' streams.
    pub fn open_stream(
        self: &std::sync::Arc<Self>,
        p: &Principal,
        client: Option<std::net::IpAddr>,
    ) -> StreamGuard {
        let mut s = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        let mine = |o: &OpenStream| o.owner == p.name;
        let from_here = s
            .open
            .iter()
            .filter(|o| mine(o) && o.client == client)
            .count();
        if from_here >= MAX_STREAMS_PER_ADDRESS {
            evict_oldest(&mut s.open, |o| mine(o) && o.client == client);
        }
        if s.open.iter().filter(|o| mine(o)).count() >= MAX_STREAMS_PER_OWNER {
            let mut per: HashMap<Option<std::net::IpAddr>, usize> = HashMap::new();
            for o in s.open.iter().filter(|o| mine(o)) {
                *per.entry(o.client).or_insert(0) += 1;
            }
            let busiest = per.into_iter().max_by_key(|(_, n)| *n).map(|(c, _)| c);
            evict_oldest(&mut s.open, |o| mine(o) && Some(o.client) == busiest);
        }
        s.next += 1;
        let id = s.next;
        let end = tokio_util::sync::CancellationToken::new();
        s.open.push(OpenStream {
            id,
            owner: p.name.clone(),
            client,
            end: end.clone(),
        });
        StreamGuard {
            access: self.clone(),
            id,
            end,
        }
    }

    /// Event streams open now (of every owner).
    pub fn open_streams(&self) -> usize {
        self.streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .open
            .len()
    }

    /// The `readable_paths` policy as a check of a resolved path: a refusal message, or
    /// none when the service lets a spec read it (the one policy every file opened on a
    /// user's behalf goes through, see `infra::files`).
    pub fn readable_check(&self) -> impl Fn(&std::path::Path) -> Option<String> + Send + 'static {
        let list =
            programs::ReadableList::new(self.policy.readable_paths.as_deref(), self.enabled());
        move |p: &std::path::Path| {
            let shown = p.display().to_string();
            (!list.permits(&shown)).then(|| format!("the service does not allow reading {shown:?}"))
        }
    }

    /// Checks every program a spec would start against the policy: one 403 field error per
    /// disallowed program or sandbox opt-out.
    pub fn check_programs(&self, spec: &JobSpec) -> Vec<FieldError> {
        programs::ProgramCheck::new(&self.policy, self.enabled()).run(spec)
    }
}

/// Hex SHA-256 of a token, as the service config stores it.
pub fn hash_token(token: &str) -> String {
    hash_bytes(token.as_bytes())
}

/// The SHA-256 of `bytes` in lowercase hex.
pub fn hash_bytes(bytes: &[u8]) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, bytes);
    d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// A fresh token: `rk_` and 32 random bytes in hex.
pub fn new_token() -> Result<String, ring::error::Unspecified> {
    infra::secret::new_token("rk_")
}

/// Ends the oldest stream (the first in opening order) that `pick` selects.
fn evict_oldest(open: &mut Vec<OpenStream>, pick: impl Fn(&OpenStream) -> bool) {
    if let Some(i) = open.iter().position(pick) {
        open.remove(i).end.cancel();
    }
}

/// Token buckets, one per token (the map is bounded by the tokens of the config, plus the
/// one bucket of open mode). Time comes from tokio (a paused clock in tests).
struct Limiter {
    rate: RateLimit,
    buckets: Mutex<BTreeMap<String, (f64, tokio::time::Instant)>>,
}

impl Limiter {
    fn new(rate: RateLimit) -> Self {
        Self {
            rate,
            buckets: Mutex::new(BTreeMap::new()),
        }
    }

    /// [`Limiter::take`] with at most `max_keys` buckets: past it the bucket idle longest
    /// is forgotten (it would have refilled first).
    fn take_bounded(&self, key: &str, max_keys: usize) -> Result<(), Denied> {
        {
            let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
            if buckets.len() >= max_keys && !buckets.contains_key(key) {
                let idle = buckets
                    .iter()
                    .min_by_key(|(_, (_, at))| *at)
                    .map(|(k, _)| k.clone());
                if let Some(k) = idle {
                    buckets.remove(&k);
                }
            }
        }
        self.take(key)
    }

    fn take(&self, key: &str) -> Result<(), Denied> {
        let now = tokio::time::Instant::now();
        let burst = f64::from(self.rate.burst);
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let (level, at) = buckets.entry(key.to_string()).or_insert((burst, now));
        let refilled =
            (*level + now.duration_since(*at).as_secs_f64() * self.rate.per_second).min(burst);
        *at = now;
        if refilled >= 1.0 {
            *level = refilled - 1.0;
            Ok(())
        } else {
            *level = refilled;
            let wait = (1.0 - refilled) / self.rate.per_second;
            Err(Denied::RateLimited {
                retry_after_s: wait.ceil().max(1.0) as u64,
            })
        }
    }
}

#[cfg(test)]
mod tests;
