//! One job's runtime: the plan of the spec ([`crate::wiring`]) is spawned as a supervision
//! tree (weight store, shard pools, environment pools, sample buffer, trainer, scheduler under
//! a job supervisor) and driven one training step at a time by the weight-update protocol.
//!
//! Files by role: `spawn` builds the actors, `driver` runs the steps, `protocol` is the
//! suspend → install → resume exchange with the shards, `metrics` records each step,
//! `scheduler` admits groups and owns the episodes (`episode`, `barrier`), `supervisor` counts
//! and escalates actor failures.

mod driver;
mod error;
pub mod eval;
mod metrics;
mod protocol;
pub mod scheduler;
mod spawn;
pub mod supervisor;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use actors::buffer::TrajectorySink;
use ractor::ActorRef;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::hub::FunctionHub;
use crate::spec::{Barrier, JobSpec};
use crate::wiring::JobPlan;
use actors::episode::EpisodeShared;
use scheduler::SchedMsg;
use supervisor::SupervisorReport;

pub use error::{JobError, ObserverError};
pub use metrics::{
    CriticalPath, NoObserver, PoolMetrics, RolloutMetrics, StageSeconds, StepMetrics, StepObserver,
    TaskMetrics,
};

/// How long control calls to the job's actors may take (virtual or wall time).
const CONTROL_TIMEOUT: Duration = Duration::from_secs(3600);

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
    /// Simulated function deployments (scaled or on GPUs): calls, instances, instance- and
    /// GPU-seconds held and busy, up to the job's end (a deployment shared with other jobs:
    /// all of theirs too).
    pub functions: BTreeMap<String, actors::reward::FunctionUsage>,
}

/// Inputs of one run of a job.
pub struct JobRun {
    pub id: String,
    pub spec: JobSpec,
    /// First step to run (steps already completed before a restart are skipped).
    pub start_step: u64,
    /// Distinguishes trajectory ids of runs resumed after a restart.
    pub epoch: u64,
    /// Where admission continues after a restart (group ids, seeds); none: from the start.
    pub resume: Option<scheduler::Cursor>,
    pub sink: Arc<dyn TrajectorySink>,
    pub observer: Arc<dyn StepObserver>,
    pub cancel: CancellationToken,
    /// Where the built-in trainer keeps its checkpoints (none: not kept).
    pub checkpoint_dir: Option<std::path::PathBuf>,
    /// The service's function hub (runtime + routers); none: the job starts its own when it
    /// names functions that run as processes, and stops it at the end.
    pub functions: Option<Arc<FunctionHub>>,
    /// Record the per-resource utilisation timeline in the step metrics.
    pub timeline: bool,
    /// The service's batch desk (jobs with an external trainer need one).
    pub batches: Option<Arc<crate::trainer_api::BatchDesk>>,
    /// Simulated function deployments shared with other jobs of the same virtual runtime;
    /// none: the job has its own.
    pub shared_sim_functions: Option<Arc<SharedSimFunctions>>,
    /// The service's gateway and claim board for agent tasks; none: a job with agent tasks
    /// opens its episodes on a gateway of its own (managed agents only).
    pub agents: Option<Arc<crate::agents::AgentAccess>>,
}

/// Simulated function deployments (those with `scaling` or `gpu`) shared by the jobs of one
/// virtual runtime, by function name: the first job to name one deploys it, later jobs call
/// the same instances and autoscaler.
#[derive(Default)]
pub struct SharedSimFunctions(std::sync::Mutex<BTreeMap<String, Arc<actors::reward::SimFunction>>>);

impl SharedSimFunctions {
    /// The deployment named `name`, made by `make` if no job has made it yet.
    pub fn get_or_deploy(
        &self,
        name: &str,
        make: impl FnOnce() -> Arc<actors::reward::SimFunction>,
    ) -> Arc<actors::reward::SimFunction> {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(name.to_string()).or_insert_with(make).clone()
    }

    /// What every shared deployment used up to now.
    pub fn usage(&self) -> BTreeMap<String, actors::reward::FunctionUsage> {
        let m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.iter().map(|(k, f)| (k.clone(), f.usage())).collect()
    }
}

/// Runs the job to its last step, or until cancelled or failed.
pub async fn run(job: JobRun) -> Result<JobSummary, JobError> {
    let inputs = crate::resolve::resolve(&job.spec, &crate::resolve::Host::process())?;
    let plan = crate::wiring::plan(&job.spec, &inputs)?;
    let started = tokio::time::Instant::now();
    let needs_hub = plan.functions.iter().any(|(_, f)| f.needs_hub());
    let (hub, own_hub) = match (&job.functions, needs_hub) {
        (Some(h), _) => (Some(h.clone()), false),
        (None, true) => {
            let h = FunctionHub::new(crate::hub::default_fn_bin()).map_err(JobError::Functions)?;
            (Some(h), true)
        }
        (None, false) => (None, false),
    };
    let prefix = format!("{}/r{}", job.id, job.epoch);
    let (sup, report) = supervisor::spawn(&prefix)
        .await
        .map_err(JobError::spawn("job supervisor"))?;
    let span = tracing::info_span!(
        "job",
        job = %job.id,
        name = job.spec.name.as_deref().unwrap_or(""),
        epoch = job.epoch,
    );
    let result = tracing::Instrument::instrument(
        run_plan(&job, plan, started, &sup, &report, hub.as_ref()),
        span,
    )
    .await;
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

async fn run_plan(
    job: &JobRun,
    plan: JobPlan,
    started: tokio::time::Instant,
    sup: &ActorRef<supervisor::SupMsg>,
    report: &Arc<SupervisorReport>,
    hub: Option<&Arc<FunctionHub>>,
) -> Result<JobSummary, JobError> {
    let knobs = plan.knobs.clone();
    let mut a = spawn::spawn(job, plan, &sup.get_cell(), hub).await?;
    report.set_critical(&[
        a.scheduler.get_id(),
        a.buffer.get_id(),
        a.trainer.get_id(),
        a.weights.get_id(),
    ]);
    // The first step's trace span, before any episode starts.
    a.trace_parent
        .set(driver::step_span(job.start_step + 1, job.start_step));
    let shared = Arc::new(EpisodeShared {
        buffer: a.buffer.clone(),
        trace_parent: a.trace_parent.clone(),
        tasks: std::mem::take(&mut a.tasks),
        epoch: job.epoch,
        started,
        batch_barrier: knobs.barrier == Barrier::Batch,
        framing: a.framing.clone(),
    });
    a.scheduler
        .cast(SchedMsg::Start(shared))
        .map_err(|_| JobError::Call {
            what: "scheduler",
            source: actors::call::CallError::Stopped,
        })?;
    // The crash watcher ends with `a` (aborted on drop), whichever way this returns.
    driver::drive(job, &knobs, &a, report, hub, started).await
}
