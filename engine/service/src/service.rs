//! The long-running service: accepts jobs into the store, runs up to `max_running` at once
//! (each on its own thread and runtime: a paused clock for fully simulated jobs), streams
//! their events, cancels them, and after a restart resumes every unfinished job from its last
//! completed step.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use actors::supervisor::{RestartPolicy, RestartTracker};
use tokio_util::sync::CancellationToken;

use crate::telemetry::Catalogue;
use job::spec::JobSpec;
use job::store::{JobState, Store, StoreError};

mod events;
mod observer;
mod recovery;
mod runs;

use events::EventLog;
pub use events::{EVENT_HISTORY, JobEvent, Subscription};
pub use recovery::{MAX_DEATHS_IN_A_ROW, MAX_PROCESS_DEATHS};

/// Why the service cannot do what it was asked.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("could not create the data directory {dir}")]
    DataDir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the data directory {dir} is in use by another rollarc process ({holder}); one service \
         (serve or run) per data directory: stop it or use another --data-dir"
    )]
    InUse { dir: PathBuf, holder: String },
    #[error("the service is shutting down and accepts no new jobs")]
    ShuttingDown,
    #[error("the function runtime could not be started")]
    Functions(#[source] job::hub::HubError),
    #[error("job {0} not found")]
    NotFound(String),
    #[error("job {id} has no text: {why}")]
    NoText { id: String, why: String },
    #[error("job {id} is already {state}")]
    Terminal { id: String, state: &'static str },
    #[error(
        "{field} is a fault-injection hook for the service's own tests; this service runs \
         without them (test_hooks = false)"
    )]
    TestHooksOff { field: &'static str },
    #[error(
        "the job needs an estimated {} of memory; the service's budget (max_memory) is {}",
        crate::admission::human(*estimate),
        crate::admission::human(*budget)
    )]
    OverBudget {
        estimate: u64,
        budget: u64,
        /// The estimate's parts, largest first: (spec field, what and how much).
        parts: Vec<(String, String)>,
    },
}

/// A job running on its own thread.
struct Running {
    /// Estimated peak memory (counted against the budget while it runs).
    memory: u64,
    cancel: CancellationToken,
    /// Set when the service stops: the job stays `running` in the store and resumes later.
    interrupted: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Where the service keeps its data, and how much it runs at once.
pub struct ServiceConfig {
    pub data_dir: PathBuf,
    pub max_running: usize,
    /// Memory the jobs may use together, in bytes (default: 60 % of the machine's).
    pub max_memory: Option<u64>,
    /// Accept the spec's fault-injection hooks (`sim.trainer_panic_*`): the service's own
    /// tests only. Off, a spec naming one is refused with 400.
    pub test_hooks: bool,
}

/// Takes the data directory's lock (`rollarc.lock`, an advisory lock the kernel drops with
/// the process) and records the holder in it; the holder's record when another has it.
fn lock_data_dir(dir: &std::path::Path) -> Result<std::fs::File, ServiceError> {
    use std::io::{Read, Seek, Write};
    let path = dir.join("rollarc.lock");
    let io = |source| ServiceError::DataDir {
        dir: path.clone(),
        source,
    };
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io)?;
    match f.try_lock() {
        Ok(()) => {
            let me = format!(
                "pid {}: {}",
                std::process::id(),
                std::env::args().collect::<Vec<_>>().join(" ")
            );
            f.set_len(0).map_err(io)?;
            f.rewind().map_err(io)?;
            f.write_all(me.as_bytes()).map_err(io)?;
            Ok(f)
        }
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = f.read_to_string(&mut holder);
            Err(ServiceError::InUse {
                dir: dir.to_path_buf(),
                holder: if holder.trim().is_empty() {
                    "unknown".into()
                } else {
                    holder.trim().to_string()
                },
            })
        }
        Err(std::fs::TryLockError::Error(e)) => Err(io(e)),
    }
}

/// The job manager behind the HTTP API.
pub struct Service {
    pub store: Store,
    data_dir: PathBuf,
    /// The data directory's lock (held while the service lives; `rollarc.lock`).
    _lock: Option<std::fs::File>,
    max_running: usize,
    /// Memory budget of all running jobs together (see [`crate::admission`]).
    memory_budget: u64,
    /// [`ServiceConfig::test_hooks`].
    test_hooks: bool,
    running: Mutex<BTreeMap<String, Running>>,
    /// How many jobs run now (a drain waits for 0).
    running_count: tokio::sync::watch::Sender<usize>,
    events: Mutex<BTreeMap<String, EventLog>>,
    /// Tokenizers of jobs whose trajectories were asked for as text (the newest few).
    tokenizers: Mutex<Vec<(String, Arc<crate::text::JobTokenizer>)>>,
    /// This service process's start (ms since the epoch): the first part of every event id,
    /// so an id from an earlier process is recognised as unknown.
    boot: i64,
    /// Cancelled when the service stops accepting jobs.
    pub intake: CancellationToken,
    metrics: Catalogue,
    job_restarts: Mutex<BTreeMap<String, RestartTracker>>,
    /// The function runtime and routers every job's reward functions go through.
    pub functions: Arc<job::hub::FunctionHub>,
    /// Training batches of jobs with an external trainer (the trainer API).
    pub batches: Arc<job::trainer_api::BatchDesk>,
    /// The agent gateway's open episodes (`/gateway/v1/…`).
    pub gateway: Arc<gateway::Gateway>,
    /// What jobs' agent tasks share: the gateway and the board external harnesses claim
    /// episodes from.
    pub agents: Arc<job::agents::AgentAccess>,
}

