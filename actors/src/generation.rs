//! Generation: the engine trait every backend implements (built-in CPU model, roofline
//! simulator, remote inference server), the shard engine loop behind a flume seam, and the
//! shard actor that controls it.
//!
//! The engine loop applies ADD / ABORT / RELEASE between engine steps, so adding or aborting
//! one trajectory never stalls the batch. SUSPEND stops stepping; INSTALL swaps weights under
//! the job's in-flight policy; RESUME continues.

pub mod contract;
pub mod remote;
pub mod shard;
pub mod sim;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::types::{Logprobs, PolicyVersion, Tokens, VersionSpan};
use crate::weights::Weights;

/// What happens to sequences in flight when new weights are installed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InFlightPolicy {
    /// Drop the partial turn and regenerate it from its prompt under the new weights.
    Abort,
    /// Keep the generated tokens and rebuild their KV cache under the new weights.
    Recompute,
}

/// Sampling parameters of one request.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_p: f32,
    /// Sample among the `top_k` most likely tokens only (0: all).
    pub top_k: u32,
    pub max_tokens: u32,
    pub stop_tokens: Vec<u32>,
    /// Generation stops once the decoded answer contains one of these (the tokens that
    /// completed it are kept: they were sampled and are trained on).
    pub stop_strings: Vec<String>,
    /// Keep generating past the model's own end-of-turn ids (benchmarks); `stop_tokens` and
    /// `stop_strings` still apply.
    pub ignore_eos: bool,
    /// Seed of this request's RNG, so a run can be replayed.
    pub seed: u64,
    /// Constrained decoding: when set, only these tokens may be sampled (the environment's
    /// action alphabet); log-probabilities are those of the constrained distribution, and the
    /// trainer applies the same constraint (the trajectory carries it).
    pub allowed_tokens: Option<std::sync::Arc<[u32]>>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_tokens: 64,
            stop_tokens: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: false,
            seed: 0,
            allowed_tokens: None,
        }
    }
}

/// One generation request: the whole context as token ids (token-in / token-out).
#[derive(Clone, Debug)]
pub struct GenRequest {
    pub id: u64,
    /// Trajectory the request belongs to; the engine keeps its prefix cache between turns.
    pub session: u64,
    pub context: Arc<Tokens>,
    pub params: SamplingParams,
    /// For simulators only: how many tokens the simulated policy answers with.
    pub sim_response_len: Option<u32>,
    /// Prefill/decode disaggregation: the context's KV was computed on a prefill shard and
    /// transferred here, so this engine only decodes.
    pub prefilled: bool,
    /// How many leading tokens of `context` equal the session's previous request's context
    /// (its prompt and answer): what a prefix cache may reuse. `None`: all of it (the context
    /// extends the previous one). Simulators honour it (`context = { keep = f }`); real
    /// engines match the real tokens.
    pub reusable: Option<u64>,
    /// KV of this many leading context tokens arrives with the request (the decode side of a
    /// P/D pair handing a session's KV back to the prefill side): none of them is prefilled.
    pub carried: u64,
}

/// Why a sequence stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

/// A finished generation.
#[derive(Clone, Debug, PartialEq)]
pub struct GenOutput {
    pub tokens: Tokens,
    pub logprobs: Logprobs,
    pub versions: Vec<VersionSpan>,
    pub finish: FinishReason,
    /// Context tokens that were prefilled (not served from the prefix cache).
    pub prefill_tokens: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GenError {
    #[error("request aborted")]
    Aborted,
    #[error("shard stopped")]
    ShardStopped,
    #[error("context of {len} tokens exceeds the shard's limit of {limit}")]
    ContextTooLong { len: usize, limit: usize },
    #[error("the backend failed")]
    Backend(#[source] crate::error::SharedError),
}

/// The result of one engine step.
#[derive(Debug, Default)]
pub struct StepReport {
    pub finished: Vec<(u64, Result<GenOutput, GenError>)>,
    /// Modelled duration of the step (simulators); zero for real backends, whose compute
    /// already took its time.
    pub modelled: Duration,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
}

/// Load of one shard, as reported to the scheduler and the cluster view.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadReport {
    pub running: usize,
    pub waiting: usize,
    pub kv_tokens: u64,
    pub kv_capacity_tokens: u64,
    pub version: PolicyVersion,
    pub suspended: bool,
    /// Engine steps taken since start (progress counter for frozen detection).
    pub steps: u64,
    /// Seconds the engine spent stepping (busy), since start.
    pub busy_s: f64,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    /// Requests the backend runs or queues for other clients (a shared inference server, as
    /// the server reports it); not counted in `running`/`waiting`.
    pub external: usize,
    /// Context tokens of admitted requests that were looked up in the prefix cache, and those
    /// found there (hit rate = hit / lookup), since start; engines without a modelled cache
    /// report 0.
    pub cache_lookup_tokens: u64,
    pub cache_hit_tokens: u64,
}

/// A generation backend as seen by the engine loop. Implementations do not block on I/O in
/// `step` unless they run on their own thread (see [`LoopPlacement`]).
pub trait GenerationEngine: Send + 'static {
    fn add(&mut self, req: GenRequest);
    /// Drops a request; returns whether it was known.
    fn abort(&mut self, id: u64) -> bool;
    /// Forgets a session's prefix cache.
    fn release(&mut self, session: u64);

