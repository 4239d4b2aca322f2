//! Generation on a remote inference server (llama.cpp, SGLang, vLLM) behind the generation
//! contract.
//!
//! [`RemoteEngine`] is a [`GenerationEngine`] whose compute happens in a server process: `add`
//! submits the request as a task on the job's runtime (token ids in, token ids and
//! log-probabilities out, streamed so that a partial answer is known), `step` collects what
//! the server finished, `abort` closes the request (and tells servers that have an abort
//! endpoint), `install` puts new weights on the server by its best path and re-submits the
//! in-flight requests under the job's in-flight policy. The engine admits at most as many
//! requests as the server has slots and queues the rest, so it always knows what runs where,
//! and it keeps every session on the slot that holds its prefix.
//!
//! The server-specific part is a [`ServerClient`]; a [`managed`] server is a child process the
//! engine starts, health-checks and restarts.

pub mod http;
pub mod llamacpp;
pub mod managed;
pub mod sglang;
pub mod vllm;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{
    FinishReason, GenError, GenOutput, GenRequest, GenerationEngine, InFlightPolicy, LoadReport,
    SamplingParams, StepReport,
};
use crate::error::SharedError;
use crate::types::{PolicyVersion, VersionSpan};
use crate::weights::Weights;

/// A boxed future that owns what it needs.
pub type BoxFut<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Writes the weights of a version where a server can load them (a GGUF file, a Hugging
/// Face directory); returns the path.
pub type WeightsExporter = Arc<
    dyn Fn(PolicyVersion, Arc<Weights>) -> BoxFut<Result<std::path::PathBuf, ServerError>>
        + Send
        + Sync,
>;

/// What a server generated for one request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Completion {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub finish: Option<FinishReason>,
    /// Prompt tokens the server computed (not served from its prefix cache).
    pub prefill_tokens: u32,
    /// Tokens the server gave no log-probability for (reported as 0).
    pub missing_logprobs: u32,
}

/// Tokens a request has produced so far (written by the client as they stream in).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Progress {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
}

/// One request as sent to a server.
#[derive(Clone, Debug)]
pub struct ServerRequest {
    /// Request id on the server (unique per attempt, for servers that abort by id).
    pub rid: String,
    pub context: Arc<Vec<u32>>,
    pub params: SamplingParams,
    /// The server slot that holds this session's prefix (servers with slots).
    pub slot: Option<u32>,
    pub progress: Arc<Mutex<Progress>>,
}

/// Requests a server reports running and queued.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServerLoad {
    pub running: usize,
    pub waiting: usize,
}

/// What the engine needs to know about a server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerInfo {
    /// Requests it generates at once.
    pub slots: usize,
    /// Tokens (context + answer) one request may hold.
    pub context: usize,
}

/// Why a request to a server failed.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The server could not be reached or dropped the connection: it may come back.
    #[error("{server} is unreachable")]
    Unreachable {
        server: String,
        #[source]
        source: SharedError,
    },
    /// The server answered with an error status.
    #[error("{server} answered {status} to {path}: {body}")]
    Status {
        server: String,
        path: String,
        status: u16,
        body: String,
    },
    /// The server answered something this client cannot read.
    #[error("{server} answered {path} with an unexpected body: {detail}")]
    Protocol {
        server: String,
        path: String,
        detail: String,
    },
    #[error("{server} was not healthy within {seconds:.0} s")]
    NotHealthy { server: String, seconds: f64 },
    #[error("{server} cannot install weights: {reason}")]
    CannotInstall { server: String, reason: String },
    /// The server cannot take the request now (paused, overloaded): it may later.
    #[error("{server} is unavailable: {message}")]
    Unavailable { server: String, message: String },
    /// The server aborted the request (asked to, or on its own), with what it had generated.
    #[error("{server} aborted the request")]
    Aborted { server: String, partial: Completion },
    #[error("{0}")]
    Other(String),
}

impl ServerError {
    fn transient(&self) -> bool {
        matches!(
            self,
            Self::Unreachable { .. } | Self::Unavailable { .. } | Self::Aborted { .. }
        )
    }
}

