//! What a job records per training step: the metric records (stored per step and streamed as
//! events), the observer that receives them, and their collection from the job's actors.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use actors::buffer::{BufferMsg, BufferStats};
use actors::call::call;
use actors::env::EnvCounters;
use actors::generation::LoadReport;
use actors::generation::shard::ShardMsg;
use actors::trainer::TrainStats;
use actors::types::{Batch, PolicyVersion};
use ractor::ActorRef;
use serde::{Deserialize, Serialize};

use super::error::ObserverError;
use super::scheduler::{SchedMsg, SchedSnapshot};
use super::supervisor::SupervisorReport;
use super::{CONTROL_TIMEOUT, JobError};
use crate::hub::FunctionHub;

/// Where one step's rollout time went: the span of its batch, each stage per trajectory, the
/// weight installs, and the work thrown away.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RolloutMetrics {
    /// From the first trajectory of the batch starting to the last one ending.
    pub rollout_s: f64,
    /// Mean seconds per trajectory of the batch in each stage.
    pub stages: StageSeconds,
    /// Seconds the step spent suspending, installing weights and resuming generation.
    pub weight_sync_s: f64,
    /// Since the start: episodes cancelled once their group was full (redundancy), groups
    /// of a wave cancelled once its batch was full (over-provisioning), what those
    /// cancellations threw away (tokens prefilled and generated, seconds environments were
    /// held), and groups aborted or evicted for staleness.
    pub cancelled_episodes: u64,
    pub cancelled_groups: u64,
    pub cancelled_tokens: u64,
    pub cancelled_env_s: f64,
    pub stale_aborted: u64,
    pub stale_evicted: u64,
    /// The trajectory whose end closed the rollout span, and where its time went.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub critical: Option<CriticalPath>,
}

/// The critical path of a step's rollout: the batch's last trajectory to end (the step
/// waited on it), its stages, and the one that took most of its time.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CriticalPath {
    pub trajectory: String,
    pub task: String,
    /// From its start to its end.
    pub span_s: f64,
    /// Its own seconds in each stage.
    pub stages: StageSeconds,
    /// The stage with the most seconds: `reset`, `generate`, `env_step`, `reward` or `wait`.
    pub bottleneck: String,
}

/// Mean seconds per trajectory in each stage of an episode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StageSeconds {
    /// Environment reset.
    pub reset_s: f64,
    /// Generation (prefill and decode, queueing at the shard included).
    pub generate_s: f64,
    /// Environment steps.
    pub env_step_s: f64,
    /// Reward functions.
    pub reward_s: f64,
    /// Waiting: for an environment, at a barrier, or suspended for a weight update.
    pub wait_s: f64,
}

impl StageSeconds {
    /// The stages by name, in episode order.
    pub fn named(&self) -> [(&'static str, f64); 5] {
        [
            ("reset", self.reset_s),
            ("generate", self.generate_s),
            ("env_step", self.env_step_s),
            ("reward", self.reward_s),
            ("wait", self.wait_s),
        ]
    }

    /// The stage with the most seconds (the first of equals).
    pub fn largest(&self) -> &'static str {
        self.named()
            .into_iter()
            .fold(
                ("reset", f64::NEG_INFINITY),
                |a, b| if b.1 > a.1 { b } else { a },
            )
            .0
    }

    /// The weighted mean of several (stage seconds, weight) pairs.
    pub fn weighted_mean(items: impl Iterator<Item = (StageSeconds, f64)>) -> Self {
        let mut s = Self::default();
        let mut total = 0.0;
        for (x, w) in items {
            s.reset_s += w * x.reset_s;
            s.generate_s += w * x.generate_s;
            s.env_step_s += w * x.env_step_s;
            s.reward_s += w * x.reward_s;
            s.wait_s += w * x.wait_s;
            total += w;
        }
        if total > 0.0 {
            for v in [
                &mut s.reset_s,
                &mut s.generate_s,
                &mut s.env_step_s,
                &mut s.reward_s,
                &mut s.wait_s,
            ] {
                *v /= total;
            }
        }
        s
    }
}