    /// Leading context tokens of `session` whose KV this engine's prefix cache holds (0 for
    /// engines without a modelled cache).
    fn cached(&self, _session: u64) -> u64 {
        0
    }
    /// Installs weights of `version`; in-flight sequences follow `policy`. Returns the
    /// modelled duration of the swap (zero for real backends).
    fn install(
        &mut self,
        version: PolicyVersion,
        weights: &Weights,
        policy: InFlightPolicy,
    ) -> Result<Duration, GenError>;
    fn has_work(&self) -> bool;
    fn step(&mut self) -> StepReport;
    fn load(&self) -> LoadReport;

    /// Requests the backend runs or queues for other clients (a shared inference server);
    /// the scheduler adds them to the shard's own when it places a trajectory. Cheap: the
    /// loop reads it whenever it wakes.
    fn external_load(&self) -> usize {
        0
    }

    /// Whether the scheduler may place new trajectories here: false for a shard of an
    /// elastic pool with no server yet, or whose server is leaving (it finishes what it
    /// holds). Cheap: the loop reads it whenever it wakes.
    fn accepting(&self) -> bool {
        true
    }

    /// Tokens request `id` has generated so far, where the engine can tell (tests wait on
    /// it to land an install mid-answer).
    fn progress(&self, _id: u64) -> Option<usize> {
        None
    }

    /// The loop stopped stepping (SUSPEND); engines whose work runs elsewhere (a server)
    /// stop admitting and pause it.
    fn suspend(&mut self) {}

    /// The loop steps again (RESUME).
    fn resume(&mut self) {}

    /// Engines whose work completes outside `step` (a remote server): notified when `step`
    /// has something to deliver. The loop waits on it as well as on its commands.
    fn waker(&self) -> Option<Arc<tokio::sync::Notify>> {
        None
    }

    /// Virtual-time engines: how many decode iterations may run now with nothing but time
    /// passing (no admission, no prefill, no sequence finishing before the last one). 0 or 1:
    /// take ordinary steps. The engine may admit waiting requests first.
    fn fusable(&mut self) -> u64 {
        0
    }

    /// Modelled duration of the first `iterations` of the fusable run (monotone).
    fn fused_time(&self, _iterations: u64) -> Duration {
        Duration::ZERO
    }

    /// Applies `iterations` fused iterations (at most what `fusable` offered).
    fn advance(&mut self, _iterations: u64) -> StepReport {
        StepReport::default()
    }
}

/// Where the engine loop runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoopPlacement {
    /// As a task on the caller's runtime: for simulators on the virtual clock.
    Task,
    /// On its own OS thread: for compute-heavy real backends.
    Thread,
}

/// Commands over the flume seam into the engine loop.
pub enum EngineCommand {
    Add(
        Box<GenRequest>,
        oneshot::Sender<Result<GenOutput, GenError>>,
    ),
    Abort(u64),
    Release(u64),
    /// [`GenerationEngine::cached`].
    Cached(u64, tokio::sync::oneshot::Sender<u64>),
    Suspend(tokio::sync::oneshot::Sender<()>),
    Install(
        PolicyVersion,
        Arc<Weights>,
        InFlightPolicy,
        tokio::sync::oneshot::Sender<Result<(), GenError>>,
    ),
    Resume,
    Load(tokio::sync::oneshot::Sender<LoadReport>),
    Stop,
}

/// Handle to a running engine loop: the data path episodes use directly.
#[derive(Clone)]
pub struct EngineHandle {
    tx: flume::Sender<EngineCommand>,
    /// The engine's [`GenerationEngine::external_load`], as of the loop's last wake.
    external: Arc<AtomicUsize>,
}

