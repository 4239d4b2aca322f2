//! Builds a job's actors from its [`JobPlan`] under the job supervisor: weight store, shard
//! pools (each shard starts on the run's initial weights), environment pools with their
//! reward functions, sample buffer, trainer and scheduler.
//!
//! Files by part: `trainer` picks the trainer and the weights shards start from, `pools`
//! spawns the shards (`server`: their inference-server engines), `tasks` the reward functions
//! and environment pools.

mod agents;
mod pools;
mod server;
mod tasks;
mod trainer;

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use actors::buffer::{BufferArgs, BufferMsg, SampleBuffer};
use actors::env::EnvCounters;
use actors::episode::{ByteFraming, ChatFraming, Framing};
use actors::episode::{EpisodeShared, EpisodeTask};
use actors::fault::{Fault, FaultPolicy, Faults};
use actors::generation::shard::ShardHandle;
use actors::reward::SimFunction;
use actors::trainer::{Trainer, TrainerActor, TrainerArgs, TrainerMsg};
use actors::weights::{WeightStore, WeightStoreArgs, WeightStoreMsg, Weights};
use infra::faas::Deployment;
use ractor::{Actor, ActorCell, ActorRef};

use super::metrics::PoolShards;
use super::scheduler::{PoolView, SchedArgs, SchedMsg, Scheduler};
use super::{JobError, JobRun};
use crate::hub::FunctionHub;
use crate::spec::Knobs;
use crate::wiring::{EnginePlan, JobPlan, PoolPlan, TaskPlan, TaskView};
use pools::spawn_pools;
use tasks::{HeldOut, spawn_tasks};
use trainer::{ShardStart, trainer_and_weights};

/// The actors of a running job.
pub(super) struct JobActors {
    pub weights: ActorRef<WeightStoreMsg>,
    pub pools: Vec<PoolShards>,
    pub shard_restarts: Arc<AtomicU64>,
    pub buffer: ActorRef<BufferMsg>,
    pub trainer: ActorRef<TrainerMsg>,
    pub scheduler: ActorRef<SchedMsg>,
    pub env_counters: Vec<(String, Arc<EnvCounters>)>,
    pub tasks: Vec<EpisodeTask>,
    /// Fault budgets of the reward functions and environments; the driver fails the job on
    /// the first broken one.
    pub faults: Arc<Faults>,
    /// Watches the job's function deployments for crash loops (aborted when dropped).
    pub _crash_watch: Option<tokio_util::task::AbortOnDropHandle<()>>,
    /// How episodes frame observations for the built-in policy (`None`: simulated tokens).
    pub framing: Option<Arc<dyn Framing>>,
    /// Held-out evaluation, when the spec asks for it.
    pub evaluator: Option<super::eval::Evaluator>,
    /// The span episodes' trace spans hang under (the step driver moves it step by step).
    pub trace_parent: Arc<actors::episode::TraceParent>,
    /// Simulated function deployments with usage to report (scaled or on GPUs).
    pub sim_functions: Vec<(String, Arc<SimFunction>)>,
    /// The gateway listeners of the job's managed agents.
    pub _agent_host: Option<crate::agents::AgentHost>,
}

/// Instances in a row that die or never become ready before a deployment counts as
/// crash-looping (and the jobs using it fail).
pub(super) const CRASH_LOOP_INSTANCES: u32 = 3;

