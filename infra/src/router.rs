//! The async router that reaches function instances.
//!
//! Per call, outside in:
//! - **idempotency**: results are keyed by the call's idempotency key; concurrent calls with one
//!   key share one dispatch and a finished key answers from the cache, so a retried or hedged
//!   call yields exactly one result;
//! - **deadline** for the whole call (propagated in `x-rollarc-deadline-ms`);
//! - **retries** (tower `Retry`) of retryable failures only, within a `TpsBudget` (20 % of calls
//!   + 10/s over 10 s), with full-jitter exponential backoff that honours `Retry-After`;
//! - optional **hedging** (tower `Hedge`) after the p95 latency, under its own budget;
//! - **activator** buffer (tower `Buffer` + `LoadShed`): while nothing can take a request
//!   (no instance ready, or all at their container concurrency) it waits in a bounded buffer;
//!   past the bound the call fails at once with `Overloaded` (a 503 with a retry hint);
//! - **balancing** (tower `p2c::Balance`) over ready, non-ejected instances scored by
//!   **peak-EWMA** latency × in-flight; 429 and 503-with-`Retry-After` hold their load handle for
//!   the hinted time, so a shedding instance looks slow, never fast;
//! - per instance a **concurrency limit** (the container concurrency), a per-try timeout, a
//!   response-size cap, and **outlier ejection** (5 consecutive failures → out for 30 s × n, at
//!   most 10 % of instances, at least one).

use crate::error_chain;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokio::sync::{Notify, OnceCell, watch};
use tokio::time::Instant;
use tower::balance::p2c::Balance;
use tower::buffer::Buffer;
use tower::discover::Change;
use tower::limit::ConcurrencyLimit;
use tower::load::completion::TrackCompletion;
use tower::load::peak_ewma::{Handle, PeakEwma};
use tower::load_shed::LoadShed;
use tower::retry::budget::{Budget, TpsBudget};
use tower::util::BoxCloneService;
use tower::{BoxError, Service, ServiceExt};

use crate::faas::runtime::Deployment;
pub use crate::faas::runtime::Endpoint;

/// One function call.
#[derive(Clone, Debug)]
pub struct Call {
    /// Same key → same result (trajectory id + reward spec version).
    pub key: String,
    pub body: Bytes,
    pub deadline: Instant,
}

/// A function's answer (2xx, or a non-retryable 4xx the caller should see).
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: u16,
    pub body: Bytes,
    pub instance: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouterError {
    #[error("function {function} is overloaded (activator buffer full); retry after {retry_after_ms} ms")]
    Overloaded { function: String, retry_after_ms: u64 },
    #[error("function {function}: deadline exceeded after {attempts} attempt(s)")]
    DeadlineExceeded { function: String, attempts: u64 },
    #[error("function {function}: failed after {attempts} attempt(s): {last}")]
    Failed { function: String, attempts: u64, last: String },
    #[error("function {function} rejected the request with {status}: {body}")]
    Rejected { function: String, status: u16, body: String },
}

/// Why one try failed.
#[derive(Clone, Debug, thiserror::Error)]
pub enum TryError {
    #[error("transport: {0}")]
    Transport(String),
    #[error("try timed out after {0:?}")]
    Timeout(Duration),
    #[error("response body over {0} bytes")]
    BodyTooLarge(usize),
    #[error("status {status}")]
    Status { status: u16, retry_after: Option<Duration>, body: String },
}

impl TryError {
    fn retryable(&self) -> bool {
        match self {
            TryError::Status { status, .. } => *status == 429 || *status >= 500,
            _ => true,
        }
    }
}

