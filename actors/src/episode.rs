//! The episode driver: one trajectory from reset to reward. Short-lived, owned (and aborted)
//! by the scheduler, which awaits its [`EpisodeOutcome`]. Token ids flow end to end: the context is the previous context plus the
//! generated tokens plus the new observation's tokens; nothing is re-tokenised.

use std::sync::Arc;

use ractor::ActorRef;
use tracing::Instrument;

use crate::buffer::BufferMsg;
use crate::env::{EnvError, EnvPool, Observation};
use crate::generation::shard::ShardHandle;
use crate::generation::{GenError, GenRequest, SamplingParams};
use crate::reward::SharedScorer;
use crate::types::{FailureReason, PolicyVersion, Timings, Trajectory, Turn};

pub mod barrier;
pub mod framing;

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
    /// The prompt is re-rendered every turn: no prefix survives between turns.
    pub rewrite_context: bool,
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

/// The context the policy sees, and what was left out of it.
struct Context {
    /// Shared with the engine while a request is in flight; appended in place once the
    /// engine has let go of it (no copy of the whole history per turn).
    tokens: Arc<Vec<u32>>,
    /// Turns after the first left out of it (`Truncation::DropOldestTurns`).
    dropped: u32,
    /// The model's own context limit, once an engine has named it.
    model_limit: Option<usize>,
}

impl Context {
    /// Leaves turns out (after the first) until `extra` more tokens fit in `budget`, or
    /// every turn but the first and none of `turns` fit; rebuilds the tokens if anything
    /// was left out. Returns whether it was.
    fn drop_to_fit(&mut self, turns: &[Turn], extra: usize, budget: usize) -> bool {
        let size = |t: &Turn| t.observation_tokens.len() + t.response_tokens.len();
        if turns.len() < 2 {
            return false;
        }
        let mut d = self.dropped as usize;
        let mut len = self.tokens.len();
        while len + extra > budget && 1 + d < turns.len() {
            len -= size(&turns[1 + d]);
            d += 1;
        }
        if d == self.dropped as usize {
            return false;
        }
        self.dropped = u32::try_from(d).unwrap_or(u32::MAX);
        let mut v = Vec::with_capacity(len + extra);
        for t in std::iter::once(&turns[0]).chain(&turns[1 + d..]) {
            v.extend_from_slice(&t.observation_tokens);
            v.extend_from_slice(&t.response_tokens);
        }
        self.tokens = Arc::new(v);
        true
    }
}

/// Why a turn did not produce an answer.
enum TurnEnd {
    Failed(FailureReason),
    /// The context budget is reached (the detail says where).
    Truncated(String),
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
}

/// Leaves the wave barrier if the episode is dropped (cancelled) before finishing.
struct BarrierGuard(Option<Arc<WaveBarrier>>, bool, u64);

impl BarrierGuard {
    fn finish(&mut self) {
        if let Some(b) = &self.0
            && !self.1
        {
            b.finish(self.2);
            self.1 = true;
        }
    }
}

impl Drop for BarrierGuard {
    fn drop(&mut self) {
        if let Some(b) = &self.0
            && !self.1
        {
            b.leave();
        }
    }
}

fn secs(since: tokio::time::Instant) -> f64 {
    since.elapsed().as_secs_f64()
}

