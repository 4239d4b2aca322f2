//! Environments: the trait every environment implements (built-in games, external programs
//! over the protocol, simulated latency models), the environment actor that owns one, and the
//! pool episodes lease them from.

pub mod builtin;
pub mod delayed;
pub mod external;
pub mod mux;
pub mod protocol;
pub mod remote;
pub mod sim;
pub mod starts;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

/// What an environment shows the policy.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Observation {
    pub text: String,
    /// Token ids, when the environment produces them itself (simulators); otherwise the
    /// episode encodes `text` with the policy's tokenizer.
    pub tokens: Option<crate::tokens::Tokens>,
    /// For simulators only: the length of the simulated policy's next answer.
    pub sim_response_len: Option<u32>,
    /// The task's reference (answer, tests) for reward functions; set at reset.
    pub reference: Option<serde_json::Value>,
    /// A chat-format prompt (a dataset row's messages, roles kept); first turn only. The
    /// policy's framing renders it with its chat template instead of `text`.
    pub messages: Option<Vec<crate::model::llm::ChatMessage>>,
}

/// A dataset row handed to an environment at reset (environment protocol v2):
/// `{"index", "epoch", "position", "prompt", "answer", "row"}`.
pub type Record = Arc<serde_json::Value>;

/// The result of one step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepOutcome {
    pub observation: Observation,
    pub reward: f64,
    pub terminated: bool,
    pub truncated: bool,
    pub success: bool,
    pub invalid_action: bool,
    /// What the environment said about the step besides the flags rollarc reads (an
    /// external program's `info` without `success`, `invalid_action` and `reference`: a
    /// parsed answer, a verifier's verdict); kept with the trajectory's last step.
    pub info: Option<serde_json::Value>,
}

/// Why an environment call failed.
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    /// The environment's own report of what went wrong (an external program's `"error"`).
    #[error("environment error: {0}")]
    Reported(String),
    /// A step after the episode ended.
    #[error("step after the episode ended; reset first")]
    EpisodeOver,
    /// A step before the first reset.
    #[error("step before the first reset")]
    NotReset,
    /// A simulated environment's injected failure.
    #[error("injected failure")]
    Injected,
    /// The environment program has no command line.
    #[error("empty environment command")]
    EmptyCommand,
    #[error("cannot start the environment program")]
    Spawn(#[source] infra::process::ProcessError),
    /// The program was started without one of its pipes (`stdin` or `stdout`).
    #[error("the environment program has no {0}")]
    NoPipe(&'static str),
    #[error("environment I/O")]
    Io(#[source] std::io::Error),
    #[error("cannot encode the request to the environment")]
    Encode(#[source] serde_json::Error),
    #[error("environment protocol violation")]
    Protocol(#[source] protocol::ProtocolError),
    #[error("environment reported a non-finite reward {0}")]
    NonFiniteReward(f64),
    #[error("environment call timed out after {0:?}")]
    Timeout(Duration),
    /// The program closed its output (exit status when it is already known).
    #[error("environment exited ({})", status.as_deref().unwrap_or("status not yet known"))]
    Exited { status: Option<String> },
    #[error("environment is closed")]
    Closed,
    /// The multiplexed program serving the episode stopped (why, with its stderr's tail).
    #[error("the environment program serving this episode stopped: {0}")]
    ProcessLost(String),
    /// An env worker (`rollarc env-worker`) lost or could not take the episode.
    #[error("{0}")]
    Worker(String),
    /// A program's failure with the end of what it wrote to stderr.
    #[error("{error}; its stderr ends with:\n{stderr}")]
    WithStderr {
        error: Box<EnvError>,
        stderr: String,
    },
}

/// One environment instance. Async so that external processes and simulated latencies fit;
/// CPU-heavy built-ins simply do their work inline.
pub trait Environment: Send + 'static {
    fn reset(&mut self, seed: u64) -> impl Future<Output = Result<Observation, EnvError>> + Send;
    /// A reset that carries the task's dataset row; environments that take no data ignore it.
    fn reset_with(
        &mut self,
        seed: u64,
        record: Option<Record>,
    ) -> impl Future<Output = Result<Observation, EnvError>> + Send {
        let _ = record;
        self.reset(seed)
    }
    fn step(
        &mut self,
        action: &str,
        action_tokens: &crate::tokens::Tokens,
    ) -> impl Future<Output = Result<StepOutcome, EnvError>> + Send;
    fn close(&mut self) -> impl Future<Output = ()> + Send;
    /// The episode ended and the environment goes back to its pool (it stays open for the
    /// next episode): one that holds resources per episode elsewhere (a multiplexed program's
    /// state, an env worker's slot) frees them now rather than at the next reset.
    fn release(&mut self) -> impl Future<Output = ()> + Send {
        async {}
    }
    /// How the last reset found its sandbox (see [`starts`]); `None` for environments
    /// without one (in-process games) and before any reset.
    fn last_start(&self) -> Option<starts::Start> {
        None
    }
}

/// Object-safe form of [`Environment`], so an actor can own any of them.
pub trait DynEnvironment: Send + 'static {
    fn reset_boxed(
        &mut self,
        seed: u64,
        record: Option<Record>,
    ) -> futures::future::BoxFuture<'_, Result<Observation, EnvError>>;
    fn step_boxed<'a>(
        &'a mut self,
        action: &'a str,
        tokens: &'a crate::tokens::Tokens,
    ) -> futures::future::BoxFuture<'a, Result<StepOutcome, EnvError>>;
    fn close_boxed(&mut self) -> futures::future::BoxFuture<'_, ()>;
    fn release_boxed(&mut self) -> futures::future::BoxFuture<'_, ()>;
    fn last_start_dyn(&self) -> Option<starts::Start>;
}

impl<E: Environment> DynEnvironment for E {
    fn reset_boxed(
        &mut self,
        seed: u64,
        record: Option<Record>,
    ) -> futures::future::BoxFuture<'_, Result<Observation, EnvError>> {
        Box::pin(self.reset_with(seed, record))
    }
    fn step_boxed<'a>(
        &'a mut self,
        action: &'a str,
        tokens: &'a crate::tokens::Tokens,
    ) -> futures::future::BoxFuture<'a, Result<StepOutcome, EnvError>> {
        Box::pin(self.step(action, tokens))
    }
    fn close_boxed(&mut self) -> futures::future::BoxFuture<'_, ()> {
        Box::pin(self.close())
    }
    fn release_boxed(&mut self) -> futures::future::BoxFuture<'_, ()> {
        Box::pin(self.release())
    }
    fn last_start_dyn(&self) -> Option<starts::Start> {
        self.last_start()
    }
}

