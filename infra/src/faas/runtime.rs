//! The local function runtime: deployments whose instances are child processes on free ports,
//! scaled by the KPA (`kpa.rs`), probed for readiness, replaced when they crash, drained on
//! scale-down (SIGTERM, wait for in-flight requests, SIGKILL after the grace period).
//!
//! One runtime is shared by every job of a service. Routers reach a deployment's ready
//! instances through `Deployment::endpoints()` and report the requests they carry (in flight
//! or buffered by the activator) through `Deployment::track()`; that count is the KPA's signal.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::Serialize;
use tokio::io::AsyncBufReadExt;
use tokio::sync::{Notify, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::config::DeploymentConfig;
use super::kpa::{ConcurrencyMeter, Kpa};

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("deployment {name}: {field}: {message}")]
    Invalid { name: String, field: String, message: String },
    #[error("deployment {0} already exists with a different configuration")]
    Conflict(String),
    #[error("the function runtime is shutting down")]
    ShuttingDown,
}

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

struct Instance {
    phase: Phase,
    url: String,
    pid: Option<u32>,
    stop: Option<oneshot::Sender<()>>,
}

struct State {
    meter: ConcurrencyMeter,
    kpa: Kpa,
    instances: BTreeMap<u64, Instance>,
    next_id: u64,
    desired: u32,
    panicking: bool,
    peak_waiting: u64,
    consecutive_crashes: u32,
}

/// Counters of one deployment (monotonic).
#[derive(Debug, Default)]
pub struct DeploymentCounters {
    pub started: AtomicU64,
    pub ready: AtomicU64,
    pub crashed: AtomicU64,
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
    poke: Notify,
    cancel: CancellationToken,
    pub counters: DeploymentCounters,
    probe: reqwest::Client,
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
    fn lock(&self) -> MutexGuard<'_, State> {
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
            scale_ups: self.counters.scale_ups.load(Ordering::Relaxed),
            scale_downs: self.counters.scale_downs.load(Ordering::Relaxed),
            container_concurrency: self.cfg.scaling.container_concurrency,
            instances: st.instances.iter().map(|(&id, i)| InstanceStatus { id, phase: i.phase, url: i.url.clone(), pid: i.pid }).collect(),
        }
    }

    /// Pids of ready instances (for fault-injection tests and the operator).
    pub fn ready_pids(&self) -> Vec<u32> {
        self.lock().instances.values().filter(|i| i.phase == Phase::Ready).filter_map(|i| i.pid).collect()
    }

    fn publish(&self, st: &State) {
        let eps: Vec<Endpoint> = st.instances.iter().filter(|(_, i)| i.phase == Phase::Ready).map(|(&id, i)| Endpoint { id, url: i.url.clone() }).collect();
        self.endpoints.send_if_modified(|cur| {
            if *cur == eps {
                false
            } else {
                *cur = eps;
                true
            }
        });
        let m = metrics();
        let name = opentelemetry::KeyValue::new("function", self.cfg.name.clone());
        for (phase, label) in [(Phase::Starting, "starting"), (Phase::Ready, "ready"), (Phase::Draining, "draining")] {
            let n = st.instances.values().filter(|i| i.phase == phase).count() as u64;
            m.instances.record(n, &[name.clone(), opentelemetry::KeyValue::new("state", label)]);
        }
        m.desired.record(st.desired as u64, std::slice::from_ref(&name));
    }
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
                .u64_counter("rollarc_function_instance_events_total")
                .with_description("Instance lifecycle events: started, ready, crashed, killed, startup_failed, scale_up, scale_down, panic")
                .build(),
        }
    })
}

fn event(dep: &Deployment, what: &'static str) {
    metrics().events.add(1, &[opentelemetry::KeyValue::new("function", dep.cfg.name.clone()), opentelemetry::KeyValue::new("event", what)]);
}

/// The local runtime: owns every deployment's processes.
pub struct FunctionRuntime {
    deployments: Mutex<BTreeMap<String, Arc<Deployment>>>,
    cancel: CancellationToken,
    tasks: TaskTracker,
    /// Every control loop and instance task runs here, whoever deploys.
    rt: tokio::runtime::Handle,
}