impl From<ServerError> for GenError {
    fn from(e: ServerError) -> Self {
        GenError::Backend(SharedError::new(e))
    }
}

/// The protocol of one inference server.
pub trait ServerClient: Send + Sync + 'static {
    /// The server, for messages ("llama.cpp at http://127.0.0.1:8080").
    fn describe(&self) -> String;
    /// Slots and context length (asked once the server is healthy).
    fn info(&self) -> BoxFut<Result<ServerInfo, ServerError>>;
    /// Generates for `req`, recording tokens in `req.progress` as they arrive. Dropping the
    /// future closes the request.
    fn generate(&self, req: ServerRequest) -> BoxFut<Result<Completion, ServerError>>;
    /// Teacher forcing: the log-probability of each of `tokens[1..]` given the tokens before
    /// it, from the server's untempered distribution (what the server would have sampled
    /// from at temperature 1); a trainer compares its own log-probabilities with these.
    fn prompt_logprobs(&self, tokens: Arc<[u32]>) -> BoxFut<Result<Vec<f32>, ServerError>>;
    /// Tells the server to drop request `rid` (servers that abort by id; closing the request
    /// is enough for the others).
    fn cancel(&self, _rid: &str) -> BoxFut<()> {
        Box::pin(async {})
    }
    /// Whether a cancelled request's `generate` returns what it had generated (servers with
    /// an abort endpoint); otherwise the engine closes the request and reads its progress.
    fn partial_on_cancel(&self) -> bool {
        false
    }
    /// Pauses generation on the server (where it has a pause); the engine stops admitting.
    fn pause(&self) -> BoxFut<Result<(), ServerError>> {
        Box::pin(async { Ok(()) })
    }
    fn resume(&self) -> BoxFut<Result<(), ServerError>> {
        Box::pin(async { Ok(()) })
    }
    /// Puts `weights` on the server as `version`. In-flight requests were closed first.
    fn install(
        &self,
        version: PolicyVersion,
        weights: Arc<Weights>,
    ) -> BoxFut<Result<(), ServerError>>;
    /// Whether the server answers (a managed server also restarts here when its process
    /// died).
    fn health(&self) -> BoxFut<Result<(), ServerError>>;
    /// What the server runs and queues, every client's requests included (llama.cpp's
    /// `/slots`, SGLang's `/v1/loads`, vLLM's `/metrics`); `None` where it cannot say.
    fn server_load(&self) -> BoxFut<Option<ServerLoad>> {
        Box::pin(async { None })
    }
}

/// Settings of a remote engine.
#[derive(Clone, Debug)]
pub struct RemoteConfig {
    /// How often the server's health is checked (each success is a heartbeat for the shard's
    /// frozen-engine watchdog).
    pub probe_every: Duration,
    /// A server unreachable this long fails its requests (the job retries or masks them).
    pub down_after: Duration,
    /// Attempts per request when the server drops it (restarts, crashes).
    pub attempts: u32,
    /// How long an install may take (export, restart, load).
    pub install_timeout: Duration,
    /// How long the server may take to become healthy at start.
    pub ready_within: Duration,
    /// Version the server serves when it starts (the checkpoint it was launched on), if known.
    pub serving: Option<PolicyVersion>,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        Self {
            probe_every: Duration::from_secs(1),
            down_after: Duration::from_secs(60),
            attempts: 3,
            install_timeout: Duration::from_secs(600),
            ready_within: Duration::from_secs(300),
            serving: Some(0),
        }
    }
}

/// Tokens kept from earlier attempts (recompute installs).
#[derive(Clone, Debug, Default)]
struct Kept {
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    versions: Vec<VersionSpan>,
}

struct Pending {
    req: GenRequest,
    kept: Kept,
    /// Attempts the server dropped.
    failures: u32,
    /// Times the server answered "unavailable".
    unavailable: u32,
}

struct Running {
    pending: Pending,
    attempt: u64,
    slot: Option<u32>,
    rid: String,
    progress: Arc<Mutex<Progress>>,
    task: tokio::task::JoinHandle<()>,
}

/// What the engine's tasks report back.
enum Event {
    /// Request `.0`'s attempt `.1` ended.
    Done(u64, u64, Result<Completion, ServerError>),
    /// The server became healthy (with its slots and context), or never did.
    Ready(Result<ServerInfo, ServerError>),
}