/// Spawns every actor of the plan, linked to `cell` (the job supervisor).
pub(super) async fn spawn(
    job: &JobRun,
    plan: JobPlan,
    cell: &ActorCell,
    hub: Option<&Arc<FunctionHub>>,
) -> Result<JobActors, JobError> {
    let start_version = job.start_step;
    let weight_bytes = plan.weight_bytes();
    let (start, trainer_impl) = trainer_and_weights(job, plan.trainer, plan.seed, weight_bytes)?;
    let framing = framing(&start, &plan.pools)?;
    let weights = spawn_weight_store(&plan.knobs, start.initial.clone(), cell).await?;
    let shard_restarts = Arc::new(AtomicU64::new(0));
    let (views, pools) = spawn_pools(
        &plan.pools,
        plan.seed,
        job.epoch,
        cell,
        &start,
        &shard_restarts,
    )
    .await?;
    let faults = Faults::new(FaultPolicy {
        window: Duration::from_secs_f64(plan.knobs.fault_window_s),
        min_failures: plan.knobs.fault_min_failures,
    });
    // Training and held-out tasks are spawned together (they share function deployments);
    // the held-out ones are split off for the evaluator.
    let n_train = plan.tasks.len();
    let mut all: Vec<&TaskPlan> = plan.tasks.iter().collect();
    if let Some(e) = &plan.eval {
        all.extend(e.tasks.iter());
    }
    let (runners, agent_host) =
        agents::agent_runners(&all, job, start.policy.as_ref().map(|p| &p.tokenizer)).await?;
    let (mut task_views, mut tasks, deployments, sim_functions) =
        spawn_tasks(&all, &plan.functions, &plan.knobs, cell, job, hub, &faults).await?;
    for (task, runner) in tasks.iter_mut().zip(runners) {
        task.agent = runner;
    }
    let (held_out, eval_tasks) =
        HeldOut::split_off(&mut task_views, &mut tasks, n_train, plan.eval.as_ref());
    let crash_watch = watch(deployments, &faults);
    let env_counters = tasks
        .iter()
        .map(|t| (t.domain.clone(), t.envs.counters.clone()))
        .collect();

    // The buffer tells the scheduler about closed groups; the scheduler is spawned after it.
    let sched_slot: Arc<OnceLock<ActorRef<SchedMsg>>> = Arc::new(OnceLock::new());
    let buffer = spawn_buffer(job, &plan.knobs, cell, sched_slot.clone()).await?;
    let trainer = spawn_trainer(trainer_impl, &weights, start_version, cell).await?;
    let eval_shards = generating_shards(&views);
    let scheduler = spawn_scheduler(
        job,
        &plan.knobs,
        plan.seed,
        views,
        task_views,
        &buffer,
        cell,
    )
    .await?;
    let _ = sched_slot.set(scheduler.clone());
    // The job's span until the first step starts.
    let trace_parent = Arc::new(actors::episode::TraceParent::new(tracing::Span::current()));
    let evaluator = plan.eval.as_ref().map(|e| {
        let shared = Arc::new(EpisodeShared {
            buffer: buffer.clone(),
            trace_parent: trace_parent.clone(),
            tasks: eval_tasks,
            epoch: job.epoch,
            started: tokio::time::Instant::now(),
            batch_barrier: false,
            framing: framing.clone(),
        });
        held_out.evaluator(e, shared, eval_shards, plan.seed)
    });
    Ok(JobActors {
        evaluator,
        trace_parent,
        sim_functions,
        framing,
        weights,
        pools,
        shard_restarts,
        buffer,
        trainer,
        scheduler,
        env_counters,
        tasks,
        faults,
        _crash_watch: crash_watch,
        _agent_host: agent_host,
    })
}

/// How episodes frame observations for the built-in policy: the checkpoint's chat template,
/// bytes for the tiny model, none for simulated engines.
fn framing(start: &ShardStart, pools: &[PoolPlan]) -> Result<Option<Arc<dyn Framing>>, JobError> {
    Ok(match &start.policy {
        Some(p) => Some(Arc::new(
            ChatFraming::new(p.tokenizer.clone(), None)
                .map_err(|e| JobError::Framing(Box::new(e)))?,
        )),
        None if pools
            .iter()
            .any(|p| matches!(p.engine, EnginePlan::Builtin { .. })) =>
        {
            Some(Arc::new(ByteFraming))
        }
        None => None,
    })
}

/// The weight store, holding the run's initial weights and as many versions as the
/// staleness bound can still need.
async fn spawn_weight_store(
    knobs: &Knobs,
    initial: Arc<Weights>,
    cell: &ActorCell,
) -> Result<ActorRef<WeightStoreMsg>, JobError> {
    let (weights, _) = Actor::spawn_linked(
        None,
        WeightStore,
        WeightStoreArgs {
            keep: actors::types::weight_versions_kept(knobs.alpha),
            initial,
        },
        cell.clone(),
    )
    .await
    .map_err(JobError::spawn("weight store"))?;
    Ok(weights)
}

