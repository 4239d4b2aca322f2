//! Driving one trajectory: leasing and resetting an environment, playing its turns (the
//! policy answers, the environment steps), the wave barrier, and scoring the result.

use std::sync::Arc;

use tracing::Instrument;

use super::turn::{Context, TurnEnd, generate};
use super::{EpisodeParams, EpisodeShared, EpisodeTask, WaveBarrier, release, secs};
use crate::env::{EnvError, EnvLease, Observation};
use crate::types::{FailureReason, Timings, Trajectory, Turn};

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

/// Drives one trajectory from the environment's reset to its reward.
pub(super) async fn drive(shared: &EpisodeShared, p: &EpisodeParams) -> Trajectory {
    let task = &shared.tasks[p.task];
    let mut guard = BarrierGuard(p.barrier.clone(), false, p.group);
    let mut traj = new_trajectory(shared, p, task);
    if let Some(runner) = &task.agent {
        super::agent::play(shared, p, runner, &mut traj).await;
        guard.finish();
        return Box::pin(finish(shared, p, task, traj)).await;
    }
    let wait0 = tokio::time::Instant::now();
    let Some(mut env) = task.envs.lease().await else {
        traj.failure = Some(FailureReason::EnvFailed("environment pool closed".into()));
        guard.finish();
        return traj;
    };
    traj.timings.wait_s += secs(wait0);
    let Some(mut obs) = reset(task, p, &mut env, &mut traj).await else {
        guard.finish();
        return traj;
    };
    play(shared, p, &mut env, &mut obs, &mut traj).await;
    release(p);
    drop(env);
    guard.finish();
    // Boxed, like every call that is live only for a moment of the episode: the task's
    // future is as large as its largest await point, for the episode's whole life.
    Box::pin(finish(shared, p, task, traj)).await
}

/// The end of every episode: the batch barrier, the reward (unless it failed or its reward
/// is already decided) and the end time.
async fn finish(
    shared: &EpisodeShared,
    p: &EpisodeParams,
    task: &EpisodeTask,
    mut traj: Trajectory,
) -> Trajectory {
    if shared.batch_barrier
        && let Some(b) = &p.barrier
    {
        let w = tokio::time::Instant::now();
        b.all_finished().await;
        traj.timings.wait_s += secs(w);
    }
    if traj.failure.is_none() && traj.reward.is_none() {
        score(task, &mut traj).await;
    }
    // An agent episode succeeds when its reward is above its task's threshold and the policy
    // did not fail it (there is no environment to say so).
    if let Some(a) = &traj.agent {
        traj.success =
            a.policy_failure.is_none() && traj.reward.is_some_and(|r| r > a.success_above);
    }
    traj.timings.ended_at_s = tokio::time::Instant::now()
        .duration_since(shared.started)
        .as_secs_f64();
    traj
}

/// Resets the environment for this episode; returns its first observation, or `None` with
/// the failure recorded in `traj`.
async fn reset(
    task: &EpisodeTask,
    p: &EpisodeParams,
    env: &mut EnvLease,
    traj: &mut Trajectory,
) -> Option<Observation> {
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
            return None;
        }
    };
    traj.reference = obs.reference.take();
    Some(obs)
}

/// Plays turns from the first observation until the environment ends the episode, a turn
/// fails or is truncated, or the task's `max_turns` are played.
async fn play(
    shared: &EpisodeShared,
    p: &EpisodeParams,
    env: &mut EnvLease,
    obs: &mut Observation,
    traj: &mut Trajectory,
) {
    // (Big values come by reference: an async fn keeps a parameter moved into it twice in its
    // future, as the argument and as the local.)
    let task = &shared.tasks[p.task];
    let mut context = Context::default();
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
        if task.context_keep <= 0.0 && turn_no > 0 {
            release(p);
        }
        let Some(turn) = answer(shared, p, obs, turn_no, &mut context, traj, &turn_span).await
        else {
            break;
        };
        if traj.turns.capacity() == 0 {
            // The room the task's turns need, up to 8 (growth past that doubles as usual): a
            // growing Vec of 5 turns would hold 8 (memory per in-flight trajectory).
            traj.turns.reserve_exact(task.max_turns.min(8) as usize);
        }
        traj.turns.push(turn);
        match step_env(shared, task, env, &turn_span, traj).await {
            Some(next) => *obs = next,
            None => break,
        }
    }
}

