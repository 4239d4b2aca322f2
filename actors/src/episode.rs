//! The episode driver: one trajectory from reset to reward. Short-lived, owned (and aborted)
//! by the scheduler, which awaits its [`EpisodeOutcome`]. Token ids flow end to end: the context is the previous context plus the
//! generated tokens plus the new observation's tokens; nothing is re-tokenised.
//!
//! The driving of one trajectory (environment, turns, barrier, reward) is in `drive`; one
//! turn's generation (context budget, request, disaggregated prefill) in `turn`.

use std::sync::Arc;

use ractor::ActorRef;
use tracing::Instrument;

use crate::buffer::BufferMsg;
use crate::env::{EnvError, EnvPool};
use crate::generation::shard::ShardHandle;
use crate::reward::SharedScorer;
use crate::types::{PolicyVersion, Trajectory};

mod agent;
pub mod barrier;
mod drive;
pub mod framing;
mod turn;

use drive::drive;

pub use barrier::WaveBarrier;
pub use framing::{ByteFraming, ChatFraming, Framing, FramingError};

/// What every episode of a job shares.
pub struct EpisodeShared {
    pub buffer: ActorRef<BufferMsg>,
    /// Where new episodes' trace spans hang (the training step in progress).
    pub trace_parent: Arc<TraceParent>,
    pub tasks: Vec<EpisodeTask>,
    pub epoch: u64,
    pub started: tokio::time::Instant,
    pub batch_barrier: bool,
    /// The built-in policy's framing of observations and answers (byte-level or the
    /// checkpoint's chat template). `None`: simulated tokens.
    pub framing: Option<Arc<dyn Framing>>,
}

/// The span new episodes' trace spans are children of: the training step in progress (the
/// job's span before the first step). The step driver sets it at each step's start, so an
/// episode hangs under the step during which it started (under asynchrony it may train in a
/// later one). A step's span closes once the episodes under it have ended.
#[derive(Debug)]
pub struct TraceParent(std::sync::Mutex<tracing::Span>);

impl TraceParent {
    pub fn new(span: tracing::Span) -> Self {
        Self(std::sync::Mutex::new(span))
    }

    pub fn set(&self, span: tracing::Span) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = span;
    }

    pub fn get(&self) -> tracing::Span {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// The episode's trace span (see [`infra::telemetry::TRACE_TARGET`]).
fn episode_span(shared: &EpisodeShared, p: &EpisodeParams, eval: bool) -> tracing::Span {
    let parent = shared.trace_parent.get();
    tracing::info_span!(
        target: infra::telemetry::TRACE_TARGET,
        parent: &parent,
        "episode",
        episode = p.id,
        group = p.group,
        task = %shared.tasks[p.task].domain,
        seed = p.seed,
        eval,
        reward = tracing::field::Empty,
        success = tracing::field::Empty,
        turns = tracing::field::Empty,
    )
}

/// A task as episodes see it.
pub struct EpisodeTask {
    pub domain: String,
    pub envs: EnvPool,
    pub scorers: Vec<SharedScorer>,
    pub max_turns: u32,
    pub max_tokens_per_turn: u32,
    /// Constrained decoding: the tokens the policy may sample.
    pub allowed_tokens: Option<Arc<[u32]>>,
    /// The share of the previous turn's context (prompt and answer) that the next turn's
    /// context keeps as its prefix, for the engines' prefix caches: 1 when the history only
    /// grows (`append`), 0 when the prompt is re-rendered every turn (`rewrite`: the shard
    /// forgets the session between turns), in between for partly rewritten histories (what a
    /// simulated engine reuses; real engines match the real tokens).
    pub context_keep: f64,
    /// The job's fault budgets; environment calls count against `environments of task …`.
    pub faults: Option<Arc<crate::fault::Faults>>,
    /// Tokens a trajectory's context may hold (prompt, observations and answers); a turn's
    /// answer is cut to what is left. Reaching it — or the model's own context — ends the
    /// episode as `truncated` instead of failing it.
    pub max_context: Option<usize>,
    /// Whether truncated trajectories train (otherwise they are masked, never retried).
    pub train_truncated: bool,
    /// What reaching the context budget does: end the episode, or drop the oldest turns
    /// (after the first) from the context and go on.
    pub truncation: Truncation,
    /// Sampling temperature of the policy.
    pub temperature: f32,
    /// Agent tasks: who plays their episodes (a managed program, an external harness). The
    /// environment pool then only bounds how many run at once.
    pub agent: Option<crate::agent::SharedRunner>,
}

/// What an episode does when its next turn would not fit the context budget.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Truncation {
    /// End the episode with status `truncated`.
    #[default]
    End,
    /// Leave the oldest turns (all but the first, which holds the task) out of the context
    /// until the next turn fits with room for a whole answer; end (`truncated`) only when it
    /// cannot fit even so. For environments whose observations carry their state.
    DropOldestTurns,
}

