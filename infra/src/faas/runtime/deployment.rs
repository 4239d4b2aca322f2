//! One deployment's shared state: its instances, the autoscaler's inputs, what routers see
//! (the ready endpoints) and what the operator sees (status, counters, metrics).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::Serialize;
use tokio::sync::{Notify, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::faas::config::DeploymentConfig;
use crate::faas::kpa::{ConcurrencyMeter, Kpa};

/// A ready instance the router may send requests to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// Unique within the deployment, never reused.
    pub id: u64,
    pub url: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Starting,
    Ready,
    Draining,
}

pub(super) struct Instance {
    pub(super) phase: Phase,
    pub(super) url: String,
    pub(super) pid: Option<u32>,
    pub(super) stop: Option<oneshot::Sender<()>>,
}

pub(super) struct State {
    pub(super) meter: ConcurrencyMeter,
    pub(super) kpa: Kpa,
    pub(super) instances: BTreeMap<u64, Instance>,
    pub(super) next_id: u64,
    pub(super) desired: u32,
    pub(super) panicking: bool,
    pub(super) peak_waiting: u64,
    pub(super) consecutive_crashes: u32,
    /// The last instance failure, with the end of what instances wrote to stderr.
    pub(super) last_failure: Option<String>,
    /// The last lines instances wrote to stderr (at most [`STDERR_TAIL_LINES`]).
    pub(super) stderr_tail: std::collections::VecDeque<String>,
    /// Removed from its label's gauges: publish no more.
    pub(super) forgotten: bool,
}

/// Lines of instance stderr kept to explain a failure.
pub(super) const STDERR_TAIL_LINES: usize = 6;

/// Counters of one deployment (monotonic).
#[derive(Debug, Default)]
pub struct DeploymentCounters {
    pub started: AtomicU64,
    pub ready: AtomicU64,
    /// Instances that failed to start, never became ready or died during startup.
    pub crashed: AtomicU64,
    /// Instances that died after they became ready (not a crash loop).
    pub died_serving: AtomicU64,
    pub killed_after_grace: AtomicU64,
    pub startup_failures: AtomicU64,
    pub scale_ups: AtomicU64,
    pub scale_downs: AtomicU64,
    pub panics: AtomicU64,
}

/// What `/v1/cluster` shows for a deployment.
#[derive(Clone, Debug, Serialize)]
pub struct DeploymentStatus {
    pub name: String,
    pub desired: u32,
    pub starting: u32,
    pub ready: u32,
    pub draining: u32,
    pub panicking: bool,
    /// Requests in flight or waiting in the activator now.
    pub requests: u64,
    pub peak_requests: u64,
    pub instances_started: u64,
    pub instances_crashed: u64,
    /// Instances that died after they became ready (killed from outside; not a crash loop).
    pub instances_died_serving: u64,
    pub scale_ups: u64,
    pub scale_downs: u64,
    pub container_concurrency: u32,
    pub instances: Vec<InstanceStatus>,
}

#[derive(Clone, Debug, Serialize)]
pub struct InstanceStatus {
    pub id: u64,
    pub phase: Phase,
    pub url: String,
    pub pid: Option<u32>,
}

pub struct Deployment {
    pub cfg: DeploymentConfig,
    state: Mutex<State>,
    endpoints: watch::Sender<Vec<Endpoint>>,
    /// Wakes the control loop (a cold request, an instance gone).
    pub(super) poke: Notify,
    pub(super) cancel: CancellationToken,
    pub counters: DeploymentCounters,
    /// The readiness prober.
    pub(super) probe: reqwest::Client,
}

/// Counts one request for the autoscaler while alive.
pub struct Tracked {
    dep: Arc<Deployment>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.dep.lock().meter.add(Instant::now(), -1);
    }
}