/// Restart policy of the engine supervisor for failed jobs (actor escalation or panic).
pub const JOB_RESTART_POLICY: RestartPolicy = RestartPolicy {
    intensity: 3,
    window: std::time::Duration::from_secs(600),
};

impl Service {
    /// Where the service keeps its store and the jobs' files.
    pub fn data_dir(&self) -> &std::path::Path {
        &self.data_dir
    }

    pub fn open(cfg: &ServiceConfig) -> Result<Arc<Self>, ServiceError> {
        std::fs::create_dir_all(&cfg.data_dir).map_err(|e| ServiceError::DataDir {
            dir: cfg.data_dir.clone(),
            source: e,
        })?;
        // One service per data directory: two would run each other's queued jobs and end each
        // other's processes as left behind by a crash.
        let lock = lock_data_dir(&cfg.data_dir)?;
        let store = Store::open(&cfg.data_dir.join("rollarc.db"))?;
        // Before any process starts: end the function instances and environments a crash of
        // the previous run left behind, and list the ones this run starts.
        // No sandbox ever sees the data directory (every job's spec and trajectories).
        infra::sandbox::protect(&cfg.data_dir).map_err(|source| ServiceError::DataDir {
            dir: cfg.data_dir.clone(),
            source,
        })?;
        let ledger = cfg.data_dir.join("processes");
        match infra::process::use_ledger(&ledger) {
            Ok(0) => {}
            Ok(n) => tracing::warn!(
                groups = n,
                "killed processes left behind by the previous run"
            ),
            Err(source) => {
                return Err(ServiceError::DataDir {
                    dir: ledger,
                    source,
                });
            }
        }
        Self::build(store, cfg, Some(lock))
    }

    /// The service over an open store (`cfg.data_dir` for the jobs' files).
    pub fn with_store(store: Store, cfg: &ServiceConfig) -> Result<Arc<Self>, ServiceError> {
        Self::build(store, cfg, None)
    }

    fn build(
        store: Store,
        cfg: &ServiceConfig,
        lock: Option<std::fs::File>,
    ) -> Result<Arc<Self>, ServiceError> {
        let functions = job::hub::FunctionHub::new(job::hub::default_fn_bin())
            .map_err(ServiceError::Functions)?;
        let gateway = Arc::new(gateway::Gateway::new());
        Ok(Arc::new(Self {
            batches: job::trainer_api::BatchDesk::new(store.clone()),
            agents: Arc::new(job::agents::AgentAccess::new(gateway.clone())),
            gateway,
            store,
            data_dir: cfg.data_dir.clone(),
            _lock: lock,
            max_running: cfg.max_running.max(1),
            memory_budget: cfg
                .max_memory
                .unwrap_or_else(crate::admission::default_budget),
            test_hooks: cfg.test_hooks,
            running: Mutex::new(BTreeMap::new()),
            running_count: tokio::sync::watch::Sender::new(0),
            events: Mutex::new(BTreeMap::new()),
            boot: job::store::now_ms(),
            tokenizers: Mutex::new(Vec::new()),
            intake: CancellationToken::new(),
            metrics: Catalogue::new(),
            job_restarts: Mutex::new(BTreeMap::new()),
            functions,
        }))
    }

    pub fn submit(self: &Arc<Self>, spec: JobSpec) -> Result<String, ServiceError> {
        self.submit_as(spec, None)
    }

    /// Accepts a job owned by `owner` (the submitting token's name).
    pub fn submit_as(
        self: &Arc<Self>,
        spec: JobSpec,
        owner: Option<&str>,
    ) -> Result<String, ServiceError> {
        if self.intake.is_cancelled() {
            return Err(ServiceError::ShuttingDown);
        }
        if !self.test_hooks {
            let hooks = [
                ("sim.trainer_panic_at_step", spec.sim.trainer_panic_at_step),
                ("sim.trainer_panic_runs", spec.sim.trainer_panic_runs),
            ];
            if let Some((field, _)) = hooks.iter().find(|(_, v)| v.is_some()) {
                return Err(ServiceError::TestHooksOff { field });
            }
        }
        self.admit(&spec)?;
        let steps = spec.knobs().steps;
        let id = self.store.create_job(&spec, steps, owner)?;
        self.metrics.jobs_submitted.add(1, &[]);
        self.emit_state(&id);
        self.dispatch();
        Ok(id)
    }

