//! Trajectories, turns and policy versions: the records that flow from episodes to the trainer
//! and into the durable log.

use serde::{Deserialize, Serialize};

pub use crate::tokens::{Logprobs, Tokens};
pub use precision::Precision;

mod precision;
use utoipa::ToSchema;

/// A policy version: 0 is the initial weights; training step `s` produces version `s + 1`.
pub type PolicyVersion = u64;

/// The staleness rule of trajectory-level asynchrony, the one place it is written: work that
/// started under policy version `start` is too stale to train at version `now` once
/// `now − start > α`. The buffer evicts such groups, the scheduler cancels them in flight.
pub fn too_stale(now: PolicyVersion, start: PolicyVersion, alpha: u64) -> bool {
    now.saturating_sub(start) > alpha
}

/// Weight versions the weight store keeps under staleness bound α: the α + 1 versions that
/// trajectories still allowed to train may have started under, and the newest one being
/// installed beside them.
pub fn weight_versions_kept(alpha: u64) -> usize {
    usize::try_from(alpha)
        .unwrap_or(usize::MAX)
        .saturating_add(2)
}

/// Why a trajectory did not finish normally. Infrastructure failures are masked out of group
/// statistics, never scored as zero.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case", tag = "kind", content = "detail")]
pub enum FailureReason {
    /// The environment process crashed or returned an error.
    EnvFailed(String),
    /// An environment call exceeded its wall-clock timeout.
    EnvTimeout,
    /// The generation shard failed or was restarted while serving the trajectory.
    GenerationFailed(String),
    /// The reward call exhausted its retries.
    RewardFailed(String),
    /// The episode reached its context budget and the task does not train truncated
    /// trajectories (or its first observation alone is over the budget); never retried.
    Truncated(String),
    /// An agent episode's infrastructure failed: its sandbox did not start, the agent died
    /// before its first model call or was killed from outside, a claim expired.
    AgentFailed(String),
}

impl std::fmt::Display for FailureReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::EnvFailed(e) => write!(f, "environment failed: {e}"),
            Self::EnvTimeout => write!(f, "an environment call timed out"),
            Self::GenerationFailed(e) => write!(f, "generation failed: {e}"),
            Self::RewardFailed(e) => write!(f, "reward failed: {e}"),
            Self::Truncated(e) => write!(f, "truncated: {e}"),
            Self::AgentFailed(e) => write!(f, "agent infrastructure failed: {e}"),
        }
    }
}

impl FailureReason {
    /// A bounded label for metrics.
    pub fn code(&self) -> &'static str {
        match self {
            Self::EnvFailed(_) => "env_failed",
            Self::EnvTimeout => "env_timeout",
            Self::GenerationFailed(_) => "generation_failed",
            Self::RewardFailed(_) => "reward_failed",
            Self::Truncated(_) => "truncated",
            Self::AgentFailed(_) => "agent_failed",
        }
    }
}

/// A run of consecutive response tokens sampled under one policy version (and, when the
/// engine reports it, one precision of the weights).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct VersionSpan {
    pub version: PolicyVersion,
    pub tokens: u32,
    /// The precision of the weights that sampled these tokens: the built-in engine reports
    /// it on every span; absent where the engine does not (a remote server serves what it
    /// loaded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<Precision>,
}

/// One turn: the observation tokens appended to the context, then the generated response.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Turn {
    /// Tokens appended to the context before generation (observation, prompt); loss mask 0.
    #[schema(value_type = Vec<u32>)]
    pub observation_tokens: Tokens,
    /// Tokens the policy generated this turn; loss mask 1.
    #[schema(value_type = Vec<u32>)]
    pub response_tokens: Tokens,
    /// Behaviour log-probability of each response token, as sampled.
    #[schema(value_type = Vec<f32>)]
    pub logprobs: Logprobs,
    /// Which policy version produced which response tokens (a partial rollout spans updates).
    pub versions: Vec<VersionSpan>,
    /// Reward the environment gave for this step.
    pub env_reward: f64,
    /// Context tokens that had to be prefilled (not served from the prefix cache).
    pub prefill_tokens: u32,
    /// When generation for this turn was requested, in seconds since the job (run) started.
    #[serde(default)]
    pub started_at_s: f64,
    /// Turns left out of this turn's context (`truncation = "drop_oldest_turns"`): it saw
    /// the first turn, then turns `1 + dropped ..` of the history. 0: the whole history.
    /// Never decreases along a trajectory.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dropped: u32,
    /// This turn's context is its observation alone, not the history before it: an agent
    /// sent a history that diverged from its session's context (edited, truncated or
    /// summarised; a new system prompt or new tools), so a new segment starts here and trains
    /// under that context only.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub restart: bool,
    /// Agent episodes: the model call this turn answered (API, tool calls and results,
    /// timing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call: Option<Box<AgentCall>>,
}

