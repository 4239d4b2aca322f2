//! Playing an agent episode: the task's runner plays it through the gateway while the
//! episode holds one of the task's slots; its report becomes the trajectory (turns = model
//! calls), or an infrastructure failure masks it.

use tracing::Instrument;

use super::{EpisodeParams, EpisodeShared, secs};
use crate::agent::{AgentEpisode, AgentOutcome, SharedRunner};
use crate::types::{FailureReason, Trajectory};

/// Plays the episode with `runner` and records what it did in `traj`.
pub(super) async fn play(
    shared: &EpisodeShared,
    p: &EpisodeParams,
    runner: &SharedRunner,
    traj: &mut Trajectory,
) {
    let task = &shared.tasks[p.task];
    let wait0 = tokio::time::Instant::now();
    let Some(slot) = task.envs.lease().await else {
        traj.failure = Some(FailureReason::AgentFailed(
            "the task's slots are closed".into(),
        ));
        return;
    };
    traj.timings.wait_s += secs(wait0);
    traj.reference = p
        .record
        .as_ref()
        .and_then(|r| r.get("answer"))
        .filter(|a| !a.is_null())
        .cloned();
    let episode = AgentEpisode {
        id: p.id,
        group: p.group,
        seed: p.seed,
        sample_seed: p.sample_seed,
        record: p.record.clone(),
        shard: p.shard.clone(),
        start_version: p.start_version,
        temperature: task.temperature,
        max_tokens_per_call: task.max_tokens_per_turn,
    };
    let t = tokio::time::Instant::now();
    let outcome = runner
        .run(episode)
        .instrument(tracing::info_span!(target: infra::telemetry::TRACE_TARGET, "agent"))
        .await;
    traj.timings.env_step_s += secs(t);
    // (The gateway released the episode's prefix cache: its engine session is the gateway's.)
    drop(slot);
    match outcome {
        AgentOutcome::Infra(why) => traj.failure = Some(FailureReason::AgentFailed(why)),
        AgentOutcome::GenerationFailed(why) => {
            traj.failure = Some(FailureReason::GenerationFailed(why));
        }
        AgentOutcome::Done(report) => {
            let report = *report;
            if let Some(c) = &p.progress {
                let tokens: u64 = report
                    .turns
                    .iter()
                    .map(|t| u64::from(t.prefill_tokens) + t.response_tokens.len() as u64)
                    .sum();
                c.fetch_add(tokens, std::sync::atomic::Ordering::Relaxed);
            }
            traj.invalid_actions = report
                .turns
                .iter()
                .filter(|t| {
                    t.call
                        .as_ref()
                        .is_some_and(|c| c.invalid_tool_call.is_some())
                })
                .count() as u32;
            traj.turns = report.turns;
            traj.final_text.clone_from(&report.summary.answer);
            traj.reward = report.reward;
            if traj.turns.is_empty() {
                traj.failure = Some(FailureReason::AgentFailed(format!(
                    "the agent made no model call ({})",
                    report.summary.ended
                )));
            }
            traj.agent = Some(Box::new(report.summary));
        }
    }
}