impl FunctionRuntime {
    /// A runtime whose tasks run on the current tokio runtime (call from within one).
    pub fn new() -> Arc<Self> {
        Self::on(tokio::runtime::Handle::current())
    }

    /// A runtime whose tasks run on `rt`.
    pub fn on(rt: tokio::runtime::Handle) -> Arc<Self> {
        Arc::new(Self { deployments: Mutex::new(BTreeMap::new()), cancel: CancellationToken::new(), tasks: TaskTracker::new(), rt })
    }

    fn map(&self) -> MutexGuard<'_, BTreeMap<String, Arc<Deployment>>> {
        self.deployments.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Creates a deployment, or returns the existing one of that name when its configuration
    /// is the same (jobs share functions this way).
    pub fn deploy(&self, cfg: DeploymentConfig) -> Result<Arc<Deployment>, RuntimeError> {
        if let Some((field, message)) = cfg.problems().into_iter().next() {
            return Err(RuntimeError::Invalid { name: cfg.name.clone(), field, message });
        }
        if self.cancel.is_cancelled() {
            return Err(RuntimeError::ShuttingDown);
        }
        let mut map = self.map();
        if let Some(d) = map.get(&cfg.name) {
            return if d.cfg == cfg { Ok(d.clone()) } else { Err(RuntimeError::Conflict(cfg.name)) };
        }
        let now = Instant::now();
        let initial = cfg.scaling.initial_scale.max(cfg.scaling.min_scale);
        let dep = Arc::new(Deployment {
            state: Mutex::new(State {
                meter: ConcurrencyMeter::new(now),
                kpa: Kpa::new(cfg.scaling.clone(), now),
                instances: BTreeMap::new(),
                next_id: 1,
                desired: initial,
                panicking: false,
                peak_waiting: 0,
                consecutive_crashes: 0,
            }),
            endpoints: watch::Sender::new(Vec::new()),
            poke: Notify::new(),
            cancel: self.cancel.child_token(),
            counters: DeploymentCounters::default(),
            probe: reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap_or_default(),
            cfg,
        });
        map.insert(dep.cfg.name.clone(), dep.clone());
        self.tasks.spawn_on(control_loop(dep.clone(), self.tasks.clone()), &self.rt);
        tracing::info!(function = %dep.cfg.name, initial, "deployment created");
        Ok(dep)
    }

    pub fn get(&self, name: &str) -> Option<Arc<Deployment>> {
        self.map().get(name).cloned()
    }

    /// Stops a deployment: drains every instance.
    pub async fn remove(&self, name: &str) {
        let dep = self.map().remove(name);
        if let Some(dep) = dep {
            dep.cancel.cancel();
            let mut rx = dep.endpoints();
            // Wait (bounded) for the instances to go.
            let deadline = Instant::now() + dep.cfg.termination_grace.0 + Duration::from_secs(2);
            while !dep.lock().instances.is_empty() && Instant::now() < deadline {
                let _ = tokio::time::timeout(Duration::from_millis(50), rx.changed()).await;
            }
        }
    }

    pub fn status(&self) -> Vec<DeploymentStatus> {
        self.map().values().map(|d| d.status()).collect()
    }

