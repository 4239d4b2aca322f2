//! The `tasks[]` section: what a task domain is, how many episodes make a group, and its
//! environment and reward functions.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::env::EnvSpec;
use super::knob::{Knob, KnobInfo, knob};
use super::pool::BackendSpec;
use super::reward::BUILTIN_REWARDS;
use super::{JobSpec, Problems};
use actors::dist::Dist;

/// One task domain. Its numeric fields are [`Knob`]s (bounds, defaults and meanings declared
/// once, below).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TaskSpec {
    /// Task domain tag, e.g. `frozenlake`; unique within the job.
    pub domain: String,
    pub env: EnvSpec,
    #[serde(default = "default_group_size")]
    pub group_size: usize,
    #[serde(default)]
    pub redundancy: usize,
    #[serde(default = "default_max_turns")]
    pub max_turns: u32,
    #[serde(default = "default_max_tokens_per_turn")]
    pub max_tokens_per_turn: u32,
    /// Reward function names; `env` is the environment's own reward.
    #[serde(default = "default_reward")]
    #[schema(min_items = 1)]
    pub reward: Vec<String>,
    #[serde(default = "default_task_weight")]
    pub weight: f64,
    #[serde(default)]
    pub seeds: Option<SeedRange>,
    #[serde(default)]
    pub envs: Option<usize>,
    /// The env pool (`env_pools[].name`) whose workers host this task's environments;
    /// default: the service's own machine (the pool named `local`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env_pool: Option<String>,
    /// Constrained decoding (built-in model): the policy samples only the environment's
    /// action alphabet (`LDRU` for the grid games, digits and `-` for arithmetic, `1`–`9` for
    /// tic-tac-toe), plus end-of-turn when a turn may be longer than one token.
    #[serde(default)]
    pub constrain_actions: bool,
    /// The alphabet for `constrain_actions`, overriding the environment's (ASCII characters).
    #[serde(default)]
    pub action_alphabet: Option<String>,
    /// Extra latency added to this task's environment calls (benchmarks: realistic
    /// environment delays on the built-in games).
    #[serde(default)]
    pub inject_latency: Option<InjectLatency>,
    /// How the agent's context evolves between turns: `append` (the history grows and the
    /// engine's prefix cache serves it), `rewrite` (the framework re-renders the prompt each
    /// turn — compacted or truncated history — so the whole context is prefilled every turn),
    /// or `{ keep = f }` in between: each turn's context keeps the first share `f` of the
    /// previous one as its prefix (what a simulated engine's cache may reuse; `append` is
    /// `keep = 1`, `rewrite` is `keep = 0`).
    #[serde(default)]
    pub context: ContextMode,
    /// Prompts from a dataset file (one row per group) instead of seeds.
    #[serde(default)]
    pub dataset: Option<DatasetSpec>,
    #[serde(default)]
    pub max_context_tokens: Option<u32>,
    /// Whether truncated trajectories train (default) or are masked out of their group
    /// (never retried: a truncation would happen again).
    #[serde(default = "default_true")]
    pub train_truncated: bool,
    /// What a turn that would not fit the context does: `end` the episode (status
    /// `truncated`), or `drop_oldest_turns` — leave the oldest turns after the first out of
    /// the context until it fits with room for a whole answer (environments whose
    /// observations carry their state; each answer trains under the context it was
    /// sampled in).
    #[serde(default)]
    pub truncation: TruncationPolicy,
}

/// What reaching a task's context budget does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum TruncationPolicy {
    #[default]
    End,
    DropOldestTurns,
}

