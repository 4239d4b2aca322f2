//! What the scheduler does on what it hears: ended episodes (their tokens feed the cost
//! model), installed versions (groups past the staleness bound are aborted) and the sample
//! buffer's events (retries, extras to cancel, ready, dropped and consumed groups).

use actors::buffer::{BufferEvent, BufferMsg, DropReason};
use actors::episode::EpisodeOutcome;
use actors::types::{FailureReason, PolicyVersion};
use ractor::ActorProcessingErr;

use super::{FAILED_GROUPS_BEFORE_GIVING_UP, SchedState, TAIL_WINDOW};
use crate::cost::Tokens;

impl SchedState {
    /// An episode task has ended: its shards are freed, what it spent is added to its group,
    /// and (unless it failed) its tokens update the task's observations.
    pub(super) fn on_episode_ended(&mut self, outcome: EpisodeOutcome) {
        let EpisodeOutcome {
            episode,
            task,
            prefill,
            decode,
            context,
            failed,
        } = outcome;
        if let Some(e) = self.episodes.remove(&episode) {
            self.release_shards(&e);
            if let Some(g) = self.groups.get_mut(&e.group) {
                g.spent.episodes += 1;
                g.spent.tokens += e.tokens.load(std::sync::atomic::Ordering::Relaxed);
                g.spent.env_s += e.started.elapsed().as_secs_f64();
            }
        }
        self.reap();
        if failed {
            self.snap.failed_episodes += 1;
        } else {
            let seen = Tokens {
                prefill: prefill as f64,
                decode: decode as f64,
                context: context as f64,
            };
            let o = self.observed[task].get_or_insert(seen);
            o.prefill = 0.9 * o.prefill + 0.1 * seen.prefill;
            o.decode = 0.9 * o.decode + 0.1 * seen.decode;
            o.context = 0.9 * o.context + 0.1 * seen.context;
            self.ended_since_plan = self.ended_since_plan.saturating_add(1);
            let r = &mut self.recent[task];
            if r.len() == TAIL_WINDOW {
                r.pop_front();
            }
            r.push_back(seen);
        }
        self.try_admit();
    }

    /// Shards now run `v`: groups past the staleness bound are aborted, more are admitted.
    pub(super) fn on_version_installed(&mut self, v: PolicyVersion) {
        self.version = v;
        self.snap.version = v;
        let alpha = self.a.knobs.alpha;
        let stale: Vec<u64> = self
            .groups
            .iter()
            .filter(|(_, g)| !g.closed && actors::types::too_stale(v, g.start_version, alpha))
            .map(|(id, _)| *id)
            .collect();
        for gid in stale {
            self.snap.aborted_stale += 1;
            self.abort_group_episodes(gid);
            // The buffer answers with Dropped { Aborted }, which frees the slot.
            let _ = self.a.buffer.cast(BufferMsg::Abort { group: gid });
        }
        self.try_admit();
    }

    /// What the sample buffer says about a group; an error gives the job up.
    pub(super) fn on_buffer(&mut self, ev: BufferEvent) -> Result<(), ActorProcessingErr> {
        match ev {
            BufferEvent::Retry { group } => {
                self.snap.retries += 1;
                if let Some(g) = self.groups.get(&group)
                    && !g.closed
                {
                    // A retry runs outside any wave barrier: the wave was sized without it.
                    let (task, seed, sv, pool) = (g.task, g.seed, g.start_version, g.pool);
                    self.spawn_episode(group, task, seed, sv, pool, None);
                }
            }
            BufferEvent::CancelExtras { group } => {
                let w = self.abort_group_episodes(group);
                self.snap.cancelled_extras += w.episodes as u64;
                self.count_waste(w);
            }
            BufferEvent::Ready { group } => {
                if let Some(g) = self.groups.get_mut(&group) {
                    g.closed = true;
                }
            }
            BufferEvent::Dropped {
                group,
                reason,
                failure,
            } => self.on_dropped(group, reason, failure)?,
            BufferEvent::Consumed { groups, .. } => {
                self.consumed += 1;
                self.snap.consumed = self.consumed;
                let mut waves = std::collections::BTreeSet::new();
                for g in groups {
                    if let Some(run) = self.groups.remove(&g) {
                        self.open_groups -= 1;
                        waves.extend(run.wave);
                    }
                }
                if self.a.knobs.overprovision > 0 {
                    self.cancel_stragglers(&waves);
                }
            }
        }
        self.try_admit();
        Ok(())
    }

    /// The buffer dropped `group`: its episodes are aborted and its row may be drawn again;
    /// an error when groups keep failing from the start or are (almost) all dropped.
    fn on_dropped(
        &mut self,
        group: u64,
        reason: DropReason,
        failure: Option<FailureReason>,
    ) -> Result<(), ActorProcessingErr> {
        self.abort_group_episodes(group);
        if let Some(g) = self.groups.remove(&group) {
            self.open_groups -= 1;
            // A row whose group never got a verdict (stale, aborted) is drawn again;
            // one whose rewards were all equal was used (it taught nothing, as in
            // dynamic sampling), and so was one whose episodes failed after their
            // retries (drawing it again could fail forever).
            if let Some(p) = g.position
                && matches!(reason, DropReason::Stale | DropReason::Aborted)
            {
                self.requeue[g.task].push_back(p);
            }
        }
        self.snap.dropped_groups += 1;
        // Groups whose trajectories all fail in their environment (an error it reports,
        // a crash, a prompt past the context budget), one after another from the
        // start: the environment is broken; say why at once. Generation and reward
        // failures are not counted: shards restart, functions have fault budgets.
        let env_broken = matches!(
            failure,
            Some(
                FailureReason::EnvFailed(_)
                    | FailureReason::Truncated(_)
                    | FailureReason::AgentFailed(_)
            )
        );
        if let Some(f) = failure {
            self.last_failure = Some(f.to_string());
        }
        if reason == DropReason::TooFewValid && env_broken && self.consumed == self.a.start_version
        {
            self.failed_in_a_row += 1;
        } else {
            self.failed_in_a_row = 0;
        }
        if self.failed_in_a_row >= FAILED_GROUPS_BEFORE_GIVING_UP
            && let Some(f) = &self.last_failure
        {
            return Err(format!(
                "the first {} groups all failed before any was trained; the last trajectory's failure: {f}",
                self.failed_in_a_row
            )
            .into());
        }
        // A job whose groups are (almost) all dropped would admit forever: give up
        // loudly instead (the failure escalates to the job supervisor).
        let k = &self.a.knobs;
        let limit = 10 * k.batch_size as u64 * k.steps + 100;
        if self.snap.dropped_groups > limit {
            return Err(format!(
                "{} groups were dropped for {} consumed (last: {})",
                self.snap.dropped_groups,
                self.consumed,
                self.drop_reason(reason)
            )
            .into());
        }
        Ok(())
    }

    /// Why groups are dropped, as the job's failure says it: the last drop's reason.
    fn drop_reason(&self, reason: DropReason) -> String {
        match (reason, &self.last_failure) {
            (DropReason::TooFewValid, Some(f)) => {
                format!("too few valid trajectories; the last failure: {f}")
            }
            (DropReason::AllEqual, _) => {
                "all rewards of a group equal; check filter_all_equal and the reward".into()
            }
            (DropReason::Stale, _) | (DropReason::Aborted, _) => {
                "stale or aborted; check alpha".into()
            }
            (DropReason::TooFewValid, None) => "too few valid trajectories".into(),
        }
    }
}