/// One model call of an agent episode, as the gateway served it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct AgentCall {
    /// The API the agent called: `chat.completions`, `responses` or `messages`.
    pub api: String,
    /// Whether the answer was streamed.
    #[serde(default)]
    pub stream: bool,
    /// The tool calls the answer made (returned to the agent as structured calls).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<Object>)]
    pub tool_calls: Vec<crate::chat::ToolCall>,
    /// The tool results this request brought that earlier calls had not.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<Object>)]
    pub tool_results: Vec<crate::chat::Message>,
    /// Why the answer's tool calls were refused (bad JSON, an unknown tool, arguments that
    /// break the schema); the answer went back as plain text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub invalid_tool_call: Option<String>,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: String,
    /// Seconds from the request's arrival to its answer.
    #[serde(default)]
    pub latency_s: f64,
}

/// How an agent episode went, kept with its trajectory and handed to reward functions.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct AgentSummary {
    /// The agent's answer: its last stdout line's `answer` (or a runner's `finish`), else its
    /// last model answer.
    #[serde(default)]
    pub answer: String,
    /// The conversation as the agent last sent it, with the last answer appended.
    #[serde(default)]
    #[schema(value_type = Vec<Object>)]
    pub transcript: Vec<crate::chat::Message>,
    /// The dataset row the agent was given (its `row` object).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub row: Option<serde_json::Value>,
    /// The agent's own `info` object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub info: Option<serde_json::Value>,
    /// A failure the policy caused (non-zero exit, timeout, spent budget); rewarded by the
    /// spec's `failure_reward` instead of the reward functions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_failure: Option<String>,
    /// How the program ended (`exit status 0`, `killed by signal 9`, `timed out after 30 s`);
    /// external runners: `finished`.
    #[serde(default)]
    pub ended: String,
    /// Model calls refused before generation (budget, bad input), as the agent saw them.
    #[serde(default)]
    pub refused_calls: u32,
    /// Seconds from the start to the end of the episode (program or claim).
    #[serde(default)]
    pub wall_s: f64,
    /// The episode succeeds when its reward is above this (the task's `success_threshold`).
    #[serde(default)]
    pub success_above: f64,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// One sequence the policy saw and the trainer scores in one forward pass: tokens, whether
/// each was generated *and* trained here, and each token's behaviour log-probability.
pub type Segment = (Vec<u32>, Vec<bool>, Vec<f32>);

/// Wall (or virtual) time spent in each stage of a trajectory, in seconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Timings {
    pub started_at_s: f64,
    pub ended_at_s: f64,
    pub reset_s: f64,
    pub generate_s: f64,
    pub env_step_s: f64,
    pub reward_s: f64,
    /// Time spent waiting at a turn or batch barrier, or suspended for a weight update.
    pub wait_s: f64,
}

/// A finished (or failed) trajectory: the unit the trainer consumes and the store keeps.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Trajectory {
    /// Unique within the job: `g{group}-e{episode}`.
    pub id: String,
    pub group_id: u64,
    pub task: String,
    pub seed: u64,
    /// Policy version when the trajectory (its group) started.
    pub start_version: PolicyVersion,
    pub pool: String,
    pub shard: usize,
    pub turns: Vec<Turn>,
    /// Final scalar reward from the reward function(s); `None` when it failed.
    pub reward: Option<f64>,
    pub success: bool,
    pub invalid_actions: u32,
    pub failure: Option<FailureReason>,
    pub timings: Timings,
    /// The task's reference (answer, tests) from the environment's reset, for reward functions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub reference: Option<serde_json::Value>,
    /// The last response as text (what reward functions score).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub final_text: String,
    /// Tokens the policy was constrained to (constrained decoding); the trainer applies the
    /// same constraint to its log-probabilities.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_tokens: Option<Vec<u32>>,
    /// The episode ended early because its context reached the budget (the task's
    /// `max_context_tokens` or the model's context): status `truncated`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
    /// Agent episodes: the answer, the transcript, the program's end and `info`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<Box<AgentSummary>>,
    /// How the reward was reached, for debugging it: `env`, what the environment said of its
    /// last step beyond the flags rollarc reads (the reasoning-gym bridge's `extracted`
    /// answer, say), and `functions`, each reward function's `{name, score, details}` in the
    /// task's order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub verdict: Option<serde_json::Value>,
}

