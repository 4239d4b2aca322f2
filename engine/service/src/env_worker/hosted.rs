//! The worker's state: its tasks, their open episodes and spare environments, slots and
//! drain; what each API call does to it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actors::env::protocol::{self, PROTOCOL_V3, Request};
use actors::env::{DynEnvironment, EnvFactory};
use axum::Json;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use tokio::time::Instant;

use super::{DEFAULT_IDLE_S, MAX_TASKS, WorkerConfig};

mod agents;
pub(super) use agents::AgentRun;

/// The worker's state, shared by its handlers.
pub struct Worker {
    cfg: WorkerConfig,
    token_digest: Option<String>,
    draining: AtomicBool,
    open: AtomicUsize,
    calls: AtomicU64,
    tasks: Mutex<HashMap<String, Arc<HostedTask>>>,
    /// The worker's own cap on programs starting at once, over all its tasks.
    caps: actors::env::starts::StartCaps,
    /// Its resets' starts, warm and cold.
    starts: actors::env::starts::StartLog,
    /// Managed agent episodes: running now, run since start, gateway calls forwarded.
    agents_running: AtomicUsize,
    agent_runs: AtomicU64,
    forwarded: Arc<AtomicU64>,
    /// The client of the agents' gateway forwarders.
    gateway_client: reqwest::Client,
}

/// What a task hosts: environments served over the protocol, or a managed agent's program
/// run once per episode.
enum Hosting {
    Envs(EnvFactory),
    Agent(Arc<job::agents::managed::AgentProgram>),
}

/// A task registered on the worker: its environments' factory and open episodes.
struct HostedTask {
    spec: serde_json::Value,
    hosting: Hosting,
    /// Agent episodes running now (a task with one is not idle).
    running: AtomicUsize,
    /// Cancelled when the task is unregistered: its running agent programs are stopped.
    stop: tokio_util::sync::CancellationToken,
    idle: Duration,
    next_index: AtomicU64,
    episodes: Mutex<HashMap<String, Arc<Episode>>>,
    /// Environments of ended episodes, kept for the next ones.
    spare: Mutex<Vec<Box<dyn DynEnvironment>>>,
    last_call: Mutex<Instant>,
}

struct Episode {
    /// `None` once closed.
    env: tokio::sync::Mutex<Option<Box<dyn DynEnvironment>>>,
    last_call: Mutex<Instant>,
    /// A call failed: the environment is not reused.
    failed: AtomicBool,
}

impl HostedTask {
    /// Ends an episode: its environment is kept for the next episode of the task (an
    /// external program stays running, as in a local pool) unless a call failed or
    /// `keep` spares are already kept, then it is closed.
    async fn retire(&self, ep: &Episode, keep: usize) {
        let Some(mut env) = ep.env.lock().await.take() else {
            return;
        };
        if !ep.failed.load(Ordering::Relaxed) {
            let mut spare = lock(&self.spare);
            if spare.len() < keep {
                spare.push(env);
                return;
            }
        }
        env.close_boxed().await;
    }

