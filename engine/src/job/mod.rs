//! One job's runtime: builds the supervision tree from the spec (weight store, shard pools,
//! environment pools, sample buffer, trainer, scheduler under a job supervisor) and drives the
//! six-step weight-update protocol, one training step at a time.

pub mod barrier;
pub mod builtin;
pub mod episode;
pub mod scheduler;
pub mod supervisor;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use actors::buffer::{BufferArgs, BufferMsg, BufferStats, SampleBuffer, TrajectorySink};
use actors::device::{DeviceProfile, Efficiency, ModelProfile};
use actors::env::{EnvFactory, EnvPool};
use actors::generation::shard::{EngineFactory, ShardActor, ShardArgs, ShardHandle, ShardMsg};
use actors::generation::sim::{SimEngine, SimEngineConfig};
use actors::generation::{InFlightPolicy, LoadReport, Placement as EnginePlacement};
use actors::reward::{EnvRewardPassThrough, SharedScorer, SimReward};
use actors::trainer::{SimTrainer, TrainStats, TrainerActor, TrainerArgs, TrainerMsg};
use actors::types::{Batch, PolicyVersion};
use actors::weights::{WeightStore, WeightStoreArgs, WeightStoreMsg, Weights};
use ractor::{Actor, ActorRef};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::spec::{BackendSpec, EnvSpec, FunctionSpec, JobSpec, Knobs, OnWeightUpdate, Placement, TrainerSpec};
use episode::{EpisodeShared, EpisodeTask};
use scheduler::{PoolView, SchedArgs, SchedMsg, SchedSnapshot, Scheduler, TaskView};
use supervisor::SupervisorReport;