/// Builds environments for a task (at start and after a restart).
pub type EnvFactory = Arc<dyn Fn(u64) -> Box<dyn DynEnvironment> + Send + Sync>;

pub enum EnvMsg {
    Reset(
        u64,
        Option<Record>,
        RpcReplyPort<Result<Observation, EnvError>>,
    ),
    Step(
        String,
        crate::tokens::Tokens,
        RpcReplyPort<Result<StepOutcome, EnvError>>,
    ),
    /// The episode ended; the environment goes back to the pool.
    Release,
    Close,
}

/// Owns one environment instance; calls are served one at a time.
pub struct EnvActor;

pub struct EnvArgs {
    pub task: String,
    pub index: u64,
    /// Place in the pool (a replacement takes the slot of the actor it replaces).
    pub slot: usize,
    pub factory: EnvFactory,
    pub counters: Arc<EnvCounters>,
}

pub struct EnvState {
    args: EnvArgs,
    env: Box<dyn DynEnvironment>,
}

/// Restarts, kills and calls of a task's environments (exported as metrics).
#[derive(Debug, Default)]
pub struct EnvCounters {
    pub restarts: AtomicU64,
    pub steps: AtomicU64,
    pub resets: AtomicU64,
    pub failures: AtomicU64,
    pub timeouts: AtomicU64,
    /// Resets that found or started a sandbox, warm and cold, with their latencies.
    pub starts: starts::StartLog,
    /// Per pool slot: time held by an episode's lease.
    held: std::sync::Mutex<Vec<Held>>,
}

#[derive(Clone, Copy, Debug, Default)]
struct Held {
    total: Duration,
    since: Option<tokio::time::Instant>,
}

