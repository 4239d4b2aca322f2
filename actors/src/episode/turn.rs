//! One turn's generation: the context the policy sees, the observation's tokens joining it,
//! the context budget (and dropping the oldest turns to meet it), the request to the shard
//! (or to a disaggregated prefill/decode pair) and the answer's tokens joining the context.

use std::sync::Arc;

use tracing::Instrument;

use super::{
    EpisodeParams, EpisodeShared, EpisodeTask, Framing, FramingError, PrefillRoute, Truncation,
    release, secs,
};
use crate::env::Observation;
use crate::generation::shard::ShardHandle;
use crate::generation::{GenError, GenOutput, GenRequest, SamplingParams};
use crate::types::{FailureReason, Tokens, Trajectory, Turn};

/// The context the policy sees, and what was left out of it.
#[derive(Default)]
pub(super) struct Context {
    /// Shared with the engine while a request is in flight; appended in place once the
    /// engine has let go of it (no copy of the whole history per turn).
    tokens: Arc<Tokens>,
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
        let mut v = Tokens::new();
        for t in std::iter::once(&turns[0]).chain(&turns[1 + d..]) {
            v.extend_from(&t.observation_tokens);
            v.extend_from(&t.response_tokens);
        }
        self.tokens = Arc::new(v);
        true
    }

    /// The tokens this turn may hold: the task's budget and the model's limit, whichever is
    /// smaller (none while neither is known).
    fn budget(&self, task: &EpisodeTask) -> Option<usize> {
        match (task.max_context, self.model_limit) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// Why a turn did not produce an answer.
pub(super) enum TurnEnd {
    Failed(FailureReason),
    /// The context budget is reached (the detail says where).
    Truncated(String),
}

fn encode(
    obs: &Observation,
    framing: Option<&dyn Framing>,
    first: bool,
    previous: Option<&Tokens>,
) -> Result<Tokens, FramingError> {
    Ok(match (framing, &obs.tokens) {
        (Some(f), _) => match &obs.messages {
            Some(m) if first => f.prompt(m)?.into(),
            _ => f
                .observation(&obs.text, first, previous.map_or(&[][..], |t| &t[..]))?
                .into(),
        },
        (None, Some(t)) => t.clone(),
        (None, None) => obs.text.bytes().map(u32::from).collect(),
    })
}

/// One generation: the observation's tokens join the context, the shard answers, and the
/// answer's tokens join the context too (nothing is re-tokenised). Under
/// `Truncation::DropOldestTurns` the oldest turns leave the context first when the turn would
/// not fit (the task's budget, or the model's limit once an engine names it: the turn is then
/// tried again once).
pub(super) async fn generate(
    shared: &EpisodeShared,
    p: &EpisodeParams,
    obs: &Observation,
    turn_no: u32,
    context: &mut Context,
    traj: &mut Trajectory,
) -> Result<Turn, TurnEnd> {
    let task = &shared.tasks[p.task];
    let previous = traj.turns.last().map(|t| &t.response_tokens);
    let observation_tokens = encode(obs, shared.framing.as_deref(), turn_no == 0, previous)
        .map_err(|e| TurnEnd::Failed(FailureReason::EnvFailed(infra::error_chain(&e))))?;
    let dropping = task.truncation == Truncation::DropOldestTurns;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let max_tokens = fit_budget(task, p, turn_no, observation_tokens.len(), context, traj)?;
        let base = context.tokens.len();
        Arc::make_mut(&mut context.tokens).extend_from(&observation_tokens);
        let mut req = request(shared, p, obs, turn_no, context.tokens.clone(), max_tokens);
        if task.context_keep < 1.0 {
            req.reusable = Some((task.context_keep.max(0.0) * base as f64) as u64);
        }
        let t = tokio::time::Instant::now();
        let started_at_s = t.duration_since(shared.started).as_secs_f64();
        let out = call_shard(p, Box::new(req)).await;
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
            Err(e) => return Err(turn_end(turn_no, e)),
        };
        Arc::make_mut(&mut context.tokens).extend_from(&out.tokens);
        return Ok(Turn {
            observation_tokens,
            response_tokens: out.tokens,
            logprobs: out.logprobs,
            versions: out.versions,
            env_reward: 0.0,
            prefill_tokens: out.prefill_tokens,
            started_at_s,
            dropped: context.dropped,
            ..Turn::default()
        });
    }
}