impl EngineHandle {
    /// Submits a request and waits for its result.
    pub fn generate(
        &self,
        req: GenRequest,
    ) -> impl Future<Output = Result<GenOutput, GenError>> + Send + '_ {
        self.generate_boxed(Box::new(req))
    }

    /// [`Self::generate`] of a boxed request (no copy of it in the futures that wait).
    pub async fn generate_boxed(&self, req: Box<GenRequest>) -> Result<GenOutput, GenError> {
        // A oneshot: one allocation per request (a bounded flume channel took two, its queue
        // and its shared state: ≈ 0.5 KiB per in-flight request).
        let (rtx, rrx) = oneshot::channel();
        self.tx
            .send_async(EngineCommand::Add(req, rtx))
            .await
            .map_err(|_| GenError::ShardStopped)?;
        rrx.await.unwrap_or(Err(GenError::ShardStopped))
    }

    pub fn abort(&self, id: u64) {
        let _ = self.tx.send(EngineCommand::Abort(id));
    }

    pub fn release(&self, session: u64) {
        let _ = self.tx.send(EngineCommand::Release(session));
    }

    /// [`GenerationEngine::cached`] on this loop; a stopped loop holds nothing.
    pub async fn cached(&self, session: u64) -> u64 {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.ask(EngineCommand::Cached(session, tx), rx).await
    }

    async fn ask(&self, cmd: EngineCommand, rx: tokio::sync::oneshot::Receiver<u64>) -> u64 {
        if self.tx.send_async(cmd).await.is_err() {
            return 0;
        }
        rx.await.unwrap_or(0)
    }

    pub(crate) fn send(&self, cmd: EngineCommand) -> bool {
        self.tx.send(cmd).is_ok()
    }

    pub fn is_closed(&self) -> bool {
        self.tx.is_disconnected()
    }

    /// Requests other clients run on the backend, as the loop last saw it.
    pub fn external_load(&self) -> usize {
        self.external.load(Ordering::Relaxed) & !NOT_ACCEPTING
    }

    /// Whether the engine takes new trajectories, as the loop last saw it.
    pub fn accepting(&self) -> bool {
        self.external.load(Ordering::Relaxed) & NOT_ACCEPTING == 0
    }
}

/// The bit of the loop's published external load that says the engine takes no new
/// trajectories ([`GenerationEngine::accepting`]).
const NOT_ACCEPTING: usize = 1 << (usize::BITS - 1);

/// Capacity of the command seam. ADD is sent with `send_async`, so a full seam makes the
/// episode wait (back-pressure); control commands are small and rare.
pub const ENGINE_QUEUE_CAPACITY: usize = 16_384;

/// Starts an engine loop for `engine`.
pub fn spawn_engine(
    engine: Box<dyn GenerationEngine>,
    placement: LoopPlacement,
) -> (EngineHandle, EngineLoopJoin) {
    let (tx, rx) = flume::bounded(ENGINE_QUEUE_CAPACITY);
    let external = Arc::new(AtomicUsize::new(0));
    let ext = external.clone();
    let join = match placement {
        LoopPlacement::Task => EngineLoopJoin::Task(tokio::spawn(engine_loop(engine, rx, ext))),
        LoopPlacement::Thread => EngineLoopJoin::Thread(
            std::thread::Builder::new()
                .name("rollarc-engine".into())
                .spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_time()
                        .build();
                    match rt {
                        Ok(rt) => rt.block_on(engine_loop(engine, rx, ext)),
                        Err(e) => {
                            tracing::error!(error = %e, "engine thread could not build its runtime")
                        }
                    }
                })
                .ok(),
        ),
    };
    (EngineHandle { tx, external }, join)
}

/// Owner of the engine loop's task or thread.
pub enum EngineLoopJoin {
    Task(tokio::task::JoinHandle<()>),
    Thread(Option<std::thread::JoinHandle<()>>),
}

impl EngineLoopJoin {
    /// Kills a task-placed loop at once (threads stop on `Stop` or when the seam closes).
    pub fn kill(&self) {
        if let Self::Task(h) = self {
            h.abort();
        }
    }
}

struct LoopState {
    engine: Box<dyn GenerationEngine>,
    /// Ordered by request id: when the loop is killed (a frozen shard), the senders drop in
    /// this order and their episodes wake in it, so a restart is the same on every run (a
    /// `HashMap`'s order is seeded per process).
    replies: BTreeMap<u64, oneshot::Sender<Result<GenOutput, GenError>>>,
    suspended: bool,
    busy: Duration,
    steps: u64,
    pending_install: Vec<(Duration, tokio::sync::oneshot::Sender<Result<(), GenError>>)>,
}

