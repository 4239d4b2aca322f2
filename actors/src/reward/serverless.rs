//! The simulated serverless reward function: instances scaled by the Knative pod autoscaler,
//! cold starts, the activator's queue, GPU instances that batch their calls, and what the
//! function used (instance- and GPU-seconds, batches).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use rand::SeedableRng;
use rand::rngs::SmallRng;

use super::gpu::GpuService;
use super::{RewardError, TrajectoryScorer};
use crate::dist::Dist;
use crate::types::Trajectory;
use infra::faas::Scaling;
use infra::faas::kpa::{ConcurrencyMeter, Kpa};

/// A simulated serverless function in virtual time: instances scaled by the Knative pod
/// autoscaler (the same [`Kpa`] state machine the local runtime runs), each serving up to its
/// container concurrency, a cold start for every instance started, requests waiting in the
/// activator while nothing can take them, and scale to zero after the grace period.
pub struct SimFunction {
    latency: Dist,
    cold_start: Duration,
    concurrency: u32,
    tick: Duration,
    /// A reward model on GPUs: each instance batches its calls through the device roofline.
    gpu: Option<GpuService>,
    state: std::sync::Mutex<FnState>,
    changed: tokio::sync::Notify,
    pub calls: AtomicU64,
    /// Instances started (each paid a cold start).
    pub cold_starts: AtomicU64,
    pub peak_instances: AtomicU64,
}

struct FnState {
    rng: SmallRng,
    kpa: Kpa,
    meter: ConcurrencyMeter,
    instances: Vec<SimInstance>,
    next_id: u64,
    ticking: bool,
    /// Instance-seconds held (from an instance's start, cold start included, to its stop) and
    /// instance-seconds serving, integrated up to `accounted_at`.
    held_s: f64,
    busy_s: f64,
    accounted_at: tokio::time::Instant,
    batches: u64,
    batched_calls: u64,
}

struct SimInstance {
    id: u64,
    ready_at: tokio::time::Instant,
    in_flight: u32,
    /// GPU instances: calls waiting for the next batch (tokens to read, who to wake).
    queue: std::collections::VecDeque<(f64, tokio::sync::oneshot::Sender<()>)>,
    /// GPU instances: a batch is running.
    serving: bool,
}

impl SimInstance {
    /// Serving now: running a batch (GPU), or holding a call (otherwise).
    fn busy(&self, gpu: bool) -> bool {
        if gpu {
            self.serving
        } else {
            self.in_flight > 0
        }
    }
}

impl FnState {
    fn ready(&self, now: tokio::time::Instant) -> u32 {
        self.instances.iter().filter(|i| i.ready_at <= now).count() as u32
    }

    fn start(&mut self, ready_at: tokio::time::Instant) {
        self.instances.push(SimInstance {
            id: self.next_id,
            ready_at,
            in_flight: 0,
            queue: Default::default(),
            serving: false,
        });
        self.next_id += 1;
    }

    /// Integrates held and busy instance-seconds up to `now`; called before every change of
    /// the instance set or of an instance's busy state.
    fn account(&mut self, now: tokio::time::Instant, gpu: bool) {
        let dt = now
            .saturating_duration_since(self.accounted_at)
            .as_secs_f64();
        if dt > 0.0 {
            let busy = self.instances.iter().filter(|i| i.busy(gpu)).count();
            self.held_s += dt * self.instances.len() as f64;
            self.busy_s += dt * busy as f64;
        }
        self.accounted_at = now;
    }
}

/// What a simulated function used, up to when it was asked.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FunctionUsage {
    pub calls: u64,
    /// Instances started (each paid a cold start).
    pub cold_starts: u64,
    pub peak_instances: u64,
    /// Instance-seconds held (cold starts included) and spent serving.
    pub instance_s: f64,
    pub busy_instance_s: f64,
    /// GPUs per instance (0: not a GPU function).
    pub gpus_per_instance: u32,
    /// GPU functions: batches run and their mean size.
    pub batches: u64,
    pub mean_batch: f64,
}

impl FunctionUsage {
    /// GPU-seconds held (0 for functions without GPUs).
    pub fn gpu_s(&self) -> f64 {
        self.instance_s * f64::from(self.gpus_per_instance)
    }

    /// GPU-seconds spent serving.
    pub fn busy_gpu_s(&self) -> f64 {
        self.busy_instance_s * f64::from(self.gpus_per_instance)
    }

    /// Busy share of the time held.
    pub fn utilisation(&self) -> f64 {
        if self.instance_s > 0.0 {
            self.busy_instance_s / self.instance_s
        } else {
            0.0
        }
    }