#[derive(Clone, Debug)]
pub struct RouterConfig {
    pub per_try_timeout: Duration,
    pub max_attempts: u32,
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    /// Retry budget: `retry_ratio` of calls plus `retry_min_per_sec`, over `retry_window`.
    pub retry_ratio: f32,
    pub retry_min_per_sec: u32,
    pub retry_window: Duration,
    pub eject_after: u32,
    pub eject_base: Duration,
    pub eject_max_percent: u32,
    /// Hedge after this latency percentile (e.g. 0.95); `None` = no hedging.
    pub hedge_percentile: Option<f32>,
    pub hedge_min_samples: u64,
    pub max_response_bytes: usize,
    /// Hard in-flight limit per instance (container concurrency); 0 = none.
    pub container_concurrency: u32,
    /// Activator buffer bound.
    pub buffer: usize,
    /// How long a 429/503-with-Retry-After keeps an instance looking busy at most.
    pub shed_penalty_cap: Duration,
    pub seed: u64,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            per_try_timeout: Duration::from_secs(30),
            max_attempts: 5,
            backoff_base: Duration::from_millis(25),
            backoff_cap: Duration::from_millis(250),
            retry_ratio: 0.2,
            retry_min_per_sec: 10,
            retry_window: Duration::from_secs(10),
            eject_after: 5,
            eject_base: Duration::from_secs(30),
            eject_max_percent: 10,
            hedge_percentile: None,
            hedge_min_samples: 20,
            max_response_bytes: 4 << 20,
            container_concurrency: 0,
            buffer: 10_000,
            shed_penalty_cap: Duration::from_secs(2),
            seed: 0,
        }
    }
}

/// Counters of one router (monotonic unless noted).
#[derive(Debug, Default)]
pub struct RouterStats {
    pub calls: AtomicU64,
    pub tries: AtomicU64,
    pub retries: AtomicU64,
    pub hedges: AtomicU64,
    pub budget_exhausted: AtomicU64,
    pub deduplicated: AtomicU64,
    pub overloaded: AtomicU64,
    pub failures: AtomicU64,
    pub ejections: AtomicU64,
    pub oversized: AtomicU64,
    /// Tries per instance id.
    pub per_instance: Mutex<BTreeMap<u64, u64>>,
    /// Busy time per instance id (time with at least one try in flight), for utilisation
    /// timelines.
    pub busy: Mutex<BTreeMap<u64, InstanceBusy>>,
    /// Calls inside the router now / at most (waiting in the activator buffer, backing off, or
    /// at an instance); with every instance at its container concurrency, the excess over
    /// `instances × concurrency` is the activator queue.
    pub queued: AtomicU64,
    pub peak_queued: AtomicU64,
}

#[derive(Clone, Debug, Serialize)]
pub struct RouterSnapshot {
    pub calls: u64,
    pub tries: u64,
    pub retries: u64,
    pub hedges: u64,
    pub budget_exhausted: u64,
    pub deduplicated: u64,
    pub overloaded: u64,
    pub failures: u64,
    pub ejections: u64,
    pub oversized: u64,
    pub peak_queued: u64,
    pub per_instance: BTreeMap<u64, u64>,
    /// Seconds each instance has had at least one try in flight, up to the snapshot.
    pub busy_s: BTreeMap<u64, f64>,
}

/// In-flight accounting of one instance.
#[derive(Clone, Copy, Debug)]
pub struct InstanceBusy {
    in_flight: u32,
    since: Instant,
    busy: Duration,
}

impl InstanceBusy {
    fn busy_until(&self, now: Instant) -> Duration {
        if self.in_flight > 0 { self.busy + now.saturating_duration_since(self.since) } else { self.busy }
    }
}

impl RouterStats {
    /// One try starts (+1) or ends (−1) at an instance.
    fn in_flight(&self, id: u64, delta: i32) {
        let now = Instant::now();
        let Ok(mut m) = self.busy.lock() else { return };
        let b = m.entry(id).or_insert(InstanceBusy { in_flight: 0, since: now, busy: Duration::ZERO });
        if b.in_flight > 0 {
            b.busy += now.saturating_duration_since(b.since);
        }
        b.since = now;
        b.in_flight = b.in_flight.saturating_add_signed(delta);
    }

