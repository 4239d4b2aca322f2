//! The remote engine: requests queued and admitted to the server's slots, their attempts
//! and what earlier attempts kept, the server's health, and the generation contract on top.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::health::{Health, probe, read_load, wait_ready};
use super::{Completion, Progress, ServerClient, ServerError, ServerInfo};
use crate::error::SharedError;
use crate::generation::{
    GenError, GenOutput, GenRequest, GenerationEngine, InFlightPolicy, LoadReport, StepReport,
};
use crate::types::{PolicyVersion, VersionSpan};
use crate::weights::Weights;

mod install;
mod requests;

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

/// A request not yet finished, with what its earlier attempts produced.
struct Pending {
    req: GenRequest,
    kept: Kept,
    /// Attempts the server dropped.
    failures: u32,
    /// Times the server answered "unavailable".
    unavailable: u32,
}

/// A request's attempt running on the server.
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
        Self::start_woken(client, rt, cfg, Arc::new(tokio::sync::Notify::new()))
    }

    /// [`Self::start`], notifying `wake` (its [`GenerationEngine::waker`]) when it has
    /// something to deliver: an engine that wraps it hands its loop one waker for all the
    /// servers it uses in turn.
    pub fn start_woken(
        client: Arc<dyn ServerClient>,
        rt: tokio::runtime::Handle,
        cfg: RemoteConfig,
        wake: Arc<tokio::sync::Notify>,
    ) -> Self {
        // Unbounded but bounded in fact: each submitted attempt sends one `Done` (at most the
        // server's slots are in flight) and the start sends one `Ready`.
        let (events_tx, events_rx) = flume::unbounded();
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
            if ok {
                // The server's own load is known before the first placement that uses it: a
                // shared server's other clients count from the start, not from the first beat.
                read_load(&*c, &h, Duration::from_secs(5)).await;
            }
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

    /// Why the server will never serve (it was not healthy in time), if so.
    pub fn broken(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// Whether it holds requests (running, queued or finished and not yet delivered).
    pub fn busy(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty() || !self.ready.is_empty()
    }

    /// Ends every request it holds: those finished are delivered as they are, the others
    /// fail with `error` (their server is gone).
    pub fn fail_all(&mut self, error: &GenError) -> Vec<(u64, Result<GenOutput, GenError>)> {
        let mut out = std::mem::take(&mut self.ready);
        let running: Vec<Running> = self.running.drain().map(|(_, r)| r).collect();
        for r in running {
            self.close(&r);
            out.push((r.pending.req.id, Err(error.clone())));
        }
        out.extend(
            self.waiting
                .drain(..)
                .map(|p| (p.req.id, Err(error.clone()))),
        );
        out
    }

    /// The version its server serves, if known.
    pub fn serving(&self) -> Option<PolicyVersion> {
        self.serving
    }
}

/// A backend error carrying `message`.
fn backend_error(message: String) -> GenError {
    GenError::Backend(SharedError::new(ServerError::Other(message)))
}

/// Counts `tokens` generated under `version` in `versions` (merged into the last span when
/// it is the same version).
fn push_span(versions: &mut Vec<VersionSpan>, version: PolicyVersion, tokens: u32) {
    if tokens == 0 {
        return;
    }
    match versions.last_mut() {
        Some(s) if s.version == version => s.tokens += tokens,
        _ => versions.push(VersionSpan {
            version,
            tokens,
            precision: None,
        }),
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
