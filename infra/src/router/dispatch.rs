//! The router itself: idempotency cache, deadline, and the tower stack that does the rest.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::SmallRng;
use tokio::sync::{OnceCell, watch};
use tokio::time::Instant;
use tower::balance::p2c::Balance;
use tower::buffer::Buffer;
use tower::limit::ConcurrencyLimit;
use tower::load::peak_ewma::PeakEwma;
use tower::load_shed::LoadShed;
use tower::retry::budget::{Budget, TpsBudget};
use tower::util::BoxCloneService;
use tower::{BoxError, ServiceExt};

use super::call::{Call, CallFailure, Reply, RouterError};
use super::config::RouterConfig;
use super::discovery::discover;
use super::instance::{InstanceSvc, SlowOnShed};
use super::outliers::Outliers;
use super::policy::{HedgePolicy, RetryPolicy};
use super::stats::{RouterStats, router_metrics};
use crate::faas::runtime::{Deployment, Endpoint};

type Inner = BoxCloneService<Call, Result<Reply, CallFailure>, BoxError>;

/// Where a router sends calls.
pub enum Target {
    /// A deployment of the local runtime (its ready instances; its autoscaler sees the load).
    Local(Arc<Deployment>),
    /// A fixed URL, e.g. a Knative Service's address.
    Url(String),
    /// Any changing set of endpoints (another platform's discovery).
    Endpoints(watch::Receiver<Vec<Endpoint>>),
}

