//! Environments: the trait every environment implements (built-in games, external programs
//! over the protocol, simulated latency models), and the pool episodes lease them from (its
//! actor owns their lifetimes; an episode calls its leased environment directly).

pub mod builtin;
pub mod delayed;
pub mod external;
pub mod mux;
mod pool;
pub mod protocol;
pub mod remote;
pub mod sim;
pub mod starts;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

pub use pool::{EnvLease, EnvPool, EnvPoolActor, PoolCore, PoolMsg, PoolShared};

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
    /// The environment's code panicked during the call (the environment is replaced).
    #[error("the environment panicked: {0}")]
    Panicked(String),
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

/// Object-safe form of [`Environment`], so a pool can hold any of them.
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

#[cfg(test)]
mod tests;
