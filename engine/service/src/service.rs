//! The long-running service: accepts jobs into the store, runs up to `max_running` at once
//! (each on its own thread and runtime: a paused clock for fully simulated jobs), streams
//! their events, cancels them, and after a restart resumes every unfinished job from its last
//! completed step.

use infra::error_chain;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use actors::supervisor::{Decision, RestartPolicy, RestartTracker};
use actors::types::Batch;
use serde::Serialize;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use utoipa::ToSchema;

use crate::telemetry::Catalogue;
use job::runtime::{self, JobError, JobRun, ObserverError, StepMetrics, StepObserver};
use job::spec::{Clock, JobSpec};
use job::store::{JobSink, JobState, Store, StoreError};

/// Capacity of each job's event channel. A subscriber that falls further behind receives a
/// `lagged` event and continues from the newest events (progress is cumulative, so nothing
/// needed is lost); the store keeps every step's metrics.
const EVENT_CAPACITY: usize = 1024;

/// An event of a job's stream.
#[derive(Clone, Debug, PartialEq, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum JobEvent {
    State {
        id: String,
        state: JobState,
        step: u64,
        steps: u64,
        error: Option<String>,
    },
    Progress {
        id: String,
        step: u64,
        steps: u64,
        #[schema(value_type = Object)]
        metrics: serde_json::Value,
    },
    /// Every shard now generates with `version` (suspend → install → resume done).
    WeightsInstalled { id: String, version: u64 },
}

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

struct Running {
    /// Estimated peak memory (counted against the budget while it runs).
    memory: u64,
    cancel: CancellationToken,
    /// Set when the service stops: the job stays `running` in the store and resumes later.
    interrupted: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

pub struct ServiceConfig {
    pub data_dir: PathBuf,
    pub max_running: usize,
    /// Memory the jobs may use together, in bytes (default: 60 % of the machine's).
    pub max_memory: Option<u64>,
}

/// Attempts of one job in a row during which the service process died before a training step
/// completed, after which the job is failed at the next start instead of run again (a spec
/// that takes the process down must not keep it crash-looping; a job killed while it makes
/// progress is resumed however often that happens).
pub const MAX_PROCESS_DEATHS: u64 = 2;

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

/// Events of a running job kept for clients that reconnect (`Last-Event-ID`).
pub const EVENT_HISTORY: usize = 256;

/// A running job's event channel, its count of events and the newest of them.
struct EventLog {
    tx: broadcast::Sender<JobEvent>,
    seq: u64,
    recent: std::collections::VecDeque<(u64, JobEvent)>,
}

impl EventLog {
    fn new() -> Self {
        Self {
            tx: broadcast::channel(EVENT_CAPACITY).0,
            seq: 0,
            recent: std::collections::VecDeque::with_capacity(16),
        }
    }

