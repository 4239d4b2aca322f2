//! A step's batch as an external trainer receives it ([`TrainingBatch`]): groups of samples,
//! each a trajectory flattened to tokens with its loss mask, log-probabilities, versions,
//! rewards and advantage; and the way back to the batch the built-in trainer consumes.

use actors::rl::{AdvantageKind, advantages};
use actors::types::{Batch, FailureReason, Group, PolicyVersion, Trajectory, Turn, VersionSpan};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// One training step's batch, as offered to an external trainer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TrainingBatch {
    /// The step this batch trains, counted from 1 like every step the API shows:
    /// acknowledging the batch completes step `step`, and the weights it produces are policy
    /// version `step`.
    pub step: u64,
    /// Oldest and newest policy version that produced a token of the batch.
    pub policy_version_min: PolicyVersion,
    pub policy_version_max: PolicyVersion,
    pub groups: Vec<BatchGroup>,
}

/// A group of samples of one prompt (one environment seed).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct BatchGroup {
    pub group_id: u64,
    pub task: String,
    /// The environment seed every sample of the group started from.
    pub prompt_id: u64,
    pub samples: Vec<Sample>,
}

/// One trajectory as a token sequence.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Sample {
    pub trajectory_id: String,
    /// Every turn's observation then response tokens, exactly as generated.
    pub tokens: Vec<u32>,
    /// 1 where the policy generated the token (train on it), 0 for observations.
    pub loss_mask: Vec<u8>,
    /// The behaviour policy's log-probability of each token (0 where `loss_mask` is 0).
    pub behaviour_logprobs: Vec<f32>,
    /// Which policy version generated which response tokens, in order.
    pub version_spans: Vec<VersionSpan>,
    /// Each turn's response as `[start, end)` offsets into `tokens`.
    pub turn_bounds: Vec<[usize; 2]>,
    /// The trajectory's reward (null when its reward function failed).
    pub reward: Option<f64>,
    /// The environment's reward of each turn.
    pub per_turn_rewards: Vec<f64>,
    /// The job's advantage estimate over the group (0 with `advantage = "none"` or without a
    /// reward).
    pub advantage: f64,
    /// `completed`, or `failed` (no reward: mask it).
    pub status: String,
    /// The tokens generation was constrained to (constrained decoding), if it was: a trainer
    /// renormalises its log-probabilities over the same set. Absent when unconstrained.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_tokens: Option<Vec<u32>>,
    /// The episode ended at its context budget (status `truncated`), cut rather than
    /// finished; absent when it finished.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
    /// Per turn, how many turns after the first were left out of the context it was
    /// generated in (`truncation = "drop_oldest_turns"`); absent when none was. Turn `i`
    /// then saw turn 0, turns `1 + dropped[i] .. i` and its observation — not the whole
    /// `tokens` prefix: score each response under that context.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dropped_turns: Vec<u32>,
    /// Turns of an agent episode whose context is their observation alone: the agent's
    /// history diverged (edited, summarised) and a new segment starts there. Turn `i` listed
    /// here saw only its own observation; the turns after it (up to the next one listed)
    /// extend that context. Absent when the policy saw one sequence.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub restarted_turns: Vec<u32>,
}

impl TrainingBatch {
    /// The batch of `batch`, with advantages from `estimator` per group (none: 0).
    pub fn from_batch(batch: &Batch, estimator: Option<AdvantageKind>) -> Self {
        let mut versions = batch.trajectories().flat_map(Trajectory::versions);
        let first = versions.next();
        let (lo, hi) = versions.fold((first, first), |(lo, hi), v| {
            (lo.map(|l| l.min(v)), hi.map(|h| h.max(v)))
        });
        let groups = batch
            .groups
            .iter()
            .map(|g| {
                let rewards: Vec<f64> = g.trajectories.iter().filter_map(|t| t.reward).collect();
                let mut adv = match estimator {
                    Some(k) => advantages(k, &rewards),
                    None => vec![0.0; rewards.len()],
                }
                .into_iter();
                let samples = g
                    .trajectories
                    .iter()
                    .map(|t| {
                        let a = if t.reward.is_some() {
                            adv.next().unwrap_or(0.0)
                        } else {
                            0.0
                        };
                        sample(t, a)
                    })
                    .collect();
                let first = g.trajectories.first();
                BatchGroup {
                    group_id: first.map_or(0, |t| t.group_id),
                    task: first.map(|t| t.task.clone()).unwrap_or_default(),
                    prompt_id: first.map_or(0, |t| t.seed),
                    samples,
                }
            })
            .collect();
        Self {
            step: batch.step + 1,
            policy_version_min: lo.unwrap_or(0),
            policy_version_max: hi.unwrap_or(0),
            groups,
        }
    }