/// Health shared between the engine and its probe task.
#[derive(Default)]
struct Health {
    /// Successful probes so far.
    beats: AtomicU64,
    /// Milliseconds (of the job's clock) since the server last answered; 0 while it does.
    down_since_ms: AtomicU64,
    up: AtomicBool,
    /// What the server last said it runs and queues (all clients' requests), +1 (0: unknown).
    server_running: AtomicU64,
    server_waiting: AtomicU64,
}

/// A generation engine backed by an inference server.
pub struct RemoteEngine {
    client: Arc<dyn ServerClient>,
    rt: tokio::runtime::Handle,
    cfg: RemoteConfig,
    /// Known once the server is healthy; requests wait until then.
    info: Option<ServerInfo>,
    /// The server never became healthy: every request fails with this.
    broken: Option<String>,
    version: PolicyVersion,
    serving: Option<PolicyVersion>,
    paused: bool,
    waiting: VecDeque<Pending>,
    running: HashMap<u64, Running>,
    free: BTreeSet<u32>,
    affinity: HashMap<u64, u32>,
    next_attempt: u64,
    events_tx: flume::Sender<Event>,
    events_rx: flume::Receiver<Event>,
    ready: Vec<(u64, Result<GenOutput, GenError>)>,
    wake: Arc<tokio::sync::Notify>,
    health: Arc<Health>,
    beats_seen: u64,
    /// A request was dropped by the server at this many health beats: nothing is admitted
    /// until the server answers a health check again.
    await_beat: Option<u64>,
    started: tokio::time::Instant,
    prefill_tokens: u64,
    decode_tokens: u64,
    _probe: tokio_util::task::AbortOnDropHandle<()>,
}

impl RemoteEngine {
    /// An engine for the server `client` speaks to; the server's I/O runs on `rt` (the job's
    /// runtime). Requests wait until the server is healthy (up to `cfg.ready_within`).
    pub fn start(
        client: Arc<dyn ServerClient>,
        rt: tokio::runtime::Handle,
        cfg: RemoteConfig,
    ) -> Self {
        // Unbounded but bounded in fact: each submitted attempt sends one `Done` (at most the
        // server's slots are in flight) and the start sends one `Ready`.
        let (events_tx, events_rx) = flume::unbounded();
        let wake = Arc::new(tokio::sync::Notify::new());
        let health = Arc::new(Health::default());
        let started = tokio::time::Instant::now();
        let (c, tx, w, within) = (
            client.clone(),
            events_tx.clone(),
            wake.clone(),
            cfg.ready_within,
        );
        let (h, every) = (health.clone(), cfg.probe_every);
        let probe = rt.spawn(async move {
            let ready = wait_ready(&*c, within).await;
            let ok = ready.is_ok();
            let _ = tx.send(Event::Ready(ready));
            w.notify_one();
            if ok {
                h.up.store(true, Ordering::Relaxed);
                probe(c, h, w, every, started).await;
            }
        });
        Self {
            client,
            rt,
            serving: cfg.serving,
            version: cfg.serving.unwrap_or(0),
            cfg,
            info: None,
            broken: None,
            paused: false,
            waiting: VecDeque::new(),
            running: HashMap::new(),
            free: BTreeSet::new(),
            affinity: HashMap::new(),
            next_attempt: 0,
            events_tx,
            events_rx,
            ready: Vec::new(),
            wake,
            health,
            beats_seen: 0,
            await_beat: None,
            started,
            prefill_tokens: 0,
            decode_tokens: 0,
            _probe: tokio_util::task::AbortOnDropHandle::new(probe),
        }
    }

    /// The server's slots and context, once it is healthy.
    pub fn info(&self) -> Option<ServerInfo> {
        self.info
    }