impl Trajectory {
    pub fn response_tokens(&self) -> usize {
        self.turns.iter().map(|t| t.response_tokens.len()).sum()
    }

    pub fn prefill_tokens(&self) -> usize {
        self.turns.iter().map(|t| t.prefill_tokens as usize).sum()
    }

    /// The mean context a generated token attended to (tokens before it in the sequence it
    /// was sampled in: the history kept at its turn, the turn's observation and the answer so
    /// far), which is what a decode step reads from the KV cache. However often the context
    /// was prefilled (a `rewrite` context re-prefills it every turn), this is its length.
    /// 0 without generated tokens.
    pub fn decode_context(&self) -> f64 {
        let len = |t: &Turn| (t.observation_tokens.len() + t.response_tokens.len()) as f64;
        let (mut attended, mut generated, mut history) = (0.0, 0.0, 0.0);
        for (i, t) in self.turns.iter().enumerate() {
            let d = t.dropped as usize;
            if t.restart {
                history = 0.0;
            }
            let kept = if d > 0 && i > 0 {
                len(&self.turns[0]) + self.turns[(1 + d).min(i)..i].iter().map(len).sum::<f64>()
            } else {
                history
            };
            let r = t.response_tokens.len() as f64;
            let before = kept + t.observation_tokens.len() as f64;
            attended += r * before + r * (r - 1.0).max(0.0) / 2.0;
            generated += r;
            history += len(t);
        }
        if generated > 0.0 {
            attended / generated
        } else {
            0.0
        }
    }

    /// Every policy version that produced a token of this trajectory.
    pub fn versions(&self) -> impl Iterator<Item = PolicyVersion> + '_ {
        self.turns
            .iter()
            .flat_map(|t| t.versions.iter().map(|s| s.version))
    }

    /// Whether the policy saw one sequence: no turn was dropped from the context and no
    /// agent history diverged (then [`Trajectory::segments`] has one element).
    pub fn single_sequence(&self) -> bool {
        self.turns.iter().all(|t| t.dropped == 0 && !t.restart)
    }

    /// The sequences the policy actually saw. Without dropped turns, one: every turn's
    /// observation then response. When turns were dropped from the context, one per run of
    /// turns that share a context: the first turn, the kept history, then the run's turns;
    /// only the run's responses train there (each response trains exactly once, under the
    /// context it was sampled in). A `restart` turn (an agent's diverged history) starts a
    /// segment of its own: its observation is the whole context.
    pub fn segments(&self) -> Vec<Segment> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.turns.len() {
            let d = self.turns[i].dropped as usize;
            let mut end = i + 1;
            while end < self.turns.len()
                && self.turns[end].dropped as usize == d
                && !self.turns[end].restart
            {
                end += 1;
            }
            let mut seg: Segment = (Vec::new(), Vec::new(), Vec::new());
            let push = |seg: &mut Segment, t: &Turn, train: bool| {
                seg.0.extend_from_slice(&t.observation_tokens);
                seg.1
                    .extend(std::iter::repeat_n(false, t.observation_tokens.len()));
                seg.2
                    .extend(std::iter::repeat_n(0.0, t.observation_tokens.len()));
                for (k, &r) in t.response_tokens.iter().enumerate() {
                    seg.0.push(r);
                    seg.1.push(train);
                    seg.2.push(if train {
                        t.logprobs.get(k).copied().unwrap_or(0.0)
                    } else {
                        0.0
                    });
                }
            };
            if d > 0 && i > 0 && !self.turns[i].restart {
                // The kept head (the first turn), then the kept history before this run.
                push(&mut seg, &self.turns[0], false);
                for t in &self.turns[(1 + d).min(i)..i] {
                    push(&mut seg, t, false);
                }
            }
            for t in &self.turns[i..end] {
                push(&mut seg, t, true);
            }
            out.push(seg);
            i = end;
        }
        out
    }

    /// Oldest version that produced any token, or the start version for an empty trajectory.
    pub fn oldest_version(&self) -> PolicyVersion {
        self.versions()
            .min()
            .unwrap_or(self.start_version)
            .min(self.start_version)
    }
}

