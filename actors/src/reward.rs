//! Reward scoring behind one trait: the serverless function client (issue: serverless reward),
//! dedicated local scorers, and the latency simulator used in virtual time.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use tokio::sync::{Mutex, Semaphore};

use crate::dist::Dist;
use crate::types::Trajectory;
use infra::faas::Scaling;
use infra::faas::kpa::{ConcurrencyMeter, Kpa};

#[derive(Debug, thiserror::Error)]
pub enum RewardError {
    /// The function could not be reached or kept failing (the router's retries included).
    #[error("reward call failed after retries")]
    Exhausted(#[source] functions::client::ClientError),
    /// The function answered with something that is not a valid score.
    #[error("reward function returned an invalid score")]
    InvalidScore(#[source] functions::client::InvalidResponse),
    /// A simulated function's call slots are gone (it is shutting down).
    #[error("reward function is closed")]
    Closed(#[source] tokio::sync::AcquireError),
}

/// Scores finished trajectories. Implementations are shared by all episodes of a job.
pub trait TrajectoryScorer: Send + Sync + 'static {
    /// Scores one trajectory as soon as it ends.
    fn score<'a>(&'a self, traj: &'a Trajectory) -> BoxFuture<'a, Result<f64, RewardError>>;
}

/// The environment's own reward (sum of step rewards), with no call at all.
pub struct EnvRewardPassThrough;

impl TrajectoryScorer for EnvRewardPassThrough {
    fn score<'a>(&'a self, traj: &'a Trajectory) -> BoxFuture<'a, Result<f64, RewardError>> {
        Box::pin(async move { Ok(traj.turns.iter().map(|t| t.env_reward).sum()) })
    }
}

/// A simulated reward function: per-call latency, limited concurrency, and a cold start when
/// it has scaled to zero after being idle (serverless), or always warm (dedicated).
pub struct SimReward {
    latency: Dist,
    cold_start: Duration,
    idle_to_zero: Option<Duration>,
    slots: Semaphore,
    state: Mutex<SimRewardState>,
    pub calls: AtomicU64,
    pub cold_starts: AtomicU64,
}

struct SimRewardState {
    rng: SmallRng,
    last_call_end: Option<tokio::time::Instant>,
    warm: bool,
}

impl SimReward {
    /// `idle_to_zero = None` models dedicated (always warm) instances.
    pub fn new(
        latency: Dist,
        cold_start: Duration,
        concurrency: usize,
        idle_to_zero: Option<Duration>,
        seed: u64,
    ) -> Self {
        Self {
            latency,
            cold_start,
            idle_to_zero,
            slots: Semaphore::new(concurrency.max(1)),
            state: Mutex::new(SimRewardState {
                rng: SmallRng::seed_from_u64(seed),
                last_call_end: None,
                warm: idle_to_zero.is_none(),
            }),
            calls: AtomicU64::new(0),
            cold_starts: AtomicU64::new(0),
        }
    }
}

impl TrajectoryScorer for SimReward {
    fn score<'a>(&'a self, traj: &'a Trajectory) -> BoxFuture<'a, Result<f64, RewardError>> {
        Box::pin(async move {
            let _permit = self.slots.acquire().await.map_err(RewardError::Closed)?;
            self.calls.fetch_add(1, Ordering::Relaxed);
            let delay = {
                let mut st = self.state.lock().await;
                let now = tokio::time::Instant::now();
                if let (Some(idle), Some(last)) = (self.idle_to_zero, st.last_call_end)
                    && now.duration_since(last) > idle
                {
                    st.warm = false;
                }
                let mut d = Duration::from_secs_f64(self.latency.sample(&mut st.rng));
                if !st.warm {
                    self.cold_starts.fetch_add(1, Ordering::Relaxed);
                    d += self.cold_start;
                    st.warm = true;
                }
                d
            };
            tokio::time::sleep(delay).await;
            self.state.lock().await.last_call_end = Some(tokio::time::Instant::now());
            Ok(traj.turns.iter().map(|t| t.env_reward).sum())
        })
    }
}

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

/// A reward model served on GPUs: every instance holds `gpus` devices (one tensor-parallel
/// group) and runs its waiting calls in batches of up to `max_batch`. A batch prefills every
/// trajectory it reads, then decodes `verdict_tokens` for each, on the device roofline.
#[derive(Clone, Debug)]
pub struct GpuService {
    /// The instance's device group (see [`crate::device::DeviceProfile::group`]).
    pub device: crate::device::DeviceProfile,
    pub model: crate::device::ModelProfile,
    pub efficiency: crate::device::Efficiency,
    pub gpus: u32,
    pub max_batch: u32,
    pub verdict_tokens: u32,
    /// Reads only the task and the final answer (otherwise every turn).
    pub final_answer_only: bool,
}

impl GpuService {
    /// Tokens the judge prefills for `traj`.
    pub fn read_tokens(&self, traj: &Trajectory) -> usize {
        if self.final_answer_only {
            traj.turns.first().map_or(0, |t| t.observation_tokens.len())
                + traj.turns.last().map_or(0, |t| t.response_tokens.len())
        } else {
            traj.turns
                .iter()
                .map(|t| t.observation_tokens.len() + t.response_tokens.len())
                .sum()
        }
    }

    /// Seconds one batch takes: prefill of every trajectory it reads, then the verdicts' decode
    /// steps over the batch's whole KV.
    pub fn batch_seconds(&self, tokens: &[f64]) -> f64 {
        use crate::device::{decode_step_seconds, prefill_seconds};
        let read: f64 = tokens.iter().sum();
        let b = tokens.len() as f64;
        let prefill = prefill_seconds(&self.device, &self.model, self.efficiency, read);
        let v = f64::from(self.verdict_tokens);
        // Mean KV over the verdict: the trajectories plus half the verdict of each.
        let decode = v * decode_step_seconds(
            &self.device,
            &self.model,
            self.efficiency,
            b,
            read + b * v / 2.0,
        );
        prefill + decode
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
            tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
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
                Duration::from_secs_f64(self.latency.sample(&mut st.rng))
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

pub type SharedScorer = Arc<dyn TrajectoryScorer>;

/// A reward function reached through the router (serverless or dedicated instances, or a URL):
/// one call per trajectory as soon as it ends, keyed `job/trajectory@reward` so retries and
/// hedges give one result.
pub struct FunctionReward {
    pub client: functions::client::FunctionClient,
    /// Makes keys unique across the jobs sharing a function.
    pub key_prefix: String,
}

impl TrajectoryScorer for FunctionReward {
    fn score<'a>(&'a self, traj: &'a Trajectory) -> BoxFuture<'a, Result<f64, RewardError>> {
        Box::pin(async move {
            let item = functions::protocol::ScoredItem {
                trajectory_id: traj.id.clone(),
                text: traj.final_text.clone(),
                token_ids: traj
                    .turns
                    .last()
                    .map(|t| t.response_tokens.clone())
                    .unwrap_or_default(),
                env_reward: traj.turns.iter().map(|t| t.env_reward).sum(),
            };
            let key = format!("{}/{}", self.key_prefix, traj.id);
            match self
                .client
                .score(&key, vec![item], traj.reference.clone())
                .await
            {
                Ok(scores) => scores.first().map(|s| s.score).ok_or_else(|| {
                    RewardError::InvalidScore(functions::client::InvalidResponse::Missing {
                        id: traj.id.clone(),
                    })
                }),
                Err(functions::client::ClientError::Invalid { reason, .. }) => {
                    Err(RewardError::InvalidScore(reason))
                }
                Err(e) => Err(RewardError::Exhausted(e)),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use infra::faas::Dur;

    fn traj() -> Trajectory {
        Trajectory::for_test(
            "t",
            crate::types::Turn {
                env_reward: 1.0,
                ..Default::default()
            },
            None,
        )
    }

    /// A paused current-thread runtime (virtual time).
    fn paused() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
    }

    /// `n` calls of `t` at once: each one's score and when it came back (since `t0`).
    async fn burst(
        f: &Arc<SimFunction>,
        t: &Trajectory,
        n: usize,
        t0: tokio::time::Instant,
    ) -> Vec<(Result<f64, RewardError>, Duration)> {
        let calls = (0..n).map(|_| async move { (f.score(t).await, t0.elapsed()) });
        futures::future::join_all(calls).await
    }

    #[test]
    fn a_simulated_serverless_function_scales_from_zero_with_cold_starts_and_back_to_zero() {
        paused().block_on(async {
            let scaling = Scaling {
                container_concurrency: 4,
                initial_scale: 0,
                stable_window: Dur::secs(10),
                scale_to_zero_grace_period: Dur::secs(5),
                ..Scaling::default()
            };
            let f = SimFunction::new(Dist::Constant(1.0), Duration::from_secs(3), scaling, 7);
            assert_eq!(f.instances(), 0);
            let t0 = tokio::time::Instant::now();
            // A burst of 40 calls at zero: the first instance starts on the activator's poke,
            // the autoscaler adds more; every call waits for a cold start, then 1 s of work.
            let out = burst(&f, &traj(), 40, t0).await;
            assert!(out.iter().all(|(r, _)| matches!(r, Ok(v) if *v == 1.0)));
            let first = out.iter().map(|(_, d)| *d).min().unwrap();
            let last = out.iter().map(|(_, d)| *d).max().unwrap();
            assert!(
                first >= Duration::from_secs(4),
                "cold start (3 s) + latency (1 s) before any answer: {first:?}"
            );
            assert!(
                f.cold_starts.load(Ordering::Relaxed) >= 2,
                "scaled past one instance"
            );
            // 40 calls at concurrency 4 on one instance would take 10 s of work: scaling out
            // must beat that.
            assert!(last < Duration::from_secs(3 + 10), "{last:?}");
            assert_eq!(f.calls.load(Ordering::Relaxed), 40);
            // Idle: back to zero after the stable window and the grace period.
            tokio::time::sleep(Duration::from_secs(60)).await;
            assert_eq!(f.instances(), 0, "scaled to zero when idle");
        });
    }

    fn judge(gpus: u32) -> GpuService {
        use crate::device::{DeviceProfile, Efficiency, ModelProfile};
        GpuService {
            device: DeviceProfile::builtin("H800").unwrap().group(gpus, 0.9),
            model: ModelProfile::builtin("qwen3-8b").unwrap(),
            efficiency: Efficiency::default(),
            gpus,
            max_batch: 8,
            verdict_tokens: 16,
            final_answer_only: false,
        }
    }

    #[test]
    fn a_gpu_reward_model_batches_its_calls_on_the_roofline_and_accounts_its_gpu_time() {
        paused().block_on(async {
            // One always-on instance of two GPUs (a dedicated reward deployment).
            let scaling = Scaling {
                container_concurrency: 64,
                initial_scale: 1,
                min_scale: 1,
                max_scale: 1,
                ..Scaling::default()
            };
            let g = judge(2);
            let f = SimFunction::serving(
                Dist::Constant(0.0),
                Duration::ZERO,
                scaling,
                7,
                Some(g.clone()),
            );
            // 20 trajectories of 4,000 tokens arrive together.
            let t = Trajectory::for_test(
                "t",
                crate::types::Turn {
                    observation_tokens: vec![1; 3_000],
                    response_tokens: vec![2; 1_000],
                    env_reward: 1.0,
                    ..Default::default()
                },
                None,
            );
            let t0 = tokio::time::Instant::now();
            let out = burst(&f, &t, 20, t0).await;
            assert!(out.iter().all(|(r, _)| matches!(r, Ok(v) if *v == 1.0)));
            let done = out.iter().map(|(_, d)| *d).max().unwrap().as_secs_f64();
            let u = f.usage();
            assert_eq!(u.calls, 20);
            // Batches of at most 8: at least 3 of them, and calls really were batched.
            assert!(u.batches >= 3 && u.batches < 20, "{u:?}");
            assert!(u.mean_batch > 1.0 && u.mean_batch <= 8.0, "{u:?}");
            // Batching amortises the verdict's decode: 8 calls in one batch beat 8 batches of
            // one, but never the prefill of everything they read.
            let one = g.batch_seconds(&[4_000.0]);
            let eight = g.batch_seconds(&[4_000.0; 8]);
            assert!(eight < 8.0 * one * 0.8, "{eight} vs 8 × {one}");
            let prefill =
                crate::device::prefill_seconds(&g.device, &g.model, g.efficiency, 32_000.0);
            assert!(eight > prefill);
            // The one instance served back to back, so it was busy until the last answer, and
            // the calls took the batches' roofline time.
            assert!((u.busy_instance_s - done).abs() < 1e-3, "{u:?} vs {done}");
            assert!(done >= 2.0 * eight && done <= 3.0 * eight + one, "{done}");
            // Idle afterwards: held, not busy. Two GPUs per instance.
            tokio::time::sleep(Duration::from_secs(100)).await;
            let u = f.usage();
            assert!((u.instance_s - (done + 100.0)).abs() < 1e-3, "{u:?}");
            assert!((u.gpu_s() - 2.0 * u.instance_s).abs() < 1e-9);
            assert!((u.utilisation() - done / (done + 100.0)).abs() < 1e-6);
            // A call after the idle spell adds its batch, not the idle time, to the busy time.
            let before = u.busy_instance_s;
            f.score(&t).await.unwrap();
            let u = f.usage();
            assert!(
                (u.busy_instance_s - before - one).abs() < 1e-3,
                "{u:?} vs {one}"
            );
        });
    }
}