    /// Whether every event after number `k` is still held.
    fn holds_after(&self, k: u64) -> bool {
        match self.recent.front() {
            Some((first, _)) => *first <= k + 1,
            None => k == self.seq,
        }
    }
}

/// A client's view of a job's events: what to send first (each with its event id), then the
/// live receiver (none for an ended job), whose events are numbered from `next` on.
pub struct Subscription {
    pub replay: Vec<(String, JobEvent)>,
    pub rx: Option<broadcast::Receiver<JobEvent>>,
    pub next: u64,
    pub boot: i64,
}

impl Subscription {
    /// The id of the live event numbered `seq`.
    pub fn event_id(&self, seq: u64) -> String {
        format!("{}-{seq}", self.boot)
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
        Ok(Arc::new(Self {
            batches: job::trainer_api::BatchDesk::new(store.clone()),
            store,
            data_dir: cfg.data_dir.clone(),
            _lock: lock,
            max_running: cfg.max_running.max(1),
            memory_budget: cfg
                .max_memory
                .unwrap_or_else(crate::admission::default_budget),
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

    /// Re-queues jobs that were running when the service last stopped, then starts jobs.
    pub fn recover(self: &Arc<Self>) -> Result<usize, ServiceError> {
        self.recover_with(&|_| Vec::new())
    }

    /// [`Self::recover`], re-checking every unfinished job against today's limits first: the
    /// memory budget and `policy` (the programs the service allows, which may have changed
    /// since the job was accepted). A job that no longer passes is failed with the reason.
    pub fn recover_with(
        self: &Arc<Self>,
        policy: &dyn Fn(&JobSpec) -> Vec<job::spec::FieldError>,
    ) -> Result<usize, ServiceError> {
        let mut n = 0;
        for j in self.store.unfinished()? {
            if let Some(spec) = self.store.spec(&j.id)? {
                let why = match self.admit(&spec) {
                    Err(e) => Some(format!("not resumed: {e}")),
                    Ok(_) => {
                        let denied = policy(&spec);
                        (!denied.is_empty()).then(|| {
                            let fields: Vec<String> = denied
                                .iter()
                                .map(|f| format!("{}: {}", f.field, f.message))
                                .collect();
                            format!(
                                "not resumed: the service policy forbids {}",
                                fields.join("; ")
                            )
                        })
                    }
                };
                if let Some(why) = why {
                    tracing::error!(job = %j.id, error = %why, "failing a recovered job");
                    self.store.transition(&j.id, JobState::Failed, Some(&why))?;
                    continue;
                }
            }
            if j.state == JobState::Running {
                let deaths = self.store.died_attempts(&j.id)?;
                if deaths >= MAX_PROCESS_DEATHS {
                    let why = format!(
                        "the service process died during {deaths} attempts to run this job in a \
                         row, none completing a training step (the limit is \
                         {MAX_PROCESS_DEATHS}); it is not run again"
                    );
                    tracing::error!(job = %j.id, deaths, "crash loop: failing the job");
                    self.store.transition(&j.id, JobState::Failed, Some(&why))?;
                    continue;
                }
                self.store.transition(
                    &j.id,
                    JobState::Queued,
                    Some("service restarted; resuming from the last completed step"),
                )?;
                n += 1;
            }
        }
        self.dispatch();
        Ok(n)
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
        self.admit(&spec)?;
        let steps = spec.knobs().steps;
        let id = self.store.create_job(&spec, steps, owner)?;
        self.metrics.jobs_submitted.add(1, &[]);
        self.emit_state(&id);
        self.dispatch();
        Ok(id)
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

    /// The job's current state event and, unless the job has ended, a receiver of its next
    /// events. Channels exist only for jobs that exist and have not ended: an unknown id is
    /// `NotFound` and creates nothing.
    pub fn subscribe(
        &self,
        id: &str,
    ) -> Result<(JobEvent, Option<broadcast::Receiver<JobEvent>>), ServiceError> {
        let sub = self.subscribe_after(id, None)?;
        let first = sub
            .replay
            .into_iter()
            .next()
            .map(|(_, e)| e)
            .ok_or_else(|| ServiceError::NotFound(id.to_string()))?;
        Ok((first, sub.rx))
    }

    /// Like [`Service::subscribe`], resuming after the event id `after` (as the events
    /// endpoint numbered it): the job's events since then are replayed when this process still
    /// holds them all (the newest [`EVENT_HISTORY`] of a running job); otherwise, and without
    /// `after`, the stream starts from the current state.
    pub fn subscribe_after(
        &self,
        id: &str,
        after: Option<&str>,
    ) -> Result<Subscription, ServiceError> {
        let mut ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        // Read the state under the lock: a transition is stored before its event is sent
        // under this lock, so one that this read misses reaches the new receiver (one it sees
        // may arrive once more, which is harmless).
        let first = self
            .state_event(id)
            .ok_or_else(|| ServiceError::NotFound(id.to_string()))?;
        let terminal = matches!(&first, JobEvent::State { state, .. } if state.is_terminal());
        let log = (!terminal).then(|| ev.entry(id.to_string()).or_insert_with(EventLog::new));
        let seq = log.as_ref().map_or(0, |l| l.seq);
        let resume = after
            .and_then(|a| a.split_once('-'))
            .filter(|(boot, _)| *boot == self.boot.to_string())
            .and_then(|(_, n)| n.parse::<u64>().ok());
        let replay = match (&log, resume) {
            (Some(l), Some(k)) if k <= l.seq && l.holds_after(k) => l
                .recent
                .iter()
                .filter(|(n, _)| *n > k)
                .map(|(n, e)| (self.event_id(*n), e.clone()))
                .collect(),
            _ => vec![(self.event_id(seq), first)],
        };
        Ok(Subscription {
            replay,
            rx: log.map(|l| l.tx.subscribe()),
            next: seq + 1,
            boot: self.boot,
        })
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

    /// The id of the newest event job `id` sent in this process (`{boot}-0` before any): a
    /// client that read the job's steps after taking it resumes the events after it and
    /// misses no step (a step is stored before its event is sent).
    pub fn last_event_id(&self, id: &str) -> String {
        let ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        self.event_id(ev.get(id).map_or(0, |l| l.seq))
    }

    fn event_id(&self, seq: u64) -> String {
        format!("{}-{seq}", self.boot)
    }

    /// Sends to the job's subscribers and keeps the event in the job's recent history; after a
    /// terminal state the channel and history are dropped (subscribers still receive what was
    /// sent, then the end of the stream).
    fn send(&self, id: &str, e: JobEvent) {
        let mut ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let terminal = matches!(&e, JobEvent::State { state, .. } if state.is_terminal());
        let log = ev.entry(id.to_string()).or_insert_with(EventLog::new);
        log.seq += 1;
        if log.recent.len() == EVENT_HISTORY {
            log.recent.pop_front();
        }
        log.recent.push_back((log.seq, e.clone()));
        let _ = log.tx.send(e);
        if terminal {
            ev.remove(id);
        }
    }

    /// Event channels held now (one per job that has sent or been asked for events and has
    /// not ended).
    pub fn event_channels(&self) -> usize {
        self.events.lock().map(|e| e.len()).unwrap_or(0)
    }

    pub fn state_event(&self, id: &str) -> Option<JobEvent> {
        let j = self.store.get(id).ok()??;
        Some(JobEvent::State {
            id: j.id,
            state: j.state,
            step: j.step,
            steps: j.steps,
            error: j.error,
        })
    }

    fn emit_state(&self, id: &str) {
        if let Some(e) = self.state_event(id) {
            self.send(id, e);
        }
    }

    pub fn running_ids(&self) -> Vec<String> {
        self.running
            .lock()
            .map(|r| r.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Starts queued jobs while there is room.
    pub fn dispatch(self: &Arc<Self>) {
        if self.intake.is_cancelled() {
            return;
        }
        let Ok(unfinished) = self.store.unfinished() else {
            return;
        };
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        for j in unfinished
            .into_iter()
            .filter(|j| j.state == JobState::Queued)
        {
            if running.len() >= self.max_running {
                break;
            }
            if running.contains_key(&j.id) {
                continue;
            }
            let Ok(Some(spec)) = self.store.spec(&j.id) else {
                continue;
            };
            // Jobs start in order while the running ones leave room in the memory budget; a
            // job that does not fit waits (it fits alone: admission checked that).
            let memory = crate::admission::estimate(&spec).total();
            let in_use: u64 = running.values().map(|r| r.memory).sum();
            if !running.is_empty() && in_use.saturating_add(memory) > self.memory_budget {
                break;
            }
            let epoch = self.store.resume_epoch(&j.id).unwrap_or(0);
            if self
                .store
                .transition(&j.id, JobState::Running, None)
                .unwrap_or(false)
            {
                let cancel = CancellationToken::new();
                let interrupted = Arc::new(std::sync::atomic::AtomicBool::new(false));
                let me = self.clone();
                let (id, c2, i2) = (j.id.clone(), cancel.clone(), interrupted.clone());
                let start_step = j.step;
                let thread = std::thread::Builder::new()
                    .name(format!("job-{}", j.id))
                    .spawn(move || me.run_job(id, spec, start_step, epoch, c2, i2))
                    .ok();
                running.insert(
                    j.id.clone(),
                    Running {
                        memory,
                        cancel,
                        interrupted,
                        thread,
                    },
                );
                self.running_count.send_replace(running.len());
                drop(running);
                self.emit_state(&j.id);
                running = self.running.lock().unwrap_or_else(|p| p.into_inner());
            }
        }
    }

    fn run_job(
        self: Arc<Self>,
        id: String,
        spec: JobSpec,
        start_step: u64,
        epoch: u64,
        cancel: CancellationToken,
        interrupted: Arc<std::sync::atomic::AtomicBool>,
    ) {
        // Recorded before anything of the job runs: an attempt that never ends is one during
        // which the process died (see `recover`).
        let attempt = self
            .store
            .start_attempt(&id, start_step)
            .map_err(|e| tracing::error!(job = %id, error = %error_chain(&e), "could not record the attempt"))
            .ok();
        // Per-resource timelines for jobs on real hardware (a simulated cluster has thousands
        // of resources; its report is the simulation summary).
        let timeline = spec.clock() == Clock::Real;
        let rt = match spec.clock() {
            Clock::Virtual => job::simrun::virtual_runtime(),
            Clock::Real => tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build(),
        };
        let result = match rt {
            Ok(rt) => {
                let observer = Arc::new(ServiceObserver {
                    service: self.clone(),
                    id: id.clone(),
                    steps: spec.knobs().steps,
                    external: matches!(spec.trainer, job::spec::TrainerSpec::External(_)),
                    tensorboard: std::sync::Mutex::new(None),
                });
                let sink = Arc::new(JobSink {
                    store: self.store.clone(),
                    job: id.clone(),
                });
                let checkpoint_dir = Some(self.data_dir.join("checkpoints").join(&id));
                // Also before any step completed: an attempt may have stored rows.
                let resume = self.resume_cursor(&id, start_step);
                let run = JobRun {
                    id: id.clone(),
                    spec,
                    start_step,
                    resume,
                    epoch,
                    sink,
                    observer,
                    cancel: cancel.clone(),
                    checkpoint_dir,
                    functions: Some(self.functions.clone()),
                    timeline,
                    batches: Some(self.batches.clone()),
                    shared_sim_functions: None,
                };
                // A panic anywhere in the job's runtime fails (or restarts) this job only.
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    rt.block_on(runtime::run(run))
                }))
                .unwrap_or_else(|p| {
                    let msg = p
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| p.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "unknown panic".into());
                    Err(JobError::Panicked(msg))
                })
            }
            Err(e) => Err(JobError::Runtime(e)),
        };
        let outcome = match &result {
            _ if interrupted.load(std::sync::atomic::Ordering::SeqCst) => None,
            Ok(_) => Some((JobState::Succeeded, None)),
            Err(JobError::Cancelled) => Some((JobState::Cancelled, Some("cancelled".to_string()))),
            Err(e @ (JobError::Escalated(_) | JobError::Panicked(_) | JobError::Call { .. })) => {
                // An actor of the job died or the runtime panicked. The engine supervisor's
                // policy: restart the job from its last completed step,
                // at most JOB_RESTART_POLICY.intensity times within its window, then fail it.
                let decision = self.job_restarts.lock().map(|mut m| {
                    m.entry(id.clone())
                        .or_insert_with(|| RestartTracker::new(JOB_RESTART_POLICY))
                        .on_failure(tokio::time::Instant::now())
                });
                if decision.ok() == Some(Decision::Restart) {
                    self.metrics.job_restarts.add(1, &[]);
                    Some((
                        JobState::Queued,
                        Some(format!("restarting after failure: {}", error_chain(e))),
                    ))
                } else {
                    Some((JobState::Failed, Some(error_chain(e))))
                }
            }
            Err(e) => Some((JobState::Failed, Some(error_chain(e)))),
        };
        if let Some(a) = attempt {
            let ended = outcome.as_ref().map_or("interrupted", |o| o.0.as_str());
            if let Err(e) = self.store.end_attempt(a, ended) {
                tracing::error!(job = %id, error = %error_chain(&e), "could not record the attempt's end");
            }
        }
        if let Some((state, reason)) = outcome {
            // Its series leave `/metrics` before anyone can see it ended.
            self.metrics.job_ended(&id);
            if let Err(e) = self.store.transition(&id, state, reason.as_deref()) {
                tracing::error!(job = %id, error = %e, "could not record the job's final state");
            }
            tracing::info!(job = %id, state = state.as_str(), "job finished");
            self.emit_state(&id);
        }
        if let Ok(mut r) = self.running.lock() {
            r.remove(&id);
            self.running_count.send_replace(r.len());
        }
        self.dispatch();
    }

    /// Where a resumed job's admission continues: the cursor stored with its last completed
    /// step (its seeds go on from there: nothing trained is generated again), with group ids
    /// above every group stored by any attempt (rows of an interrupted attempt keep theirs).
    /// Without a stored cursor (older metrics), only the group-id floor is kept (the
    /// scheduler starts its sequences afresh but never reuses a stored group id).
    fn resume_cursor(&self, id: &str, start_step: u64) -> Option<runtime::scheduler::Cursor> {
        let stored = (start_step > 0)
            .then(|| self.store.step_metrics(id))
            .transpose()
            .map_err(|e| tracing::warn!(job = %id, error = %error_chain(&e), "no step metrics to resume from"))
            .ok()
            .flatten()
            .and_then(|steps| {
                let last = steps
                    .iter()
                    .rfind(|m| m["step"].as_u64() == Some(start_step - 1))?;
                serde_json::from_value::<runtime::scheduler::Cursor>(
                    last["scheduler"]["cursor"].clone(),
                )
                .ok()
            });
        let floor = self.store.max_group_id(id).ok().flatten().map(|g| g + 1);
        match (stored, floor) {
            (Some(mut c), f) => {
                c.next_group = c.next_group.max(f.unwrap_or(0));
                Some(c)
            }
            (None, Some(f)) => Some(runtime::scheduler::Cursor {
                next_group: f,
                ..Default::default()
            }),
            (None, None) => None,
        }
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

struct ServiceObserver {
    service: Arc<Service>,
    id: String,
    steps: u64,
    /// An external trainer's acknowledgement marks the rows it trained on (the stored
    /// batch, which after a restart is not the one the job assembled again).
    external: bool,
    /// The job's TensorBoard events file (`DATA_DIR/tensorboard/JOB/`), opened at its first
    /// step; a resumed attempt starts a file of its own beside it.
    tensorboard: std::sync::Mutex<Option<crate::tensorboard::EventWriter>>,
}

impl ServiceObserver {
    /// Appends the step's scalars to the job's TensorBoard events (a failure is logged, never
    /// the job's).
    fn tensorboard(&self, m: &StepMetrics) {
        // A record's timestamp: the store's wall clock.
        let now = job::store::now_ms() as f64 / 1e3;
        let Ok(mut w) = self.tensorboard.lock() else {
            return;
        };
        if w.is_none() {
            let dir = self.service.data_dir.join("tensorboard").join(&self.id);
            match crate::tensorboard::EventWriter::create(&dir, now) {
                Ok(x) => *w = Some(x),
                Err(e) => {
                    tracing::warn!(job = %self.id, dir = %dir.display(), error = %e, "no TensorBoard events");
                    return;
                }
            }
        }
        if let Some(x) = w.as_mut() {
            for (step, values) in crate::tensorboard::step_events(m) {
                if let Err(e) = x.scalars(step, now, &values) {
                    tracing::warn!(job = %self.id, error = %e, "TensorBoard events not written");
                }
            }
        }
    }
}

impl StepObserver for ServiceObserver {
    fn on_weights_installed(&self, version: u64) {
        self.service.send(
            &self.id,
            JobEvent::WeightsInstalled {
                id: self.id.clone(),
                version,
            },
        );
    }

    fn on_step(&self, m: &StepMetrics, batch: &Batch) -> Result<(), ObserverError> {
        let metrics = serde_json::to_value(m)?;
        let trained: Vec<&str> = if self.external {
            Vec::new()
        } else {
            batch.trajectories().map(|t| t.id.as_str()).collect()
        };
        self.service
            .store
            .complete_step(&self.id, m.step + 1, &metrics, &trained)?;
        self.service.metrics.record_step(&self.id, m, batch);
        self.tensorboard(m);
        // The event stays small: the per-resource timeline (most of a step's record) is
        // served by `GET /v1/jobs/{id}/steps`.
        let mut metrics = metrics;
        if let Some(o) = metrics.as_object_mut() {
            o.remove("timeline");
        }
        self.service.send(
            &self.id,
            JobEvent::Progress {
                id: self.id.clone(),
                step: m.step + 1,
                steps: self.steps,
                metrics,
            },
        );
        Ok(())
    }
}