    /// The batch as the built-in trainer consumes it: each sample's turns rebuilt from its
    /// turn bounds (the observation is what lies between two responses), its versions from
    /// the version spans. Rewards, not advantages, travel on: the built-in trainer computes
    /// its own advantages, as it does in process.
    pub fn to_batch(&self) -> Batch {
        let groups = self
            .groups
            .iter()
            .map(|g| Group {
                id: g.group_id,
                task: g.task.clone(),
                seed: g.prompt_id,
                start_version: g
                    .samples
                    .iter()
                    .flat_map(|s| s.version_spans.iter().map(|v| v.version))
                    .min()
                    .unwrap_or(self.policy_version_min),
                trajectories: g.samples.iter().map(|s| s.to_trajectory(g)).collect(),
                masked: 0,
            })
            .collect();
        Batch {
            step: self.step.saturating_sub(1),
            groups,
        }
    }

    pub fn trajectory_ids(&self) -> Vec<String> {
        self.groups
            .iter()
            .flat_map(|g| g.samples.iter().map(|s| s.trajectory_id.clone()))
            .collect()
    }
}

impl Sample {
    /// The trajectory this sample was made from, as far as training needs it (tokens,
    /// log-probabilities, versions, rewards, constraint); timings and placement are not sent.
    fn to_trajectory(&self, g: &BatchGroup) -> Trajectory {
        let mut spans = self.version_spans.iter().copied();
        let mut span: Option<VersionSpan> = spans.next();
        let mut prev = 0;
        let mut turns = Vec::with_capacity(self.turn_bounds.len());
        for (i, &[start, end]) in self.turn_bounds.iter().enumerate() {
            let (start, end) = (start.min(self.tokens.len()), end.min(self.tokens.len()));
            let (start, end) = (start.max(prev), end.max(start.max(prev)));
            // This turn's share of the version spans, in order.
            let mut versions: Vec<VersionSpan> = Vec::new();
            let mut need = (end - start) as u32;
            while need > 0 {
                let Some(s) = span.as_mut() else { break };
                let take = s.tokens.min(need);
                if take > 0 {
                    versions.push(VersionSpan {
                        version: s.version,
                        tokens: take,
                        precision: s.precision,
                    });
                }
                s.tokens -= take;
                need -= take;
                if s.tokens == 0 {
                    span = spans.next();
                }
            }
            turns.push(Turn {
                observation_tokens: self.tokens[prev..start].to_vec().into(),
                response_tokens: self.tokens[start..end].to_vec().into(),
                logprobs: self
                    .behaviour_logprobs
                    .get(start..end)
                    .map(<[f32]>::to_vec)
                    .unwrap_or_default()
                    .into(),
                versions,
                env_reward: self.per_turn_rewards.get(i).copied().unwrap_or(0.0),
                dropped: self.dropped_turns.get(i).copied().unwrap_or(0),
                restart: u32::try_from(i).is_ok_and(|i| self.restarted_turns.contains(&i)),
                ..Turn::default()
            });
            prev = end;
        }
        Trajectory {
            id: self.trajectory_id.clone(),
            group_id: g.group_id,
            task: g.task.clone(),
            seed: g.prompt_id,
            start_version: self.version_spans.first().map_or(0, |v| v.version),
            pool: String::new(),
            shard: 0,
            turns,
            reward: self.reward,
            success: self.reward.is_some_and(|r| r > 0.0),
            invalid_actions: 0,
            failure: (self.status != "completed")
                .then(|| FailureReason::RewardFailed(self.status.clone())),
            timings: Default::default(),
            reference: None,
            final_text: String::new(),
            allowed_tokens: self.allowed_tokens.clone(),
            truncated: self.truncated,
            agent: None,
            verdict: None,
        }
    }
}