    /// Stages the spec's input files under the data directory (`inputs/`): see
    /// [`job::inputs`]. Blocking (copies files): call it off the async workers.
    pub fn stage_inputs(
        &self,
        spec: &mut JobSpec,
        readable: &dyn Fn(&std::path::Path) -> Option<String>,
    ) -> Vec<job::inputs::StageProblem> {
        // Never a file of the data directory (the store, the tokens' hashes), whatever the
        // policy lists; the staged copies themselves are recognised by the staging.
        let data = std::fs::canonicalize(&self.data_dir).unwrap_or_else(|_| self.data_dir.clone());
        let allowed = |p: &std::path::Path| {
            if p.starts_with(&data) {
                Some(format!(
                    "{} is inside the service's data directory",
                    p.display()
                ))
            } else {
                readable(p)
            }
        };
        job::inputs::stage_datasets(spec, &self.data_dir.join("inputs"), &allowed)
    }

    /// The job's estimated peak memory if it fits the budget on its own.
    pub fn admit(&self, spec: &JobSpec) -> Result<u64, ServiceError> {
        let e = crate::admission::estimate(spec);
        let estimate = e.total();
        if estimate > self.memory_budget {
            return Err(ServiceError::OverBudget {
                estimate,
                budget: self.memory_budget,
                parts: e.breakdown(),
            });
        }
        Ok(estimate)
    }

    pub fn memory_budget(&self) -> u64 {
        self.memory_budget
    }

    pub fn cancel(self: &Arc<Self>, id: &str) -> Result<JobState, ServiceError> {
        let job = self
            .store
            .get(id)?
            .ok_or_else(|| ServiceError::NotFound(id.to_string()))?;
        if job.state.is_terminal() {
            return Err(ServiceError::Terminal {
                id: id.into(),
                state: job.state.as_str(),
            });
        }
        let token = self
            .running
            .lock()
            .ok()
            .and_then(|r| r.get(id).map(|j| j.cancel.clone()));
        match token {
            // The job thread records the transition when the run returns.
            Some(t) => t.cancel(),
            None => {
                self.store.transition(
                    id,
                    JobState::Cancelled,
                    Some("cancelled before it started"),
                )?;
                self.emit_state(id);
            }
        }
        Ok(JobState::Cancelled)
    }

    /// The tokenizer of job `id`'s model (kept for the four jobs asked for most recently).
    pub fn tokenizer(&self, id: &str) -> Result<Arc<crate::text::JobTokenizer>, ServiceError> {
        if let Some((_, t)) = self
            .tokenizers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|(j, _)| j == id)
        {
            return Ok(t.clone());
        }
        let spec = self
            .store
            .spec(id)?
            .ok_or_else(|| ServiceError::NotFound(id.to_string()))?;
        let t = Arc::new(crate::text::JobTokenizer::for_spec(&spec).map_err(|why| {
            ServiceError::NoText {
                id: id.to_string(),
                why,
            }
        })?);
        let mut g = self.tokenizers.lock().unwrap_or_else(|p| p.into_inner());
        if g.len() >= 4 {
            g.remove(0);
        }
        g.push((id.to_string(), t.clone()));
        Ok(t)
    }

    pub fn running_ids(&self) -> Vec<String> {
        self.running
            .lock()
            .map(|r| r.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Stops intake; waits up to `grace` for running jobs; then interrupts the rest, which stay
    /// `running` in the store and resume at the next start. Returns the interrupted job ids.
    pub async fn shutdown(self: &Arc<Self>, grace: std::time::Duration) -> Vec<String> {
        let mut idle = self.running_count.subscribe();
        let force = CancellationToken::new();
        let drained = async move {
            // The sender lives in `self`, so this ends only when no job runs.
            let _ = idle.wait_for(|n| *n == 0).await;
        };
        let outcome = infra::shutdown::drain(&self.intake, &force, grace, drained).await;
        tracing::info!(?outcome, "drained the running jobs");
        let mut forced = Vec::new();
        let threads: Vec<_> = match self.running.lock() {
            Ok(mut r) => r
                .iter_mut()
                .map(|(id, j)| {
                    forced.push(id.clone());
                    j.interrupted
                        .store(true, std::sync::atomic::Ordering::SeqCst);
                    j.cancel.cancel();
                    j.thread.take()
                })
                .collect(),
            Err(_) => Vec::new(),
        };
        for t in threads.into_iter().flatten() {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
        if !forced.is_empty() {
            tracing::warn!(jobs = ?forced, "grace period over: interrupted running jobs; they resume at the next start");
        }
        // Function instances drain last (jobs may still have been scoring).
        self.functions.shutdown().await;
        forced
    }
}
