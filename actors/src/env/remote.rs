//! Environments hosted by env workers (`rollarc env-worker`) on other machines, reached over
//! HTTP/2 (one multiplexed connection per worker). A job's env pool ([`WorkerPool`]) knows
//! its workers' slots, load, health and drain state from a probe every second; each task
//! registers its environment spec on the workers it uses ([`RemoteTask`]); an episode
//! ([`RemoteEnv`]) is placed at `reset` on the least-loaded worker with a free slot and stays
//! there until it ends.
//!
//! Failure semantics:
//! - A `reset` that a worker refuses (draining, full) or cannot take (unreachable) goes to
//!   the next worker; only when none takes it does the reset fail, naming the pool and what
//!   each worker said.
//! - A step on a worker that is gone (killed, unreachable, restarted without the episode)
//!   fails the episode ([`EnvError::Worker`]): an environment failure, masked or retried
//!   like any other. The worker gets no new episodes until a probe finds it healthy.
//! - A call past the call timeout (plus [`NETWORK_MARGIN`]) is a timeout.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::protocol::{PROTOCOL_V3, Request};
use super::{EnvError, Environment, Observation, Record, StepOutcome};

mod agent;
mod pool;
pub use crate::discovery::{KubeTarget, Membership, RESOLVE_TIMEOUT};
pub use agent::AgentRunReport;
use pool::{CallError, Worker, lock};
pub use pool::{START_HEADER, WorkerPool, WorkerPoolConfig, WorkerState};

/// Time a call may take on top of the environment's own call timeout (the worker enforces
/// that one): the network and the worker's queue.
pub const NETWORK_MARGIN: Duration = Duration::from_secs(5);
/// How often the pool asks each worker for its slots, load and drain state.
pub const PROBE_EVERY: Duration = Duration::from_secs(1);

/// One task's environments on a pool: its spec, registered on each worker before its first
/// episode there, and unregistered when the task ends.
pub struct RemoteTask {
    pool: Arc<WorkerPool>,
    key: String,
    /// What the worker builds the task's environments from: `{"env": …, "call_timeout_s": …,
    /// "slots": …}`.
    registration: serde_json::Value,
    call_timeout: Duration,
    registered: Mutex<HashSet<String>>,
}