/// Metrics of one training step (stored per step and streamed as events).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StepMetrics {
    /// The step, counted from 1 as everywhere a step is shown (API, events, TensorBoard, the
    /// dashboard, the CLI): step k is the k-th training step and produces policy version k.
    pub step: u64,
    /// Policy version produced by this step.
    pub version: PolicyVersion,
    /// Seconds since the job (run) started, on the job's clock.
    pub elapsed_s: f64,
    pub step_s: f64,
    pub train_s: f64,
    /// The training step's loss (an external trainer's, as it acknowledged the batch).
    #[serde(default)]
    pub loss: f64,
    /// The trainer's diagnostics (policy loss, KL, entropy, gradient norm, learning rate,
    /// clip fractions, importance weights, response lengths); an external trainer's are what
    /// it acknowledged the batch with.
    #[serde(default)]
    pub trainer: actors::trainer::TrainerNumbers,
    /// Time the step driver waited for the batch.
    pub wait_batch_s: f64,
    /// Where the step's rollout time went.
    pub rollout: RolloutMetrics,
    pub groups: usize,
    pub trajectories: usize,
    pub mean_reward: f64,
    pub success_rate: f64,
    pub tasks: BTreeMap<String, TaskMetrics>,
    pub staleness_mean: f64,
    pub staleness_max: u64,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    pub trajectories_per_s: f64,
    /// Idle fraction of generation capacity since the start of the run.
    pub bubble_ratio: f64,
    pub pools: BTreeMap<String, PoolMetrics>,
    pub buffer: BufferStats,
    pub scheduler: SchedSnapshot,
    pub env_restarts: u64,
    pub env_timeouts: u64,
    /// Environment resets and steps since the start.
    pub env_calls: u64,
    /// This step's resets that found their sandbox running (warm) or started one: counts,
    /// warm hit rate, and the median and 99th percentile of their wall time (see
    /// `actors::env::starts`). In-process environments have no sandbox and are not counted.
    pub env_starts: actors::env::starts::StartStats,
    /// Since the start: resets that found their sandbox running, and those that started one.
    pub env_warm_starts: u64,
    pub env_cold_starts: u64,
    pub shard_restarts: u64,
    pub actor_failures: u64,
    /// Busy fraction over this step of every generation shard (`shard POOL/I`), environment
    /// (`env TASK/SLOT`: held by a trajectory) and function instance (`fn DEPLOYMENT/ID`: a
    /// request in flight); empty unless the run records a timeline.
    pub timeline: BTreeMap<String, f64>,
    /// Held-out evaluations run after this step (the first step's record also holds the one
    /// before training).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub eval: Vec<super::eval::EvalRecord>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TaskMetrics {
    pub trajectories: usize,
    pub success_rate: f64,
    pub mean_reward: f64,
    pub mean_turns: f64,
    /// Share of this step's trajectories that ended at their context budget.
    pub truncation_rate: f64,
    /// The seeds of the groups trained this step, sorted; for a task with a dataset, the
    /// dataset positions of their rows (position k: epoch k div rows).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub seeds: Vec<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PoolMetrics {
    pub device: String,
    pub shards: usize,
    pub utilisation: f64,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    pub groups: u64,
    /// Engine steps taken (a fused simulator step counts once), since the start.
    pub engine_steps: u64,
    /// Context tokens the pool's prefix caches were asked for, and served, since the start
    /// (simulated engines; 0 elsewhere), and their ratio.
    pub prefix_lookup_tokens: u64,
    pub prefix_hit_tokens: u64,
    pub prefix_hit_rate: f64,
}