/// The crash-loop watch of the job's function deployments, if it has any.
fn watch(
    deployments: Vec<(String, Arc<Deployment>)>,
    faults: &Arc<Faults>,
) -> Option<tokio_util::task::AbortOnDropHandle<()>> {
    (!deployments.is_empty()).then(|| {
        tokio_util::task::AbortOnDropHandle::new(tokio::spawn(watch_crash_loops(
            deployments,
            faults.clone(),
        )))
    })
}

/// Breaks a reward function at once when its deployment crash-loops (calls would otherwise
/// wait for an instance until their deadline, each).
///
/// Only crashes during this job count: a shared deployment that crash-looped for an earlier
/// job gets fresh instances to prove itself.
async fn watch_crash_loops(deployments: Vec<(String, Arc<Deployment>)>, faults: Arc<Faults>) {
    use std::sync::atomic::Ordering;
    let base: Vec<u64> = deployments
        .iter()
        .map(|(_, d)| d.counters.crashed.load(Ordering::Relaxed))
        .collect();
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tick.tick().await;
        for ((name, d), base) in deployments.iter().zip(&base) {
            let ours = d.counters.crashed.load(Ordering::Relaxed) - base;
            if ours < u64::from(CRASH_LOOP_INSTANCES) {
                continue;
            }
            if let Some((crashes, last)) = d.crash_loop(CRASH_LOOP_INSTANCES) {
                faults.trip(Fault {
                    dependency: format!("reward function `{name}`"),
                    failures: u64::from(crashes),
                    over_s: 0.0,
                    last: format!(
                        "its last {crashes} instances died or never became ready (deployment \
                         {}); last: {last}",
                        d.cfg.name
                    ),
                });
                return;
            }
        }
    }
}

/// The sample buffer; it tells the scheduler (spawned after it, set in `scheduler`) about
/// closed and dropped groups.
async fn spawn_buffer(
    job: &JobRun,
    knobs: &Knobs,
    cell: &ActorCell,
    scheduler: Arc<OnceLock<ActorRef<SchedMsg>>>,
) -> Result<ActorRef<BufferMsg>, JobError> {
    let notify = Arc::new(move |ev| {
        if let Some(s) = scheduler.get() {
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
    .map_err(JobError::spawn("sample buffer"))?;
    Ok(buffer)
}

/// The trainer actor, publishing the versions `trainer` makes to the weight store.
async fn spawn_trainer(
    trainer: Box<dyn Trainer>,
    weights: &ActorRef<WeightStoreMsg>,
    start_version: u64,
    cell: &ActorCell,
) -> Result<ActorRef<TrainerMsg>, JobError> {
    let (trainer, _) = Actor::spawn_linked(
        None,
        TrainerActor,
        TrainerArgs {
            trainer,
            weights: weights.clone(),
            start_version,
        },
        cell.clone(),
    )
    .await
    .map_err(JobError::spawn("trainer"))?;
    Ok(trainer)
}

/// The shards evaluation episodes run on: those that generate (not prefill-only ones).
fn generating_shards(views: &[PoolView]) -> Vec<ShardHandle> {
    views
        .iter()
        .filter(|v| !v.prefill_only)
        .flat_map(|v| v.shards.iter().cloned())
        .collect()
}

/// The scheduler over the pools' and tasks' views, continuing a resumed run's admission.
async fn spawn_scheduler(
    job: &JobRun,
    knobs: &Knobs,
    seed: u64,
    pools: Vec<PoolView>,
    tasks: Vec<TaskView>,
    buffer: &ActorRef<BufferMsg>,
    cell: &ActorCell,
) -> Result<ActorRef<SchedMsg>, JobError> {
    let (scheduler, _) = Actor::spawn_linked(
        None,
        Scheduler,
        SchedArgs {
            knobs: knobs.clone(),
            pools,
            tasks,
            buffer: buffer.clone(),
            seed,
            start_version: job.start_step,
            resume: job.resume.clone(),
        },
        cell.clone(),
    )
    .await
    .map_err(JobError::spawn("scheduler"))?;
    Ok(scheduler)
}