impl EpisodeTask {
    /// Counts an environment call's outcome against the task's fault budget.
    fn env_outcome<T>(&self, r: &Result<T, EnvError>) {
        let Some(f) = &self.faults else {
            return;
        };
        let dependency = format!("environments of task `{}`", self.domain);
        match r {
            Ok(_) => f.ok(&dependency),
            Err(e) => f.failed(&dependency, &infra::error_chain(e)),
        }
    }
}

/// One episode to drive.
pub struct EpisodeParams {
    pub id: u64,
    pub group: u64,
    pub task: usize,
    pub seed: u64,
    pub sample_seed: u64,
    pub start_version: PolicyVersion,
    pub shard: ShardHandle,
    pub barrier: Option<Arc<WaveBarrier>>,
    /// Prefill/decode disaggregation: where each turn's prefill runs.
    pub prefill: Option<PrefillRoute>,
    /// The group's dataset row (tasks with a dataset), handed to the environment's reset.
    pub record: Option<crate::env::Record>,
    /// Tokens prefilled and generated so far, for whoever may cancel the episode (what a
    /// cancellation wastes).
    pub progress: Option<Arc<std::sync::atomic::AtomicU64>>,
}

/// The prefill side of a disaggregated pool for one trajectory.
#[derive(Clone)]
pub struct PrefillRoute {
    pub shard: ShardHandle,
    /// KV transfer bandwidth, bytes/s.
    pub bandwidth: f64,
    pub kv_bytes_per_token: f64,
    /// After each turn the decode side hands the turn's KV back to the prefill side (over the
    /// same link), so the next turn prefills only its new tokens there.
    pub kv_return: bool,
}

/// Seconds since `since`.
fn secs(since: tokio::time::Instant) -> f64 {
    since.elapsed().as_secs_f64()
}

/// What the scheduler learns when an episode ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpisodeOutcome {
    pub episode: u64,
    pub task: usize,
    /// Tokens prefilled and generated (for the cost model).
    pub prefill: u64,
    pub decode: u64,
    /// The mean context a generated token attended to ([`Trajectory::decode_context`],
    /// rounded): what the cost model sizes decode steps by.
    pub context: u64,
    /// Masked for an infrastructure failure (the buffer decides about a retry).
    pub failed: bool,
}

/// Drives one trajectory, hands it to the sample buffer and returns its outcome.
///
/// Not an `async fn`: that would keep `p` in its future a second time, beside the block's
/// own (memory per in-flight trajectory).
pub fn run(
    shared: Arc<EpisodeShared>,
    p: EpisodeParams,
) -> impl Future<Output = EpisodeOutcome> + Send {
    let span = episode_span(&shared, &p, false);
    let inner = span.clone();
    async move {
        let traj = drive(&shared, &p).await;
        record_outcome(&inner, &traj);
        let outcome = EpisodeOutcome {
            episode: p.id,
            task: p.task,
            prefill: traj.prefill_tokens() as u64,
            decode: traj.response_tokens() as u64,
            context: traj.decode_context().round() as u64,
            failed: traj.failure.is_some(),
        };
        // The buffer is critical: if it is gone the job is failing already.
        let _ = shared.buffer.cast(BufferMsg::Record(Box::new(traj)));
        outcome
    }
    .instrument(span)
}

/// Drives one trajectory and returns it instead of handing it to the buffer (held-out
/// evaluation: nothing trains on it).
pub async fn run_detached(shared: &EpisodeShared, p: &EpisodeParams) -> Trajectory {
    let span = episode_span(shared, p, true);
    let traj = drive(shared, p).instrument(span.clone()).await;
    record_outcome(&span, &traj);
    traj
}

fn record_outcome(span: &tracing::Span, traj: &Trajectory) {
    if let Some(r) = traj.reward {
        span.record("reward", r);
    }
    span.record("success", traj.success);
    span.record("turns", traj.turns.len());
}

/// Lets the engine(s) drop this episode's cached prefix.
fn release(p: &EpisodeParams) {
    p.shard.release(p.id);
    if let Some(route) = &p.prefill {
        route.shard.release(p.id);
    }
}