    /// The usage of two deployments together (e.g. the same function of two jobs).
    pub fn add(&mut self, o: &FunctionUsage) {
        let batched = self.mean_batch * self.batches as f64 + o.mean_batch * o.batches as f64;
        self.calls += o.calls;
        self.cold_starts += o.cold_starts;
        self.peak_instances += o.peak_instances;
        self.instance_s += o.instance_s;
        self.busy_instance_s += o.busy_instance_s;
        self.gpus_per_instance = self.gpus_per_instance.max(o.gpus_per_instance);
        self.batches += o.batches;
        self.mean_batch = if self.batches > 0 {
            batched / self.batches as f64
        } else {
            0.0
        };
    }
}

impl SimFunction {
    pub fn new(latency: Dist, cold_start: Duration, scaling: Scaling, seed: u64) -> Arc<Self> {
        Self::serving(latency, cold_start, scaling, seed, None)
    }

    /// A function whose instances serve on GPUs (`gpu`), or take `latency` per call (`None`).
    /// With GPUs, `latency` is what a call costs besides the model (network, parsing).
    pub fn serving(
        latency: Dist,
        cold_start: Duration,
        scaling: Scaling,
        seed: u64,
        gpu: Option<GpuService>,
    ) -> Arc<Self> {
        let now = tokio::time::Instant::now();
        let concurrency = scaling.container_concurrency;
        let tick = scaling.tick_interval.0.max(Duration::from_millis(100));
        // Initial instances are warm (deployed before the job), like a deployment at rest.
        let initial = scaling.initial_scale.max(scaling.min_scale);
        let mut st = FnState {
            rng: SmallRng::seed_from_u64(seed),
            kpa: Kpa::new(scaling, now),
            meter: ConcurrencyMeter::new(now),
            instances: Vec::new(),
            next_id: 0,
            ticking: false,
            held_s: 0.0,
            busy_s: 0.0,
            accounted_at: now,
            batches: 0,
            batched_calls: 0,
        };
        for _ in 0..initial {
            st.start(now);
        }
        Arc::new(Self {
            latency,
            cold_start,
            concurrency: if concurrency == 0 {
                u32::MAX
            } else {
                concurrency
            },
            tick,
            gpu,
            state: std::sync::Mutex::new(st),
            changed: tokio::sync::Notify::new(),
            calls: AtomicU64::new(0),
            cold_starts: AtomicU64::new(0),
            peak_instances: AtomicU64::new(initial as u64),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FnState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Instances now (starting or ready).
    pub fn instances(&self) -> usize {
        self.lock().instances.len()
    }

    /// What the function used up to now.
    pub fn usage(&self) -> FunctionUsage {
        let gpu = self.gpu.is_some();
        let mut st = self.lock();
        st.account(tokio::time::Instant::now(), gpu);
        FunctionUsage {
            calls: self.calls.load(Ordering::Relaxed),
            cold_starts: self.cold_starts.load(Ordering::Relaxed),
            peak_instances: self.peak_instances.load(Ordering::Relaxed),
            instance_s: st.held_s,
            busy_instance_s: st.busy_s,
            gpus_per_instance: self.gpu.as_ref().map_or(0, |g| g.gpus),
            batches: st.batches,
            mean_batch: if st.batches > 0 {
                st.batched_calls as f64 / st.batches as f64
            } else {
                0.0
            },
        }
    }

    /// Applies a decision: starts instances (ready after the cold start) or stops idle ones.
    fn scale_to(self: &Arc<Self>, st: &mut FnState, desired: u32, now: tokio::time::Instant) {
        let have = st.instances.len() as u32;
        if desired != have {
            st.account(now, self.gpu.is_some());
        }
        if desired > have {
            for _ in have..desired {
                st.start(now + self.cold_start);
            }
            self.cold_starts
                .fetch_add(u64::from(desired - have), Ordering::Relaxed);
            self.peak_instances
                .fetch_max(u64::from(desired), Ordering::Relaxed);
            let me = Arc::downgrade(self);
            let at = now + self.cold_start;
            tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                if let Some(me) = me.upgrade() {
                    me.changed.notify_waiters();
                }
            });
        } else if desired < have {
            // Stop idle instances, those still starting first.
            let mut excess = have - desired;
            st.instances
                .sort_by_key(|i| (std::cmp::Reverse(i.ready_at), i.id));
            st.instances.retain(|i| {
                if excess > 0 && i.in_flight == 0 {
                    excess -= 1;
                    false
                } else {
                    true
                }
            });
        }
    }

    /// The autoscaler's loop: one decision per tick while the function lives.
    fn start_ticking(self: &Arc<Self>, st: &mut FnState) {
        if st.ticking {
            return;
        }
        st.ticking = true;
        let me = Arc::downgrade(self);
        let tick = self.tick;
        tokio::spawn(async move {
            let mut every = tokio::time::interval(tick);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let Some(me) = me.upgrade() else { return };
                let now = tokio::time::Instant::now();
                let mut st = me.lock();
                let (avg, period) = st.meter.take(now);
                st.kpa.record(now, avg, period);
                let ready = st.ready(now);
                let waiting = st.meter.current();
                let d = st.kpa.decide(now, ready, waiting);
                me.scale_to(&mut st, d.desired, now);
                if st.instances.is_empty() && waiting == 0 && d.desired == 0 {
                    // At zero and idle: stop ticking until the next request.
                    st.ticking = false;
                    return;
                }
            }
        });
    }