impl RemoteTask {
    /// A task with the unique `key` whose environment `registration` describes.
    pub fn new(
        pool: Arc<WorkerPool>,
        key: String,
        registration: serde_json::Value,
        call_timeout: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            pool,
            key,
            registration,
            call_timeout,
            registered: Mutex::new(HashSet::new()),
        })
    }

    /// Environment number `index` of the task.
    pub fn env(self: &Arc<Self>, index: u64) -> RemoteEnv {
        RemoteEnv {
            task: Arc::clone(self),
            name: index,
            resets: 0,
            current: None,
            last_start: None,
        }
    }

    async fn register(&self, w: &Worker) -> Result<(), CallError> {
        if lock(&self.registered).contains(&w.url) {
            return Ok(());
        }
        let r = self
            .pool
            .request(
                reqwest::Method::PUT,
                format!("{}/v1/tasks/{}", w.url, self.key),
            )
            .json(&self.registration)
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .map_err(|e| CallError::Unreachable(infra::error_chain(&e)))?;
        let status = r.status();
        if !status.is_success() {
            let body: serde_json::Value = r.json().await.unwrap_or_default();
            let msg = body["error"].as_str().unwrap_or("").to_string();
            return Err(if status.as_u16() == 503 {
                CallError::Refused(msg)
            } else {
                CallError::Other(format!("refused the task ({status}): {msg}"))
            });
        }
        lock(&self.registered).insert(w.url.clone());
        Ok(())
    }
    /// Registers the task on `w` if needed, then `send`s; a worker that restarted and lost
    /// the task gets it again, once.
    async fn on_worker<T, F, Fut>(&self, w: &Arc<Worker>, send: &F) -> Result<T, CallError>
    where
        F: Fn(Arc<Worker>) -> Fut,
        Fut: std::future::Future<Output = Result<T, CallError>>,
    {
        for attempt in 0..2 {
            self.register(w).await?;
            match send(Arc::clone(w)).await {
                Err(CallError::UnknownTask) if attempt == 0 => {
                    lock(&self.registered).remove(&w.url);
                }
                r => return r,
            }
        }
        Err(CallError::UnknownTask)
    }

    /// Places an episode: `send` opens it on the least-loaded worker that takes episodes; one
    /// that refuses (draining, full) or cannot be reached is skipped for the next. While
    /// some worker is up (full or draining: slots will open) or a new member awaits its
    /// first probe, it waits for a free slot, at most the call timeout; with every worker
    /// down it fails now. The slot stays reserved on the worker that took the episode (the
    /// caller gives it back with `closed_on`).
    async fn placed<T, F, Fut>(&self, send: F) -> Result<(T, Arc<Worker>), Unplaced>
    where
        F: Fn(Arc<Worker>) -> Fut,
        Fut: std::future::Future<Output = Result<T, CallError>>,
    {
        let pool = &self.pool;
        let deadline = tokio::time::Instant::now() + self.call_timeout;
        loop {
            let changed = pool.changed.notified();
            let mut said = Vec::new();
            while let Some(w) = pool.reserve() {
                let placed = self.on_worker(&w, &send).await;
                if !matches!(placed, Ok(_) | Err(CallError::Timeout)) {
                    let mut st = lock(&w.st);
                    st.mine = st.mine.saturating_sub(1);
                }
                match placed {
                    Ok(v) => return Ok((v, w)),
                    Err(CallError::Refused(why)) => {
                        // Draining or full: the next probe says which; skip it until then.
                        lock(&w.st).refused = true;
                        said.push(format!("{}: refused ({why})", w.url));
                    }
                    Err(CallError::Unreachable(why)) => {
                        pool.mark_down(&w, &why);
                        said.push(format!("{}: unreachable ({why})", w.url));
                    }
                    Err(CallError::Timeout) => return Err(Unplaced::TimedOut(w)),
                    Err(e) => return Err(Unplaced::Failed(self.lost(&w, e, self.call_timeout))),
                }
            }
            let now = tokio::time::Instant::now();
            if !pool.any_hope() || now >= deadline {
                let mut why = pool.describe();
                if !said.is_empty() {
                    why = format!("{} (then: {why})", said.join("; "));
                }
                return Err(Unplaced::Failed(EnvError::Worker(format!(
                    "env pool {}: no worker took the episode: {why}",
                    pool.name
                ))));
            }
            let _ = tokio::time::timeout(PROBE_EVERY.min(deadline - now), changed).await;
        }
    }

    /// The error of a call to `w` that failed mid-episode (`timeout`: the call's limit).
    fn lost(&self, w: &Worker, e: CallError, timeout: Duration) -> EnvError {
        match e {
            CallError::Timeout => EnvError::Timeout(timeout),
            CallError::Unreachable(why) => {
                self.pool.mark_down(w, &why);
                EnvError::Worker(format!(
                    "env pool {}: worker {} lost the episode: {why}",
                    self.pool.name, w.url
                ))
            }
            e => EnvError::Worker(format!(
                "env pool {}: worker {}: {e}",
                self.pool.name, w.url
            )),
        }
    }
}

/// Why an episode was not placed.
enum Unplaced {
    Failed(EnvError),
    /// `w` did not answer in time: it may hold the episode.
    TimedOut(Arc<Worker>),
}

impl Drop for RemoteTask {
    fn drop(&mut self) {
        let urls: Vec<String> = lock(&self.registered).drain().collect();
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        for u in urls {
            let req = self
                .pool
                .request(
                    reqwest::Method::DELETE,
                    format!("{u}/v1/tasks/{}", self.key),
                )
                .timeout(Duration::from_secs(5));
            handle.spawn(async move {
                let _ = req.send().await;
            });
        }
    }
}