/// The sample of trajectory `t`, with its group's `advantage`.
fn sample(t: &Trajectory, advantage: f64) -> Sample {
    let mut s = Sample {
        trajectory_id: t.id.clone(),
        tokens: Vec::new(),
        loss_mask: Vec::new(),
        behaviour_logprobs: Vec::new(),
        version_spans: Vec::new(),
        turn_bounds: Vec::new(),
        reward: t.reward,
        per_turn_rewards: t.turns.iter().map(|u| u.env_reward).collect(),
        advantage,
        status: if t.reward.is_some() && t.failure.is_none() {
            "completed".into()
        } else {
            "failed".into()
        },
        allowed_tokens: t.allowed_tokens.clone(),
        truncated: t.truncated,
        dropped_turns: if t.turns.iter().any(|u| u.dropped > 0) {
            t.turns.iter().map(|u| u.dropped).collect()
        } else {
            Vec::new()
        },
        restarted_turns: (0u32..)
            .zip(&t.turns)
            .filter(|(_, u)| u.restart)
            .map(|(i, _)| i)
            .collect(),
    };
    for u in &t.turns {
        s.tokens.extend_from_slice(&u.observation_tokens);
        s.loss_mask
            .extend(std::iter::repeat_n(0, u.observation_tokens.len()));
        s.behaviour_logprobs
            .extend(std::iter::repeat_n(0.0, u.observation_tokens.len()));
        let start = s.tokens.len();
        s.tokens.extend_from_slice(&u.response_tokens);
        s.loss_mask
            .extend(std::iter::repeat_n(1, u.response_tokens.len()));
        s.behaviour_logprobs.extend_from_slice(&u.logprobs);
        // A response without logprobs (never from our engines) keeps the columns aligned.
        s.behaviour_logprobs.resize(s.tokens.len(), 0.0);
        s.turn_bounds.push([start, s.tokens.len()]);
        for v in &u.versions {
            match s.version_spans.last_mut() {
                Some(last) if last.version == v.version && last.precision == v.precision => {
                    last.tokens += v.tokens
                }
                _ => s.version_spans.push(*v),
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use actors::model::trainer::{BuiltinTrainer, TrainerConfig, flatten};
    use actors::model::transformer::{ModelConfig, Params};

    fn traj(
        id: &str,
        group: u64,
        turns: &[(&[u8], &[u8], u64)],
        reward: Option<f64>,
    ) -> Trajectory {
        let ids = |b: &[u8]| b.iter().map(|&c| u32::from(c)).collect::<Vec<u32>>();
        Trajectory {
            id: id.into(),
            group_id: group,
            task: "lake".into(),
            seed: 7 + group,
            start_version: 0,
            pool: "cpu".into(),
            shard: 0,
            turns: turns
                .iter()
                .enumerate()
                .map(|(i, (obs, resp, v))| Turn {
                    observation_tokens: ids(obs).into(),
                    response_tokens: ids(resp).into(),
                    logprobs: resp.iter().map(|&r| -0.1 * f32::from(r % 7 + 1)).collect(),
                    // A response split across two versions (a weight update mid-turn).
                    versions: if resp.len() > 1 {
                        vec![
                            VersionSpan {
                                version: *v,
                                tokens: 1,
                                precision: None,
                            },
                            VersionSpan {
                                version: v + 1,
                                tokens: resp.len() as u32 - 1,
                                precision: None,
                            },
                        ]
                    } else {
                        vec![VersionSpan {
                            version: *v,
                            tokens: resp.len() as u32,
                            precision: None,
                        }]
                    },
                    env_reward: i as f64 * 0.5,
                    ..Turn::default()
                })
                .collect(),
            reward,
            success: reward.is_some_and(|r| r > 0.0),
            invalid_actions: 0,
            failure: None,
            timings: Default::default(),
            reference: None,
            final_text: String::new(),
            allowed_tokens: Some(vec![b'l' as u32, b'd' as u32, b'r' as u32, b'u' as u32]),
            truncated: false,
            agent: None,
            verdict: None,
        }
    }

    fn batch() -> Batch {
        let g = |id: u64, rewards: [f64; 3]| Group {
            id,
            task: "lake".into(),
            seed: 7 + id,
            start_version: 0,
            trajectories: rewards
                .iter()
                .enumerate()
                .map(|(e, &r)| {
                    traj(
                        &format!("g{id}-e{e}"),
                        id,
                        &[
                            (b"SFFH\n", b"d", 0),
                            (b"pos 4\n", &[b'r', b'u'][..1 + e % 2], 1),
                            (b"", b"dd", 1),
                        ],
                        Some(r),
                    )
                })
                .collect(),
            masked: 0,
        };
        Batch {
            step: 3,
            groups: vec![g(0, [1.0, 0.0, 0.0]), g(1, [0.0, 1.0, 1.0])],
        }
    }

    /// What a trainer receives and rebuilds is what the in-process trainer sees: the same
    /// token sequences, masks, log-probabilities, versions, rewards and constraint — and one
    /// optimiser step on each gives the same weights.
    #[test]
    fn a_batch_sent_to_an_external_trainer_trains_as_it_does_in_process() {
        let mut b = batch();
        // One trajectory's last turn left turn 1 out of its context (drop_oldest_turns).
        b.groups[1].trajectories[2].turns[2].dropped = 1;
        // Another's agent history diverged at turn 1: a new segment starts there.
        b.groups[1].trajectories[1].turns[1].restart = true;
        let sent = TrainingBatch::from_batch(&b, Some(AdvantageKind::Grpo));
        assert_eq!(sent.groups[1].samples[1].restarted_turns, [1]);
        assert!(sent.groups[1].samples[2].restarted_turns.is_empty());
        let drops: Vec<&Vec<u32>> = sent
            .groups
            .iter()
            .flat_map(|g| &g.samples)
            .map(|s| &s.dropped_turns)
            .collect();
        assert_eq!(drops.iter().filter(|d| d.is_empty()).count(), 5);
        assert_eq!(drops[5], &vec![0, 0, 1]);
        let wire: TrainingBatch =
            serde_json::from_slice(&serde_json::to_vec(&sent).unwrap()).unwrap();
        let back = wire.to_batch();
        assert_eq!(back.step, 3);
        assert_eq!(back.groups.len(), 2);
        for (g0, g1) in b.groups.iter().zip(&back.groups) {
            assert_eq!((g0.id, g0.seed, &g0.task), (g1.id, g1.seed, &g1.task));
            assert_eq!(g0.rewards(), g1.rewards());
            for (t0, t1) in g0.trajectories.iter().zip(&g1.trajectories) {
                assert_eq!(flatten(t0), flatten(t1), "{}", t0.id);
                assert_eq!(t0.segments(), t1.segments(), "{}", t0.id);
                assert_eq!(t0.allowed_tokens, t1.allowed_tokens);
                for (u0, u1) in t0.turns.iter().zip(&t1.turns) {
                    assert_eq!(u0.observation_tokens, u1.observation_tokens);
                    assert_eq!(u0.versions, u1.versions);
                    assert_eq!(u0.env_reward, u1.env_reward);
                }
            }
        }
        let cfg = ModelConfig {
            d_model: 16,
            n_layers: 1,
            n_heads: 2,
            d_ff: 32,
            max_seq: 32,
            ..ModelConfig::default()
        };
        let init =
            Params::init(&cfg, 5, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        let step = |batch: &Batch| {
            let mut t = BuiltinTrainer::new(cfg, &init, TrainerConfig::default()).unwrap();
            let (s, w) = t.step(batch).unwrap();
            (s.loss, w.tensors)
        };
        let (loss0, w0) = step(&b);
        let (loss1, w1) = step(&back);
        assert!(loss0.is_finite() && loss0 != 0.0, "loss {loss0}");
        assert_eq!(loss0, loss1);
        assert_eq!(w0, w1);
        // The rebuilt batch trained: the weights moved from the initial ones.
        assert_ne!(w1, init.to_weights(0).unwrap().tensors);
    }

    /// Samples without a constraint leave the field out of the document.
    #[test]
    fn an_unconstrained_sample_has_no_allowed_tokens_field() {
        let mut b = batch();
        for g in &mut b.groups {
            for t in &mut g.trajectories {
                t.allowed_tokens = None;
            }
        }
        let v = serde_json::to_value(TrainingBatch::from_batch(&b, None)).unwrap();
        let s = &v["groups"][0]["samples"][0];
        assert!(s.get("allowed_tokens").is_none(), "{s}");
        assert_eq!(s["loss_mask"].as_array().unwrap().len(), 5 + 1 + 6 + 1 + 2);
    }
}