impl EnvCounters {
    pub fn with_slots(n: usize) -> Self {
        Self {
            held: std::sync::Mutex::new(vec![Held::default(); n]),
            ..Self::default()
        }
    }

    /// Seconds each slot's environment has been held by an episode, up to now.
    pub fn slot_held_s(&self) -> Vec<f64> {
        let now = tokio::time::Instant::now();
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        held.iter()
            .map(|h| {
                (h.total
                    + h.since
                        .map_or(Duration::ZERO, |s| now.saturating_duration_since(s)))
                .as_secs_f64()
            })
            .collect()
    }

    fn hold(&self, slot: usize, on: bool) {
        let now = tokio::time::Instant::now();
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = held.get_mut(slot) {
            if let Some(s) = h.since.take() {
                h.total += now.saturating_duration_since(s);
            }
            if on {
                h.since = Some(now);
            }
        }
    }
}

impl Actor for EnvActor {
    type Msg = EnvMsg;
    type State = EnvState;
    type Arguments = EnvArgs;

    async fn pre_start(
        &self,
        _me: ActorRef<Self::Msg>,
        args: EnvArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let env = (args.factory)(args.index);
        Ok(EnvState { args, env })
    }

    async fn post_stop(
        &self,
        _me: ActorRef<Self::Msg>,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        st.env.close_boxed().await;
        Ok(())
    }

    async fn handle(
        &self,
        me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            EnvMsg::Reset(seed, record, reply) => {
                st.args.counters.resets.fetch_add(1, Ordering::Relaxed);
                let began = tokio::time::Instant::now();
                let r = st.env.reset_boxed(seed, record).await;
                if r.is_err() {
                    st.args.counters.failures.fetch_add(1, Ordering::Relaxed);
                } else if let Some(s) = st.env.last_start_dyn() {
                    st.args.counters.starts.record(s, began.elapsed());
                }
                let _ = reply.send(r);
            }
            EnvMsg::Step(action, tokens, reply) => {
                st.args.counters.steps.fetch_add(1, Ordering::Relaxed);
                let r = st.env.step_boxed(&action, &tokens).await;
                if r.is_err() {
                    st.args.counters.failures.fetch_add(1, Ordering::Relaxed);
                }
                let _ = reply.send(r);
            }
            EnvMsg::Release => st.env.release_boxed().await,
            EnvMsg::Close => me.stop(None),
        }
        Ok(())
    }
}

/// A bounded pool of environment actors for one task. Episodes lease one for the whole
/// trajectory; the lease returns it on drop. Its capacity caps the task's concurrent episodes
/// (and so its environment step concurrency): a lease request waits while all are taken.
#[derive(Clone)]
pub struct EnvPool {
    pub task: String,
    free_tx: flume::Sender<(usize, ActorRef<EnvMsg>)>,
    free_rx: flume::Receiver<(usize, ActorRef<EnvMsg>)>,
    pub size: usize,
    pub counters: Arc<EnvCounters>,
    /// Per-call wall-clock timeout; a call past it fails the trajectory and restarts the env.
    pub call_timeout: Duration,
    /// Backoff before an environment that failed is offered again.
    pub restart_backoff: Duration,
    factory: EnvFactory,
    supervisor: ractor::ActorCell,
    next_index: Arc<AtomicU64>,
}

/// One leased environment actor.
pub struct EnvLease {
    pool: EnvPool,
    slot: usize,
    env: Option<ActorRef<EnvMsg>>,
    failed: bool,
}

impl EnvPool {
    /// Spawns `size` environment actors linked to `supervisor`.
    pub async fn spawn(
        task: &str,
        size: usize,
        factory: EnvFactory,
        call_timeout: Duration,
        restart_backoff: Duration,
        supervisor: ractor::ActorCell,
    ) -> Result<Self, ractor::SpawnErr> {
        // Capacity = number of environments: every actor is always either free or leased.
        let (free_tx, free_rx) = flume::bounded(size.max(1));
        let counters = Arc::new(EnvCounters::with_slots(size));
        for i in 0..size {
            let args = EnvArgs {
                task: task.to_string(),
                index: i as u64,
                slot: i,
                factory: factory.clone(),
                counters: counters.clone(),
            };
            let (a, _) = Actor::spawn_linked(None, EnvActor, args, supervisor.clone()).await?;
            let _ = free_tx.send((i, a));
        }
        Ok(Self {
            task: task.to_string(),
            free_tx,
            free_rx,
            size,
            counters,
            call_timeout,
            restart_backoff,
            factory,
            supervisor,
            next_index: Arc::new(AtomicU64::new(size as u64)),
        })
    }