#[cfg(test)]
impl Trajectory {
    /// A finished single-turn trajectory of task `t` on pool `p`, for unit tests.
    pub(crate) fn for_test(id: &str, turn: Turn, reward: Option<f64>) -> Self {
        Self {
            id: id.into(),
            group_id: 0,
            task: "t".into(),
            seed: 0,
            start_version: 0,
            pool: "p".into(),
            shard: 0,
            turns: vec![turn],
            reward,
            success: reward.is_some_and(|r| r > 0.0),
            invalid_actions: 0,
            failure: None,
            timings: Timings::default(),
            reference: None,
            final_text: String::new(),
            allowed_tokens: None,
            truncated: false,
            agent: None,
            verdict: None,
        }
    }
}

/// A complete group of trajectories for one task seed (GRPO group).
#[derive(Clone, Debug)]
pub struct Group {
    pub id: u64,
    pub task: String,
    pub seed: u64,
    pub start_version: PolicyVersion,
    /// Valid trajectories (failures are masked out and not included).
    pub trajectories: Vec<Trajectory>,
    /// How many trajectories were masked out for infrastructure failures.
    pub masked: u32,
}

impl Group {
    pub fn rewards(&self) -> Vec<f64> {
        self.trajectories
            .iter()
            .map(|t| t.reward.unwrap_or(0.0))
            .collect()
    }
}

/// A training batch: complete groups, all within the staleness bound for `step`.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    pub step: u64,
    pub groups: Vec<Group>,
}

impl Batch {
    pub fn trajectories(&self) -> impl Iterator<Item = &Trajectory> {
        self.groups.iter().flat_map(|g| g.trajectories.iter())
    }