/// Receives each completed step (the service stores it and streams it).
pub trait StepObserver: Send + Sync {
    /// The batch training step `step` (1-based) trained on, as soon as it is trained and
    /// before its record ([`Self::on_step`]) is made. Keep what the record will need (ids,
    /// staleness): the driver lets the batch go when this returns, before rollout goes on,
    /// so a run never holds one batch while the next one fills.
    fn on_batch(&self, _step: u64, _batch: &Batch) {}
    /// The record of a completed step (1-based `m.step`), after its [`Self::on_batch`].
    fn on_step(&self, m: &StepMetrics) -> Result<(), ObserverError>;
    /// Every shard generates with `version` now.
    fn on_weights_installed(&self, _version: u64) {}
}

/// Observer that keeps nothing.
pub struct NoObserver;

impl StepObserver for NoObserver {
    fn on_step(&self, _m: &StepMetrics) -> Result<(), ObserverError> {
        Ok(())
    }
}

/// Cumulative busy seconds per resource at the previous step, for per-step busy fractions.
#[derive(Default)]
pub(super) struct Timeline {
    pub on: bool,
    prev: BTreeMap<String, f64>,
}

impl Timeline {
    pub(super) fn new(on: bool) -> Self {
        Self {
            on,
            prev: BTreeMap::new(),
        }
    }

    /// Busy fractions over the last `interval_s` seconds, from cumulative busy seconds.
    fn step(&mut self, now: BTreeMap<String, f64>, interval_s: f64) -> BTreeMap<String, f64> {
        let out = now
            .iter()
            .map(|(k, &b)| {
                let prev = self.prev.get(k).copied().unwrap_or(0.0);
                (
                    k.clone(),
                    ((b - prev) / interval_s.max(1e-9)).clamp(0.0, 1.0),
                )
            })
            .collect();
        self.prev = now;
        out
    }
}

/// A pool's shards as metrics see them.
pub(super) struct PoolShards {
    pub name: String,
    pub device: String,
    pub actors: Vec<ActorRef<ShardMsg>>,
}

/// Where a step's metrics come from.
pub(super) struct MetricSources<'a> {
    pub started: tokio::time::Instant,
    pub pools: &'a [PoolShards],
    pub buffer: &'a ActorRef<BufferMsg>,
    pub scheduler: &'a ActorRef<SchedMsg>,
    pub env_counters: &'a [(String, Arc<EnvCounters>)],
    pub shard_restarts: &'a AtomicU64,
    pub report: &'a SupervisorReport,
    pub hub: Option<&'a Arc<FunctionHub>>,
}

/// The step driver's own timings of a step.
pub(super) struct StepTimes {
    pub step: u64,
    pub step_s: f64,
    pub train_s: f64,
    pub wait_batch_s: f64,
    pub weight_sync_s: f64,
}