    /// A GPU instance's batch loop: takes up to `max_batch` waiting calls, runs them as one
    /// batch, answers them, and stops when nothing waits.
    async fn serve(self: Arc<Self>, id: u64) {
        let Some(g) = self.gpu.clone() else { return };
        loop {
            let (waiters, seconds) = {
                let mut st = self.lock();
                st.account(tokio::time::Instant::now(), true);
                let Some(i) = st.instances.iter_mut().find(|i| i.id == id) else {
                    return;
                };
                if i.queue.is_empty() {
                    i.serving = false;
                    return;
                }
                let n = i.queue.len().min(g.max_batch.max(1) as usize);
                let (tokens, waiters): (Vec<f64>, Vec<_>) = i.queue.drain(..n).unzip();
                st.batches += 1;
                st.batched_calls += n as u64;
                (waiters, g.batch_seconds(&tokens))
            };
            tokio::time::sleep(crate::dist::seconds(seconds)).await;
            for w in waiters {
                let _ = w.send(());
            }
        }
    }

    async fn acquire(self: &Arc<Self>) -> u64 {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let now = tokio::time::Instant::now();
                let mut st = self.lock();
                let cc = self.concurrency;
                // Least-loaded ready instance with room.
                let best = st
                    .instances
                    .iter()
                    .filter(|i| i.ready_at <= now && i.in_flight < cc)
                    .min_by_key(|i| (i.in_flight, i.id))
                    .map(|i| (i.id, i.in_flight));
                if let Some((id, load)) = best {
                    if self.gpu.is_none() && load == 0 {
                        st.account(now, false);
                    }
                    if let Some(i) = st.instances.iter_mut().find(|i| i.id == id) {
                        i.in_flight += 1;
                    }
                    return id;
                }
                if st.instances.is_empty() {
                    // The activator's poke: scale from zero at once.
                    let waiting = st.meter.current();
                    let d = st.kpa.decide(now, 0, waiting);
                    self.scale_to(&mut st, d.desired.max(1), now);
                }
            }
            notified.await;
        }
    }
}

impl TrajectoryScorer for Arc<SimFunction> {
    fn score<'a>(&'a self, traj: &'a Trajectory) -> BoxFuture<'a, Result<f64, RewardError>> {
        Box::pin(async move {
            self.calls.fetch_add(1, Ordering::Relaxed);
            let delay = {
                let now = tokio::time::Instant::now();
                let mut st = self.lock();
                st.meter.add(now, 1);
                self.start_ticking(&mut st);
                crate::dist::seconds(self.latency.sample(&mut st.rng))
            };
            let slot = self.acquire().await;
            tokio::time::sleep(delay).await;
            if let Some(g) = &self.gpu {
                let tokens = g.read_tokens(traj);
                let (tx, rx) = tokio::sync::oneshot::channel();
                let start = {
                    let mut st = self.lock();
                    // The instance may turn busy now.
                    st.account(tokio::time::Instant::now(), true);
                    // An instance with calls is never scaled down, so it is still there.
                    st.instances
                        .iter_mut()
                        .find(|i| i.id == slot)
                        .is_some_and(|i| {
                            i.queue.push_back((tokens as f64, tx));
                            !std::mem::replace(&mut i.serving, true)
                        })
                };
                if start {
                    tokio::spawn(self.clone().serve(slot));
                }
                // The batch runner answers every call it takes.
                let _ = rx.await;
            }
            {
                let now = tokio::time::Instant::now();
                let mut st = self.lock();
                st.meter.add(now, -1);
                let gpu = self.gpu.is_some();
                if !gpu
                    && st
                        .instances
                        .iter()
                        .any(|i| i.id == slot && i.in_flight == 1)
                {
                    st.account(now, false);
                }
                if let Some(i) = st.instances.iter_mut().find(|i| i.id == slot) {
                    i.in_flight = i.in_flight.saturating_sub(1);
                }
            }
            self.changed.notify_waiters();
            Ok(traj.turns.iter().map(|t| t.env_reward).sum())
        })
    }
}