    /// An environment for a new episode: a spare one, or a new one (`None`: an agent task).
    fn env(&self) -> Option<Box<dyn DynEnvironment>> {
        let Hosting::Envs(factory) = &self.hosting else {
            return None;
        };
        let spare = lock(&self.spare).pop();
        Some(spare.unwrap_or_else(|| factory(self.next_index.fetch_add(1, Ordering::Relaxed))))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A task's registration body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Registration {
    pub env: job::spec::EnvSpec,
    pub call_timeout_s: f64,
    /// The task's environment slots on the service (what its multiplexed programs share).
    #[serde(default)]
    pub slots: Option<usize>,
    #[serde(default)]
    pub episode_idle_s: Option<f64>,
    /// The task's programs starting at once on this worker (default: the worker's cap only).
    #[serde(default)]
    pub max_concurrent_starts: Option<usize>,
    /// Programs kept started ahead for the task (default: the worker's `--warm`).
    #[serde(default)]
    pub warm: Option<usize>,
}

pub(super) fn error(status: StatusCode, code: &str, msg: impl Into<String>) -> Response {
    (status, Json(json!({ "error": msg.into(), "code": code }))).into_response()
}

/// Why a request is refused: its status, a machine-readable code and the message.
type Refusal = (StatusCode, &'static str, String);

/// Checks a registration's key, environment and limits; its episodes' idle limit.
fn check_registration(key: &str, reg: &Registration) -> Result<Duration, Refusal> {
    let bad = |code, msg: String| Err((StatusCode::BAD_REQUEST, code, msg));
    if key.is_empty()
        || key.len() > 128
        || !key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return bad(
            "bad_key",
            format!("task key {key:?}: 1 to 128 letters, digits, - _ ."),
        );
    }
    if !job::spec::remote_capable(&reg.env) {
        return bad(
            "bad_env",
            format!(
                "env.kind: {} environments run on the service, not on a worker",
                reg.env.kind_name()
            ),
        );
    }
    let in_range = |v: f64| v.is_finite() && v > 0.0 && v <= job::spec::MAX_SECONDS;
    if !in_range(reg.call_timeout_s) {
        return bad(
            "bad_timeout",
            format!(
                "call_timeout_s must be in (0, {}], got {}",
                job::spec::MAX_SECONDS,
                reg.call_timeout_s
            ),
        );
    }
    let idle_s = reg.episode_idle_s.unwrap_or(DEFAULT_IDLE_S);
    if !in_range(idle_s) {
        return bad(
            "bad_idle",
            format!(
                "episode_idle_s must be in (0, {}], got {idle_s}",
                job::spec::MAX_SECONDS
            ),
        );
    }
    if reg.max_concurrent_starts == Some(0) {
        return bad(
            "bad_starts",
            "max_concurrent_starts must be at least 1 (leave it out for no cap)".into(),
        );
    }
    if let Some(w) = reg.warm
        && w > job::spec::MAX_WARM as usize
    {
        return bad(
            "bad_warm",
            format!(
                "warm: at most {} programs per task, got {w}",
                job::spec::MAX_WARM
            ),
        );
    }
    Ok(Duration::from_secs_f64(idle_s))
}

impl Worker {
    pub fn new(cfg: WorkerConfig) -> Arc<Self> {
        Arc::new(Self {
            token_digest: cfg.token.as_deref().map(crate::access::hash_token),
            draining: AtomicBool::new(false),
            open: AtomicUsize::new(0),
            calls: AtomicU64::new(0),
            tasks: Mutex::new(HashMap::new()),
            caps: actors::env::starts::StartCaps::new(cfg.max_concurrent_starts),
            starts: Default::default(),
            agents_running: AtomicUsize::new(0),
            agent_runs: AtomicU64::new(0),
            forwarded: Arc::new(AtomicU64::new(0)),
            gateway_client: super::forward::client(),
            cfg,
        })
    }

    /// Episodes open now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Stops taking new episodes (SIGTERM).
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Whether it is draining.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Episodes it may hold open at once.
    pub fn slots(&self) -> usize {
        self.cfg.slots
    }