impl MetricSources<'_> {
    /// Collects the metrics of a finished step from its training and the actors, onto the
    /// figures of its batch ([`BatchFigures`]).
    pub(super) async fn collect(
        &self,
        t: StepTimes,
        stats: &TrainStats,
        batch: BatchFigures,
        timeline: &mut Timeline,
    ) -> Result<StepMetrics, JobError> {
        let elapsed = self.started.elapsed().as_secs_f64().max(1e-9);
        let mut m = batch.0;
        debug_assert_eq!(
            m.step,
            t.step + 1,
            "the batch's figures are of another step"
        );
        m.version = stats.version;
        m.elapsed_s = elapsed;
        m.step_s = t.step_s;
        m.train_s = t.train_s;
        m.loss = stats.loss;
        m.trainer = stats.numbers.clone();
        m.wait_batch_s = t.wait_batch_s;
        m.rollout.weight_sync_s = t.weight_sync_s;
        let mut busy_now: BTreeMap<String, f64> = BTreeMap::new();
        m.scheduler = call(self.scheduler, SchedMsg::Snapshot, CONTROL_TIMEOUT)
            .await
            .map_err(JobError::call("scheduler"))?;
        let (mut busy_total, mut shards_total) = (0.0, 0usize);
        for p in self.pools {
            let loads = futures::future::join_all(
                p.actors
                    .iter()
                    .map(|a| call(a, ShardMsg::Load, CONTROL_TIMEOUT)),
            )
            .await;
            let loads: Vec<LoadReport> = loads.into_iter().filter_map(Result::ok).collect();
            if timeline.on {
                for (i, l) in loads.iter().enumerate() {
                    busy_now.insert(format!("shard {}/{i}", p.name), l.busy_s);
                }
            }
            let busy: f64 = loads.iter().map(|l| l.busy_s.min(elapsed)).sum();
            busy_total += busy;
            shards_total += p.actors.len();
            let pm = PoolMetrics {
                device: p.device.clone(),
                shards: p.actors.len(),
                utilisation: busy / (elapsed * p.actors.len().max(1) as f64),
                prefill_tokens: loads.iter().map(|l| l.prefill_tokens).sum(),
                decode_tokens: loads.iter().map(|l| l.decode_tokens).sum(),
                groups: m
                    .scheduler
                    .groups_per_pool
                    .get(&p.name)
                    .copied()
                    .unwrap_or(0),
                engine_steps: loads.iter().map(|l| l.steps).sum(),
                prefix_lookup_tokens: loads.iter().map(|l| l.cache_lookup_tokens).sum(),
                prefix_hit_tokens: loads.iter().map(|l| l.cache_hit_tokens).sum(),
                prefix_hit_rate: 0.0,
            };
            let pm = PoolMetrics {
                prefix_hit_rate: pm.prefix_hit_tokens as f64
                    / pm.prefix_lookup_tokens.max(1) as f64,
                ..pm
            };
            m.prefill_tokens += pm.prefill_tokens;
            m.decode_tokens += pm.decode_tokens;
            m.pools.insert(p.name.clone(), pm);
        }
        m.bubble_ratio = 1.0 - busy_total / (elapsed * shards_total.max(1) as f64);
        m.buffer = call(self.buffer, BufferMsg::Stats, CONTROL_TIMEOUT)
            .await
            .map_err(JobError::call("sample buffer"))?;
        m.trajectories_per_s = m.buffer.committed as f64 / elapsed;
        m.rollout.cancelled_episodes = m.scheduler.cancelled_extras;
        m.rollout.cancelled_groups = m.scheduler.cancelled_groups;
        m.rollout.cancelled_tokens = m.scheduler.cancelled_tokens;
        m.rollout.cancelled_env_s = m.scheduler.cancelled_env_s;
        m.rollout.stale_aborted = m.scheduler.aborted_stale;
        m.rollout.stale_evicted = m.buffer.evicted_stale;
        self.counters(&mut m);
        if timeline.on {
            for (task, c) in self.env_counters {
                for (slot, b) in c.slot_held_s().into_iter().enumerate() {
                    busy_now.insert(format!("env {task}/{slot}"), b);
                }
            }
            for (name, b) in self.hub.map(|h| h.instance_busy()).unwrap_or_default() {
                busy_now.insert(format!("fn {name}"), b);
            }
            m.timeline = timeline.step(busy_now, t.step_s);
        }
        Ok(m)
    }

    /// Restart, timeout and call counters since the run started.
    fn counters(&self, m: &mut StepMetrics) {
        let sum = |f: &dyn Fn(&EnvCounters) -> u64| -> u64 {
            self.env_counters.iter().map(|(_, c)| f(c)).sum()
        };
        m.env_restarts = sum(&|c| c.restarts.load(Ordering::Relaxed));
        m.env_timeouts = sum(&|c| c.timeouts.load(Ordering::Relaxed));
        m.env_calls = sum(&|c| c.steps.load(Ordering::Relaxed) + c.resets.load(Ordering::Relaxed));
        m.env_warm_starts = sum(&|c| c.starts.totals().0);
        m.env_cold_starts = sum(&|c| c.starts.totals().1);
        let mut latencies = Vec::new();
        let (mut warm, mut cold) = (0, 0);
        for (_, c) in self.env_counters {
            let (w, k) = c.starts.take_step_into(&mut latencies);
            warm += w;
            cold += k;
        }
        m.env_starts =
            actors::env::starts::StartStats::from_latencies(warm, warm + cold, &mut latencies);
        m.shard_restarts = self.shard_restarts.load(Ordering::Relaxed);
        m.actor_failures = self.report.failures.load(Ordering::Relaxed);
    }
}