    pub async fn lease(&self) -> Option<EnvLease> {
        let (slot, env) = self.free_rx.recv_async().await.ok()?;
        self.counters.hold(slot, true);
        Some(EnvLease {
            pool: self.clone(),
            slot,
            env: Some(env),
            failed: false,
        })
    }

    pub fn available(&self) -> usize {
        self.free_rx.len()
    }

    /// Stops the environment actors that are free now (leased ones stop with their episode's
    /// job supervisor).
    pub fn close_free(&self) {
        while let Ok((_, a)) = self.free_rx.try_recv() {
            let _ = a.cast(EnvMsg::Close);
        }
    }
}

impl EnvLease {
    fn actor(&self) -> Result<&ActorRef<EnvMsg>, EnvError> {
        self.env.as_ref().ok_or(EnvError::Closed)
    }

    pub async fn reset(
        &mut self,
        seed: u64,
        record: Option<Record>,
    ) -> Result<Observation, EnvError> {
        let t = self.pool.call_timeout;
        let a = self.actor()?.clone();
        let r = call_env(&a, t, |p| EnvMsg::Reset(seed, record, p))
            .await
            .and_then(|r| r);
        self.note(&r);
        r
    }

    pub async fn step(
        &mut self,
        action: String,
        tokens: crate::tokens::Tokens,
    ) -> Result<StepOutcome, EnvError> {
        let t = self.pool.call_timeout;
        let a = self.actor()?.clone();
        let r = call_env(&a, t, |p| EnvMsg::Step(action, tokens, p))
            .await
            .and_then(|r| r);
        self.note(&r);
        r
    }

    fn note<T>(&mut self, r: &Result<T, EnvError>) {
        if let Err(e) = r {
            self.failed = true;
            if matches!(e, EnvError::Timeout(_)) {
                self.pool.counters.timeouts.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

async fn call_env<T: Send + 'static>(
    a: &ActorRef<EnvMsg>,
    timeout: Duration,
    msg: impl FnOnce(RpcReplyPort<T>) -> EnvMsg,
) -> Result<T, EnvError> {
    let (tx, rx) = ractor::concurrency::oneshot();
    a.cast(msg(tx.into())).map_err(|_| EnvError::Closed)?;
    match tokio::time::timeout(timeout, rx).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(_)) => Err(EnvError::Closed),
        Err(_) => Err(EnvError::Timeout(timeout)),
    }
}

impl Drop for EnvLease {
    fn drop(&mut self) {
        let Some(env) = self.env.take() else { return };
        let slot = self.slot;
        self.pool.counters.hold(slot, false);
        if !self.failed {
            // Served before the next lease's reset: the mailbox is in order.
            let _ = env.cast(EnvMsg::Release);
            let _ = self.pool.free_tx.try_send((slot, env));
            return;
        }
        // A failed or hung environment: kill its actor (a hung call never returns, so the
        // actor cannot be reused) and start a replacement after the backoff.
        let pool = self.pool.clone();
        tokio::spawn(async move {
            pool.counters.restarts.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(pool.restart_backoff).await;
            if let Some(a) = respawn(&env, slot, &pool).await {
                let _ = pool.free_tx.try_send((slot, a));
            }
        });
    }
}

async fn respawn(old: &ActorRef<EnvMsg>, slot: usize, pool: &EnvPool) -> Option<ActorRef<EnvMsg>> {
    old.kill();
    let index = pool.next_index.fetch_add(1, Ordering::Relaxed);
    let args = EnvArgs {
        task: pool.task.clone(),
        index,
        slot,
        factory: pool.factory.clone(),
        counters: pool.counters.clone(),
    };
    match Actor::spawn_linked(None, EnvActor, args, pool.supervisor.clone()).await {
        Ok((a, _)) => Some(a),
        Err(e) => {
            tracing::error!(task = %pool.task, error = %e, "could not respawn an environment actor");
            None
        }
    }
}