/// Calls one function: idempotent, deadline-bound, retried, optionally hedged, buffered by
/// the activator and balanced over the function's instances.
pub struct Router {
    function: Arc<str>,
    label: Arc<str>,
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

impl Router {
    /// Builds a router on the current tokio runtime (its tasks and calls run there).
    pub fn new(function: &str, target: Target, cfg: RouterConfig) -> Arc<Self> {
        let stats = Arc::new(RouterStats::default());
        let outliers = Arc::new(Outliers::new(
            cfg.eject_after,
            cfg.eject_base,
            cfg.eject_max_percent,
            stats.clone(),
        ));
        let (endpoints, keepalive, deployment) = match target {
            Target::Local(d) => (d.endpoints(), None, Some(d)),
            Target::Url(url) => {
                let (tx, rx) = watch::channel(vec![Endpoint { id: 0, url }]);
                (rx, Some(tx), None)
            }
            Target::Endpoints(rx) => (rx, None, None),
        };
        let function: Arc<str> = Arc::from(function);
        // Metrics are labelled by the deployment's bounded label (a URL's by the function).
        let label: Arc<str> = deployment
            .as_ref()
            .map_or_else(|| function.clone(), |d| Arc::from(d.cfg.metrics_label()));
        let budget = Arc::new(TpsBudget::new(
            cfg.retry_window,
            cfg.retry_min_per_sec,
            cfg.retry_ratio,
        ));
        let inner = service_stack(&label, &cfg, endpoints, outliers, &stats, &budget);
        Arc::new(Self {
            function,
            label,
            inner: Mutex::new(inner),
            budget,
            stats,
            deployment,
            results: Mutex::new(Results {
                map: HashMap::new(),
                order: VecDeque::new(),
            }),
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

    /// The `function` label of this router's metrics (bounded: no job ids).
    pub fn metrics_label(&self) -> &str {
        &self.label
    }

    /// The local deployment behind this router (none for a URL or other endpoints).
    pub fn deployment(&self) -> Option<&Arc<Deployment>> {
        self.deployment.as_ref()
    }

    /// Calls the function; one result per idempotency key. The call runs on the router's own
    /// runtime (connections and timers live there), so any runtime may await it; a caller that
    /// gives up does not cancel it (its result still lands in the idempotency cache).
    pub async fn call(self: &Arc<Self>, call: Call) -> Result<Reply, RouterError> {
        let me = self.clone();
        let function = self.function.to_string();
        match self.rt.spawn(async move { me.call_here(call).await }).await {
            Ok(r) => r,
            Err(e) => Err(RouterError::Failed {
                function,
                attempts: 0,
                last: CallFailure::TaskEnded(Arc::new(e)),
            }),
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
            if r.map
                .get(&key)
                .is_some_and(|c| c.get().is_none() && Arc::ptr_eq(c, &cell))
            {
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
        // This call's own count (the router-wide counter also moves with other calls).
        let tries = call.clone();
        let svc = self.inner.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let r = tokio::time::timeout_at(deadline, svc.oneshot(call)).await;
        self.stats.queued.fetch_sub(1, Ordering::Relaxed);
        let attempts = tries.tries().max(1);
        let function = self.function.to_string();
        let out = match r {
            Err(_) => Err(RouterError::DeadlineExceeded {
                function,
                attempts,
                last: tries.last_failure(),
            }),
            Ok(Ok(Ok(reply))) if (200..300).contains(&reply.status) => Ok(reply),
            Ok(Ok(Ok(reply))) => Err(RouterError::Rejected {
                function,
                status: reply.status,
                body: String::from_utf8_lossy(&reply.body[..reply.body.len().min(500)])
                    .into_owned(),
            }),
            Ok(Ok(Err(last))) => Err(RouterError::Failed {
                function,
                attempts,
                last,
            }),
            Ok(Err(e)) if e.is::<tower::load_shed::error::Overloaded>() => {
                self.stats.overloaded.fetch_add(1, Ordering::Relaxed);
                Err(RouterError::Overloaded {
                    function,
                    retry_after_ms: 1000,
                })
            }
            Ok(Err(e)) => Err(RouterError::Failed {
                function,
                attempts,
                last: CallFailure::Service(Arc::from(e)),
            }),
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
        let f = opentelemetry::KeyValue::new("function", self.label.to_string());
        m.calls.add(
            1,
            &[f.clone(), opentelemetry::KeyValue::new("outcome", outcome)],
        );
        m.tries.add(attempts, std::slice::from_ref(&f));
        m.latency.record(started.elapsed().as_secs_f64(), &[f]);
        out
    }

    /// The activator bound this router was built with.
    pub fn buffer_capacity(&self) -> usize {
        self.buffer
    }
}

/// Retry (→ hedge) → activator buffer with load shedding → p2c balance over peak-EWMA
/// instances, each behind its concurrency limit. `function` labels its metrics and logs.
fn service_stack(
    function: &Arc<str>,
    cfg: &RouterConfig,
    endpoints: watch::Receiver<Vec<Endpoint>>,
    outliers: Arc<Outliers>,
    stats: &Arc<RouterStats>,
    budget: &Arc<TpsBudget>,
) -> Inner {
    let client = reqwest::Client::builder()
        .pool_idle_timeout(Duration::from_secs(30))
        .build()
        .unwrap_or_default();
    let limit = if cfg.container_concurrency == 0 {
        10_000
    } else {
        cfg.container_concurrency as usize
    };
    let make = {
        let (function, stats, outliers) = (function.clone(), stats.clone(), outliers.clone());
        let (per_try, max_body, cap) = (
            cfg.per_try_timeout,
            cfg.max_response_bytes,
            cfg.shed_penalty_cap,
        );
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
            PeakEwma::new(
                ConcurrencyLimit::new(svc, limit),
                Duration::from_millis(30),
                Duration::from_secs(10).as_nanos() as f64,
                SlowOnShed { cap },
            )
        }
    };
    let balance = Balance::from_rng(
        discover(endpoints, outliers, make),
        tower::util::rng::HasherRng::default(),
    );
    let buffered = Buffer::new(balance, cfg.buffer.max(1));
    let shed = LoadShed::new(buffered);
    let mut inner: Inner = BoxCloneService::new(shed);
    if let Some(p) = cfg.hedge_percentile {
        let policy = HedgePolicy {
            budget: Arc::new(TpsBudget::new(cfg.retry_window, 1, 0.1)),
            stats: stats.clone(),
        };
        // Hedge is not Clone: a second buffer makes it shareable (its inner readiness is
        // immediate — the activator buffer below sheds rather than waits).
        let hedge = tower::hedge::Hedge::new::<Call>(
            inner,
            policy,
            cfg.hedge_min_samples,
            p,
            Duration::from_secs(10),
        );
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
    BoxCloneService::new(tower::retry::Retry::new(policy, inner))
}