    /// Tokens the trainer processes: every trajectory's sequences (observations and
    /// responses; one sequence unless turns were dropped from its context) once, however
    /// often generation had to prefill them.
    pub fn tokens(&self) -> usize {
        self.trajectories()
            .map(|t| {
                if t.single_sequence() {
                    t.turns
                        .iter()
                        .map(|x| x.observation_tokens.len() + x.response_tokens.len())
                        .sum::<usize>()
                } else {
                    t.segments().iter().map(|s| s.0.len()).sum()
                }
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staleness_allows_alpha_versions_of_lag_and_no_more() {
        assert!(!too_stale(5, 4, 1));
        assert!(too_stale(6, 4, 1));
        assert!(!too_stale(4, 4, 0) && too_stale(5, 4, 0));
        // Work that started after `now` (a resumed job's cursor) is never stale.
        assert!(!too_stale(3, 4, 0));
        assert_eq!(weight_versions_kept(0), 2);
        assert_eq!(weight_versions_kept(1), 3);
        assert_eq!(weight_versions_kept(u64::MAX), usize::MAX);
    }

    fn turn(obs: &[u32], resp: u32, dropped: u32) -> Turn {
        Turn {
            observation_tokens: obs.to_vec().into(),
            response_tokens: vec![resp].into(),
            logprobs: vec![-(resp as f32) / 10.0].into(),
            dropped,
            ..Turn::default()
        }
    }

    #[test]
    fn segments_follow_the_contexts_the_policy_saw() {
        let t = Trajectory::for_test("a", turn(&[1, 2], 3, 0), Some(1.0));
        assert_eq!(t.segments().len(), 1);
        let mut t = t;
        t.turns.extend([
            turn(&[4], 5, 0),
            turn(&[6], 7, 1),
            turn(&[8], 9, 1),
            turn(&[10], 11, 2),
        ]);
        let s = t.segments();
        let toks: Vec<&[u32]> = s.iter().map(|x| &x.0[..]).collect();
        assert_eq!(
            toks,
            [
                &[1, 2, 3, 4, 5][..],
                // Turn 0, then turns 2 and 3 (turn 1 left out); both answers train.
                &[1, 2, 3, 6, 7, 8, 9],
                // Turn 0, turn 3 as history (not trained again), then turn 4.
                &[1, 2, 3, 8, 9, 10, 11],
            ]
        );
        let f = |b: &[bool]| b.iter().map(|&x| u8::from(x)).collect::<Vec<_>>();
        assert_eq!(f(&s[0].1), [0, 0, 1, 0, 1]);
        assert_eq!(f(&s[1].1), [0, 0, 0, 0, 1, 0, 1]);
        assert_eq!(f(&s[2].1), [0, 0, 0, 0, 0, 0, 1]);
        assert_eq!(s[2].2, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.1]);
        assert_eq!(s[1].2[4], -0.7);
        // The trainer processes every segment's tokens.
        let b = Batch {
            step: 0,
            groups: vec![Group {
                id: 0,
                task: "t".into(),
                seed: 0,
                start_version: 0,
                trajectories: vec![t],
                masked: 0,
            }],
        };
        assert_eq!(b.tokens(), 5 + 7 + 7);
    }

    #[test]
    fn a_restart_turn_starts_a_segment_holding_its_observation_only() {
        let mut t = Trajectory::for_test("a", turn(&[1, 2], 3, 0), Some(1.0));
        t.turns.push(turn(&[4], 5, 0));
        // The agent rewrote its history: the new context is [1, 9, 3, 4, 5, 6].
        let mut r = turn(&[1, 9, 3, 4, 5, 6], 7, 0);
        r.restart = true;
        t.turns.extend([r, turn(&[8], 10, 0)]);
        assert!(!t.single_sequence());
        let s = t.segments();
        let toks: Vec<&[u32]> = s.iter().map(|x| &x.0[..]).collect();
        assert_eq!(toks, [&[1, 2, 3, 4, 5][..], &[1, 9, 3, 4, 5, 6, 7, 8, 10]]);
        let f = |b: &[bool]| b.iter().map(|&x| u8::from(x)).collect::<Vec<_>>();
        // The old answers (3, 5) are context in the second segment, never trained twice.
        assert_eq!(f(&s[1].1), [0, 0, 0, 0, 0, 0, 1, 0, 1]);
        // Answer 7 attended to 6 tokens, answer 10 to 8: the mean with 3 (2 tokens) and 5 (4).
        assert!((t.decode_context() - (2.0 + 4.0 + 6.0 + 8.0) / 4.0).abs() < 1e-12);
    }

    #[test]
    fn the_decode_context_is_what_each_answer_token_attended_to_not_what_was_prefilled() {
        let mut t = Trajectory::for_test("a", turn(&[1, 2], 3, 0), Some(1.0));
        t.turns.extend([
            turn(&[4], 5, 0),
            turn(&[6], 7, 1),
            turn(&[8], 9, 1),
            turn(&[10], 11, 2),
        ]);
        // Each answer token's position in the sequence it was sampled in (the segments).
        let mut positions = Vec::new();
        for (toks, train, _) in t.segments() {
            positions.extend((0..toks.len()).filter(|&k| train[k]).map(|k| k as f64));
        }
        assert_eq!(positions, [2.0, 4.0, 4.0, 6.0, 6.0]);
        assert!(
            (t.decode_context() - 4.4).abs() < 1e-12,
            "{}",
            t.decode_context()
        );
        // Re-prefilling every turn (a rewrite context) does not change it.
        for x in &mut t.turns {
            x.prefill_tokens = 1_000;
        }
        assert!((t.decode_context() - 4.4).abs() < 1e-12);
        // A longer answer: its tokens see the observation and the answer so far.
        let mut long = turn(&[1, 2], 3, 0);
        long.response_tokens = vec![3, 4, 5].into();
        let t = Trajectory::for_test("b", long, None);
        assert_eq!(t.decode_context(), 3.0);
        assert_eq!(
            Trajectory::for_test("c", turn(&[1], 2, 0), None).decode_context(),
            1.0
        );
    }
}