    /// Starts waiting requests while slots are free.
    fn admit(&mut self) {
        if let Some(e) = &self.broken {
            let e = e.clone();
            while let Some(p) = self.waiting.pop_front() {
                self.ready.push((p.req.id, Err(backend_error(e.clone()))));
            }
            return;
        }
        if let Some(b) = self.await_beat {
            if self.health.beats.load(Ordering::Relaxed) <= b {
                return;
            }
            self.await_beat = None;
        }
        while !self.paused && !self.free.is_empty() {
            let Some(p) = self.waiting.pop_front() else {
                break;
            };
            self.submit(p);
        }
    }

    fn submit(&mut self, p: Pending) {
        let id = p.req.id;
        let info = self
            .info
            .expect("slots are free only once the server is ready");
        let context: Arc<Vec<u32>> = if p.kept.tokens.is_empty() {
            p.req.context.clone()
        } else {
            let mut c = Vec::with_capacity(p.req.context.len() + p.kept.tokens.len());
            c.extend_from_slice(&p.req.context);
            c.extend_from_slice(&p.kept.tokens);
            Arc::new(c)
        };
        if context.len() + 1 > info.context {
            self.ready.push((
                id,
                Err(GenError::ContextTooLong {
                    len: context.len(),
                    limit: info.context.saturating_sub(1),
                }),
            ));
            return;
        }
        // The session's slot when free (its prefix is cached there), else any free one.
        let slot = match self.affinity.get(&p.req.session) {
            Some(s) if self.free.contains(s) => *s,
            _ => *self
                .free
                .iter()
                .next()
                .expect("admit checks for a free slot"),
        };
        self.free.remove(&slot);
        self.affinity.insert(p.req.session, slot);
        let mut params = p.req.params.clone();
        params.max_tokens = params
            .max_tokens
            .saturating_sub(p.kept.tokens.len() as u32)
            .max(1);
        // The answer must fit the slot.
        let room = (info.context - context.len()) as u32;
        params.max_tokens = params.max_tokens.min(room);
        self.next_attempt += 1;
        let attempt = self.next_attempt;
        // Fixed width: servers that abort by id prefix (SGLang) never match another request.
        let rid = format!("rollarc-{id:016x}-{attempt:016x}");
        let progress = Arc::new(Mutex::new(Progress::default()));
        let fut = self.client.generate(ServerRequest {
            rid: rid.clone(),
            context,
            params,
            slot: Some(slot),
            progress: progress.clone(),
        });
        let (tx, wake) = (self.events_tx.clone(), self.wake.clone());
        let task = self.rt.spawn(async move {
            let r = fut.await;
            let _ = tx.send(Event::Done(id, attempt, r));
            wake.notify_one();
        });
        self.running.insert(
            id,
            Running {
                pending: p,
                attempt,
                slot: Some(slot),
                rid,
                progress,
                task,
            },
        );
    }

    /// Closes a running request; returns it with what it had generated.
    fn close(&mut self, r: &Running) -> Progress {
        r.task.abort();
        let cancel = self.client.cancel(&r.rid);
        self.rt.spawn(cancel);
        if let Some(s) = r.slot {
            self.free.insert(s);
        }
        r.progress.lock().map(|p| p.clone()).unwrap_or_default()
    }

    fn finish(&mut self, id: u64, attempt: u64, res: Result<Completion, ServerError>) {
        let Some(r) = self.running.get(&id) else {
            return;
        };
        if r.attempt != attempt {
            return;
        }
        let r = self.running.remove(&id).expect("present");
        if let Some(s) = r.slot {
            self.free.insert(s);
        }
        let mut p = r.pending;
        match res {
            Ok(c) => {
                if c.missing_logprobs > 0 {
                    tracing::warn!(server = %self.client.describe(), request = id, tokens = c.missing_logprobs, "the server reported no log-probability for some tokens; they count as 0");
                }
                self.prefill_tokens += u64::from(c.prefill_tokens);
                self.decode_tokens += c.tokens.len() as u64;
                let mut tokens = p.kept.tokens;
                let mut logprobs = p.kept.logprobs;
                let mut versions = p.kept.versions;
                push_span(&mut versions, self.version, c.tokens.len() as u32);
                tokens.extend_from_slice(&c.tokens);
                logprobs.extend_from_slice(&c.logprobs);
                let finish = c.finish.unwrap_or(FinishReason::Stop);
                self.ready.push((
                    id,
                    Ok(GenOutput {
                        tokens,
                        logprobs,
                        versions,
                        finish,
                        prefill_tokens: c.prefill_tokens,
                    }),
                ));
            }
            // A server that refuses for now (paused by someone else, overloaded) is asked
            // again after each health beat, for up to `down_after`.
            Err(e @ ServerError::Unavailable { .. })
                if p.unavailable < self.unavailable_budget() =>
            {
                tracing::debug!(error = %e, request = id, "server unavailable; retrying");
                p.unavailable += 1;
                self.waiting.push_front(p);
                self.await_beat = Some(self.health.beats.load(Ordering::Relaxed));
            }
            Err(e) if e.transient() && p.failures + 1 < self.cfg.attempts => {
                // The server went away mid-request (crash, restart): start it again once the
                // server is back, from the tokens kept before.
                tracing::debug!(error = %e, request = id, "request dropped by the server; retrying");
                p.failures += 1;
                self.waiting.push_front(p);
                self.await_beat = Some(self.health.beats.load(Ordering::Relaxed));
            }
            Err(e) => self.ready.push((id, Err(e.into()))),
        }
    }