    pub fn snapshot(&self) -> RouterSnapshot {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RouterSnapshot {
            calls: l(&self.calls),
            tries: l(&self.tries),
            retries: l(&self.retries),
            hedges: l(&self.hedges),
            budget_exhausted: l(&self.budget_exhausted),
            deduplicated: l(&self.deduplicated),
            overloaded: l(&self.overloaded),
            failures: l(&self.failures),
            ejections: l(&self.ejections),
            oversized: l(&self.oversized),
            peak_queued: l(&self.peak_queued),
            per_instance: self.per_instance.lock().map(|m| m.clone()).unwrap_or_default(),
            busy_s: {
                let now = Instant::now();
                self.busy.lock().map(|m| m.iter().map(|(&id, b)| (id, b.busy_until(now).as_secs_f64())).collect()).unwrap_or_default()
            },
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Outlier ejection.

struct Outliers {
    cfg_after: u32,
    cfg_base: Duration,
    cfg_max_percent: u32,
    state: Mutex<OutState>,
    changed: Notify,
    stats: Arc<RouterStats>,
}

#[derive(Default)]
struct OutState {
    consecutive: HashMap<u64, u32>,
    /// Outcomes of the last `RATE_WINDOW` tries per instance (true = failed).
    recent: HashMap<u64, VecDeque<bool>>,
    ejected: HashMap<u64, Instant>,
    times: HashMap<u64, u32>,
    instances: usize,
}

/// Failure-rate ejection (Envoy's `failure_percentage`): over the last `RATE_WINDOW` tries of
/// an instance, at least `RATE_MIN` of them, a failure share ≥ `RATE_THRESHOLD` ejects it, so a
/// 50 %-failing instance goes even when its failures never come five in a row.
pub const RATE_WINDOW: usize = 20;
pub const RATE_MIN: usize = 10;
pub const RATE_THRESHOLD: f64 = 0.5;

fn push_outcome(s: &mut OutState, id: u64, failed: bool) -> f64 {
    let r = s.recent.entry(id).or_default();
    r.push_back(failed);
    while r.len() > RATE_WINDOW {
        r.pop_front();
    }
    if r.len() < RATE_MIN { 0.0 } else { r.iter().filter(|f| **f).count() as f64 / r.len() as f64 }
}

impl Outliers {
    fn success(&self, id: u64) {
        if let Ok(mut s) = self.state.lock() {
            s.consecutive.insert(id, 0);
            push_outcome(&mut s, id, false);
        }
    }

    fn failure(&self, id: u64, function: &str) {
        let Ok(mut s) = self.state.lock() else { return };
        let now = Instant::now();
        s.ejected.retain(|_, until| *until > now);
        let rate = push_outcome(&mut s, id, true);
        let c = s.consecutive.entry(id).or_insert(0);
        *c += 1;
        if (*c < self.cfg_after && rate < RATE_THRESHOLD) || s.ejected.contains_key(&id) {
            return;
        }
        let cap = ((s.instances as u64 * self.cfg_max_percent as u64) / 100).max(1) as usize;
        if s.ejected.len() >= cap {
            return;
        }
        s.consecutive.insert(id, 0);
        s.recent.remove(&id);
        let n = {
            let t = s.times.entry(id).or_insert(0);
            *t += 1;
            *t
        };
        let until = now + self.cfg_base * n;
        s.ejected.insert(id, until);
        self.stats.ejections.fetch_add(1, Ordering::Relaxed);
        router_metrics().ejections.add(1, &[opentelemetry::KeyValue::new("function", function.to_string())]);
        tracing::warn!(function, instance = id, for_s = (self.cfg_base * n).as_secs_f64(), "instance ejected after consecutive failures");
        drop(s);
        self.changed.notify_one();
    }

    /// Ejected ids now, and the earliest instant one comes back.
    fn ejected(&self) -> (Vec<u64>, Option<Instant>) {
        let Ok(mut s) = self.state.lock() else { return (Vec::new(), None) };
        let now = Instant::now();
        s.ejected.retain(|_, until| *until > now);
        (s.ejected.keys().copied().collect(), s.ejected.values().min().copied())
    }

    fn set_instances(&self, n: usize) {
        if let Ok(mut s) = self.state.lock() {
            s.instances = n;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// One instance.

#[derive(Clone)]
struct InstanceSvc {
    id: u64,
    url: String,
    function: Arc<str>,
    client: reqwest::Client,
    per_try: Duration,
    max_body: usize,
    outliers: Arc<Outliers>,
    stats: Arc<RouterStats>,
}

impl Service<Call> for InstanceSvc {
    type Response = Result<Reply, TryError>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, call: Call) -> Self::Future {
        let me = self.clone();
        Box::pin(async move {
            me.stats.tries.fetch_add(1, Ordering::Relaxed);
            if let Ok(mut m) = me.stats.per_instance.lock() {
                *m.entry(me.id).or_insert(0) += 1;
            }
            let remaining = call.deadline.saturating_duration_since(Instant::now());
            let timeout = me.per_try.min(remaining).max(Duration::from_millis(1));
            let _busy = BusyGuard::start(&me.stats, me.id);
            let r = me.try_once(&call, remaining, timeout).await;
            match &r {
                Ok(_) => me.outliers.success(me.id),
                Err(TryError::Status { status: 429, .. }) => {}
                Err(TryError::Status { status: 503, retry_after: Some(_), .. }) => {}
                Err(e) if e.retryable() || matches!(e, TryError::BodyTooLarge(_)) => me.outliers.failure(me.id, &me.function),
                Err(_) => me.outliers.success(me.id),
            }
            Ok(r)
        })
    }
}

/// Counts a try as in flight at its instance until dropped (also when the call is cancelled).
struct BusyGuard<'a>(&'a RouterStats, u64);

impl<'a> BusyGuard<'a> {
    fn start(stats: &'a RouterStats, id: u64) -> Self {
        stats.in_flight(id, 1);
        Self(stats, id)
    }
}

impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        self.0.in_flight(self.1, -1);
    }
}

impl InstanceSvc {
    async fn try_once(&self, call: &Call, remaining: Duration, timeout: Duration) -> Result<Reply, TryError> {
        let send = self
            .client
            .post(&self.url)
            .header("content-type", "application/json")
            .header("idempotency-key", &call.key)
            .header("x-rollarc-deadline-ms", remaining.as_millis().to_string())
            .body(call.body.clone())
            .send();
        let fut = async {
            let mut resp = send.await.map_err(|e| TryError::Transport(error_chain(&e)))?;
            let status = resp.status().as_u16();
            let retry_after =
                resp.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|s| s.trim().parse::<f64>().ok()).map(Duration::from_secs_f64);
            if resp.content_length().is_some_and(|n| n as usize > self.max_body) {
                self.stats.oversized.fetch_add(1, Ordering::Relaxed);
                return Err(TryError::BodyTooLarge(self.max_body));
            }
            let mut body = Vec::new();
            while let Some(chunk) = resp.chunk().await.map_err(|e| TryError::Transport(error_chain(&e)))? {
                if body.len() + chunk.len() > self.max_body {
                    self.stats.oversized.fetch_add(1, Ordering::Relaxed);
                    return Err(TryError::BodyTooLarge(self.max_body));
                }
                body.extend_from_slice(&chunk);
            }
            if (200..300).contains(&status) || (400..500).contains(&status) && status != 429 && status != 408 {
                Ok(Reply { status, body: Bytes::from(body), instance: self.id })
            } else {
                Err(TryError::Status { status, retry_after, body: String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned() })
            }
        };
        match tokio::time::timeout(timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(TryError::Timeout(timeout)),
        }
    }
}

/// Shedding answers keep the load handle for the hinted time: a fast 429 looks slow.
#[derive(Clone)]
struct SlowOnShed {
    cap: Duration,
}

impl TrackCompletion<Handle, Result<Reply, TryError>> for SlowOnShed {
    type Output = Result<Reply, TryError>;