/// How long control calls to the job's actors may take (virtual or wall time).
const CONTROL_TIMEOUT: Duration = Duration::from_secs(3600);

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("could not start actor {what}")]
    Spawn {
        what: String,
        #[source]
        source: ractor::SpawnErr,
    },
    #[error("actor call to {what} failed: {message}")]
    Call { what: &'static str, message: String },
    #[error("training failed")]
    Train(#[source] actors::trainer::TrainError),
    #[error("generation shard {pool}[{index}] failed to install weights: {source}")]
    Install {
        pool: String,
        index: usize,
        #[source]
        source: actors::generation::GenError,
    },
    #[error("an actor of the job failed beyond its restart policy: {0}")]
    Escalated(String),
    #[error("the job runtime panicked: {0}")]
    Panicked(String),
    #[error("the job was cancelled")]
    Cancelled,
    #[error("could not record step metrics: {0}")]
    Observer(String),
}

/// Metrics of one training step (stored per step and streamed as events).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StepMetrics {
    pub step: u64,
    /// Policy version produced by this step.
    pub version: PolicyVersion,
    /// Seconds since the job (run) started, on the job's clock.
    pub elapsed_s: f64,
    pub step_s: f64,
    pub train_s: f64,
    /// Time the step driver waited for the batch.
    pub wait_batch_s: f64,
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
    pub buffer: BufferMetrics,
    pub scheduler: SchedMetrics,
    pub env_restarts: u64,
    pub env_timeouts: u64,
    /// Environment resets and steps since the start.
    pub env_calls: u64,
    pub shard_restarts: u64,
    pub actor_failures: u64,
    /// Busy fraction over this step of every generation shard (`shard POOL/I`), environment
    /// (`env TASK/SLOT`: held by a trajectory) and function instance (`fn DEPLOYMENT/ID`: a
    /// request in flight); empty unless the run records a timeline.
    pub timeline: BTreeMap<String, f64>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TaskMetrics {
    pub trajectories: usize,
    pub success_rate: f64,
    pub mean_reward: f64,
    pub mean_turns: f64,
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
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BufferMetrics {
    pub committed: u64,
    pub redundant: u64,
    pub masked: u64,
    pub retried: u64,
    pub filtered_all_equal: u64,
    pub dropped_too_few: u64,
    pub evicted_stale: u64,
    pub aborted: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SchedMetrics {
    pub admitted_groups: u64,
    pub dispatched_episodes: u64,
    pub cancelled_extras: u64,
    pub aborted_stale: u64,
    pub failed_episodes: u64,
    pub peak_active_episodes: usize,
}

impl From<BufferStats> for BufferMetrics {
    fn from(s: BufferStats) -> Self {
        Self {
            committed: s.committed,
            redundant: s.redundant,
            masked: s.masked,
            retried: s.retried,
            filtered_all_equal: s.filtered_all_equal,
            dropped_too_few: s.dropped_too_few,
            evicted_stale: s.evicted_stale,
            aborted: s.aborted,
        }
    }
}

impl From<SchedSnapshot> for SchedMetrics {
    fn from(s: SchedSnapshot) -> Self {
        Self {
            admitted_groups: s.admitted_groups,
            dispatched_episodes: s.dispatched_episodes,
            cancelled_extras: s.cancelled_extras,
            aborted_stale: s.aborted_stale,
            failed_episodes: s.failed_episodes,
            peak_active_episodes: s.peak_active,
        }
    }
}

/// Receives each completed step (the service stores it and streams it).
pub trait StepObserver: Send + Sync {
    fn on_step(&self, m: &StepMetrics, batch: &Batch) -> Result<(), String>;
}

/// Observer that keeps nothing.
pub struct NoObserver;

impl StepObserver for NoObserver {
    fn on_step(&self, _m: &StepMetrics, _b: &Batch) -> Result<(), String> {
        Ok(())
    }
}

/// What a finished run reports.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct JobSummary {
    pub steps_done: u64,
    pub elapsed_s: f64,
    pub steps: Vec<StepMetrics>,
    pub trajectories_committed: u64,
    pub bubble_ratio: f64,
    pub pools: BTreeMap<String, PoolMetrics>,
}

/// Inputs of one run of a job.
pub struct JobRun {
    pub id: String,
    pub spec: JobSpec,
    /// First step to run (steps already completed before a restart are skipped).
    pub start_step: u64,
    /// Distinguishes trajectory ids of runs resumed after a restart.
    pub epoch: u64,
    pub sink: Arc<dyn TrajectorySink>,
    pub observer: Arc<dyn StepObserver>,
    pub cancel: CancellationToken,
    /// Where the built-in trainer keeps its checkpoints (none: not kept).
    pub checkpoint_dir: Option<std::path::PathBuf>,
    /// The service's function hub (runtime + routers); none: the job starts its own when it
    /// names functions that run as processes, and stops it at the end.
    pub functions: Option<Arc<crate::functions::FunctionHub>>,
    /// Record the per-resource utilisation timeline in the step metrics.
    pub timeline: bool,
}

/// Cumulative busy seconds per resource at the previous step, for per-step busy fractions.
#[derive(Default)]
struct Timeline {
    on: bool,
    prev: BTreeMap<String, f64>,
}

impl Timeline {
    /// Busy fractions over the last `interval_s` seconds, from cumulative busy seconds.
    fn step(&mut self, now: BTreeMap<String, f64>, interval_s: f64) -> BTreeMap<String, f64> {
        let out = now.iter().map(|(k, &b)| (k.clone(), ((b - self.prev.get(k).copied().unwrap_or(0.0)) / interval_s.max(1e-9)).clamp(0.0, 1.0))).collect();
        self.prev = now;
        out
    }
}

struct Pools {
    views: Vec<PoolView>,
    actors: Vec<Vec<ActorRef<ShardMsg>>>,
    restarts: Arc<AtomicU64>,
}

/// Runs the job to its last step, or until cancelled or failed.
pub async fn run(job: JobRun) -> Result<JobSummary, JobError> {
    let knobs = job.spec.knobs();
    let started = tokio::time::Instant::now();
    let needs_hub = job.spec.reward.functions.values().any(|f| !matches!(f, FunctionSpec::Sim { .. }));
    let (hub, own_hub) = match (&job.functions, needs_hub) {
        (Some(h), _) => (Some(h.clone()), false),
        (None, true) => (Some(crate::functions::FunctionHub::new(crate::functions::default_fn_bin()).map_err(|e| JobError::Observer(e.to_string()))?), true),
        (None, false) => (None, false),
    };
    let prefix = format!("{}/r{}", job.id, job.epoch);
    let (sup, report) = supervisor::spawn(&prefix).await.map_err(|source| JobError::Spawn { what: "job supervisor".into(), source })?;
    let span = tracing::info_span!("job", job = %job.id, epoch = job.epoch);
    let result = tracing::Instrument::instrument(run_inner(&job, &knobs, started, &sup, &report, hub.as_ref()), span).await;
    // Stop intake and abort episodes first, then the tree.
    sup.stop_children(None);
    sup.stop(None);
    if let Some(h) = &hub {
        h.release(&job.id).await;
        if own_hub {
            h.shutdown().await;
        }
    }
    result
}

async fn run_inner(
    job: &JobRun,
    knobs: &Knobs,
    started: tokio::time::Instant,
    sup: &ActorRef<supervisor::SupMsg>,
    report: &Arc<SupervisorReport>,
    hub: Option<&Arc<crate::functions::FunctionHub>>,
) -> Result<JobSummary, JobError> {
    let spec = &job.spec;
    let cell = sup.get_cell();
    let start_version = job.start_step;
    let model_bytes = spec.pools.iter().find_map(|p| match &p.backend {
        BackendSpec::Sim { model, .. } => spec.model_profile(model).map(|m| m.weight_bytes()),
        BackendSpec::Builtin { model, .. } => Some(model.config().params() as f64 * 4.0),
    });
    // The built-in trainer owns the real weights (resumed from its checkpoint if any).
    let builtin = match (&spec.trainer, spec.builtin_model()) {
        (TrainerSpec::Builtin(t), Some(m)) => Some(
            builtin::BuiltinParts::new(m.config(), t.config(), spec.seed, start_version, job.checkpoint_dir.clone())
                .map_err(|e| JobError::Observer(format!("built-in model: {e}")))?,
        ),
        _ => None,
    };
    let weights_initial = match &builtin {
        Some(b) => b.initial.clone(),
        None => Arc::new(Weights::simulated(start_version, model_bytes.unwrap_or(0.0))),
    };
    let (weights, _) =
        Actor::spawn_linked(None, WeightStore, WeightStoreArgs { keep: knobs.alpha as usize + 2, initial: weights_initial.clone() }, cell.clone())
            .await
            .map_err(|source| JobError::Spawn { what: "weight store".into(), source })?;

    let pools = spawn_pools(spec, knobs, job.epoch, &cell, &weights_initial).await?;
    // Shards start at the resumed version.
    for (pi, p) in pools.actors.iter().enumerate() {
        for (i, a) in p.iter().enumerate() {
            install(a, weights_initial.clone(), InFlightPolicy::Abort, &pools.views[pi].name, i).await?;
        }
    }

    let tasks = build_tasks(spec, knobs, &cell, &job.id, hub).await?;

    let sched_slot: Arc<OnceLock<ActorRef<SchedMsg>>> = Arc::new(OnceLock::new());
    let notify_slot = sched_slot.clone();
    let notify = Arc::new(move |ev| {
        if let Some(s) = notify_slot.get() {
            let _ = s.cast(SchedMsg::Buffer(ev));
        }
    });
    let (buffer, _) = Actor::spawn_linked(
        None,
        SampleBuffer,
        BufferArgs {
            batch_size: knobs.batch_size,
            alpha: knobs.alpha,
            filter_all_equal: knobs.filter_all_equal,
            max_retries_per_group: knobs.max_retries_per_group,
            sink: job.sink.clone(),
            notify,
        },
        cell.clone(),
    )
    .await
    .map_err(|source| JobError::Spawn { what: "sample buffer".into(), source })?;

    let trainer_impl: Box<dyn actors::trainer::Trainer> = match (&spec.trainer, builtin) {
        (_, Some(b)) => Box::new(b.trainer),
        (TrainerSpec::Sim { seconds_per_token, gpus, step_overhead_s, device, model, mfu }, None) => {
            // With a device class: the roofline's seconds per token on one GPU of it.
            let pools_model = spec.pools.iter().find_map(|p| match &p.backend {
                BackendSpec::Sim { model, .. } => Some(model.clone()),
                BackendSpec::Builtin { .. } => None,
            });
            let roofline = device.as_deref().and_then(|d| spec.device_profile(d)).and_then(|d| {
                let m = model.clone().or(pools_model).and_then(|m| spec.model_profile(&m))?;
                Some(actors::device::train_seconds(&d, &m, 1, mfu.unwrap_or(0.35), 1.0))
            });
            let bytes = model_bytes.unwrap_or(0.0);
            Box::new(SimTrainer {
                seconds_per_token: roofline.unwrap_or(*seconds_per_token),
                gpus: *gpus,
                step_overhead: Duration::from_secs_f64(*step_overhead_s + spec.weight_sync().publish_seconds(bytes)),
                modelled_weight_bytes: bytes,
                panic_at_step: spec.sim.trainer_panic_at_step.filter(|_| job.epoch < spec.sim.trainer_panic_runs.unwrap_or(1)),
            })
        }
        (TrainerSpec::Builtin(_), None) => return Err(JobError::Observer("the built-in trainer needs built-in pools".into())),
    };
    let (trainer, _) = Actor::spawn_linked(None, TrainerActor, TrainerArgs { trainer: trainer_impl, weights: weights.clone(), start_version }, cell.clone())
        .await
        .map_err(|source| JobError::Spawn { what: "trainer".into(), source })?;

    let task_views = spec
        .tasks
        .iter()
        .map(|t| {
            let (prefill, decode) = prior_tokens(t);
            TaskView {
                domain: t.domain.clone(),
                weight: t.weight,
                group_size: t.group_size,
                redundancy: t.redundancy,
                seeds: t.seeds.map(|s| (s.start, s.count)),
                prefill_estimate: prefill,
                decode_estimate: decode,
                declared_pool: spec
                    .mapping
                    .declared
                    .get(&t.domain)
                    .or(spec.mapping.fallback.as_ref())
                    .and_then(|name| spec.pools.iter().position(|p| &p.name == name)),
            }
        })
        .collect();
    let pool_meta: Vec<(String, String, usize)> = pools.views.iter().map(|p| (p.name.clone(), p.device.name.clone(), p.shards.len())).collect();
    let (sched, _) = Actor::spawn_linked(
        None,
        Scheduler,
        SchedArgs { knobs: knobs.clone(), pools: pools.views, tasks: task_views, buffer: buffer.clone(), seed: spec.seed, start_version },
        cell.clone(),
    )
    .await
    .map_err(|source| JobError::Spawn { what: "scheduler".into(), source })?;
    let _ = sched_slot.set(sched.clone());
    report.set_critical(&[sched.get_id(), buffer.get_id(), trainer.get_id(), weights.get_id()]);

    let env_counters: Vec<_> = tasks.iter().map(|t| (t.domain.clone(), t.envs.counters.clone())).collect();
    let mut timeline = Timeline { on: job.timeline, ..Timeline::default() };
    let shared = Arc::new(EpisodeShared {
        buffer: buffer.clone(),
        scheduler: sched.clone(),
        tasks,
        epoch: job.epoch,
        started,
        batch_barrier: knobs.barrier == crate::spec::Barrier::Batch,
        framing: spec.builtin_model().map(|_| actors::model::tokenizer::ByteTokenizer),
    });
    sched.cast(SchedMsg::Start(shared.clone())).map_err(|e| JobError::Call { what: "scheduler", message: e.to_string() })?;

    let policy = match knobs.on_weight_update {
        OnWeightUpdate::Abort => InFlightPolicy::Abort,
        OnWeightUpdate::Recompute => InFlightPolicy::Recompute,
    };
    let mut installed = start_version;
    let mut summary = JobSummary::default();
    let mut last_step_end = started;
    let mut escalated = report.escalated.subscribe();
    for step in job.start_step..knobs.steps {
        let t_wait = tokio::time::Instant::now();
        // 1. get_batch
        let batch = tokio::select! {
            biased;
            _ = job.cancel.cancelled() => return Err(JobError::Cancelled),
            r = escalated.wait_for(|e| e.is_some()) => {
                let why = r.map(|e| e.clone().unwrap_or_default()).unwrap_or_default();
                return Err(JobError::Escalated(why));
            }
            b = async { ractor::call_t!(buffer, |reply| BufferMsg::GetBatch { step, reply }, CONTROL_TIMEOUT.as_millis() as u64) } => {
                b.map_err(|e| JobError::Call { what: "sample buffer", message: e.to_string() })?
            }
        };
        let wait_batch_s = t_wait.elapsed().as_secs_f64();
        let t_train;
        let stats: TrainStats;
        if knobs.overlap_training {
            // 2-4. suspend, install the newest finished weights, resume; 5. rollout goes on
            // while 6. the step trains.
            installed = update_weights(&pools.actors, &pool_meta, &weights, installed, policy, &sched).await?;
            t_train = tokio::time::Instant::now();
            stats = train(&trainer, batch.clone(), &job.cancel).await?;
        } else {
            // No overlap: generation pauses while training, then installs the fresh version.
            let _ = sched.cast(SchedMsg::Training(true));
            suspend_all(&pools.actors).await?;
            t_train = tokio::time::Instant::now();
            stats = train(&trainer, batch.clone(), &job.cancel).await?;
            installed = update_weights(&pools.actors, &pool_meta, &weights, installed, policy, &sched).await?;
            let _ = sched.cast(SchedMsg::Training(false));
        }
        let train_s = t_train.elapsed().as_secs_f64();
        let now = tokio::time::Instant::now();
        let m = step_metrics(
            step,
            &stats,
            &batch,
            started,
            now.duration_since(last_step_end).as_secs_f64(),
            train_s,
            wait_batch_s,
            &pools.actors,
            &pool_meta,
            &buffer,
            &sched,
            &env_counters,
            &pools.restarts,
            report,
            &mut timeline,
            hub,
        )
        .await?;
        last_step_end = now;
        job.observer.on_step(&m, &batch).map_err(JobError::Observer)?;
        summary.steps_done = step + 1;
        summary.steps.push(m);
    }
    let _ = sched.cast(SchedMsg::Shutdown);
    summary.elapsed_s = started.elapsed().as_secs_f64();
    if let Some(last) = summary.steps.last() {
        summary.bubble_ratio = last.bubble_ratio;
        summary.pools = last.pools.clone();
        summary.trajectories_committed = last.buffer.committed;
    }
    Ok(summary)
}

/// Prior per-trajectory token estimates for the cost model, from the task's environment.
fn prior_tokens(t: &crate::spec::TaskSpec) -> (f64, f64) {
    // Built-in games: byte-level observations of the board each turn, short answers.
    let game = |turns: f64, obs: f64, resp: f64| {
        let turns = turns.min(t.max_turns as f64);
        (turns * obs, turns * resp.min(t.max_tokens_per_turn as f64))
    };
    match &t.env {
        EnvSpec::Frozenlake { size, .. } => game(2.0 * *size as f64, (*size * *size * 2) as f64, 6.0),
        EnvSpec::Sokoban { size, .. } => game(10.0, (*size * (*size + 1)) as f64, 6.0),
        EnvSpec::Arithmetic { .. } => game(1.0, 8.0, 4.0),
        EnvSpec::Tictactoe { .. } => game(4.0, 20.0, 2.0),
        EnvSpec::External { .. } => game(8.0, 64.0, 8.0),
        EnvSpec::Sim { turns, observation_tokens, prompt_tokens, response_tokens, .. } => {
            let turns = turns.as_ref().map_or(1.0, |d| d.mean()).min(t.max_turns as f64).max(1.0);
            let obs = observation_tokens.as_ref().map_or(64.0, |d| d.mean());
            let prompt = prompt_tokens.as_ref().map_or(obs, |d| d.mean());
            let resp = response_tokens.as_ref().map_or(64.0, |d| d.mean()).min(t.max_tokens_per_turn as f64);
            if t.context == crate::spec::ContextMode::Rewrite {
                // The whole context every turn: the prompt, then the grown history.
                (turns * prompt + (obs + resp) * turns * (turns - 1.0) / 2.0, turns * resp)
            } else {
                // Prefill the prompt, then each later turn's observation (the history is cached).
                (prompt + (turns - 1.0) * obs, turns * resp)
            }
        }
    }
}

async fn spawn_pools(spec: &JobSpec, knobs: &Knobs, epoch: u64, cell: &ractor::ActorCell, initial: &Arc<Weights>) -> Result<Pools, JobError> {
    let restarts = Arc::new(AtomicU64::new(0));
    let mut views = Vec::new();
    let mut all = Vec::new();
    let sim_shards: u32 = spec.pools.iter().filter(|p| matches!(p.backend, BackendSpec::Sim { .. })).map(|p| p.count as u32).sum();
    for (pi, p) in spec.pools.iter().enumerate() {
        let device = spec.device_profile(&p.device).unwrap_or_else(|| {
            DeviceProfile::builtin("H20").unwrap_or(DeviceProfile { name: p.device.clone(), flops: 1e14, bandwidth: 1e12, memory: 8e10, cost: 1.0 })
        });
        // A shard of a tensor-parallel pool is its whole group.
        let device = match &p.backend {
            BackendSpec::Sim { gpus_per_shard, tp_efficiency, .. } => device.group(*gpus_per_shard, tp_efficiency.unwrap_or(0.9)),
            BackendSpec::Builtin { .. } => device,
        };
        let (model, max_batch, make): (ModelProfile, usize, Box<dyn Fn(usize) -> (EngineFactory, EnginePlacement)>) = match &p.backend {
            BackendSpec::Sim { model, max_batch, mfu, mbu, weight_sync_gbps, hang_probability, gpus_per_shard, .. } => {
                let model = spec.model_profile(model).unwrap_or_else(|| {
                    ModelProfile::builtin("qwen3-8b").unwrap_or(ModelProfile {
                        name: model.clone(),
                        params: 8e9,
                        active_params: 8e9,
                        layers: 36,
                        kv_bytes_per_token: 147_456.0,
                        bytes_per_param: 2.0,
                    })
                });
                let mut cfg = SimEngineConfig::new(device.clone(), model.clone());
                let e = Efficiency::default();
                cfg.efficiency = Efficiency { mfu: mfu.unwrap_or(e.mfu), mbu: mbu.unwrap_or(e.mbu) };
                if let Some(b) = max_batch {
                    cfg.max_batch = *b;
                }
                cfg.weight_sync = spec.weight_sync();
                cfg.weight_sync.shards = sim_shards;
                cfg.weight_sync.gpus_per_shard = *gpus_per_shard;
                if let Some(g) = weight_sync_gbps {
                    cfg.weight_sync.intra_bandwidth = g * 1e9;
                }
                cfg.hang_probability = *hang_probability;
                let mb = cfg.max_batch;
                let restarts = restarts.clone();
                let seed = spec.seed;
                let faults: Vec<(usize, u64)> = spec.sim.faults.iter().filter(|f| f.pool == p.name).map(|f| (f.shard, f.hang_after_steps)).collect();
                let make = move |i: usize| -> (EngineFactory, EnginePlacement) {
                    let mut cfg = cfg.clone();
                    cfg.seed = seed ^ ((pi as u64) << 40) ^ ((i as u64) << 20) ^ epoch;
                    let counter = restarts.clone();
                    // An injected fault fires in the shard's first engine only.
                    let fault = std::sync::Mutex::new(faults.iter().find(|f| f.0 == i).map(|f| f.1));
                    let f: EngineFactory = Arc::new(move || {
                        let mut c = cfg.clone();
                        // A restarted engine gets a fresh RNG stream (and so does not hang again at once).
                        c.seed = c.seed.wrapping_add(counter.load(Ordering::Relaxed).wrapping_mul(0x9e37_79b9));
                        c.hang_after_steps = fault.lock().map(|mut f| f.take()).unwrap_or(None);
                        Box::new(SimEngine::new(c))
                    });
                    (f, EnginePlacement::Task)
                };
                (model, mb, Box::new(make))
            }
            BackendSpec::Builtin { model, max_batch } => {
                let cfg = model.config();
                let profile = ModelProfile {
                    name: "builtin".into(),
                    params: cfg.params() as f64,
                    active_params: cfg.params() as f64,
                    layers: cfg.n_layers as u32,
                    kv_bytes_per_token: (2 * cfg.n_layers * cfg.d_model * 4) as f64,
                    bytes_per_param: 4.0,
                };
                let w = initial.clone();
                let mb = *max_batch;
                let make = move |_i: usize| -> (EngineFactory, EnginePlacement) {
                    let w = w.clone();
                    let f: EngineFactory = Arc::new(move || match actors::model::engine::BuiltinEngine::new(cfg, &w, mb) {
                        Ok(e) => Box::new(e),
                        Err(e) => Box::new(builtin::FailedEngine(e.to_string(), Vec::new())),
                    });
                    (f, EnginePlacement::Thread)
                };
                (profile, mb, Box::new(make))
            }
        };
        let mut handles = Vec::new();
        let mut actors = Vec::new();
        for i in 0..p.count {
            let (factory, placement) = make(i);
            let (tx, rx) = tokio::sync::oneshot::channel::<ShardHandle>();
            let args = ShardArgs {
                pool: p.name.clone(),
                index: i,
                device: device.clone(),
                factory,
                placement,
                frozen_after: Duration::from_secs_f64(knobs.frozen_after_s),
                restarts: restarts.clone(),
            };
            let (a, _) = Actor::spawn_linked(None, ShardActor, (args, tx), cell.clone())
                .await
                .map_err(|source| JobError::Spawn { what: format!("shard {}[{i}]", p.name), source })?;
            let h = rx.await.map_err(|e| JobError::Call { what: "shard", message: e.to_string() })?;
            handles.push(h);
            actors.push(a);
        }
        views.push(PoolView { name: p.name.clone(), device, model, max_batch, shards: handles, prefill_from: None, prefill_only: false });
        all.push(actors);
    }
    // Prefill/decode disaggregation links (validated: the named pool exists and is simulated).
    for (pi, p) in spec.pools.iter().enumerate() {
        if let BackendSpec::Sim { prefill_pool: Some(pp), kv_transfer_gbps, .. } = &p.backend
            && let Some(qi) = spec.pools.iter().position(|q| &q.name == pp)
        {
            let kv = views[pi].model.kv_bytes_per_token;
            views[pi].prefill_from = Some(scheduler::PrefillLink { pool: qi, bandwidth: kv_transfer_gbps.unwrap_or(50.0) * 1e9, kv_bytes_per_token: kv });
            views[qi].prefill_only = true;
        }
    }
    Ok(Pools { views, actors: all, restarts })
}

async fn build_tasks(
    spec: &JobSpec,
    knobs: &Knobs,
    cell: &ractor::ActorCell,
    job_id: &str,
    hub: Option<&Arc<crate::functions::FunctionHub>>,
) -> Result<Vec<EpisodeTask>, JobError> {
    let mut functions: BTreeMap<String, SharedScorer> = BTreeMap::new();
    for (name, f) in &spec.reward.functions {
        let scorer: SharedScorer = match f {
            FunctionSpec::Sim { latency_s, cold_start_s, concurrency, scale_to_zero_after_s, scaling } => {
                let latency = latency_s.clone().unwrap_or_default();
                let seed = spec.seed ^ name.bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
                match knobs.placement {
                    Placement::Serverless if scaling.is_some() => {
                        Arc::new(actors::reward::SimFunction::new(latency, Duration::from_secs_f64(*cold_start_s), scaling.clone().unwrap_or_default(), seed))
                    }
                    Placement::Serverless => Arc::new(SimReward::new(
                        latency,
                        Duration::from_secs_f64(*cold_start_s),
                        *concurrency,
                        Some(Duration::from_secs_f64(*scale_to_zero_after_s)),
                        seed,
                    )),
                    Placement::Local => Arc::new(SimReward::new(latency, Duration::ZERO, *concurrency, None, seed)),
                }
            }
            other => {
                let hub = hub.ok_or_else(|| JobError::Observer(format!("reward.functions.{name}: no function runtime")))?;
                hub.scorer(job_id, name, other, knobs.placement).map_err(|e| JobError::Observer(e.to_string()))?
            }
        };
        functions.insert(name.clone(), scorer);
    }
    let mut out = Vec::new();
    for (ti, t) in spec.tasks.iter().enumerate() {
        if let EnvSpec::External { sandbox: crate::spec::SandboxMode::Bwrap, .. } = &t.env {
            crate::envs::check_sandbox().map_err(|e| JobError::Observer(format!("tasks[{ti}] ({}): {e}", t.domain)))?;
        }
        let factory: EnvFactory = crate::envs::factory(&t.env, spec.seed ^ ((ti as u64) << 32), &knobs_env(knobs), t.inject_latency.as_ref());
        let size = t.envs.unwrap_or(knobs.max_concurrent_episodes).max(1);
        let envs = EnvPool::spawn(&t.domain, size, factory, Duration::from_secs_f64(knobs.env_call_timeout_s), Duration::from_millis(100), cell.clone())
            .await
            .map_err(|source| JobError::Spawn { what: format!("environments of {}", t.domain), source })?;
        let scorers = t
            .reward
            .iter()
            .map(|r| {
                if r == "env" {
                    Arc::new(EnvRewardPassThrough) as SharedScorer
                } else {
                    functions.get(r).cloned().unwrap_or_else(|| Arc::new(EnvRewardPassThrough))
                }
            })
            .collect();
        out.push(EpisodeTask {
            domain: t.domain.clone(),
            envs,
            scorers,
            max_turns: t.max_turns,
            max_tokens_per_turn: t.max_tokens_per_turn,
            allowed_tokens: t.allowed_tokens().map(Arc::from),
            rewrite_context: t.context == crate::spec::ContextMode::Rewrite,
        });
    }
    Ok(out)
}

fn knobs_env(knobs: &Knobs) -> crate::envs::EnvLimits {
    crate::envs::EnvLimits { call_timeout: Duration::from_secs_f64(knobs.env_call_timeout_s) }
}

async fn install(a: &ActorRef<ShardMsg>, w: Arc<Weights>, policy: InFlightPolicy, pool: &str, index: usize) -> Result<(), JobError> {
    let r = ractor::call_t!(a, |reply| ShardMsg::Install(w, policy, reply), CONTROL_TIMEOUT.as_millis() as u64)
        .map_err(|e| JobError::Call { what: "shard", message: e.to_string() })?;
    r.map_err(|source| JobError::Install { pool: pool.to_string(), index, source })
}

async fn suspend_all(pools: &[Vec<ActorRef<ShardMsg>>]) -> Result<(), JobError> {
    let calls = pools.iter().flatten().map(|a| async move { ractor::call_t!(a, ShardMsg::Suspend, CONTROL_TIMEOUT.as_millis() as u64) });
    for r in futures::future::join_all(calls).await {
        r.map_err(|e| JobError::Call { what: "shard", message: e.to_string() })?;
    }
    Ok(())
}

/// Suspend → install the newest finished version → resume, on every shard at once.
async fn update_weights(
    pools: &[Vec<ActorRef<ShardMsg>>],
    meta: &[(String, String, usize)],
    store: &ActorRef<WeightStoreMsg>,
    installed: PolicyVersion,
    policy: InFlightPolicy,
    sched: &ActorRef<SchedMsg>,
) -> Result<PolicyVersion, JobError> {
    let latest = ractor::call_t!(store, WeightStoreMsg::Latest, CONTROL_TIMEOUT.as_millis() as u64)
        .map_err(|e| JobError::Call { what: "weight store", message: e.to_string() })?;
    let Some(latest) = latest else { return Ok(installed) };
    if latest.version == installed {
        for a in pools.iter().flatten() {
            let _ = a.cast(ShardMsg::Resume);
        }
        return Ok(installed);
    }
    suspend_all(pools).await?;
    let calls = pools.iter().enumerate().flat_map(|(pi, p)| {
        let latest = latest.clone();
        p.iter().enumerate().map(move |(i, a)| {
            let latest = latest.clone();
            async move { install(a, latest, policy, &meta[pi].0, i).await }
        })
    });
    for r in futures::future::join_all(calls).await {
        r?;
    }
    for a in pools.iter().flatten() {
        let _ = a.cast(ShardMsg::Resume);
    }
    let _ = sched.cast(SchedMsg::VersionInstalled(latest.version));
    Ok(latest.version)
}

async fn train(trainer: &ActorRef<TrainerMsg>, batch: Batch, cancel: &CancellationToken) -> Result<TrainStats, JobError> {
    tokio::select! {
        biased;
        _ = cancel.cancelled() => Err(JobError::Cancelled),
        r = async { ractor::call_t!(trainer, |reply| TrainerMsg::Train(batch, reply), CONTROL_TIMEOUT.as_millis() as u64) } => {
            r.map_err(|e| JobError::Call { what: "trainer", message: e.to_string() })?.map_err(JobError::Train)
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn step_metrics(
    step: u64,
    stats: &TrainStats,
    batch: &Batch,
    started: tokio::time::Instant,
    step_s: f64,
    train_s: f64,
    wait_batch_s: f64,
    pools: &[Vec<ActorRef<ShardMsg>>],
    meta: &[(String, String, usize)],
    buffer: &ActorRef<BufferMsg>,
    sched: &ActorRef<SchedMsg>,
    env_counters: &[(String, Arc<actors::env::EnvCounters>)],
    restarts: &Arc<AtomicU64>,
    report: &Arc<SupervisorReport>,
    timeline: &mut Timeline,
    hub: Option<&Arc<crate::functions::FunctionHub>>,
) -> Result<StepMetrics, JobError> {
    let mut busy_now: BTreeMap<String, f64> = BTreeMap::new();
    let elapsed = started.elapsed().as_secs_f64().max(1e-9);
    let mut m = StepMetrics { step, version: stats.version, elapsed_s: elapsed, step_s, train_s, wait_batch_s, ..StepMetrics::default() };
    m.groups = batch.groups.len();
    let trajs: Vec<_> = batch.trajectories().collect();
    m.trajectories = trajs.len();
    let n = trajs.len().max(1) as f64;
    m.mean_reward = trajs.iter().map(|t| t.reward.unwrap_or(0.0)).sum::<f64>() / n;
    m.success_rate = trajs.iter().filter(|t| t.success).count() as f64 / n;
    let stale: Vec<u64> = trajs.iter().map(|t| step.saturating_sub(t.oldest_version())).collect();
    m.staleness_mean = stale.iter().sum::<u64>() as f64 / n;
    m.staleness_max = stale.iter().copied().max().unwrap_or(0);
    for t in &trajs {
        let e = m.tasks.entry(t.task.clone()).or_default();
        e.trajectories += 1;
        e.success_rate += f64::from(u8::from(t.success));
        e.mean_reward += t.reward.unwrap_or(0.0);
        e.mean_turns += t.turns.len() as f64;
    }
    for e in m.tasks.values_mut() {
        let k = e.trajectories.max(1) as f64;
        e.success_rate /= k;
        e.mean_reward /= k;
        e.mean_turns /= k;
    }
    let mut busy_total = 0.0;
    let mut shards_total = 0usize;
    let snap = ractor::call_t!(sched, SchedMsg::Snapshot, CONTROL_TIMEOUT.as_millis() as u64)
        .map_err(|e| JobError::Call { what: "scheduler", message: e.to_string() })?;
    for (pi, p) in pools.iter().enumerate() {
        let loads = futures::future::join_all(p.iter().map(|a| async move { ractor::call_t!(a, ShardMsg::Load, CONTROL_TIMEOUT.as_millis() as u64) })).await;
        let loads: Vec<LoadReport> = loads.into_iter().filter_map(Result::ok).collect();
        if timeline.on {
            for (i, l) in loads.iter().enumerate() {
                busy_now.insert(format!("shard {}/{i}", meta[pi].0), l.busy_s);
            }
        }
        let busy: f64 = loads.iter().map(|l| l.busy_s.min(elapsed)).sum();
        busy_total += busy;
        shards_total += meta[pi].2;
        let pm = PoolMetrics {
            device: meta[pi].1.clone(),
            shards: meta[pi].2,
            utilisation: busy / (elapsed * meta[pi].2.max(1) as f64),
            prefill_tokens: loads.iter().map(|l| l.prefill_tokens).sum(),
            decode_tokens: loads.iter().map(|l| l.decode_tokens).sum(),
            groups: snap.groups_per_pool.get(&meta[pi].0).copied().unwrap_or(0),
            engine_steps: loads.iter().map(|l| l.steps).sum(),
        };
        m.prefill_tokens += pm.prefill_tokens;
        m.decode_tokens += pm.decode_tokens;
        m.pools.insert(meta[pi].0.clone(), pm);
    }
    m.bubble_ratio = 1.0 - busy_total / (elapsed * shards_total.max(1) as f64);
    let stats_buf = ractor::call_t!(buffer, BufferMsg::Stats, CONTROL_TIMEOUT.as_millis() as u64)
        .map_err(|e| JobError::Call { what: "sample buffer", message: e.to_string() })?;
    m.trajectories_per_s = stats_buf.committed as f64 / elapsed;
    m.buffer = stats_buf.into();
    m.scheduler = snap.into();
    m.env_restarts = env_counters.iter().map(|(_, c)| c.restarts.load(Ordering::Relaxed)).sum();
    m.env_timeouts = env_counters.iter().map(|(_, c)| c.timeouts.load(Ordering::Relaxed)).sum();
    m.env_calls = env_counters.iter().map(|(_, c)| c.steps.load(Ordering::Relaxed) + c.resets.load(Ordering::Relaxed)).sum();
    if timeline.on {
        for (task, c) in env_counters {
            for (slot, b) in c.slot_held_s().into_iter().enumerate() {
                busy_now.insert(format!("env {task}/{slot}"), b);
            }
        }
        for (name, b) in hub.map(|h| h.instance_busy()).unwrap_or_default() {
            busy_now.insert(format!("fn {name}"), b);
        }
        m.timeline = timeline.step(busy_now, step_s);
    }
    m.shard_restarts = restarts.load(Ordering::Relaxed);
    m.actor_failures = report.failures.load(Ordering::Relaxed);
    Ok(m)
}