    fn on_event(&mut self, ev: Event) {
        match ev {
            Event::Done(id, attempt, res) => self.finish(id, attempt, res),
            Event::Ready(Ok(info)) => {
                self.info = Some(info);
                self.free = (0..info.slots.max(1) as u32).collect();
            }
            Event::Ready(Err(e)) => {
                tracing::error!(error = %e, "inference server never became healthy");
                self.broken = Some(infra::error_chain(&e));
            }
        }
    }

    /// Stops every running request before an install; returns each with what it had
    /// generated. Servers that answer an aborted request with its partial answer are asked to
    /// abort and waited for (up to 10 s); the others' requests are closed at once.
    fn stop_running(&mut self) -> Vec<(Pending, Progress)> {
        let mut closed = Vec::with_capacity(self.running.len());
        if self.client.partial_on_cancel() && !self.running.is_empty() {
            for r in self.running.values() {
                self.rt.spawn(self.client.cancel(&r.rid));
            }
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            let mut others = Vec::new();
            while !self.running.is_empty() {
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                let Ok(ev) = self.events_rx.recv_timeout(left) else {
                    break;
                };
                match ev {
                    Event::Done(id, attempt, res @ Ok(_))
                        if self.running.get(&id).is_some_and(|r| r.attempt == attempt) =>
                    {
                        // It finished before the abort landed: delivered as it is.
                        self.finish(id, attempt, res);
                    }
                    Event::Done(id, attempt, res)
                        if self.running.get(&id).is_some_and(|r| r.attempt == attempt) =>
                    {
                        let r = self.running.remove(&id).expect("present");
                        if let Some(s) = r.slot {
                            self.free.insert(s);
                        }
                        let partial = match res {
                            Err(ServerError::Aborted { partial: c, .. }) => Progress {
                                tokens: c.tokens,
                                logprobs: c.logprobs,
                            },
                            Ok(_) | Err(_) => Progress::default(),
                        };
                        closed.push((r.pending, partial));
                    }
                    other => others.push(other),
                }
            }
            for ev in others {
                self.on_event(ev);
            }
        }
        let ids: Vec<u64> = self.running.keys().copied().collect();
        for id in ids {
            if let Some(r) = self.running.remove(&id) {
                let progress = self.close(&r);
                closed.push((r.pending, progress));
            }
        }
        closed.sort_by_key(|(p, _)| p.req.id);
        closed
    }

    /// "Unavailable" answers a request may get: as many health beats as fit in `down_after`.
    fn unavailable_budget(&self) -> u32 {
        let beats =
            self.cfg.down_after.as_secs_f64() / self.cfg.probe_every.as_secs_f64().max(1e-3);
        (beats as u32).max(self.cfg.attempts)
    }