/// A task's prompt dataset: JSONL or parquet rows. verl's parquet layout (`prompt` as chat
/// messages, `reward_model.ground_truth`) needs no key settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DatasetSpec {
    /// The file, on the service's machine (relative to its working directory).
    pub path: String,
    /// `jsonl` or `parquet`; default from the file name's extension.
    #[serde(default)]
    pub format: Option<DatasetFormat>,
    /// Dotted path of the prompt (text, or a list of `{role, content}`); default: the first
    /// of `prompt`, `question`, `problem`, `input` present.
    #[serde(default)]
    pub prompt_key: Option<String>,
    /// Dotted path of the ground truth; default: the first of `reward_model.ground_truth`,
    /// `answer`, `solution`, `label` present (none: no reference).
    #[serde(default)]
    pub answer_key: Option<String>,
    /// A system message put before prompts that have none.
    #[serde(default)]
    pub system_prompt: Option<String>,
    /// Keep only rows whose `split` (or `extra_info.split`) is this.
    #[serde(default)]
    pub split: Option<String>,
    /// Keep only rows whose dotted keys equal these values (a list: any of them).
    #[serde(default)]
    #[schema(value_type = Object)]
    pub filter: std::collections::BTreeMap<String, serde_json::Value>,
    #[serde(default)]
    pub limit: Option<usize>,
    /// Draw rows in a seeded random order, a new one each epoch (default true).
    #[serde(default = "default_true")]
    pub shuffle: bool,
    /// Seed of the shuffle; default: derived from the job's seed.
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default = "default_epochs")]
    pub epochs: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DatasetFormat {
    Jsonl,
    Parquet,
}

fn default_true() -> bool {
    true
}
pub const DATASET_LIMIT: Knob<usize> = knob(
    ("DatasetSpec", "tasks[i].dataset", "limit"),
    (1, false, 1_000_000_000),
    None,
    "every row",
    "Keep at most this many rows (after split and filter).",
);
pub const DATASET_EPOCHS: Knob<u32> = knob(
    ("DatasetSpec", "tasks[i].dataset", "epochs"),
    (1, false, 100_000),
    Some(1),
    "",
    "Passes over the rows; when every row of every epoch is used the task admits no more groups.",
);

fn default_epochs() -> u32 {
    DATASET_EPOCHS.or_default(None)
}

impl DatasetSpec {
    /// A dataset at `path` with every other setting at its default.
    pub fn at(path: &str) -> Self {
        Self {
            path: path.to_string(),
            format: None,
            prompt_key: None,
            answer_key: None,
            system_prompt: None,
            split: None,
            filter: Default::default(),
            limit: None,
            shuffle: default_true(),
            seed: None,
            epochs: default_epochs(),
        }
    }

    pub(super) fn check(&self, p: &str, problems: &mut Problems) {
        if self.path.trim().is_empty() {
            problems.push(format!("{p}.path"), "name the dataset file".into());
            return;
        }
        DATASET_EPOCHS.check_at(p, Some(self.epochs), problems);
        DATASET_LIMIT.check_at(p, self.limit, problems);
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ContextMode {
    #[default]
    Append,
    Rewrite,
    /// The share of the previous turn's context kept as the next one's prefix, in [0, 1].
    Keep(f64),
}

impl ContextMode {
    /// The share of the previous turn's context the next turn keeps as its prefix.
    pub fn keep(self) -> f64 {
        match self {
            Self::Append => 1.0,
            Self::Rewrite => 0.0,
            Self::Keep(f) => f,
        }
    }
}

/// Latency added after an environment call, in seconds (negative samples count as 0).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct InjectLatency {
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub reset_s: Option<Dist>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub step_s: Option<Dist>,
}

impl TaskSpec {
    /// The env pool of workers hosting this task's environments: `None` when they run on
    /// the service's own machine (no pool named, or the `local` one).
    pub fn remote_pool(&self) -> Option<&str> {
        self.env_pool.as_deref().filter(|p| *p != super::LOCAL_POOL)
    }

    /// Token ids the policy is constrained to, when `constrain_actions` is on.
    pub fn allowed_tokens(&self) -> Option<Vec<u32>> {
        if !self.constrain_actions {
            return None;
        }
        let alphabet = self
            .action_alphabet
            .clone()
            .or_else(|| self.env.action_alphabet().map(str::to_string))?;
        let mut v: Vec<u32> = alphabet.bytes().map(u32::from).collect();
        if self.max_tokens_per_turn > 1 {
            v.push(actors::model::tokenizer::EOT);
        }
        v.sort_unstable();
        v.dedup();
        Some(v)
    }