/// One environment of a task, whose episodes run on the pool's workers.
pub struct RemoteEnv {
    task: Arc<RemoteTask>,
    name: u64,
    resets: u64,
    /// The episode in progress and the worker holding it.
    current: Option<(String, Arc<Worker>)>,
    /// How the last reset found its sandbox, as its worker said.
    last_start: Option<super::starts::Start>,
}

static ENV_IDS: AtomicU64 = AtomicU64::new(0);

impl RemoteEnv {
    fn timeout(&self) -> Duration {
        self.task.call_timeout + NETWORK_MARGIN
    }

    /// Ends the episode in progress on its worker, without waiting.
    fn close_in_background(&mut self) {
        let Some((episode, w)) = self.current.take() else {
            return;
        };
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let task = Arc::clone(&self.task);
        handle.spawn(async move {
            let req = Request::Close {
                v: PROTOCOL_V3,
                episode: Some(episode),
            };
            let _ = task
                .pool
                .call(&w, &task.key, &req, Duration::from_secs(5))
                .await;
            task.pool.closed_on(&w);
        });
    }
}

impl Drop for RemoteEnv {
    fn drop(&mut self) {
        self.close_in_background();
    }
}

impl Environment for RemoteEnv {
    async fn reset(&mut self, seed: u64) -> Result<Observation, EnvError> {
        self.reset_with(seed, None).await
    }

    async fn reset_with(
        &mut self,
        seed: u64,
        record: Option<Record>,
    ) -> Result<Observation, EnvError> {
        self.close_in_background();
        let pool = Arc::clone(&self.task.pool);
        pool.started().await;
        self.resets += 1;
        // Unique across the tasks and jobs a worker serves: the task key is in the URL, the
        // process-wide counter keeps ids unique within it.
        let episode = format!(
            "{}.{}.{}",
            self.name,
            self.resets,
            ENV_IDS.fetch_add(1, Ordering::Relaxed)
        );
        let req = Request::Reset {
            v: PROTOCOL_V3,
            episode: Some(episode.clone()),
            seed,
            record: record.map(|r| (*r).clone()),
        };
        let timeout = self.timeout();
        let placed = self
            .task
            .placed(|w| {
                let (pool, key, req) = (&pool, &self.task.key, &req);
                async move { pool.call_start(&w, key, req, timeout).await }
            })
            .await;
        match placed {
            Ok(((resp, start), w)) => {
                self.current = Some((episode, w));
                self.last_start = start;
                let r = super::external::reported(resp)?;
                Ok(super::external::reset_observation(r))
            }
            Err(Unplaced::TimedOut(w)) => {
                // It may have opened the episode: close it there later.
                self.current = Some((episode, w));
                Err(EnvError::Timeout(timeout))
            }
            Err(Unplaced::Failed(e)) => Err(e),
        }
    }

    async fn step(
        &mut self,
        action: &str,
        _tokens: &crate::tokens::Tokens,
    ) -> Result<StepOutcome, EnvError> {
        let Some((episode, w)) = self.current.clone() else {
            return Err(EnvError::NotReset);
        };
        let req = Request::Step {
            v: PROTOCOL_V3,
            episode: Some(episode),
            action: action.to_string(),
        };
        let r = match self
            .task
            .pool
            .call(&w, &self.task.key, &req, self.timeout())
            .await
        {
            Ok(r) => super::external::reported(r)?,
            Err(e) => return Err(self.task.lost(&w, e, self.timeout())),
        };
        super::external::step_outcome(&r)
    }

    async fn release(&mut self) {
        self.close_in_background();
    }

    async fn close(&mut self) {
        self.close_in_background();
    }

    fn last_start(&self) -> Option<super::starts::Start> {
        self.last_start
    }
}