impl LoopState {
    /// Applies one command; returns false on Stop.
    fn apply(&mut self, cmd: EngineCommand) -> bool {
        match cmd {
            EngineCommand::Add(req, reply) => {
                self.replies.insert(req.id, reply);
                self.engine.add(*req);
            }
            EngineCommand::Abort(id) => {
                self.engine.abort(id);
                if let Some(r) = self.replies.remove(&id) {
                    let _ = r.send(Err(GenError::Aborted));
                }
            }
            EngineCommand::Release(s) => self.engine.release(s),
            EngineCommand::Cached(s, reply) => {
                let _ = reply.send(self.engine.cached(s));
            }
            EngineCommand::Suspend(ack) => {
                self.suspended = true;
                self.engine.suspend();
                let _ = ack.send(());
            }
            EngineCommand::Install(v, w, policy, ack) => {
                // The modelled swap time is slept by the loop before acknowledging.
                match self.engine.install(v, &w, policy) {
                    Ok(d) => self.pending_install.push((d, ack)),
                    Err(e) => {
                        let _ = ack.send(Err(e));
                    }
                }
            }
            EngineCommand::Resume => {
                self.suspended = false;
                self.engine.resume();
            }
            EngineCommand::Load(reply) => {
                let mut l = self.engine.load();
                l.suspended = self.suspended;
                l.steps = self.steps;
                l.busy_s = self.busy.as_secs_f64();
                let _ = reply.send(l);
            }
            EngineCommand::Stop => return false,
        }
        true
    }
}

async fn engine_loop(
    engine: Box<dyn GenerationEngine>,
    rx: flume::Receiver<EngineCommand>,
    external: Arc<AtomicUsize>,
) {
    let mut st = LoopState {
        engine,
        replies: BTreeMap::new(),
        suspended: false,
        busy: Duration::ZERO,
        steps: 0,
        pending_install: Vec::new(),
    };
    let waker = st.engine.waker();
    loop {
        let closed = if st.engine.accepting() {
            0
        } else {
            NOT_ACCEPTING
        };
        external.store(
            st.engine.external_load().min(!NOT_ACCEPTING) | closed,
            Ordering::Relaxed,
        );
        // Drain every pending command between engine steps.
        while let Ok(cmd) = rx.try_recv() {
            if !st.apply(cmd) {
                return;
            }
        }
        for (d, ack) in std::mem::take(&mut st.pending_install) {
            if !d.is_zero() {
                tokio::time::sleep(d).await;
                st.busy += d;
            }
            let _ = ack.send(Ok(()));
        }
        if st.suspended || !st.engine.has_work() {
            let cmd = match (&waker, st.suspended) {
                (Some(w), false) => tokio::select! {
                    cmd = rx.recv_async() => Some(cmd),
                    () = w.notified() => None,
                },
                _ => Some(rx.recv_async().await),
            };
            match cmd {
                Some(Ok(cmd)) => {
                    if !st.apply(cmd) {
                        return;
                    }
                    continue;
                }
                Some(Err(_)) => return,
                // Work completed elsewhere: look again.
                None => continue,
            }
        }
        let fusable = st.engine.fusable();
        if fusable >= 2 {
            if !fused_step(&mut st, &rx, fusable).await {
                return;
            }
            continue;
        }
        let started = tokio::time::Instant::now();
        let report = st.engine.step();
        st.steps += 1;
        if !report.modelled.is_zero() {
            tokio::time::sleep(report.modelled).await;
        }
        st.busy += started.elapsed().max(report.modelled);
        st.deliver(report);
    }
}

impl LoopState {
    fn deliver(&mut self, report: StepReport) {
        for (id, result) in report.finished {
            if let Some(r) = self.replies.remove(&id) {
                let _ = r.send(result);
            }
        }
    }
}

/// Runs `k` fused decode iterations as one sleep. A command that arrives meanwhile ends the
/// step at the first iteration boundary after it (where an engine stepping one iteration at a
/// time would have applied it); the command is applied after the step. Returns false when
/// that command was `Stop` or the seam closed.
async fn fused_step(st: &mut LoopState, rx: &flume::Receiver<EngineCommand>, k: u64) -> bool {
    let started = tokio::time::Instant::now();
    let full = st.engine.fused_time(k);
    let mut iterations = k;
    let mut pending = None;
    tokio::select! {
        biased;
        cmd = rx.recv_async() => {
            let elapsed = started.elapsed();
            // The iteration in progress completes: the smallest j with time(j) ≥ elapsed.
            let (mut lo, mut hi) = (1, k);
            while lo < hi {
                let mid = (lo + hi) / 2;
                if st.engine.fused_time(mid) >= elapsed { hi = mid } else { lo = mid + 1 }
            }
            iterations = lo;
            let end = started + st.engine.fused_time(iterations);
            tokio::time::sleep_until(end).await;
            match cmd {
                Ok(c) => pending = Some(c),
                Err(_) => return false,
            }
        }
        _ = tokio::time::sleep(full) => {}
    }
    let report = st.engine.advance(iterations);
    st.steps += 1;
    st.busy += started.elapsed().max(report.modelled);
    st.deliver(report);
    match pending {
        Some(cmd) => st.apply(cmd),
        None => true,
    }
}