/// The policy's answer to `obs` (counted in the episode's progress), or `None` with the
/// failure or truncation recorded in `traj`.
async fn answer(
    shared: &EpisodeShared,
    p: &EpisodeParams,
    obs: &Observation,
    turn_no: u32,
    context: &mut Context,
    traj: &mut Trajectory,
    turn_span: &tracing::Span,
) -> Option<Turn> {
    match generate(shared, p, obs, turn_no, context, traj)
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
            Some(turn)
        }
        Err(TurnEnd::Failed(failure)) => {
            traj.failure = Some(failure);
            None
        }
        Err(TurnEnd::Truncated(why)) => {
            traj.truncated = true;
            // Nothing to train on without a single answer; a task that does not train
            // truncated trajectories masks them too. Neither is retried.
            if traj.turns.is_empty() || !shared.tasks[p.task].train_truncated {
                traj.failure = Some(FailureReason::Truncated(why));
            }
            None
        }
    }
}

/// Steps the environment with the last turn's answer and records its reward; returns the
/// next observation, or `None` when the episode ends here (terminated, truncated or failed).
async fn step_env(
    shared: &EpisodeShared,
    task: &EpisodeTask,
    env: &mut EnvLease,
    turn_span: &tracing::Span,
    traj: &mut Trajectory,
) -> Option<Observation> {
    let turn = traj.turns.last()?;
    let response = turn.response_tokens.clone();
    let action = shared
        .framing
        .as_ref()
        .map(|f| f.action(&response))
        .unwrap_or_default();
    traj.final_text.clone_from(&action);
    let t = tokio::time::Instant::now();
    let stepped = env
        .step(action, response)
        .instrument(tracing::info_span!(target: infra::telemetry::TRACE_TARGET, parent: turn_span, "env.step"))
        .await;
    traj.timings.env_step_s += secs(t);
    task.env_outcome(&stepped);
    match stepped {
        Ok(mut s) => {
            if let Some(turn) = traj.turns.last_mut() {
                turn.env_reward = s.reward;
            }
            if let Some(r) = s.observation.reference.take() {
                traj.reference = Some(r);
            }
            if let Some(i) = s.info.take() {
                verdict(traj).insert("env".into(), i);
            }
            traj.success |= s.success;
            traj.invalid_actions += u32::from(s.invalid_action);
            if s.terminated || s.truncated {
                return None;
            }
            Some(s.observation)
        }
        Err(e) => {
            traj.failure = Some(env_failure(e));
            None
        }
    }
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
        // Reserved at the first answer (`play`): an episode waiting for its environment or its
        // first generation holds no room for turns.
        turns: Vec::new(),
        reward: None,
        success: false,
        invalid_actions: 0,
        failure: None,
        reference: None,
        final_text: String::new(),
        allowed_tokens: task.allowed_tokens.as_deref().map(<[u32]>::to_vec),
        truncated: false,
        agent: None,
        verdict: None,
        timings: Timings {
            started_at_s: tokio::time::Instant::now()
                .duration_since(shared.started)
                .as_secs_f64(),
            ..Timings::default()
        },
    }
}

/// Calls the task's reward functions; the first failure masks the trajectory.
async fn score(task: &EpisodeTask, traj: &mut Trajectory) {
    let t = tokio::time::Instant::now();
    let mut total = 0.0;
    let mut said = Vec::new();
    for s in &task.scorers {
        match s
            .score_detailed(traj)
            .instrument(tracing::info_span!(target: infra::telemetry::TRACE_TARGET, "reward"))
            .await
        {
            Ok(r) => {
                total += r.score;
                said.extend(r.detail);
            }
            Err(e) => {
                traj.failure = Some(FailureReason::RewardFailed(infra::error_chain(&e)));
                break;
            }
        }
    }
    traj.timings.reward_s = secs(t);
    if !said.is_empty() {
        verdict(traj).insert("functions".into(), serde_json::Value::Array(said));
    }
    if traj.failure.is_none() {
        traj.reward = Some(total);
    }
}

/// The trajectory's `verdict` object, made on first use.
fn verdict(traj: &mut Trajectory) -> &mut serde_json::Map<String, serde_json::Value> {
    let v = traj
        .verdict
        .get_or_insert_with(|| serde_json::Value::Object(Default::default()));
    if !v.is_object() {
        *v = serde_json::Value::Object(Default::default());
    }
    v.as_object_mut().expect("an object")
}

/// The failure an environment error masks the trajectory with.
fn env_failure(e: EnvError) -> FailureReason {
    match e {
        EnvError::Timeout(_) => FailureReason::EnvTimeout,
        other => FailureReason::EnvFailed(infra::error_chain(&other)),
    }
}