/// The answer's token budget for an observation of `observation_len` tokens: the task's per-turn
/// maximum, cut to what the context budget leaves (after dropping the oldest turns where the
/// task does); `Truncated` when not even one answer token fits.
fn fit_budget(
    task: &EpisodeTask,
    p: &EpisodeParams,
    turn_no: u32,
    observation_len: usize,
    context: &mut Context,
    traj: &Trajectory,
) -> Result<u32, TurnEnd> {
    let mut max_tokens = task.max_tokens_per_turn;
    let Some(budget) = context.budget(task) else {
        return Ok(max_tokens);
    };
    // The budget: the observation must fit with room for at least one answer token.
    let want = observation_len + max_tokens as usize;
    if task.truncation == Truncation::DropOldestTurns && context.tokens.len() + want > budget {
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
    let used = context.tokens.len() + observation_len;
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
    Ok(max_tokens)
}

/// The request of turn `turn_no` on `context`, sampled the task's way.
fn request(
    shared: &EpisodeShared,
    p: &EpisodeParams,
    obs: &Observation,
    turn_no: u32,
    context: Arc<Tokens>,
    max_tokens: u32,
) -> GenRequest {
    let task = &shared.tasks[p.task];
    GenRequest {
        id: p.id,
        session: p.id,
        context,
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
        reusable: None,
        carried: 0,
    }
}

/// Sends `req` to the episode's shard, or through its prefill route when disaggregated.
async fn call_shard(p: &EpisodeParams, req: Box<GenRequest>) -> Result<GenOutput, GenError> {
    match &p.prefill {
        None => {
            p.shard
                .generate_boxed(req)
                .instrument(tracing::info_span!(target: infra::telemetry::TRACE_TARGET, "generate"))
                .await
        }
        // Boxed: its future is twice the size of a plain call's, and inline every episode's
        // future would carry that room (memory per in-flight trajectory).
        Some(route) => {
            Box::pin(disaggregated(route, &p.shard, *req))
                .instrument(tracing::info_span!(target: infra::telemetry::TRACE_TARGET, "generate"))
                .await
        }
    }
}

/// How a generation error of turn `turn_no` ends the episode.
fn turn_end(turn_no: u32, e: GenError) -> TurnEnd {
    match e {
        GenError::ContextTooLong { len, limit } => TurnEnd::Truncated(format!(
            "turn {turn_no}: a context of {len} tokens is past the model's limit of {limit}"
        )),
        GenError::Aborted => TurnEnd::Failed(FailureReason::GenerationFailed("aborted".into())),
        other => TurnEnd::Failed(FailureReason::GenerationFailed(other.to_string())),
    }
}

/// One turn on a disaggregated pool: the prefill shard computes the context's KV (a request
/// with no tokens to generate), the KV travels to the decode shard at the link's bandwidth,
/// and the decode shard generates from it. The prefill shard's count is the turn's.
///
/// With `kv_return` the decode side hands back the KV it holds of the session's shared prefix
/// (the last context with its answer) with the prefill request, less what the prefill side's
/// cache still holds: the prefill side needs no long-lived copy of every session (it would
/// thrash) and prefills only the new tokens, as a colocated engine would.
async fn disaggregated(
    route: &PrefillRoute,
    decode: &ShardHandle,
    req: GenRequest,
) -> Result<GenOutput, GenError> {
    let transfer = |tokens: u64| {
        crate::dist::seconds(tokens as f64 * route.kv_bytes_per_token / route.bandwidth.max(1.0))
    };
    let mut pre = req.clone();
    pre.params.max_tokens = 0;
    if route.kv_return {
        // The decode side's KV of the shared prefix travels with the prefill request, less
        // what the prefill side's cache still holds of it.
        let shared = req.reusable.unwrap_or(u64::MAX);
        let back = decode.cached(req.session).await.min(shared);
        let held = route.shard.cached(req.session).await.min(shared);
        if back > held {
            tokio::time::sleep(transfer(back - held)).await;
        }
        pre.carried = back;
    }
    let prefilled = route
        .shard
        .generate_boxed(Box::new(pre))
        .await?
        .prefill_tokens;
    if prefilled > 0 {
        tokio::time::sleep(transfer(u64::from(prefilled))).await;
    }
    let mut out = decode
        .generate_boxed(Box::new(GenRequest {
            prefilled: true,
            ..req
        }))
        .await?;
    out.prefill_tokens = prefilled;
    Ok(out)
}
