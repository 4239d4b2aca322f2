//! The virtual-time runner: the real scheduler and actors on a paused current-thread tokio
//! runtime, so simulated durations cost no wall time and a seed fixes the whole run.

use std::sync::Arc;

use actors::buffer::{CountingSink, TrajectorySink};
use tokio_util::sync::CancellationToken;

use crate::runtime::{self, JobError, JobRun, JobSummary, NoObserver, StepObserver};
use crate::spec::JobSpec;

/// A paused current-thread runtime (the clock jumps whenever every task is idle).
pub fn virtual_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
}

/// Runs a fully simulated job to completion in virtual time.
pub fn run_virtual(spec: JobSpec) -> Result<JobSummary, JobError> {
    run_virtual_with(
        spec,
        Arc::new(CountingSink::default()),
        Arc::new(NoObserver),
    )
}

pub fn run_virtual_with(
    spec: JobSpec,
    sink: Arc<dyn TrajectorySink>,
    observer: Arc<dyn StepObserver>,
) -> Result<JobSummary, JobError> {
    let rt = virtual_runtime().map_err(JobError::Runtime)?;
    rt.block_on(runtime::run(JobRun {
        id: "sim".into(),
        spec,
        start_step: 0,
        epoch: 0,
        resume: None,
        sink,
        observer,
        cancel: CancellationToken::new(),
        checkpoint_dir: None,
        functions: None,
        timeline: false,
        batches: None,
        shared_sim_functions: None,
        agents: None,
    }))
}

/// Runs any job to completion on the clock its spec asks for (virtual when every backend is
/// simulated), from `start_step`, keeping built-in checkpoints in `checkpoint_dir`.
pub fn run_blocking(
    spec: JobSpec,
    start_step: u64,
    epoch: u64,
    sink: Arc<dyn TrajectorySink>,
    observer: Arc<dyn StepObserver>,
    checkpoint_dir: Option<std::path::PathBuf>,
) -> Result<JobSummary, JobError> {
    let start = Start {
        step: start_step,
        epoch,
        cursor: None,
    };
    run_from(spec, start, sink, observer, checkpoint_dir)
}

/// Where a run starts: its first step, its epoch, and admission's cursor to continue from.
#[derive(Clone, Debug, Default)]
pub struct Start {
    pub step: u64,
    pub epoch: u64,
    pub cursor: Option<crate::runtime::scheduler::Cursor>,
}

/// [`run_blocking`] resuming from `start` (a restart after a crash).
pub fn run_from(
    spec: JobSpec,
    start: Start,
    sink: Arc<dyn TrajectorySink>,
    observer: Arc<dyn StepObserver>,
    checkpoint_dir: Option<std::path::PathBuf>,
) -> Result<JobSummary, JobError> {
    let Start {
        step: start_step,
        epoch,
        cursor,
    } = start;
    // Jobs on real hardware record the per-resource timeline (as the service does).
    let timeline = spec.clock() == crate::spec::Clock::Real;
    let rt = match spec.clock() {
        crate::spec::Clock::Virtual => virtual_runtime(),
        crate::spec::Clock::Real => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
    }
    .map_err(JobError::Runtime)?;
    rt.block_on(runtime::run(JobRun {
        id: "run".into(),
        spec,
        start_step,
        epoch,
        resume: cursor,
        sink,
        observer,
        cancel: CancellationToken::new(),
        checkpoint_dir,
        functions: None,
        timeline,
        batches: None,
        shared_sim_functions: None,
        agents: None,
    }))
}