    /// Fails every request when the server has been down too long.
    fn check_down(&mut self) {
        let since = self.health.down_since_ms.load(Ordering::Relaxed);
        if since == 0 {
            return;
        }
        let down_for = self
            .started
            .elapsed()
            .saturating_sub(Duration::from_millis(since));
        if down_for < self.cfg.down_after {
            return;
        }
        let server = self.client.describe();
        let err = || {
            GenError::Backend(SharedError::new(ServerError::NotHealthy {
                server: server.clone(),
                seconds: down_for.as_secs_f64(),
            }))
        };
        let ids: Vec<u64> = self.running.keys().copied().collect();
        for id in ids {
            if let Some(r) = self.running.remove(&id) {
                self.close(&r);
                self.ready.push((id, Err(err())));
            }
        }
        while let Some(p) = self.waiting.pop_front() {
            self.ready.push((p.req.id, Err(err())));
        }
    }

    /// Runs `fut` on the job's runtime and waits for it on this (the engine's) thread.
    fn block_on<T: Send + 'static>(
        &self,
        fut: BoxFut<Result<T, ServerError>>,
        timeout: Duration,
    ) -> Result<T, ServerError> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.rt.spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.recv_timeout(timeout).unwrap_or_else(|_| {
            Err(ServerError::NotHealthy {
                server: self.client.describe(),
                seconds: timeout.as_secs_f64(),
            })
        })
    }
}

fn backend_error(message: String) -> GenError {
    GenError::Backend(SharedError::new(ServerError::Other(message)))
}

/// Waits until the server answers its health check, then asks for its slots and context.
async fn wait_ready(
    client: &dyn ServerClient,
    within: Duration,
) -> Result<ServerInfo, ServerError> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let answer = tokio::time::timeout(left.max(Duration::from_millis(100)), client.health())
            .await
            .unwrap_or_else(|_| {
                Err(ServerError::NotHealthy {
                    server: client.describe(),
                    seconds: within.as_secs_f64(),
                })
            });
        match answer {
            Ok(()) => return client.info().await,
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(match e {
                    ServerError::Unreachable { .. } => ServerError::NotHealthy {
                        server: client.describe(),
                        seconds: within.as_secs_f64(),
                    },
                    other => other,
                });
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

fn push_span(versions: &mut Vec<VersionSpan>, version: PolicyVersion, tokens: u32) {
    if tokens == 0 {
        return;
    }
    match versions.last_mut() {
        Some(s) if s.version == version => s.tokens += tokens,
        _ => versions.push(VersionSpan { version, tokens }),
    }
}

async fn probe(
    client: Arc<dyn ServerClient>,
    health: Arc<Health>,
    wake: Arc<tokio::sync::Notify>,
    every: Duration,
    started: tokio::time::Instant,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let ok = matches!(
            tokio::time::timeout(every.max(Duration::from_secs(5)), client.health()).await,
            Ok(Ok(()))
        );
        if ok {
            health.down_since_ms.store(0, Ordering::Relaxed);
            health.up.store(true, Ordering::Relaxed);
            if let Ok(Some(l)) =
                tokio::time::timeout(every.max(Duration::from_secs(5)), client.server_load()).await
            {
                health
                    .server_running
                    .store(l.running as u64 + 1, Ordering::Relaxed);
                health
                    .server_waiting
                    .store(l.waiting as u64 + 1, Ordering::Relaxed);
            }
            health.beats.fetch_add(1, Ordering::Relaxed);
        } else if health.up.swap(false, Ordering::Relaxed) {
            let ms = started.elapsed().as_millis().max(1) as u64;
            health.down_since_ms.store(ms, Ordering::Relaxed);
            tracing::warn!(server = %client.describe(), "inference server does not answer its health check");
        }
        wake.notify_one();
    }
}

impl GenerationEngine for RemoteEngine {
    fn add(&mut self, req: GenRequest) {
        self.waiting.push_back(Pending {
            req,
            kept: Kept::default(),
            failures: 0,
            unavailable: 0,
        });
        self.admit();
        if !self.ready.is_empty() {
            self.wake.notify_one();
        }
    }

    fn abort(&mut self, id: u64) -> bool {
        if let Some(r) = self.running.remove(&id) {
            self.close(&r);
            self.admit();
            return true;
        }
        let before = self.waiting.len();
        self.waiting.retain(|p| p.req.id != id);
        let ready_before = self.ready.len();
        self.ready.retain(|(i, _)| *i != id);
        before != self.waiting.len() || ready_before != self.ready.len()
    }