    /// `None` when the request carries the worker's token (or it has none), else the 401.
    pub(super) fn refused(&self, headers: &HeaderMap) -> Option<Response> {
        let want = self.token_digest.as_ref()?;
        let given = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, t)| t.trim());
        match given {
            Some(t) if crate::access::hash_token(t) == *want => None,
            _ => Some(error(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "a valid `Authorization: Bearer <token>` is required",
            )),
        }
    }

    fn task(&self, key: &str) -> Option<Arc<HostedTask>> {
        lock(&self.tasks).get(key).cloned()
    }

    pub(super) fn register(
        &self,
        key: &str,
        reg: Registration,
        raw: serde_json::Value,
    ) -> Response {
        if let Some(t) = self.task(key) {
            return Self::registered(key, &t, &raw);
        }
        let (hosting, idle) = match check_registration(key, &reg).and_then(|idle| {
            let f = self.build(&reg)?;
            Ok((f, idle))
        }) {
            Ok(v) => v,
            Err((status, code, msg)) => return error(status, code, msg),
        };
        let mut tasks = lock(&self.tasks);
        // Registered meanwhile by a concurrent request (a client's resets race to register
        // on a new worker): the first one stays, with the episodes it already holds.
        if let Some(t) = tasks.get(key) {
            return Self::registered(key, t, &raw);
        }
        if tasks.len() >= MAX_TASKS {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "full",
                format!("{MAX_TASKS} tasks are registered; one must end first"),
            );
        }
        tasks.insert(
            key.to_string(),
            Arc::new(HostedTask {
                spec: raw,
                hosting,
                running: AtomicUsize::new(0),
                stop: tokio_util::sync::CancellationToken::new(),
                idle,
                next_index: AtomicU64::new(0),
                episodes: Mutex::new(HashMap::new()),
                spare: Mutex::new(Vec::new()),
                last_call: Mutex::new(Instant::now()),
            }),
        );
        (StatusCode::CREATED, Json(json!({"registered": key}))).into_response()
    }

    /// The answer to registering `key` again: fine with the same spec, a conflict with
    /// another.
    fn registered(key: &str, t: &HostedTask, raw: &serde_json::Value) -> Response {
        if t.spec == *raw {
            (StatusCode::OK, Json(json!({"registered": key}))).into_response()
        } else {
            error(
                StatusCode::CONFLICT,
                "conflict",
                format!("task {key} is registered with another spec"),
            )
        }
    }

    /// What a registered task hosts: the factory of its environments, or its agent program;
    /// its program resolved and sandboxed here, as a service would.
    fn build(&self, reg: &Registration) -> Result<Hosting, Refusal> {
        let host = job::resolve::Host {
            vars: &infra::env::ProcessEnv,
            cwd: std::env::current_dir().ok(),
            scratch: self.cfg.scratch.clone(),
        };
        let program = job::resolve::env_program(&reg.env, &host).map_err(|e| {
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "program",
                format!("cannot prepare the environment program: {e}"),
            )
        })?;
        let sandboxed = program
            .as_ref()
            .is_some_and(|p| p.sandbox == job::spec::EnvSandbox::Bwrap);
        if sandboxed && let Err(e) = job::wiring::envs::check_sandbox() {
            return Err((
                StatusCode::SERVICE_UNAVAILABLE,
                "sandbox",
                format!(
                    "the sandbox does not work on this worker: {}",
                    infra::error_chain(&e)
                ),
            ));
        }
        if let (job::spec::EnvSpec::Agent(a), Some(p)) = (&reg.env, &program) {
            let agent = job::agents::managed::AgentProgram::new(a.clone(), p.clone())
                .map_err(|e| (StatusCode::SERVICE_UNAVAILABLE, "program", e))?;
            return Ok(Hosting::Agent(Arc::new(agent)));
        }
        let slots = reg
            .slots
            .unwrap_or(self.cfg.slots)
            .clamp(1, self.cfg.slots.max(1));
        let limits = job::wiring::envs::EnvLimits {
            call_timeout: Duration::from_secs_f64(reg.call_timeout_s),
            // The task's own cap first: a start waiting for it holds none of the worker's.
            starts: actors::env::starts::StartCaps::new(reg.max_concurrent_starts).and(&self.caps),
            // Never more started ahead than the worker has slots.
            warm: reg.warm.unwrap_or(self.cfg.warm).min(self.cfg.slots),
        };
        job::wiring::envs::factory(&reg.env, program.as_ref(), 0, &limits, None, slots)
            .map(Hosting::Envs)
            .ok_or((
                StatusCode::BAD_REQUEST,
                "bad_env",
                "env: this environment has no program to run".into(),
            ))
    }

    pub(super) async fn unregister(&self, key: &str) -> usize {
        let Some(t) = lock(&self.tasks).remove(key) else {
            return 0;
        };
        t.stop.cancel();
        let eps: Vec<Arc<Episode>> = lock(&t.episodes).drain().map(|(_, e)| e).collect();
        self.open.fetch_sub(eps.len(), Ordering::Relaxed);
        for e in &eps {
            t.retire(e, 0).await;
        }
        let spare: Vec<Box<dyn DynEnvironment>> = lock(&t.spare).drain(..).collect();
        for mut env in spare {
            env.close_boxed().await;
        }
        eps.len()
    }

    pub(super) async fn call(&self, key: &str, req: Request) -> Response {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let Some(task) = self.task(key) else {
            return error(
                StatusCode::NOT_FOUND,
                "unknown_task",
                format!("task {key} is not registered here"),
            );
        };
        let v = protocol::request_version(&req);
        let Some(id) = protocol::request_episode(&req)
            .map(str::to_string)
            .filter(|_| v == PROTOCOL_V3)
        else {
            return error(
                StatusCode::BAD_REQUEST,
                "bad_request",
                "a version-3 request with an episode id is required",
            );
        };
        *lock(&task.last_call) = Instant::now();
        let existing = lock(&task.episodes).get(&id).cloned();
        let ep = match (&req, existing) {
            (Request::Close { .. }, _) => {
                let gone = lock(&task.episodes).remove(&id);
                if let Some(e) = gone {
                    self.open.fetch_sub(1, Ordering::Relaxed);
                    task.retire(&e, self.cfg.slots).await;
                }
                return Json(protocol::Response {
                    v,
                    episode: Some(id),
                    ok: true,
                    ..Default::default()
                })
                .into_response();
            }
            (_, Some(e)) => e,
            (Request::Step { .. }, None) => {
                return error(
                    StatusCode::NOT_FOUND,
                    "unknown_episode",
                    format!("episode {id} is not open here"),
                );
            }
            (Request::Reset { .. }, None) => match self.open_episode(&task, &id) {
                Ok(e) => e,
                Err((status, code, msg)) => return error(status, code, msg),
            },
        };
        let reset = matches!(req, Request::Reset { .. });
        let began = Instant::now();
        *lock(&ep.last_call) = began;
        let mut env = ep.env.lock().await;
        let Some(env) = env.as_mut() else {
            // Closed (by a concurrent close or the reaper) while this call waited.
            return error(
                StatusCode::NOT_FOUND,
                "unknown_episode",
                format!("episode {id} was closed"),
            );
        };
        let resp = protocol::answer(env.as_mut(), req, v, Some(id)).await;
        if !resp.ok {
            ep.failed.store(true, Ordering::Relaxed);
        }
        *lock(&ep.last_call) = Instant::now();
        let start = (reset && resp.ok).then(|| env.last_start_dyn()).flatten();
        let mut reply = Json(resp).into_response();
        if let Some(s) = start {
            self.starts.record(s, began.elapsed());
            reply.headers_mut().insert(
                actors::env::remote::START_HEADER,
                axum::http::HeaderValue::from_static(s.as_str()),
            );
        }
        reply
    }

    /// Opens episode `id` of `task` on a free slot, or refuses (draining, full).
    fn open_episode(&self, task: &HostedTask, id: &str) -> Result<Arc<Episode>, Refusal> {
        self.take_slot()?;
        let Some(env) = task.env() else {
            self.open.fetch_sub(1, Ordering::Relaxed);
            return Err((
                StatusCode::BAD_REQUEST,
                "agent_task",
                "an agent task's episodes run with POST /v1/tasks/{key}/agent".into(),
            ));
        };
        let e = Arc::new(Episode {
            env: tokio::sync::Mutex::new(Some(env)),
            last_call: Mutex::new(Instant::now()),
            failed: AtomicBool::new(false),
        });
        lock(&task.episodes).insert(id.to_string(), Arc::clone(&e));
        Ok(e)
    }

    /// Takes a slot for a new episode, or refuses (draining, full).
    fn take_slot(&self) -> Result<(), Refusal> {
        if self.draining.load(Ordering::Relaxed) {
            return Err((
                StatusCode::SERVICE_UNAVAILABLE,
                "draining",
                "the worker is draining".into(),
            ));
        }
        // Take a slot, or refuse.
        let took = self
            .open
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < self.cfg.slots).then_some(n + 1)
            });
        if took.is_err() {
            return Err((
                StatusCode::SERVICE_UNAVAILABLE,
                "full",
                format!("all {} slots are open", self.cfg.slots),
            ));
        }
        Ok(())
    }

    /// Closes episodes idle past their task's limit, and tasks without episodes or calls
    /// for as long.
    pub async fn reap(&self) {
        let now = Instant::now();
        let tasks: Vec<(String, Arc<HostedTask>)> = lock(&self.tasks)
            .iter()
            .map(|(k, t)| (k.clone(), Arc::clone(t)))
            .collect();
        for (key, t) in tasks {
            let stale: Vec<Arc<Episode>> = {
                let mut eps = lock(&t.episodes);
                let ids: Vec<String> = eps
                    .iter()
                    .filter(|(_, e)| now.saturating_duration_since(*lock(&e.last_call)) > t.idle)
                    .map(|(k, _)| k.clone())
                    .collect();
                ids.iter().filter_map(|k| eps.remove(k)).collect()
            };
            if !stale.is_empty() {
                tracing::warn!(task = %key, episodes = stale.len(), "closing episodes idle past their limit");
                self.open.fetch_sub(stale.len(), Ordering::Relaxed);
                for e in stale {
                    // Its client is gone mid-episode: do not reuse the environment.
                    e.failed.store(true, Ordering::Relaxed);
                    t.retire(&e, 0).await;
                }
            }
            let idle = lock(&t.episodes).is_empty()
                && t.running.load(Ordering::Relaxed) == 0
                && now.saturating_duration_since(*lock(&t.last_call)) > t.idle;
            if idle {
                self.unregister(&key).await;
            }
        }
    }

    pub(super) fn state(&self) -> serde_json::Value {
        json!({
            "slots": self.cfg.slots,
            "open": self.open(),
            "draining": self.draining.load(Ordering::Relaxed),
            "tasks": lock(&self.tasks).len(),
            "calls": self.calls.load(Ordering::Relaxed),
            "starts": self.starts.peek_step(),
            "agents": {
                "running": self.agents_running.load(Ordering::Relaxed),
                "runs": self.agent_runs.load(Ordering::Relaxed),
                "forwarded_calls": self.forwarded.load(Ordering::Relaxed),
            },
        })
    }

    /// Stops every task's episodes and programs.
    pub async fn close_all(&self) {
        let keys: Vec<String> = lock(&self.tasks).keys().cloned().collect();
        for k in keys {
            self.unregister(&k).await;
        }
    }
}