    fn track_completion(&self, handle: Handle, value: Result<Reply, TryError>) -> Self::Output {
        let hold = match &value {
            Err(TryError::Status { status: 429, retry_after, .. }) => Some(retry_after.unwrap_or(Duration::from_secs(1))),
            Err(TryError::Status { status: 503, retry_after: Some(ra), .. }) => Some(*ra),
            _ => None,
        };
        if let Some(h) = hold {
            let h = h.min(self.cap);
            tokio::spawn(async move {
                tokio::time::sleep(h).await;
                drop(handle);
            });
        }
        value
    }
}

type Instance = PeakEwma<ConcurrencyLimit<InstanceSvc>, SlowOnShed>;

// ---------------------------------------------------------------------------------------------
// Discovery: ready endpoints minus ejected ones, as tower `Change`s.

fn discover(
    mut endpoints: watch::Receiver<Vec<Endpoint>>,
    outliers: Arc<Outliers>,
    make: impl Fn(&Endpoint) -> Instance + Send + 'static,
) -> impl futures::Stream<Item = Result<Change<u64, Instance>, Infallible>> + Send + Unpin + 'static {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Change<u64, Instance>, Infallible>>(256);
    tokio::spawn(async move {
        let mut current: BTreeMap<u64, ()> = BTreeMap::new();
        loop {
            let eps = endpoints.borrow_and_update().clone();
            outliers.set_instances(eps.len());
            let (ejected, next_back) = outliers.ejected();
            let want: BTreeMap<u64, &Endpoint> = eps.iter().filter(|e| !ejected.contains(&e.id)).map(|e| (e.id, e)).collect();
            for id in current.keys().copied().collect::<Vec<_>>() {
                if !want.contains_key(&id) {
                    current.remove(&id);
                    if tx.send(Ok(Change::Remove(id))).await.is_err() {
                        return;
                    }
                }
            }
            for (id, ep) in &want {
                if !current.contains_key(id) {
                    current.insert(*id, ());
                    if tx.send(Ok(Change::Insert(*id, make(ep)))).await.is_err() {
                        return;
                    }
                }
            }
            let back = async {
                match next_back {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                r = endpoints.changed() => if r.is_err() { return },
                _ = outliers.changed.notified() => {}
                _ = back => {}
                _ = tx.closed() => return,
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

// ---------------------------------------------------------------------------------------------
// Retry and hedge policies.

#[derive(Clone)]
struct RetryPolicy {
    budget: Arc<TpsBudget>,
    attempts: u32,
    max_attempts: u32,
    base: Duration,
    cap: Duration,
    rng: Arc<Mutex<SmallRng>>,
    stats: Arc<RouterStats>,
}

impl tower::retry::Policy<Call, Result<Reply, TryError>, BoxError> for RetryPolicy {
    type Future = tokio::time::Sleep;

    fn retry(&mut self, req: &mut Call, result: &mut Result<Result<Reply, TryError>, BoxError>) -> Option<Self::Future> {
        let retry_after = match result {
            Ok(Ok(_)) => return None,
            Ok(Err(e)) if !e.retryable() => return None,
            Ok(Err(TryError::Status { retry_after, .. })) => *retry_after,
            Ok(Err(_)) => None,
            // Overloaded (activator full) is not retried here: no amplification of an overload.
            Err(_) => return None,
        };
        self.attempts += 1;
        if self.attempts >= self.max_attempts {
            return None;
        }
        let now = Instant::now();
        if now >= req.deadline {
            return None;
        }
        if !self.budget.withdraw() {
            self.stats.budget_exhausted.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        self.stats.retries.fetch_add(1, Ordering::Relaxed);
        // Full jitter: uniform in [0, min(cap, base · 2^attempt)], at least the Retry-After hint.
        let ceiling = self.cap.min(self.base * 2u32.saturating_pow(self.attempts.min(16)));
        let jitter = {
            let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
            ceiling.mul_f64(rng.random::<f64>())
        };
        let wait = jitter.max(retry_after.unwrap_or_default().min(self.cap * 4));
        let wake = (now + wait).min(req.deadline);
        Some(tokio::time::sleep_until(wake))
    }

    fn clone_request(&mut self, req: &Call) -> Option<Call> {
        Some(req.clone())
    }
}

#[derive(Clone)]
struct HedgePolicy {
    budget: Arc<TpsBudget>,
    stats: Arc<RouterStats>,
}

impl tower::hedge::Policy<Call> for HedgePolicy {
    fn clone_request(&self, req: &Call) -> Option<Call> {
        Some(req.clone())
    }

    fn can_retry(&self, req: &Call) -> bool {
        let ok = Instant::now() < req.deadline && self.budget.withdraw();
        if ok {
            self.stats.hedges.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }
}

// ---------------------------------------------------------------------------------------------
// The router.

type Inner = BoxCloneService<Call, Result<Reply, TryError>, BoxError>;

/// Where a router sends calls.
pub enum Target {
    /// A deployment of the local runtime (its ready instances; its autoscaler sees the load).
    Local(Arc<Deployment>),
    /// A fixed URL, e.g. a Knative Service's address.
    Url(String),
    /// Any changing set of endpoints (another platform's discovery).
    Endpoints(watch::Receiver<Vec<Endpoint>>),
}

pub struct Router {
    function: Arc<str>,
    inner: Mutex<Inner>,
    budget: Arc<TpsBudget>,
    stats: Arc<RouterStats>,
    deployment: Option<Arc<Deployment>>,
    results: Mutex<Results>,
    buffer: usize,
    _url_keepalive: Option<watch::Sender<Vec<Endpoint>>>,
    /// Calls run here (the runtime the router was built on), whichever runtime awaits them.
    rt: tokio::runtime::Handle,
}

struct Results {
    map: HashMap<String, Arc<OnceCell<Reply>>>,
    order: VecDeque<String>,
}

/// Finished results kept for idempotency (oldest evicted first).
pub const RESULT_CACHE: usize = 65_536;

struct RouterMetrics {
    calls: opentelemetry::metrics::Counter<u64>,
    tries: opentelemetry::metrics::Counter<u64>,
    ejections: opentelemetry::metrics::Counter<u64>,
    latency: opentelemetry::metrics::Histogram<f64>,
}

fn router_metrics() -> &'static RouterMetrics {
    static M: std::sync::OnceLock<RouterMetrics> = std::sync::OnceLock::new();
    M.get_or_init(|| {
        let meter = crate::telemetry::Metrics::global().meter();
        RouterMetrics {
            calls: meter.u64_counter("rollarc_router_calls_total").with_description("Function calls by outcome").build(),
            tries: meter.u64_counter("rollarc_router_tries_total").with_description("HTTP tries (first tries, retries, hedges)").build(),
            ejections: meter.u64_counter("rollarc_router_ejections_total").with_description("Instances ejected as outliers").build(),
            latency: meter.f64_histogram("rollarc_router_call_seconds").with_description("Call latency including queueing and retries").with_unit("s").build(),
        }
    })
}

impl Router {
    /// Builds a router on the current tokio runtime (its tasks and calls run there).
    pub fn new(function: &str, target: Target, cfg: RouterConfig) -> Arc<Self> {
        let stats = Arc::new(RouterStats::default());
        let outliers = Arc::new(Outliers {
            cfg_after: cfg.eject_after.max(1),
            cfg_base: cfg.eject_base,
            cfg_max_percent: cfg.eject_max_percent,
            state: Mutex::new(OutState::default()),
            changed: Notify::new(),
            stats: stats.clone(),
        });
        let (endpoints, keepalive, deployment) = match target {
            Target::Local(d) => (d.endpoints(), None, Some(d)),
            Target::Url(url) => {
                let (tx, rx) = watch::channel(vec![Endpoint { id: 0, url }]);
                (rx, Some(tx), None)
            }
            Target::Endpoints(rx) => (rx, None, None),
        };
        let function: Arc<str> = Arc::from(function);
        let client = reqwest::Client::builder().pool_idle_timeout(Duration::from_secs(30)).build().unwrap_or_default();
        let limit = if cfg.container_concurrency == 0 { 10_000 } else { cfg.container_concurrency as usize };
        let make = {
            let (function, stats, outliers) = (function.clone(), stats.clone(), outliers.clone());
            let (per_try, max_body, cap) = (cfg.per_try_timeout, cfg.max_response_bytes, cfg.shed_penalty_cap);
            move |ep: &Endpoint| {
                let svc = InstanceSvc {
                    id: ep.id,
                    url: ep.url.clone(),
                    function: function.clone(),
                    client: client.clone(),
                    per_try,
                    max_body,
                    outliers: outliers.clone(),
                    stats: stats.clone(),
                };
                PeakEwma::new(ConcurrencyLimit::new(svc, limit), Duration::from_millis(30), Duration::from_secs(10).as_nanos() as f64, SlowOnShed { cap })
            }
        };
        let balance = Balance::from_rng(discover(endpoints, outliers, make), tower::util::rng::HasherRng::default());
        let buffered = Buffer::new(balance, cfg.buffer.max(1));
        let shed = LoadShed::new(buffered);
        let mut inner: Inner = BoxCloneService::new(shed);
        let budget = Arc::new(TpsBudget::new(cfg.retry_window, cfg.retry_min_per_sec, cfg.retry_ratio));
        if let Some(p) = cfg.hedge_percentile {
            let policy = HedgePolicy { budget: Arc::new(TpsBudget::new(cfg.retry_window, 1, 0.1)), stats: stats.clone() };
            // Hedge is not Clone: a second buffer makes it shareable (its inner readiness is
            // immediate — the activator buffer below sheds rather than waits).
            let hedge = tower::hedge::Hedge::new::<Call>(inner, policy, cfg.hedge_min_samples, p, Duration::from_secs(10));
            inner = BoxCloneService::new(Buffer::new(hedge, cfg.buffer.max(1)));
        }
        let policy = RetryPolicy {
            budget: budget.clone(),
            attempts: 0,
            max_attempts: cfg.max_attempts.max(1),
            base: cfg.backoff_base,
            cap: cfg.backoff_cap,
            rng: Arc::new(Mutex::new(SmallRng::seed_from_u64(cfg.seed))),
            stats: stats.clone(),
        };
        let inner = BoxCloneService::new(tower::retry::Retry::new(policy, inner));
        Arc::new(Self {
            function,
            inner: Mutex::new(inner),
            budget,
            stats,
            deployment,
            results: Mutex::new(Results { map: HashMap::new(), order: VecDeque::new() }),
            buffer: cfg.buffer.max(1),
            _url_keepalive: keepalive,
            rt: tokio::runtime::Handle::current(),
        })
    }

    pub fn stats(&self) -> &Arc<RouterStats> {
        &self.stats
    }

    pub fn function(&self) -> &str {
        &self.function
    }

    /// Calls the function; one result per idempotency key. The call runs on the router's own
    /// runtime (connections and timers live there), so any runtime may await it; a caller that
    /// gives up does not cancel it (its result still lands in the idempotency cache).
    pub async fn call(self: &Arc<Self>, call: Call) -> Result<Reply, RouterError> {
        let me = self.clone();
        let function = self.function.to_string();
        match self.rt.spawn(async move { me.call_here(call).await }).await {
            Ok(r) => r,
            Err(e) => Err(RouterError::Failed { function, attempts: 0, last: format!("router task ended: {e}") }),
        }
    }

    async fn call_here(&self, call: Call) -> Result<Reply, RouterError> {
        let cell = {
            let mut r = self.results.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(c) = r.map.get(&call.key) {
                self.stats.deduplicated.fetch_add(1, Ordering::Relaxed);
                c.clone()
            } else {
                let c = Arc::new(OnceCell::new());
                r.map.insert(call.key.clone(), c.clone());
                r.order.push_back(call.key.clone());
                while r.order.len() > RESULT_CACHE {
                    if let Some(old) = r.order.pop_front() {
                        r.map.remove(&old);
                    }
                }
                c
            }
        };
        let key = call.key.clone();
        let out = cell.get_or_try_init(|| self.dispatch(call)).await.cloned();
        if out.is_err() {
            // Failed keys are not cached: a later call may try again.
            let mut r = self.results.lock().unwrap_or_else(|p| p.into_inner());
            if r.map.get(&key).is_some_and(|c| c.get().is_none() && Arc::ptr_eq(c, &cell)) {
                r.map.remove(&key);
                r.order.retain(|k| k != &key);
            }
        }
        out
    }

    async fn dispatch(&self, call: Call) -> Result<Reply, RouterError> {
        let started = Instant::now();
        self.stats.calls.fetch_add(1, Ordering::Relaxed);
        self.budget.deposit();
        let _tracked = self.deployment.as_ref().map(|d| d.track());
        let q = self.stats.queued.fetch_add(1, Ordering::Relaxed) + 1;
        self.stats.peak_queued.fetch_max(q, Ordering::Relaxed);
        let deadline = call.deadline;
        let tries_before = self.stats.tries.load(Ordering::Relaxed);
        let svc = self.inner.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let r = tokio::time::timeout_at(deadline, svc.oneshot(call)).await;
        self.stats.queued.fetch_sub(1, Ordering::Relaxed);
        let attempts = self.stats.tries.load(Ordering::Relaxed).saturating_sub(tries_before).max(1);
        let function = self.function.to_string();
        let out = match r {
            Err(_) => Err(RouterError::DeadlineExceeded { function, attempts }),
            Ok(Ok(Ok(reply))) if (200..300).contains(&reply.status) => Ok(reply),
            Ok(Ok(Ok(reply))) => Err(RouterError::Rejected {
                function,
                status: reply.status,
                body: String::from_utf8_lossy(&reply.body[..reply.body.len().min(500)]).into_owned(),
            }),
            Ok(Ok(Err(e))) => Err(RouterError::Failed { function, attempts, last: e.to_string() }),
            Ok(Err(e)) if e.is::<tower::load_shed::error::Overloaded>() => {
                self.stats.overloaded.fetch_add(1, Ordering::Relaxed);
                Err(RouterError::Overloaded { function, retry_after_ms: 1000 })
            }
            Ok(Err(e)) => Err(RouterError::Failed { function, attempts, last: e.to_string() }),
        };
        let m = router_metrics();
        let outcome = match &out {
            Ok(_) => "ok",
            Err(RouterError::Overloaded { .. }) => "overloaded",
            Err(RouterError::DeadlineExceeded { .. }) => "deadline",
            Err(RouterError::Rejected { .. }) => "rejected",
            Err(RouterError::Failed { .. }) => "failed",
        };
        if out.is_err() {
            self.stats.failures.fetch_add(1, Ordering::Relaxed);
        }
        let f = opentelemetry::KeyValue::new("function", self.function.to_string());
        m.calls.add(1, &[f.clone(), opentelemetry::KeyValue::new("outcome", outcome)]);
        m.tries.add(attempts, std::slice::from_ref(&f));
        m.latency.record(started.elapsed().as_secs_f64(), &[f]);
        out
    }

    /// The activator bound this router was built with.
    pub fn buffer_capacity(&self) -> usize {
        self.buffer
    }
}