    fn release(&mut self, session: u64) {
        self.affinity.remove(&session);
    }

    fn install(
        &mut self,
        version: PolicyVersion,
        weights: &Weights,
        policy: InFlightPolicy,
    ) -> Result<Duration, GenError> {
        if self.serving == Some(version) {
            self.version = version;
            return Ok(Duration::ZERO);
        }
        // Stop what runs: the server is about to change under it.
        let closed = self.stop_running();
        let w = Arc::new(weights.clone());
        let r = self.block_on(self.client.install(version, w), self.cfg.install_timeout);
        let installed = r.is_ok();
        if installed {
            self.serving = Some(version);
        }
        let old = self.version;
        for (mut p, progress) in closed.into_iter().rev() {
            match policy {
                _ if !installed => {}
                InFlightPolicy::Abort => p.kept = Kept::default(),
                InFlightPolicy::Recompute => {
                    push_span(&mut p.kept.versions, old, progress.tokens.len() as u32);
                    p.kept.tokens.extend_from_slice(&progress.tokens);
                    p.kept.logprobs.extend_from_slice(&progress.logprobs);
                }
            }
            self.waiting.push_front(p);
        }
        if installed {
            self.version = version;
        }
        self.admit();
        r.map(|()| Duration::ZERO).map_err(GenError::from)
    }

    fn suspend(&mut self) {
        self.paused = true;
        let f = self.client.pause();
        self.rt.spawn(async move {
            if let Err(e) = f.await {
                tracing::warn!(error = %e, "pausing the inference server failed");
            }
        });
    }

    fn resume(&mut self) {
        self.paused = false;
        let f = self.client.resume();
        self.rt.spawn(async move {
            if let Err(e) = f.await {
                tracing::warn!(error = %e, "resuming the inference server failed");
            }
        });
        self.admit();
    }

    fn has_work(&self) -> bool {
        !self.ready.is_empty()
            || !self.events_rx.is_empty()
            || self.health.beats.load(Ordering::Relaxed) != self.beats_seen
    }

    fn step(&mut self) -> StepReport {
        self.beats_seen = self.health.beats.load(Ordering::Relaxed);
        let (p0, d0) = (self.prefill_tokens, self.decode_tokens);
        while let Ok(ev) = self.events_rx.try_recv() {
            self.on_event(ev);
        }
        self.check_down();
        self.admit();
        StepReport {
            finished: std::mem::take(&mut self.ready),
            modelled: Duration::ZERO,
            prefill_tokens: self.prefill_tokens - p0,
            decode_tokens: self.decode_tokens - d0,
        }
    }

    fn external_load(&self) -> usize {
        // The server's own count covers other clients' requests too (a shared server); ours
        // is exact for what this shard sent.
        let server = |a: &AtomicU64| (a.load(Ordering::Relaxed) as usize).saturating_sub(1);
        let on_server = server(&self.health.server_running) + server(&self.health.server_waiting);
        on_server.saturating_sub(self.running.len())
    }

    fn load(&self) -> LoadReport {
        LoadReport {
            running: self.running.len(),
            waiting: self.waiting.len(),
            external: self.external_load(),
            kv_tokens: self
                .running
                .values()
                .map(|r| r.pending.req.context.len() as u64)
                .sum(),
            kv_capacity_tokens: self.info.map_or(0, |i| (i.slots * i.context) as u64),
            version: self.version,
            prefill_tokens: self.prefill_tokens,
            decode_tokens: self.decode_tokens,
            ..Default::default()
        }
    }

    fn progress(&self, id: u64) -> Option<usize> {
        let Some(r) = self.running.get(&id) else {
            let p = self.waiting.iter().find(|p| p.req.id == id)?;
            return Some(p.kept.tokens.len());
        };
        let now = r.progress.lock().map(|p| p.tokens.len()).unwrap_or(0);
        Some(r.pending.kept.tokens.len() + now)
    }

    fn waker(&self) -> Option<Arc<tokio::sync::Notify>> {
        Some(self.wake.clone())
    }
}

#[cfg(test)]
mod tests;