/// A step's metrics as far as its batch alone gives them (reward, success, staleness, the
/// critical path, per task), taken before the batch is trained and let go: the step's record
/// is finished on them once training is done ([`MetricSources::collect`]).
pub(super) struct BatchFigures(StepMetrics);

impl BatchFigures {
    /// The figures of `batch`, the batch of training step `step` (0-based).
    pub(super) fn of(step: u64, batch: &Batch) -> Self {
        let mut m = StepMetrics {
            // Steps count from 1 wherever they are shown (step k produces version k).
            step: step + 1,
            ..StepMetrics::default()
        };
        batch_metrics(&mut m, batch);
        Self(m)
    }
}

/// Reward, success and staleness of the batch, overall and per task.
fn batch_metrics(m: &mut StepMetrics, batch: &Batch) {
    m.groups = batch.groups.len();
    let trajs: Vec<_> = batch.trajectories().collect();
    m.trajectories = trajs.len();
    let n = trajs.len().max(1) as f64;
    m.mean_reward = trajs.iter().map(|t| t.reward.unwrap_or(0.0)).sum::<f64>() / n;
    m.success_rate = trajs.iter().filter(|t| t.success).count() as f64 / n;
    let stale: Vec<u64> = trajs
        .iter()
        .map(|t| (m.step - 1).saturating_sub(t.oldest_version()))
        .collect();
    m.staleness_mean = stale.iter().sum::<u64>() as f64 / n;
    m.staleness_max = stale.iter().copied().max().unwrap_or(0);
    let first = trajs
        .iter()
        .map(|t| t.timings.started_at_s)
        .fold(f64::INFINITY, f64::min);
    let last = trajs
        .iter()
        .map(|t| t.timings.ended_at_s)
        .fold(f64::NEG_INFINITY, f64::max);
    m.rollout.rollout_s = if trajs.is_empty() {
        0.0
    } else {
        (last - first).max(0.0)
    };
    m.rollout.critical = trajs
        .iter()
        .max_by(|a, b| a.timings.ended_at_s.total_cmp(&b.timings.ended_at_s))
        .map(|t| {
            let stages = StageSeconds {
                reset_s: t.timings.reset_s,
                generate_s: t.timings.generate_s,
                env_step_s: t.timings.env_step_s,
                reward_s: t.timings.reward_s,
                wait_s: t.timings.wait_s,
            };
            CriticalPath {
                trajectory: t.id.clone(),
                task: t.task.clone(),
                span_s: (t.timings.ended_at_s - t.timings.started_at_s).max(0.0),
                bottleneck: stages.largest().to_string(),
                stages,
            }
        });
    m.rollout.stages = StageSeconds::weighted_mean(trajs.iter().map(|t| {
        (
            StageSeconds {
                reset_s: t.timings.reset_s,
                generate_s: t.timings.generate_s,
                env_step_s: t.timings.env_step_s,
                reward_s: t.timings.reward_s,
                wait_s: t.timings.wait_s,
            },
            1.0,
        )
    }));
    for t in &trajs {
        let e = m.tasks.entry(t.task.clone()).or_default();
        e.trajectories += 1;
        e.success_rate += f64::from(u8::from(t.success));
        e.mean_reward += t.reward.unwrap_or(0.0);
        e.mean_turns += t.turns.len() as f64;
        e.truncation_rate += f64::from(u8::from(t.truncated));
    }
    for g in &batch.groups {
        m.tasks
            .entry(g.task.clone())
            .or_default()
            .seeds
            .push(g.seed);
    }
    for e in m.tasks.values_mut() {
        e.seeds.sort_unstable();
        let k = e.trajectories.max(1) as f64;
        e.success_rate /= k;
        e.mean_reward /= k;
        e.mean_turns /= k;
        e.truncation_rate /= k;
    }
}