    /// Checks constrained decoding: an alphabet to constrain to, and the tiny model on every
    /// pool.
    fn check_constrained(&self, p: &str, spec: &JobSpec, problems: &mut Problems) {
        let t = self;
        if !t.constrain_actions {
            return;
        }
        if t.action_alphabet.is_none() && t.env.action_alphabet().is_none() {
            problems.push(
                format!("{p}.constrain_actions"),
                "this environment has no built-in action alphabet; set action_alphabet".into(),
            );
        }
        let all_builtin = spec
            .pools
            .iter()
            .all(|p| matches!(p.backend, BackendSpec::Builtin { .. }));
        let checkpoint = spec.pools.iter().any(
            |p| matches!(&p.backend, BackendSpec::Builtin { model, .. } if model.path.is_some()),
        );
        if !all_builtin {
            problems.push(
                format!("{p}.constrain_actions"),
                "constrained decoding needs the built-in model (backend.kind = \"builtin\") on \
                 every pool"
                    .into(),
            );
        } else if checkpoint {
            problems.push(
                format!("{p}.constrain_actions"),
                "constrained decoding is for the tiny byte-level model; a checkpoint answers in \
                 free text that the environment parses"
                    .into(),
            );
        }
    }

    /// Checks the truncation policy against the environment and the turns.
    fn check_truncation(&self, p: &str, problems: &mut Problems) {
        let t = self;
        if t.truncation != TruncationPolicy::DropOldestTurns {
            return;
        }
        if !t.env.allows_dropping_turns() {
            problems.push(
                format!("{p}.truncation"),
                format!(
                    "drop_oldest_turns needs an environment whose observations carry its state; \
                     `{}` does not (an external program says so with droppable_turns = true)",
                    t.env.kind_name()
                ),
            );
        } else if t.max_turns < 3 {
            problems.push(
                format!("{p}.truncation"),
                format!(
                    "drop_oldest_turns keeps the first turn, so it needs max_turns of at least 3, \
                     got {}",
                    t.max_turns
                ),
            );
        }
    }
}

/// A knob of a task (`tasks[i]`).
const fn task<T: Copy>(
    name: &'static str,
    (min, max): (T, T),
    default: Option<T>,
    default_note: &'static str,
    doc: &'static str,
) -> Knob<T> {
    let unit = "";
    Knob {
        schema: "TaskSpec",
        section: "tasks[i]",
        name,
        min,
        exclusive_min: false,
        max,
        default,
        unit,
        default_note,
        doc,
    }
}

pub const TASK_GROUP_SIZE: Knob<usize> = task(
    "group_size",
    (1, 1024),
    Some(8),
    "",
    "Episodes per group (GRPO: they share a task seed or dataset row).",
);
pub const TASK_WEIGHT: Knob<f64> = knob(
    ("TaskSpec", "tasks[i]", "weight"),
    (0.0, true, 1e6),
    Some(1.0),
    "",
    "Share of groups drawn from this task (weights are relative).",
);
pub const TASK_REDUNDANCY: Knob<usize> = task(
    "redundancy",
    (0, 1024),
    Some(0),
    "",
    "Extra episodes dispatched per group; the slowest are cancelled once the group is full.",
);
pub const TASK_MAX_TURNS: Knob<u32> = task(
    "max_turns",
    (1, super::MAX_TURNS as u32),
    Some(10),
    "",
    "Turns an episode may take.",
);
pub const TASK_MAX_TOKENS_PER_TURN: Knob<u32> = task(
    "max_tokens_per_turn",
    (1, 1_000_000),
    Some(128),
    "",
    "Tokens the policy may generate in one turn.",
);
pub const TASK_ENVS: Knob<usize> = task(
    "envs",
    (1, super::MAX_EPISODES),
    None,
    "rollout.max_concurrent_episodes",
    "Environments (and so concurrent episodes) kept for this task.",
);
pub const TASK_MAX_CONTEXT_TOKENS: Knob<u32> = task(
    "max_context_tokens",
    (2, 10_000_000),
    None,
    "the model's context",
    "Tokens a trajectory's context may hold (prompt, observations, answers); each turn's answer is cut to what is left. Reaching it, or the model's own context, ends the episode with status `truncated` (counted and reported) instead of failing it.",
);

/// The knobs of a task, in the manual's order.
pub(super) fn knobs() -> Vec<KnobInfo> {
    vec![
        TASK_GROUP_SIZE.info(),
        TASK_WEIGHT.info(),
        TASK_REDUNDANCY.info(),
        TASK_MAX_TURNS.info(),
        TASK_MAX_TOKENS_PER_TURN.info(),
        TASK_ENVS.info(),
        TASK_MAX_CONTEXT_TOKENS.info(),
        DATASET_LIMIT.info(),
        DATASET_EPOCHS.info(),
    ]
}

fn default_group_size() -> usize {
    TASK_GROUP_SIZE.or_default(None)
}
fn default_max_turns() -> u32 {
    TASK_MAX_TURNS.or_default(None)
}
fn default_max_tokens_per_turn() -> u32 {
    TASK_MAX_TOKENS_PER_TURN.or_default(None)
}
fn default_reward() -> Vec<String> {
    vec!["env".into()]
}
fn default_task_weight() -> f64 {
    TASK_WEIGHT.or_default(None)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SeedRange {
    pub start: u64,
    pub count: u64,
}

impl TaskSpec {
    /// Checks this task (at `at`, e.g. `tasks[0]`) against the rest of the spec.
    pub(super) fn check(&self, at: &str, spec: &JobSpec, problems: &mut Problems) {
        let (t, p) = (self, at);
        TASK_GROUP_SIZE.check_at(p, Some(t.group_size), problems);
        TASK_REDUNDANCY.check_at(p, Some(t.redundancy), problems);
        TASK_MAX_TURNS.check_at(p, Some(t.max_turns), problems);
        TASK_MAX_TOKENS_PER_TURN.check_at(p, Some(t.max_tokens_per_turn), problems);
        TASK_ENVS.check_at(p, t.envs, problems);
        TASK_MAX_CONTEXT_TOKENS.check_at(p, t.max_context_tokens, problems);
        TASK_WEIGHT.check_at(p, Some(t.weight), problems);
        if let ContextMode::Keep(f) = t.context
            && !(0.0..=1.0).contains(&f)
        {
            problems.push(
                format!("{p}.context.keep"),
                format!("{f} must be a share in [0, 1] (1: append, 0: rewrite)"),
            );
        }
        if t.reward.is_empty() {
            problems.push(
                format!("{p}.reward"),
                "name at least one reward function (e.g. \"env\")".into(),
            );
        }
        if let Some(l) = &t.inject_latency {
            for (k, d) in [("reset_s", &l.reset_s), ("step_s", &l.step_s)] {
                for m in d.iter().flat_map(|d| d.problems()) {
                    problems.push(format!("{p}.inject_latency.{k}"), m);
                }
            }
        }
        if let Some(a) = &t.action_alphabet
            && (a.is_empty() || !a.is_ascii())
        {
            problems.push(
                format!("{p}.action_alphabet"),
                format!("{a:?} must be one or more ASCII characters"),
            );
        }
        t.check_constrained(p, spec, problems);
        for (j, r) in t.reward.iter().enumerate() {
            if !BUILTIN_REWARDS.contains(&r.as_str()) && !spec.reward.functions.contains_key(r) {
                problems.push(
                    format!("{p}.reward[{j}]"),
                    format!(
                        "unknown reward function {r:?}; define it under reward.functions or use \"env\""
                    ),
                );
            }
        }
        if let Some(s) = t.seeds
            && s.count == 0
        {
            problems.push(format!("{p}.seeds.count"), "must be at least 1".into());
        }
        t.env.check(&format!("{p}.env"), problems);
        t.check_truncation(p, problems);
        if let Some(d) = &t.dataset {
            d.check(&format!("{p}.dataset"), problems);
            if t.seeds.is_some() {
                problems.push(
                    format!("{p}.seeds"),
                    "a task with a dataset draws its rows in the dataset's order; remove seeds"
                        .into(),
                );
            }
        } else if t.env.needs_dataset() {
            problems.push(
                format!("{p}.dataset"),
                "this environment serves dataset rows: give the task a dataset".into(),
            );
        }
    }
}