fn encode(
    obs: &Observation,
    framing: Option<&dyn Framing>,
    first: bool,
    previous: &[u32],
) -> Result<Vec<u32>, FramingError> {
    Ok(match (framing, &obs.tokens) {
        (Some(f), _) => match &obs.messages {
            Some(m) if first => f.prompt(m)?,
            _ => f.observation(&obs.text, first, previous)?,
        },
        (None, Some(t)) => t.clone(),
        (None, None) => obs.text.bytes().map(u32::from).collect(),
    })
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
pub async fn run(shared: Arc<EpisodeShared>, p: EpisodeParams) -> EpisodeOutcome {
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
    .await
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

async fn drive(shared: &EpisodeShared, p: &EpisodeParams) -> Trajectory {
    let task = &shared.tasks[p.task];
    let mut guard = BarrierGuard(p.barrier.clone(), false, p.group);
    let mut traj = new_trajectory(shared, p, task);
    let wait0 = tokio::time::Instant::now();
    let Some(mut env) = task.envs.lease().await else {
        traj.failure = Some(FailureReason::EnvFailed("environment pool closed".into()));
        guard.finish();
        return traj;
    };
    traj.timings.wait_s += secs(wait0);
    let t = tokio::time::Instant::now();
    let first = env
        .reset(p.seed, p.record.clone())
        .instrument(tracing::info_span!(target: infra::telemetry::TRACE_TARGET, "env.reset"))
        .await;
    traj.timings.reset_s = secs(t);
    task.env_outcome(&first);
    let mut obs = match first {
        Ok(o) => o,
        Err(e) => {
            traj.failure = Some(env_failure(e));
            guard.finish();
            return traj;
        }
    };
    traj.reference = obs.reference.take();
    let mut context = Context {
        tokens: Arc::new(Vec::new()),
        dropped: 0,
        model_limit: None,
    };
    for turn_no in 0..task.max_turns {
        let turn_span =
            tracing::info_span!(target: infra::telemetry::TRACE_TARGET, "turn", turn = turn_no);
        if let Some(b) = &p.barrier
            && turn_no > 0
        {
            let w = tokio::time::Instant::now();
            b.turn().await;
            traj.timings.wait_s += secs(w);
        }
        if task.rewrite_context && turn_no > 0 {
            release(p);
        }
        let mut turn = match generate(shared, p, &obs, turn_no, &mut context, &mut traj)
            .instrument(turn_span.clone())
            .await
        {
            Ok(turn) => {
                if let Some(c) = &p.progress {
                    c.fetch_add(
                        u64::from(turn.prefill_tokens) + turn.response_tokens.len() as u64,
                        std::sync::atomic::Ordering::Relaxed,
                    );
                }
                turn
            }
            Err(TurnEnd::Failed(failure)) => {
                traj.failure = Some(failure);
                break;
            }
            Err(TurnEnd::Truncated(why)) => {
                traj.truncated = true;
                // Nothing to train on without a single answer; a task that does not train
                // truncated trajectories masks them too. Neither is retried.
                if traj.turns.is_empty() || !task.train_truncated {
                    traj.failure = Some(FailureReason::Truncated(why));
                }
                break;
            }
        };
        let action = shared
            .framing
            .as_ref()
            .map(|f| f.action(&turn.response_tokens))
            .unwrap_or_default();
        traj.final_text.clone_from(&action);
        let t = tokio::time::Instant::now();
        let stepped = env
            .step(action, turn.response_tokens.clone())
            .instrument(tracing::info_span!(target: infra::telemetry::TRACE_TARGET, parent: &turn_span, "env.step"))
            .await;
        traj.timings.env_step_s += secs(t);
        task.env_outcome(&stepped);
        match stepped {
            Ok(mut s) => {
                turn.env_reward = s.reward;
                if let Some(r) = s.observation.reference.take() {
                    traj.reference = Some(r);
                }
                traj.success |= s.success;
                traj.invalid_actions += u32::from(s.invalid_action);
                traj.turns.push(turn);
                if s.terminated || s.truncated {
                    break;
                }
                obs = s.observation;
            }
            Err(e) => {
                traj.turns.push(turn);
                traj.failure = Some(env_failure(e));
                break;
            }
        }
    }
    release(p);
    drop(env);
    guard.finish();
    if shared.batch_barrier
        && let Some(b) = &p.barrier
    {
        let w = tokio::time::Instant::now();
        b.all_finished().await;
        traj.timings.wait_s += secs(w);
    }
    if traj.failure.is_none() {
        score(task, &mut traj).await;
    }
    traj.timings.ended_at_s = tokio::time::Instant::now()
        .duration_since(shared.started)
        .as_secs_f64();
    traj
}

/// An empty trajectory of this episode, started now.
fn new_trajectory(shared: &EpisodeShared, p: &EpisodeParams, task: &EpisodeTask) -> Trajectory {
    Trajectory {
        id: format!("r{}-g{}-e{}", shared.epoch, p.group, p.id),
        group_id: p.group,
        task: task.domain.clone(),
        seed: p.seed,
        start_version: p.start_version,
        pool: p.shard.pool.clone(),
        shard: p.shard.index,
        turns: Vec::new(),
        reward: None,
        success: false,
        invalid_actions: 0,
        failure: None,
        reference: None,
        final_text: String::new(),
        allowed_tokens: task.allowed_tokens.as_deref().map(<[u32]>::to_vec),
        truncated: false,
        timings: Timings {
            started_at_s: tokio::time::Instant::now()
                .duration_since(shared.started)
                .as_secs_f64(),
            ..Timings::default()
        },
    }
}

/// Lets the engine(s) drop this episode's cached prefix.
fn release(p: &EpisodeParams) {
    p.shard.release(p.id);
    if let Some(route) = &p.prefill {
        route.shard.release(p.id);
    }
}

/// One generation: the observation's tokens join the context, the shard answers, and the
/// answer's tokens join the context too (nothing is re-tokenised). Under
/// `Truncation::DropOldestTurns` the oldest turns leave the context first when the turn would
/// not fit (the task's budget, or the model's limit once an engine names it: the turn is then
/// tried again once).
async fn generate(
    shared: &EpisodeShared,
    p: &EpisodeParams,
    obs: &Observation,
    turn_no: u32,
    context: &mut Context,
    traj: &mut Trajectory,
) -> Result<Turn, TurnEnd> {
    let task = &shared.tasks[p.task];
    let previous = traj
        .turns
        .last()
        .map_or(&[][..], |t| &t.response_tokens[..]);
    let observation_tokens = encode(obs, shared.framing.as_deref(), turn_no == 0, previous)
        .map_err(|e| TurnEnd::Failed(FailureReason::EnvFailed(infra::error_chain(&e))))?;
    let dropping = task.truncation == Truncation::DropOldestTurns;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let budget = match (task.max_context, context.model_limit) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        // The budget: the observation must fit with room for at least one answer token.
        let mut max_tokens = task.max_tokens_per_turn;
        if let Some(budget) = budget {
            let want = observation_tokens.len() + max_tokens as usize;
            if dropping && context.tokens.len() + want > budget {
                let was = context.dropped;
                if context.drop_to_fit(&traj.turns, want, budget) {
                    // The context no longer extends the cached one.
                    release(p);
                    tracing::debug!(
                        episode = p.id,
                        turn = turn_no,
                        dropped = context.dropped - was,
                        "turns left out of the context"
                    );
                }
            }
            let used = context.tokens.len() + observation_tokens.len();
            if used >= budget {
                return Err(TurnEnd::Truncated(match task.max_context {
                    Some(m) if m == budget => format!(
                        "turn {turn_no}: the context would hold {used} tokens, the task's max_context_tokens is {budget}"
                    ),
                    _ => format!(
                        "turn {turn_no}: a context of {used} tokens is past the model's limit of {budget}"
                    ),
                }));
            }
            max_tokens = max_tokens.min(u32::try_from(budget - used).unwrap_or(u32::MAX));
        }
        let base = context.tokens.len();
        Arc::make_mut(&mut context.tokens).extend_from_slice(&observation_tokens);
        let req = GenRequest {
            id: p.id,
            session: p.id,
            context: context.tokens.clone(),
            params: SamplingParams {
                temperature: task.temperature,
                top_p: 1.0,
                max_tokens,
                stop_tokens: shared
                    .framing
                    .as_ref()
                    .map(|f| f.stop_ids())
                    .unwrap_or_default(),
                seed: p.sample_seed ^ (u64::from(turn_no) << 48),
                allowed_tokens: task.allowed_tokens.clone(),
                top_k: 0,
                stop_strings: Vec::new(),
                ignore_eos: false,
            },
            sim_response_len: obs.sim_response_len,
            prefilled: false,
        };
        let t = tokio::time::Instant::now();
        let started_at_s = t.duration_since(shared.started).as_secs_f64();
        let out = match &p.prefill {
            None => {
                p.shard
                    .generate(req)
                    .instrument(
                        tracing::info_span!(target: infra::telemetry::TRACE_TARGET, "generate"),
                    )
                    .await
            }
            Some(route) => {
                disaggregated(route, &p.shard, req)
                    .instrument(
                        tracing::info_span!(target: infra::telemetry::TRACE_TARGET, "generate"),
                    )
                    .await
            }
        };
        traj.timings.generate_s += secs(t);
        let out = match out {
            Ok(out) => out,
            // The model's own context is full: with turns to leave out, fit them to its
            // limit and try once more; otherwise the episode ends here (it would fail again).
            Err(GenError::ContextTooLong { limit, .. })
                if dropping && attempt == 1 && context.model_limit.is_none() =>
            {
                context.model_limit = Some(limit);
                Arc::make_mut(&mut context.tokens).truncate(base);
                continue;
            }
            Err(e) => {
                return Err(match e {
                    GenError::ContextTooLong { len, limit } => TurnEnd::Truncated(format!(
                        "turn {turn_no}: a context of {len} tokens is past the model's limit of {limit}"
                    )),
                    GenError::Aborted => {
                        TurnEnd::Failed(FailureReason::GenerationFailed("aborted".into()))
                    }
                    other => TurnEnd::Failed(FailureReason::GenerationFailed(other.to_string())),
                });
            }
        };
        Arc::make_mut(&mut context.tokens).extend_from_slice(&out.tokens);
        return Ok(Turn {
            observation_tokens,
            response_tokens: out.tokens,
            logprobs: out.logprobs,
            versions: out.versions,
            env_reward: 0.0,
            prefill_tokens: out.prefill_tokens,
            started_at_s,
            dropped: context.dropped,
        });
    }
}

/// Calls the task's reward functions; the first failure masks the trajectory.
async fn score(task: &EpisodeTask, traj: &mut Trajectory) {
    let t = tokio::time::Instant::now();
    let mut total = 0.0;
    for s in &task.scorers {
        match s
            .score(traj)
            .instrument(tracing::info_span!(target: infra::telemetry::TRACE_TARGET, "reward"))
            .await
        {
            Ok(r) => total += r,
            Err(e) => {
                traj.failure = Some(FailureReason::RewardFailed(infra::error_chain(&e)));
                break;
            }
        }
    }
    traj.timings.reward_s = secs(t);
    if traj.failure.is_none() {
        traj.reward = Some(total);
    }
}

/// One turn on a disaggregated pool: the prefill shard computes the context's KV (a request
/// with no tokens to generate), the KV travels to the decode shard at the link's bandwidth,
/// and the decode shard generates from it. The prefill shard's count is the turn's.
async fn disaggregated(
    route: &PrefillRoute,
    decode: &ShardHandle,
    req: GenRequest,
) -> Result<crate::generation::GenOutput, GenError> {
    let mut pre = req.clone();
    pre.params.max_tokens = 0;
    let prefilled = route.shard.generate(pre).await?.prefill_tokens;
    let bytes = prefilled as f64 * route.kv_bytes_per_token;
    if bytes > 0.0 {
        tokio::time::sleep(std::time::Duration::from_secs_f64(
            bytes / route.bandwidth.max(1.0),
        ))
        .await;
    }
    let mut out = decode
        .generate(GenRequest {
            prefilled: true,
            ..req
        })
        .await?;
    out.prefill_tokens = prefilled;
    Ok(out)
}

fn env_failure(e: EnvError) -> FailureReason {
    match e {
        EnvError::Timeout(_) => FailureReason::EnvTimeout,
        other => FailureReason::EnvFailed(infra::error_chain(&other)),
    }
}