    /// Drains every instance of every deployment, then returns.
    pub async fn shutdown(&self) {
        self.cancel.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

impl Drop for FunctionRuntime {
    fn drop(&mut self) {
        // Instance tasks kill their process groups when their tasks are dropped (kill_on_drop).
        self.cancel.cancel();
    }
}

async fn control_loop(dep: Arc<Deployment>, tasks: TaskTracker) {
    let tick = dep.cfg.scaling.tick_interval.0;
    let mut next_tick = Instant::now() + tick;
    reconcile(&dep, &tasks);
    loop {
        tokio::select! {
            _ = dep.cancel.cancelled() => break,
            _ = tokio::time::sleep_until(next_tick) => {
                let now = Instant::now();
                next_tick = now + tick;
                let mut st = dep.lock();
                let (avg, period) = st.meter.take(now);
                st.kpa.record(now, avg, period);
            }
            _ = dep.poke.notified() => {}
        }
        reconcile(&dep, &tasks);
    }
    // Drain everything.
    let mut st = dep.lock();
    st.desired = 0;
    for inst in st.instances.values_mut() {
        if let Some(stop) = inst.stop.take() {
            let _ = stop.send(());
        }
    }
}

fn reconcile(dep: &Arc<Deployment>, tasks: &TaskTracker) {
    let now = Instant::now();
    let mut st = dep.lock();
    let ready = st.instances.values().filter(|i| i.phase == Phase::Ready).count() as u32;
    let waiting = st.meter.current();
    let was_panicking = st.panicking;
    let d = st.kpa.decide(now, ready, waiting);
    st.desired = d.desired;
    st.panicking = d.panicking;
    if d.panicking && !was_panicking {
        dep.counters.panics.fetch_add(1, Ordering::Relaxed);
        event(dep, "panic");
        tracing::info!(function = %dep.cfg.name, desired = d.desired, avg_panic = d.avg_panic, "autoscaler entered panic mode");
    }
    let active: Vec<u64> = st.instances.iter().filter(|(_, i)| i.phase != Phase::Draining).map(|(&id, _)| id).collect();
    let active_n = active.len() as u32;
    if active_n < d.desired {
        dep.counters.scale_ups.fetch_add(1, Ordering::Relaxed);
        event(dep, "scale_up");
        tracing::debug!(function = %dep.cfg.name, from = active_n, to = d.desired, "scale up");
        for _ in active_n..d.desired {
            let id = st.next_id;
            st.next_id += 1;
            let (tx, rx) = oneshot::channel();
            st.instances.insert(id, Instance { phase: Phase::Starting, url: String::new(), pid: None, stop: Some(tx) });
            tasks.spawn(run_instance(dep.clone(), id, rx));
        }
    } else if active_n > d.desired {
        dep.counters.scale_downs.fetch_add(1, Ordering::Relaxed);
        event(dep, "scale_down");
        tracing::debug!(function = %dep.cfg.name, from = active_n, to = d.desired, "scale down");
        // Starting instances go first, then the newest ready ones.
        let mut order: Vec<u64> = active.clone();
        order.sort_by_key(|id| (st.instances[id].phase == Phase::Ready, std::cmp::Reverse(*id)));
        for id in order.into_iter().take((active_n - d.desired) as usize) {
            if let Some(inst) = st.instances.get_mut(&id) {
                inst.phase = Phase::Draining;
                if let Some(stop) = inst.stop.take() {
                    let _ = stop.send(());
                }
            }
        }
    }
    dep.publish(&st);
}

/// A free port for a new instance. The kernel may hand the same ephemeral port to two binds in
/// a row once the first listener is closed, so ports given out recently are skipped (two
/// instances starting together would otherwise race for one port and one would die).
fn free_port() -> std::io::Result<u16> {
    static RECENT: Mutex<std::collections::VecDeque<u16>> = Mutex::new(std::collections::VecDeque::new());
    let mut recent = RECENT.lock().unwrap_or_else(|p| p.into_inner());
    let mut port = 0;
    for _ in 0..32 {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        port = l.local_addr()?.port();
        if !recent.contains(&port) {
            break;
        }
    }
    recent.push_back(port);
    while recent.len() > 1024 {
        recent.pop_front();
    }
    Ok(port)
}

fn signal_group(pid: u32, sig: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid as i32), sig);
}

enum Exit {
    Crashed(String),
    Stopped,
}

async fn run_instance(dep: Arc<Deployment>, id: u64, mut stop: oneshot::Receiver<()>) {
    let exit = instance_life(&dep, id, &mut stop).await;
    let backoff = {
        let mut st = dep.lock();
        match &exit {
            Exit::Crashed(why) => {
                st.consecutive_crashes += 1;
                dep.counters.crashed.fetch_add(1, Ordering::Relaxed);
                event(&dep, "crashed");
                tracing::warn!(function = %dep.cfg.name, instance = id, why = %why, "instance failed; it will be replaced");
                if let Some(i) = st.instances.get_mut(&id) {
                    i.phase = Phase::Draining;
                }
                dep.publish(&st);
                Some(Duration::from_millis(100 * 2u64.pow(st.consecutive_crashes.min(7))))
            }
            Exit::Stopped => None,
        }
    };
    // A crashing function is not restarted in a tight loop: its slot stays taken for a backoff.
    if let Some(b) = backoff {
        tokio::select! {
            _ = tokio::time::sleep(b) => {}
            _ = dep.cancel.cancelled() => {}
        }
    }
    let mut st = dep.lock();
    st.instances.remove(&id);
    dep.publish(&st);
    drop(st);
    dep.poke.notify_one();
}