impl Deployment {
    /// A deployment with no instance yet, `initial` of them desired.
    pub(super) fn new(cfg: DeploymentConfig, cancel: CancellationToken) -> Self {
        let now = Instant::now();
        let initial = cfg.scaling.initial_scale.max(cfg.scaling.min_scale);
        Self {
            state: Mutex::new(State {
                meter: ConcurrencyMeter::new(now),
                kpa: Kpa::new(cfg.scaling.clone(), now),
                instances: BTreeMap::new(),
                next_id: 1,
                desired: initial,
                panicking: false,
                peak_waiting: 0,
                consecutive_crashes: 0,
                last_failure: None,
                stderr_tail: std::collections::VecDeque::new(),
                forgotten: false,
            }),
            endpoints: watch::Sender::new(Vec::new()),
            poke: Notify::new(),
            cancel,
            counters: DeploymentCounters::default(),
            probe: reqwest::Client::builder()
                .pool_max_idle_per_host(0)
                .build()
                .unwrap_or_default(),
            cfg,
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Ready instances; changes whenever one becomes ready, drains or dies.
    pub fn endpoints(&self) -> watch::Receiver<Vec<Endpoint>> {
        self.endpoints.subscribe()
    }

    /// Registers a request (in flight or buffered) until the guard drops. With nothing ready,
    /// the autoscaler is poked at once (the activator's cold-start path).
    pub fn track(self: &Arc<Self>) -> Tracked {
        let cold = {
            let mut st = self.lock();
            st.meter.add(Instant::now(), 1);
            st.peak_waiting = st.peak_waiting.max(st.meter.current());
            !st.instances.values().any(|i| i.phase == Phase::Ready)
        };
        if cold {
            self.poke.notify_one();
        }
        Tracked { dep: self.clone() }
    }

    pub fn status(&self) -> DeploymentStatus {
        let st = self.lock();
        let count = |p: Phase| st.instances.values().filter(|i| i.phase == p).count() as u32;
        DeploymentStatus {
            name: self.cfg.name.clone(),
            desired: st.desired,
            starting: count(Phase::Starting),
            ready: count(Phase::Ready),
            draining: count(Phase::Draining),
            panicking: st.panicking,
            requests: st.meter.current(),
            peak_requests: st.peak_waiting,
            instances_started: self.counters.started.load(Ordering::Relaxed),
            instances_crashed: self.counters.crashed.load(Ordering::Relaxed),
            instances_died_serving: self.counters.died_serving.load(Ordering::Relaxed),
            scale_ups: self.counters.scale_ups.load(Ordering::Relaxed),
            scale_downs: self.counters.scale_downs.load(Ordering::Relaxed),
            container_concurrency: self.cfg.scaling.container_concurrency,
            instances: st
                .instances
                .iter()
                .map(|(&id, i)| InstanceStatus {
                    id,
                    phase: i.phase,
                    url: i.url.clone(),
                    pid: i.pid,
                })
                .collect(),
        }
    }

    /// Whether the deployment is crash-looping: its last `threshold` instances or more all
    /// failed to start, to become ready or died during startup, none became ready since,
    /// and no instance is ready now (a deployment that serves is not broken, whatever
    /// happens to its other instances: instances killed from outside while starting are
    /// replaced). Returns the count and the last failure (with the end of the instances'
    /// stderr).
    pub fn crash_loop(&self, threshold: u32) -> Option<(u32, String)> {
        let st = self.lock();
        let serving = st.instances.values().any(|i| i.phase == Phase::Ready);
        (!serving && st.consecutive_crashes >= threshold.max(1)).then(|| {
            (
                st.consecutive_crashes,
                st.last_failure.clone().unwrap_or_default(),
            )
        })
    }

    /// The last instance failure, if any.
    pub fn last_failure(&self) -> Option<String> {
        self.lock().last_failure.clone()
    }

    /// Pids of ready instances (for fault-injection tests and the operator).
    pub fn ready_pids(&self) -> Vec<u32> {
        self.lock()
            .instances
            .values()
            .filter(|i| i.phase == Phase::Ready)
            .filter_map(|i| i.pid)
            .collect()
    }

    /// Publishes the ready set and the instance gauges.
    pub(super) fn publish(&self, st: &State) {
        let eps: Vec<Endpoint> = st
            .instances
            .iter()
            .filter(|(_, i)| i.phase == Phase::Ready)
            .map(|(&id, i)| Endpoint {
                id,
                url: i.url.clone(),
            })
            .collect();
        self.endpoints.send_if_modified(|cur| {
            if *cur == eps {
                false
            } else {
                *cur = eps;
                true
            }
        });
        let count = |phase| st.instances.values().filter(|i| i.phase == phase).count() as u64;
        let counts = [
            count(Phase::Starting),
            count(Phase::Ready),
            count(Phase::Draining),
            st.desired as u64,
        ];
        if !st.forgotten {
            gauges(self, Some(counts));
        }
    }

    /// Takes the deployment out of its label's gauges (it was removed; a late publish of a
    /// straggling instance does not put it back).
    pub(super) fn forget(&self) {
        let mut st = self.lock();
        st.forgotten = true;
        gauges(self, None);
        drop(st);
    }
}

/// Instances by state and desired instances of every live deployment, by label and name.
type GaugeBook = BTreeMap<String, BTreeMap<String, [u64; 4]>>;

/// Sets (or, with `None`, removes) this deployment's counts, then records the sums of its
/// label: deployments sharing a label (the same function and configuration dedicated to
/// several jobs) add up instead of overwriting each other, and a removed one leaves its
/// label's series at what the others hold.
fn gauges(dep: &Deployment, counts: Option<[u64; 4]>) {
    static BOOK: std::sync::Mutex<GaugeBook> = std::sync::Mutex::new(BTreeMap::new());
    let label = dep.cfg.metrics_label().to_string();
    let mut book = BOOK.lock().unwrap_or_else(|p| p.into_inner());
    let of_label = book.entry(label.clone()).or_default();
    match counts {
        Some(c) => {
            of_label.insert(dep.cfg.name.clone(), c);
        }
        None => {
            of_label.remove(&dep.cfg.name);
        }
    }
    let mut sum = [0u64; 4];
    for c in of_label.values() {
        for (s, v) in sum.iter_mut().zip(c) {
            *s += v;
        }
    }
    if of_label.is_empty() {
        book.remove(&label);
    }
    drop(book);
    let m = metrics();
    let name = opentelemetry::KeyValue::new("function", label);
    for (i, state) in ["starting", "ready", "draining"].into_iter().enumerate() {
        m.instances.record(
            sum[i],
            &[name.clone(), opentelemetry::KeyValue::new("state", state)],
        );
    }
    m.desired.record(sum[3], std::slice::from_ref(&name));
}

struct RuntimeMetrics {
    instances: opentelemetry::metrics::Gauge<u64>,
    desired: opentelemetry::metrics::Gauge<u64>,
    events: opentelemetry::metrics::Counter<u64>,
}

fn metrics() -> &'static RuntimeMetrics {
    static M: std::sync::OnceLock<RuntimeMetrics> = std::sync::OnceLock::new();
    M.get_or_init(|| {
        let meter = crate::telemetry::Metrics::global().meter();
        RuntimeMetrics {
            instances: meter.u64_gauge("rollarc_function_instances").with_description("Function instances by state").build(),
            desired: meter.u64_gauge("rollarc_function_desired_instances").with_description("Autoscaler decision").build(),
            events: meter
                .u64_counter("rollarc_function_instance_events")
                .with_description("Instance lifecycle events: started, ready, crashed, killed, startup_failed, scale_up, scale_down, panic")
                .build(),
        }
    })
}

/// Counts one instance lifecycle event.
pub(super) fn event(dep: &Deployment, what: &'static str) {
    metrics().events.add(
        1,
        &[
            opentelemetry::KeyValue::new("function", dep.cfg.metrics_label().to_string()),
            opentelemetry::KeyValue::new("event", what),
        ],
    );
}