async fn instance_life(dep: &Arc<Deployment>, id: u64, stop: &mut oneshot::Receiver<()>) -> Exit {
    let cfg = &dep.cfg;
    let port = match free_port() {
        Ok(p) => p,
        Err(e) => return Exit::Crashed(format!("no free port: {e}")),
    };
    let url = format!("http://127.0.0.1:{port}");
    let mut cmd = tokio::process::Command::new(&cfg.command);
    cmd.args(&cfg.args)
        .envs(&cfg.env)
        .env("PORT", port.to_string())
        .env("HOST", "127.0.0.1")
        .env("K_SERVICE", &cfg.name)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            dep.counters.startup_failures.fetch_add(1, Ordering::Relaxed);
            event(dep, "startup_failed");
            return Exit::Crashed(format!("cannot start {:?}: {e}", cfg.command));
        }
    };
    let pid = child.id();
    dep.counters.started.fetch_add(1, Ordering::Relaxed);
    event(dep, "started");
    if let Some(stderr) = child.stderr.take() {
        let name = cfg.name.clone();
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                tracing::debug!(target: "rollarc::function", function = %name, instance = id, "{}", line.chars().take(2000).collect::<String>());
            }
        });
    }
    {
        let mut st = dep.lock();
        if let Some(i) = st.instances.get_mut(&id) {
            i.url = url.clone();
            i.pid = pid;
        }
    }
    // Readiness: probe every 200 ms with a 300 ms timeout until the startup deadline.
    let deadline = Instant::now() + cfg.startup_timeout.0;
    let probe_url = format!("{url}{}", cfg.readiness_path);
    let ready = loop {
        if let Ok(Some(status)) = child.try_wait() {
            break Err(format!("exited during startup: {status}"));
        }
        if let Ok(r) = dep.probe.get(&probe_url).timeout(Duration::from_millis(300)).send().await
            && r.status().is_success()
        {
            break Ok(());
        }
        if Instant::now() >= deadline {
            dep.counters.startup_failures.fetch_add(1, Ordering::Relaxed);
            event(dep, "startup_failed");
            break Err(format!("not ready after {}", cfg.startup_timeout));
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = &mut *stop => {
                if let Some(p) = pid { signal_group(p, nix::sys::signal::Signal::SIGKILL); }
                let _ = child.wait().await;
                return Exit::Stopped;
            }
        }
    };
    if let Err(why) = ready {
        if let Some(p) = pid {
            signal_group(p, nix::sys::signal::Signal::SIGKILL);
        }
        let _ = child.wait().await;
        return Exit::Crashed(why);
    }
    {
        let mut st = dep.lock();
        st.consecutive_crashes = 0;
        if let Some(i) = st.instances.get_mut(&id)
            && i.phase == Phase::Starting
        {
            i.phase = Phase::Ready;
        }
        dep.publish(&st);
    }
    dep.counters.ready.fetch_add(1, Ordering::Relaxed);
    event(dep, "ready");
    tokio::select! {
        status = child.wait() => {
            let why = match status { Ok(s) => format!("exited: {s}"), Err(e) => format!("wait failed: {e}") };
            if let Some(p) = pid { signal_group(p, nix::sys::signal::Signal::SIGKILL); }
            Exit::Crashed(why)
        }
        _ = &mut *stop => {
            // Drain: out of the endpoint set first (done by reconcile), a moment for routers to
            // see it, then SIGTERM; the function finishes its in-flight requests and exits.
            tokio::time::sleep(Duration::from_millis(50)).await;
            if let Some(p) = pid { signal_group(p, nix::sys::signal::Signal::SIGTERM); }
            match tokio::time::timeout(cfg.termination_grace.0, child.wait()).await {
                Ok(_) => {}
                Err(_) => {
                    dep.counters.killed_after_grace.fetch_add(1, Ordering::Relaxed);
                    event(dep, "killed");
                    if let Some(p) = pid { signal_group(p, nix::sys::signal::Signal::SIGKILL); }
                    let _ = child.wait().await;
                }
            }
            Exit::Stopped
        }
    }
}
