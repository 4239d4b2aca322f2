//! The job spec: typed, `deny_unknown_fields`, parsed from TOML or JSON, validated in one
//! place that reports every problem with its dotted field path in one pass, and resolved
//! against a preset into the concrete knobs the scheduler runs with.

use std::collections::BTreeMap;

use actors::device::{DeviceProfile, ModelProfile};
use actors::dist::Dist;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// A job as submitted.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    #[serde(default)]
    pub name: Option<String>,
    /// Seed of every RNG of the job.
    #[serde(default)]
    pub seed: u64,
    /// Knob values to start from; explicit knobs override them.
    #[serde(default)]
    pub preset: Option<Preset>,
    pub tasks: Vec<TaskSpec>,
    pub pools: Vec<PoolSpec>,
    #[serde(default)]
    pub mapping: MappingSpec,
    #[serde(default)]
    pub rollout: RolloutSpec,
    #[serde(default)]
    pub reward: RewardSpec,
    #[serde(default)]
    pub trainer: TrainerSpec,
    #[serde(default)]
    pub sim: SimSpec,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Preset {
    /// Synchronous: batch barrier, on-policy, no overlap, local reward, one pool.
    Sync,
    /// Sync with asynchronous environment interaction and reward (no turn barrier),
    /// serverless reward, still synchronous training.
    SyncPlus,
    /// Rollout one step ahead of training: a batch is generated as a wave while the previous
    /// one trains.
    OneOff,
    /// Trajectory-level asynchrony, α = 1, overlap, serverless reward, affinity mapping.
    Rollarc,
    /// AReaL-style: fully asynchronous with interruptible generation (in-flight turns keep
    /// their tokens and recompute KV under new weights), one hardware type, local reward.
    Areal,
}

/// The knob values a preset stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PresetKnobs {
    pub barrier: Barrier,
    pub alpha: u64,
    pub overlap: bool,
    pub placement: Placement,
    pub mapping: MappingMode,
    pub on_weight_update: OnWeightUpdate,
}

impl Preset {
    pub const ALL: [Preset; 5] = [Preset::Sync, Preset::SyncPlus, Preset::OneOff, Preset::Areal, Preset::Rollarc];

    pub fn name(self) -> &'static str {
        match self {
            Self::Sync => "sync",
            Self::SyncPlus => "sync_plus",
            Self::OneOff => "one_off",
            Self::Rollarc => "rollarc",
            Self::Areal => "areal",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == s)
    }

    /// The knob values of this preset (architecture.md §6).
    pub fn knobs(self) -> PresetKnobs {
        let k = |barrier, alpha, overlap, placement, mapping, on_weight_update| PresetKnobs { barrier, alpha, overlap, placement, mapping, on_weight_update };
        use OnWeightUpdate::{Abort, Recompute};
        match self {
            Self::Sync => k(Barrier::Batch, 0, false, Placement::Local, MappingMode::SinglePool, Abort),
            Self::SyncPlus => k(Barrier::None, 0, false, Placement::Serverless, MappingMode::SinglePool, Abort),
            Self::OneOff => k(Barrier::Wave, 1, true, Placement::Serverless, MappingMode::SinglePool, Abort),
            Self::Areal => k(Barrier::None, 1, true, Placement::Local, MappingMode::SinglePool, Recompute),
            Self::Rollarc => k(Barrier::None, 1, true, Placement::Serverless, MappingMode::Declared, Abort),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TaskSpec {
    /// Task domain tag, e.g. `frozenlake`; unique within the job.
    pub domain: String,
    pub env: EnvSpec,
    #[serde(default = "d_group_size")]
    pub group_size: usize,
    /// Extra episodes dispatched per group; the slowest are cancelled once the group is full.
    #[serde(default)]
    pub redundancy: usize,
    #[serde(default = "d_max_turns")]
    pub max_turns: u32,
    #[serde(default = "d_max_tokens")]
    pub max_tokens_per_turn: u32,
    /// Reward function names; `env` is the environment's own reward.
    #[serde(default = "d_reward")]
    pub reward: Vec<String>,
    /// Share of groups drawn from this task.
    #[serde(default = "d_weight")]
    pub weight: f64,
    #[serde(default)]
    pub seeds: Option<SeedRange>,
    /// Environments (and so concurrent episodes) for this task; default from the rollout size.
    #[serde(default)]
    pub envs: Option<usize>,
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
    /// engine's prefix cache serves it) or `rewrite` (the framework re-renders the prompt each
    /// turn — compacted or truncated history — so the whole context is prefilled every turn).
    #[serde(default)]
    pub context: ContextMode,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ContextMode {
    #[default]
    Append,
    Rewrite,
}

/// Latency added after an environment call, in seconds (negative samples count as 0).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct InjectLatency {
    #[serde(default)]
    #[schema(value_type = Object)]
    pub reset_s: Option<Dist>,
    #[serde(default)]
    #[schema(value_type = Object)]
    pub step_s: Option<Dist>,
}

impl TaskSpec {
    /// Token ids the policy is constrained to, when `constrain_actions` is on.
    pub fn allowed_tokens(&self) -> Option<Vec<u32>> {
        if !self.constrain_actions {
            return None;
        }
        let alphabet = self.action_alphabet.clone().or_else(|| self.env.action_alphabet().map(str::to_string))?;
        let mut v: Vec<u32> = alphabet.bytes().map(u32::from).collect();
        if self.max_tokens_per_turn > 1 {
            v.push(actors::model::tokenizer::EOT);
        }
        v.sort_unstable();
        v.dedup();
        Some(v)
    }
}

fn d_group_size() -> usize {
    8
}
fn d_max_turns() -> u32 {
    10
}
fn d_max_tokens() -> u32 {
    128
}
fn d_reward() -> Vec<String> {
    vec!["env".into()]
}
fn d_weight() -> f64 {
    1.0
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SeedRange {
    pub start: u64,
    pub count: u64,
}

/// How a task's environments are provided.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum EnvSpec {
    /// Latency and length model in virtual time.
    Sim {
        #[serde(default)]
        #[schema(value_type = Object)]
        reset_latency_s: Option<Dist>,
        #[serde(default)]
        #[schema(value_type = Object)]
        step_latency_s: Option<Dist>,
        #[serde(default)]
        #[schema(value_type = Object)]
        turns: Option<Dist>,
        #[serde(default)]
        #[schema(value_type = Object)]
        observation_tokens: Option<Dist>,
        /// The first observation (the prompt); default: `observation_tokens`.
        #[serde(default)]
        #[schema(value_type = Object)]
        prompt_tokens: Option<Dist>,
        #[serde(default)]
        #[schema(value_type = Object)]
        response_tokens: Option<Dist>,
        #[serde(default = "d_half")]
        success_rate: f64,
        #[serde(default)]
        failure_probability: f64,
        #[serde(default)]
        hang_probability: f64,
    },
    /// FrozenLake (4×4 or 8×8, slippery or not); actions `left|down|right|up`.
    Frozenlake {
        #[serde(default = "d_four")]
        size: usize,
        #[serde(default)]
        slippery: bool,
        #[serde(default)]
        random_map: bool,
        #[serde(default = "d_penalty")]
        invalid_penalty: f64,
        #[serde(default)]
        end_on_invalid: bool,
    },
    /// Sokoban in generated rooms with 1–2 boxes; actions `left|down|right|up`.
    Sokoban {
        #[serde(default = "d_six")]
        size: usize,
        #[serde(default = "d_one")]
        boxes: usize,
        #[serde(default = "d_twelve")]
        scramble: usize,
        #[serde(default = "d_penalty")]
        invalid_penalty: f64,
        #[serde(default)]
        end_on_invalid: bool,
    },
    /// One arithmetic question per episode; the answer is a number.
    Arithmetic {
        #[serde(default = "d_nine")]
        max_operand: i64,
        /// Operators to draw from, e.g. "+-*".
        #[serde(default = "d_plus")]
        ops: String,
    },
    /// Any program speaking the environment protocol (NDJSON over stdio).
    External {
        /// Program and arguments, e.g. `["python3", "envs/gymnasium_bridge.py", "FrozenLake-v1"]`.
        command: Vec<String>,
        /// `bwrap` (default: namespaces, read-only system, rlimits) or `none` (opt out).
        #[serde(default)]
        sandbox: SandboxMode,
        /// Host paths made visible read-only inside the sandbox (e.g. an interpreter's install
        /// under a hidden home).
        #[serde(default)]
        readable_paths: Vec<String>,
        #[serde(default = "d_max_msg")]
        max_message_bytes: usize,
    },
    /// Tic-tac-toe against a fixed-strategy opponent; the action is a cell 1–9.
    Tictactoe {
        #[serde(default)]
        opponent_first: bool,
        #[serde(default = "d_penalty")]
        invalid_penalty: f64,
        #[serde(default)]
        end_on_invalid: bool,
    },
}

impl EnvSpec {
    /// The characters a built-in environment's actions are written in.
    pub fn action_alphabet(&self) -> Option<&'static str> {
        match self {
            EnvSpec::Frozenlake { .. } | EnvSpec::Sokoban { .. } => Some("LDRU"),
            EnvSpec::Arithmetic { .. } => Some("0123456789-"),
            EnvSpec::Tictactoe { .. } => Some("123456789"),
            EnvSpec::Sim { .. } | EnvSpec::External { .. } => None,
        }
    }
}

fn d_half() -> f64 {
    0.5
}
fn d_max_msg() -> usize {
    actors::env::protocol::MAX_MESSAGE_BYTES
}

/// Isolation of external environment programs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SandboxMode {
    #[default]
    Bwrap,
    None,
}
fn d_four() -> usize {
    4
}
fn d_six() -> usize {
    6
}
fn d_twelve() -> usize {
    12
}
fn d_nine() -> i64 {
    9
}
fn d_plus() -> String {
    "+".into()
}
fn d_penalty() -> f64 {
    -0.1
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    pub name: String,
    /// Device class: H800, H20, H100, A100 or CPU.
    pub device: String,
    #[serde(default = "d_one")]
    pub count: usize,
    pub backend: BackendSpec,
}

fn d_one() -> usize {
    1
}
fn d_one_u32() -> u32 {
    1
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum BackendSpec {
    /// Roofline simulator of the device class.
    Sim {
        /// A built-in model profile (`qwen3-8b`, …) or one defined under `sim.models`.
        #[serde(default = "d_model")]
        model: String,
        #[serde(default)]
        max_batch: Option<usize>,
        /// Model FLOP utilisation of prefill (default 0.5).
        #[serde(default)]
        mfu: Option<f64>,
        /// Memory-bandwidth utilisation of decode (default 0.7).
        #[serde(default)]
        mbu: Option<f64>,
        /// Per-GPU weight pull bandwidth in GB/s (overrides `sim.weight_sync.intra_gbps`).
        #[serde(default)]
        weight_sync_gbps: Option<f64>,
        #[serde(default)]
        hang_probability: f64,
        /// GPUs per shard (tensor parallelism); `count` shards use `count × gpus_per_shard` GPUs.
        #[serde(default = "d_one_u32")]
        gpus_per_shard: u32,
        /// Fraction of linear scaling a tensor-parallel group keeps (default 0.9).
        #[serde(default)]
        tp_efficiency: Option<f64>,
        /// Prefill/decode disaggregation: this pool decodes; the named pool prefills, and the
        /// KV cache travels at `kv_transfer_gbps` (GB/s).
        #[serde(default)]
        prefill_pool: Option<String>,
        #[serde(default)]
        kv_transfer_gbps: Option<f64>,
    },
    /// The built-in transformer on CPU (real generation, on its own thread per shard).
    Builtin {
        #[serde(default)]
        model: BuiltinModelSpec,
        /// Sequences decoded together per engine step.
        #[serde(default = "d_builtin_batch")]
        max_batch: usize,
    },
}

fn d_builtin_batch() -> usize {
    64
}

/// Size of the built-in transformer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BuiltinModelSpec {
    #[serde(default = "d_dmodel")]
    pub d_model: usize,
    #[serde(default = "d_layers")]
    pub n_layers: usize,
    #[serde(default = "d_heads")]
    pub n_heads: usize,
    #[serde(default = "d_ff")]
    pub d_ff: usize,
    #[serde(default = "d_max_seq")]
    pub max_seq: usize,
}

fn d_dmodel() -> usize {
    64
}
fn d_layers() -> usize {
    2
}
fn d_heads() -> usize {
    4
}
fn d_ff() -> usize {
    256
}
fn d_max_seq() -> usize {
    512
}

impl Default for BuiltinModelSpec {
    fn default() -> Self {
        Self { d_model: d_dmodel(), n_layers: d_layers(), n_heads: d_heads(), d_ff: d_ff(), max_seq: d_max_seq() }
    }
}

impl BuiltinModelSpec {
    pub fn config(&self) -> actors::model::transformer::ModelConfig {
        actors::model::transformer::ModelConfig {
            vocab: actors::model::tokenizer::VOCAB,
            d_model: self.d_model,
            n_layers: self.n_layers,
            n_heads: self.n_heads,
            d_ff: self.d_ff,
            max_seq: self.max_seq,
        }
    }
}

fn d_model() -> String {
    "qwen3-8b".into()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum MappingMode {
    Declared,
    CostModel,
    SinglePool,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MappingSpec {
    #[serde(default)]
    pub mode: Option<MappingMode>,
    /// Task domain → pool name.
    #[serde(default)]
    pub declared: BTreeMap<String, String>,
    /// Pool for undeclared domains (default: the first pool).
    #[serde(default)]
    pub fallback: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Barrier {
    /// Trajectory-level: every trajectory advances on its own.
    None,
    /// Batch-level generation: groups are admitted in waves of `batch_size`, the next wave once
    /// the previous one has ended; within a wave every trajectory advances on its own.
    Wave,
    /// Every environment waits for the slowest each turn.
    Turn,
    /// Turn barrier, and rewards only after the whole batch is generated.
    Batch,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnWeightUpdate {
    Abort,
    Recompute,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RolloutSpec {
    #[serde(default)]
    pub barrier: Option<Barrier>,
    #[serde(default)]
    pub alpha: Option<u64>,
    #[serde(default)]
    pub overlap_training: Option<bool>,
    /// Groups per training batch.
    #[serde(default)]
    pub batch_size: Option<usize>,
    #[serde(default)]
    pub steps: Option<u64>,
    #[serde(default)]
    pub on_weight_update: Option<OnWeightUpdate>,
    #[serde(default)]
    pub max_concurrent_episodes: Option<usize>,
    /// Drop groups whose rewards are all equal (dynamic sampling).
    #[serde(default)]
    pub filter_all_equal: Option<bool>,
    #[serde(default)]
    pub max_retries_per_group: Option<u32>,
    #[serde(default)]
    pub env_call_timeout_s: Option<f64>,
    /// A shard with work and no progress for this long is restarted.
    #[serde(default)]
    pub frozen_after_s: Option<f64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    Serverless,
    Local,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RewardSpec {
    #[serde(default)]
    pub placement: Option<Placement>,
    /// Named reward functions the tasks refer to.
    #[serde(default)]
    pub functions: BTreeMap<String, FunctionSpec>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum FunctionSpec {
    /// Latency, cold start and concurrency model in virtual time.
    Sim {
        #[serde(default)]
        #[schema(value_type = Object)]
        latency_s: Option<Dist>,
        #[serde(default)]
        cold_start_s: f64,
        #[serde(default = "d_concurrency")]
        concurrency: usize,
        #[serde(default = "d_scale_to_zero")]
        scale_to_zero_after_s: f64,
        /// Serverless placement scaled by the Knative pod autoscaler (Knative knob names, as for
        /// built-in functions; `cold_start_s` per instance started). Without it, serverless is a
        /// single pool of `concurrency` slots that goes cold after `scale_to_zero_after_s` idle.
        #[serde(default)]
        #[schema(value_type = Object)]
        scaling: Option<infra::faas::Scaling>,
    },
    /// A built-in function (`math`, `format`, `env`, `code`, `judge`) run as processes by the
    /// service's function runtime.
    Builtin {
        function: String,
        /// The function's own configuration (JSON object), e.g. the `format` regex.
        #[serde(default)]
        #[schema(value_type = Object)]
        config: Option<serde_json::Value>,
        /// Knative knob names (`container-concurrency`, `min-scale`, `stable-window`, …).
        #[serde(default)]
        #[schema(value_type = Object)]
        scaling: infra::faas::Scaling,
        #[serde(default = "d_fn_timeout")]
        timeout_s: f64,
        /// Scores outside this range are rejected.
        #[serde(default = "d_fn_range")]
        range: [f64; 2],
        /// Hedge a call (a second try elsewhere) once it runs past this latency percentile
        /// (e.g. 0.95), under a budget; off by default.
        #[serde(default)]
        hedge_percentile: Option<f64>,
    },
    /// Any program that serves the function protocol on `$PORT`, run by the function runtime.
    Command {
        command: String,
        #[serde(default)]
        args: Vec<String>,
        #[serde(default)]
        env: BTreeMap<String, String>,
        #[serde(default)]
        #[schema(value_type = Object)]
        scaling: infra::faas::Scaling,
        #[serde(default = "d_fn_timeout")]
        timeout_s: f64,
        #[serde(default = "d_fn_range")]
        range: [f64; 2],
        #[serde(default)]
        hedge_percentile: Option<f64>,
    },
    /// A function already served at a URL (e.g. a Knative Service).
    Http {
        url: String,
        #[serde(default = "d_fn_timeout")]
        timeout_s: f64,
        #[serde(default = "d_fn_range")]
        range: [f64; 2],
        #[serde(default)]
        hedge_percentile: Option<f64>,
    },
}

fn d_fn_timeout() -> f64 {
    30.0
}
fn d_fn_range() -> [f64; 2] {
    [0.0, 1.0]
}

/// Built-in function executables (`rollarc-fn NAME`).
pub const BUILTIN_FUNCTIONS: [&str; 5] = ["math", "format", "env", "code", "judge"];

fn d_concurrency() -> usize {
    64
}
fn d_scale_to_zero() -> f64 {
    90.0
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum TrainerSpec {
    /// Time model of a GPU trainer: with `device`, a roofline (8 FLOPs per active parameter
    /// per token at `mfu` on `gpus` devices of that class, for `model` or the pools' model);
    /// without, `seconds_per_token` per GPU.
    Sim {
        #[serde(default = "d_spt")]
        seconds_per_token: f64,
        #[serde(default = "d_gpus")]
        gpus: u32,
        #[serde(default)]
        step_overhead_s: f64,
        #[serde(default)]
        device: Option<String>,
        #[serde(default)]
        model: Option<String>,
        /// Training MFU (default 0.35).
        #[serde(default)]
        mfu: Option<f64>,
    },
    /// The built-in trainer for the built-in model (CPU).
    Builtin(BuiltinTrainerSpec),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageSpec {
    Grpo,
    DrGrpo,
    Rloo,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AggregationSpec {
    TokenMean,
    SeqMeanTokenMean,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BuiltinTrainerSpec {
    #[serde(default = "d_lr")]
    pub lr: f64,
    #[serde(default)]
    pub warmup_steps: u64,
    #[serde(default)]
    pub decay_steps: Option<u64>,
    #[serde(default)]
    pub weight_decay: f64,
    #[serde(default = "d_clip")]
    pub grad_clip: f64,
    #[serde(default = "d_adv")]
    pub advantage: AdvantageSpec,
    #[serde(default = "d_agg")]
    pub aggregation: AggregationSpec,
    #[serde(default = "d_eps_low")]
    pub eps_low: f64,
    #[serde(default = "d_eps_high")]
    pub eps_high: f64,
    #[serde(default)]
    pub tis_cap: Option<f64>,
    #[serde(default)]
    pub kl_beta: f64,
    #[serde(default)]
    pub recompute_old: bool,
}

fn d_lr() -> f64 {
    1e-3
}
fn d_clip() -> f64 {
    1.0
}
fn d_adv() -> AdvantageSpec {
    AdvantageSpec::Grpo
}
fn d_agg() -> AggregationSpec {
    AggregationSpec::TokenMean
}
fn d_eps_low() -> f64 {
    0.2
}
fn d_eps_high() -> f64 {
    0.28
}

impl BuiltinTrainerSpec {
    pub fn config(&self) -> actors::model::trainer::TrainerConfig {
        use actors::rl::{AdvantageKind, Aggregation, PpoConfig};
        actors::model::trainer::TrainerConfig {
            lr: self.lr,
            warmup_steps: self.warmup_steps,
            decay_steps: self.decay_steps,
            weight_decay: self.weight_decay,
            grad_clip: self.grad_clip,
            advantage: match self.advantage {
                AdvantageSpec::Grpo => AdvantageKind::Grpo,
                AdvantageSpec::DrGrpo => AdvantageKind::DrGrpo,
                AdvantageSpec::Rloo => AdvantageKind::Rloo,
            },
            ppo: PpoConfig {
                eps_low: self.eps_low,
                eps_high: self.eps_high,
                aggregation: match self.aggregation {
                    AggregationSpec::TokenMean => Aggregation::TokenMean,
                    AggregationSpec::SeqMeanTokenMean => Aggregation::SeqMeanTokenMean,
                },
                tis_cap: self.tis_cap,
            },
            kl_beta: self.kl_beta,
            recompute_old: self.recompute_old,
            ..Default::default()
        }
    }
}

fn d_spt() -> f64 {
    2e-4
}
fn d_gpus() -> u32 {
    8
}

impl Default for TrainerSpec {
    fn default() -> Self {
        Self::Sim { seconds_per_token: d_spt(), gpus: d_gpus(), step_overhead_s: 0.0, device: None, model: None, mfu: None }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Clock {
    /// Paused tokio clock: simulated durations take no wall time.
    #[default]
    Virtual,
    /// Wall clock: simulated durations are really waited (demos, restart tests).
    Real,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SimSpec {
    /// Default: virtual when every backend is simulated, real otherwise.
    #[serde(default)]
    pub clock: Option<Clock>,
    /// Fault injection: the trainer panics at this step ...
    #[serde(default)]
    pub trainer_panic_at_step: Option<u64>,
    /// ... in the first this-many runs of the job (default 1; a restarted run is the next).
    #[serde(default)]
    pub trainer_panic_runs: Option<u64>,
    /// Device classes beyond the built-in ones (or replacing them), for pools and trainers.
    #[serde(default)]
    pub devices: Vec<DeviceSpec>,
    /// Model profiles beyond the built-in ones.
    #[serde(default)]
    pub models: Vec<ModelSpec>,
    /// How weights reach the rollout shards (default: the relay, 1 GB buckets, 200/400 Gbit/s).
    #[serde(default)]
    pub weight_sync: Option<WeightSyncSpec>,
    /// Injected shard failures: the shard's engine freezes after this many engine steps (once;
    /// the watchdog restarts it and its requests are retried or masked).
    #[serde(default)]
    pub faults: Vec<FaultSpec>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    pub pool: String,
    pub shard: usize,
    pub hang_after_steps: u64,
}

/// A device class for the simulator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    pub name: String,
    /// Dense BF16 TFLOP/s.
    pub tflops: f64,
    /// Memory in GB.
    pub hbm_gb: f64,
    /// Memory bandwidth in TB/s.
    pub hbm_tbps: f64,
    /// Relative cost per hour (H20 = 1).
    pub cost: f64,
}

/// A model profile for the simulator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub name: String,
    /// Total parameters, billions.
    pub params_b: f64,
    /// Parameters active per token, billions (MoE); default: all.
    #[serde(default)]
    pub active_b: Option<f64>,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Bytes per weight in the rollout engines (2 for BF16, 1 for FP8).
    #[serde(default = "d_two")]
    pub bytes_per_param: f64,
}

fn d_two() -> f64 {
    2.0
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SyncModeSpec {
    /// Naive: every shard pulls from the trainer over the shared inter-cluster link.
    Direct,
    /// Overlapped: bucketed push to a CPU relay during training, pipelined pulls.
    Relay,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WeightSyncSpec {
    #[serde(default = "d_relay")]
    pub mode: SyncModeSpec,
    #[serde(default = "d_bucket")]
    pub bucket_gb: f64,
    /// Trainer → relay / rollout, Gbit/s.
    #[serde(default = "d_inter")]
    pub inter_gbps: f64,
    /// Relay → each rollout GPU, Gbit/s.
    #[serde(default = "d_intra")]
    pub intra_gbps: f64,
}

fn d_relay() -> SyncModeSpec {
    SyncModeSpec::Relay
}
fn d_bucket() -> f64 {
    1.0
}
fn d_inter() -> f64 {
    200.0
}
fn d_intra() -> f64 {
    400.0
}

impl WeightSyncSpec {
    pub fn model(&self) -> actors::device::WeightSync {
        actors::device::WeightSync {
            mode: match self.mode {
                SyncModeSpec::Direct => actors::device::SyncMode::Direct,
                SyncModeSpec::Relay => actors::device::SyncMode::Relay,
            },
            bucket_bytes: self.bucket_gb * 1e9,
            inter_bandwidth: self.inter_gbps * 1e9 / 8.0,
            intra_bandwidth: self.intra_gbps * 1e9 / 8.0,
            shards: 1,
            gpus_per_shard: 1,
        }
    }
}

/// One problem with a spec.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FieldError {
    /// Dotted path of the field, e.g. `tasks[0].group_size`.
    pub field: String,
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid job spec: {}", .0.iter().map(|e| format!("{}: {}", e.field, e.message)).collect::<Vec<_>>().join("; "))]
pub struct SpecErrors(pub Vec<FieldError>);

/// Body formats accepted for a spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Json,
    Toml,
}

/// Parses and validates a spec, reporting every problem found.
pub fn parse(body: &str, format: Format) -> Result<JobSpec, SpecErrors> {
    let value: serde_json::Value = match format {
        Format::Json => serde_json::from_str(body).map_err(|e| one("", format!("body is not valid JSON: {e}")))?,
        Format::Toml => {
            let t: toml::Table = toml::from_str(body).map_err(|e| one("", format!("body is not valid TOML: {}", e.message())))?;
            serde_json::to_value(t).map_err(|e| one("", e.to_string()))?
        }
    };
    from_value(value)
}

fn one(field: &str, message: String) -> SpecErrors {
    SpecErrors(vec![FieldError { field: field.into(), message }])
}

/// Deserialises section by section so that every structural problem is reported, then runs
/// the semantic checks.
pub fn from_value(value: serde_json::Value) -> Result<JobSpec, SpecErrors> {
    let mut errs = Vec::new();
    let serde_json::Value::Object(mut obj) = value else {
        return Err(one("", "a job spec must be a table / object".into()));
    };
    const KNOWN: [&str; 10] = ["name", "seed", "preset", "tasks", "pools", "mapping", "rollout", "reward", "trainer", "sim"];
    for k in obj.keys() {
        if !KNOWN.contains(&k.as_str()) {
            errs.push(FieldError { field: k.clone(), message: format!("unknown field, expected one of {}", KNOWN.join(", ")) });
        }
    }
    let name = section::<Option<String>>(&mut obj, "name", &mut errs).flatten();
    let seed = section::<u64>(&mut obj, "seed", &mut errs).unwrap_or(0);
    let preset = section::<Option<Preset>>(&mut obj, "preset", &mut errs).flatten();
    let tasks = list::<TaskSpec>(&mut obj, "tasks", &mut errs);
    let pools = list::<PoolSpec>(&mut obj, "pools", &mut errs);
    let mapping = section::<MappingSpec>(&mut obj, "mapping", &mut errs).unwrap_or_default();
    let rollout = section::<RolloutSpec>(&mut obj, "rollout", &mut errs).unwrap_or_default();
    let reward = section::<RewardSpec>(&mut obj, "reward", &mut errs).unwrap_or_default();
    let trainer = section::<TrainerSpec>(&mut obj, "trainer", &mut errs).unwrap_or_default();
    let sim = section::<SimSpec>(&mut obj, "sim", &mut errs).unwrap_or_default();
    let spec = JobSpec { name, seed, preset, tasks: tasks.unwrap_or_default(), pools: pools.unwrap_or_default(), mapping, rollout, reward, trainer, sim };
    errs.extend(validate(&spec));
    if errs.is_empty() { Ok(spec) } else { Err(SpecErrors(errs)) }
}

fn de_at<T: DeserializeOwned>(v: serde_json::Value, path: &str, errs: &mut Vec<FieldError>) -> Option<T> {
    match serde_path_to_error::deserialize::<_, T>(v) {
        Ok(t) => Some(t),
        Err(e) => {
            let inner = e.path().to_string();
            let field = if inner == "." || inner.is_empty() { path.to_string() } else { format!("{path}.{inner}") };
            errs.push(FieldError { field, message: e.into_inner().to_string() });
            None
        }
    }
}

fn section<T: DeserializeOwned + Default>(obj: &mut serde_json::Map<String, serde_json::Value>, key: &str, errs: &mut Vec<FieldError>) -> Option<T> {
    match obj.remove(key) {
        None => Some(T::default()),
        Some(v) => de_at(v, key, errs),
    }
}

fn list<T: DeserializeOwned>(obj: &mut serde_json::Map<String, serde_json::Value>, key: &str, errs: &mut Vec<FieldError>) -> Option<Vec<T>> {
    match obj.remove(key) {
        None => {
            errs.push(FieldError { field: key.into(), message: "missing field".into() });
            None
        }
        Some(serde_json::Value::Array(items)) => Some(items.into_iter().enumerate().filter_map(|(i, v)| de_at(v, &format!("{key}[{i}]"), errs)).collect()),
        Some(_) => {
            errs.push(FieldError { field: key.into(), message: "expected an array".into() });
            None
        }
    }
}

/// Names of the reward functions every job has.
pub const BUILTIN_REWARDS: [&str; 1] = ["env"];

fn check_hedge(p: &str, hedge: Option<f64>, err: &mut impl FnMut(String, String)) {
    if let Some(h) = hedge
        && !(h > 0.0 && h < 1.0)
    {
        err(format!("{p}.hedge_percentile"), format!("must be in (0, 1), e.g. 0.95; got {h}"));
    }
}

fn check_function_common(p: &str, scaling: Option<&infra::faas::Scaling>, timeout_s: f64, range: [f64; 2], err: &mut impl FnMut(String, String)) {
    if !(timeout_s.is_finite() && timeout_s > 0.0) {
        err(format!("{p}.timeout_s"), format!("must be a positive number of seconds, got {timeout_s}"));
    }
    if !(range[0].is_finite() && range[1].is_finite() && range[0] < range[1]) {
        err(format!("{p}.range"), format!("must be [min, max] with min < max, got {range:?}"));
    }
    if let Some(s) = scaling {
        for (k, m) in s.problems() {
            err(format!("{p}.scaling.{k}"), m);
        }
    }
}

/// Semantic checks; every problem with its path.
pub fn validate(spec: &JobSpec) -> Vec<FieldError> {
    let mut errs = Vec::new();
    let mut err = |field: String, message: String| errs.push(FieldError { field, message });
    if spec.tasks.is_empty() {
        err("tasks".into(), "at least one task is required".into());
    }
    if spec.pools.is_empty() {
        err("pools".into(), "at least one generation pool is required".into());
    }
    let mut domains = std::collections::BTreeSet::new();
    for (i, t) in spec.tasks.iter().enumerate() {
        let p = format!("tasks[{i}]");
        if t.domain.trim().is_empty() {
            err(format!("{p}.domain"), "must not be empty".into());
        } else if !domains.insert(t.domain.as_str()) {
            err(format!("{p}.domain"), format!("duplicate task domain {:?}", t.domain));
        }
        if t.group_size == 0 || t.group_size > 1024 {
            err(format!("{p}.group_size"), format!("must be in 1..=1024, got {}", t.group_size));
        }
        if t.redundancy > 1024 {
            err(format!("{p}.redundancy"), format!("must be at most 1024, got {}", t.redundancy));
        }
        if t.max_turns == 0 || t.max_turns > 10_000 {
            err(format!("{p}.max_turns"), format!("must be in 1..=10000, got {}", t.max_turns));
        }
        if t.max_tokens_per_turn == 0 || t.max_tokens_per_turn > 1_000_000 {
            err(format!("{p}.max_tokens_per_turn"), format!("must be in 1..=1000000, got {}", t.max_tokens_per_turn));
        }
        if !(t.weight.is_finite() && t.weight > 0.0) {
            err(format!("{p}.weight"), format!("must be a positive number, got {}", t.weight));
        }
        if t.reward.is_empty() {
            err(format!("{p}.reward"), "name at least one reward function (e.g. \"env\")".into());
        }
        if let Some(l) = &t.inject_latency {
            for (k, d) in [("reset_s", &l.reset_s), ("step_s", &l.step_s)] {
                for m in d.iter().flat_map(|d| d.problems()) {
                    err(format!("{p}.inject_latency.{k}"), m);
                }
            }
        }
        if let Some(a) = &t.action_alphabet
            && (a.is_empty() || !a.is_ascii())
        {
            err(format!("{p}.action_alphabet"), format!("{a:?} must be one or more ASCII characters"));
        }
        if t.constrain_actions {
            if t.action_alphabet.is_none() && t.env.action_alphabet().is_none() {
                err(format!("{p}.constrain_actions"), "this environment has no built-in action alphabet; set action_alphabet".into());
            }
            if !spec.pools.iter().all(|p| matches!(p.backend, BackendSpec::Builtin { .. })) {
                err(format!("{p}.constrain_actions"), "constrained decoding needs the built-in model (backend.kind = \"builtin\") on every pool".into());
            }
        }
        for (j, r) in t.reward.iter().enumerate() {
            if !BUILTIN_REWARDS.contains(&r.as_str()) && !spec.reward.functions.contains_key(r) {
                err(format!("{p}.reward[{j}]"), format!("unknown reward function {r:?}; define it under reward.functions or use \"env\""));
            }
        }
        if let Some(s) = t.seeds
            && s.count == 0
        {
            err(format!("{p}.seeds.count"), "must be at least 1".into());
        }
        if t.envs == Some(0) {
            err(format!("{p}.envs"), "must be at least 1".into());
        }
        match &t.env {
            EnvSpec::Sim {
                reset_latency_s,
                step_latency_s,
                turns,
                observation_tokens,
                prompt_tokens,
                response_tokens,
                success_rate,
                failure_probability,
                hang_probability,
            } => {
                for (name, d) in [
                    ("reset_latency_s", reset_latency_s),
                    ("step_latency_s", step_latency_s),
                    ("turns", turns),
                    ("observation_tokens", observation_tokens),
                    ("prompt_tokens", prompt_tokens),
                    ("response_tokens", response_tokens),
                ] {
                    if let Some(d) = d {
                        for m in d.problems() {
                            err(format!("{p}.env.{name}"), m);
                        }
                    }
                }
                for (name, v) in [("success_rate", success_rate), ("failure_probability", failure_probability), ("hang_probability", hang_probability)] {
                    if !(0.0..=1.0).contains(v) {
                        err(format!("{p}.env.{name}"), format!("must be a probability in [0, 1], got {v}"));
                    }
                }
            }
            EnvSpec::Frozenlake { size, invalid_penalty, .. } => {
                if *size != 4 && *size != 8 {
                    err(format!("{p}.env.size"), format!("must be 4 or 8, got {size}"));
                }
                if !invalid_penalty.is_finite() {
                    err(format!("{p}.env.invalid_penalty"), "must be a finite number".into());
                }
            }
            EnvSpec::Sokoban { size, boxes, scramble, invalid_penalty, .. } => {
                if !(5..=10).contains(size) {
                    err(format!("{p}.env.size"), format!("must be in 5..=10, got {size}"));
                }
                if !(1..=2).contains(boxes) {
                    err(format!("{p}.env.boxes"), format!("must be 1 or 2, got {boxes}"));
                }
                if *scramble == 0 || *scramble > 1000 {
                    err(format!("{p}.env.scramble"), format!("must be in 1..=1000, got {scramble}"));
                }
                if !invalid_penalty.is_finite() {
                    err(format!("{p}.env.invalid_penalty"), "must be a finite number".into());
                }
            }
            EnvSpec::Arithmetic { max_operand, ops } => {
                if !(1..=1_000_000).contains(max_operand) {
                    err(format!("{p}.env.max_operand"), format!("must be in 1..=1000000, got {max_operand}"));
                }
                if ops.is_empty() || !ops.chars().all(|c| "+-*".contains(c)) {
                    err(format!("{p}.env.ops"), format!("must be a non-empty string of + - *, got {ops:?}"));
                }
            }
            EnvSpec::External { command, max_message_bytes, .. } => {
                if command.is_empty() || command[0].trim().is_empty() {
                    err(format!("{p}.env.command"), "name the program to run".into());
                }
                if !(64..=64 << 20).contains(max_message_bytes) {
                    err(format!("{p}.env.max_message_bytes"), format!("must be in 64..=67108864, got {max_message_bytes}"));
                }
            }
            EnvSpec::Tictactoe { invalid_penalty, .. } => {
                if !invalid_penalty.is_finite() {
                    err(format!("{p}.env.invalid_penalty"), "must be a finite number".into());
                }
            }
        }
    }
    let mut pools = std::collections::BTreeSet::new();
    for (i, pl) in spec.pools.iter().enumerate() {
        let p = format!("pools[{i}]");
        if pl.name.trim().is_empty() {
            err(format!("{p}.name"), "must not be empty".into());
        } else if !pools.insert(pl.name.as_str()) {
            err(format!("{p}.name"), format!("duplicate pool name {:?}", pl.name));
        }
        if spec.device_profile(&pl.device).is_none() {
            err(
                format!("{p}.device"),
                format!("unknown device class {:?}, expected one of {} or one under sim.devices", pl.device, DeviceProfile::BUILTIN_NAMES.join(", ")),
            );
        }
        if pl.count == 0 || pl.count > 4096 {
            err(format!("{p}.count"), format!("must be in 1..=4096, got {}", pl.count));
        }
        match &pl.backend {
            BackendSpec::Sim {
                model,
                max_batch,
                mfu,
                mbu,
                weight_sync_gbps,
                hang_probability,
                gpus_per_shard,
                tp_efficiency,
                prefill_pool,
                kv_transfer_gbps,
            } => {
                if spec.model_profile(model).is_none() {
                    err(
                        format!("{p}.backend.model"),
                        format!("unknown model {model:?}, expected one of {} or one under sim.models", ModelProfile::BUILTIN_NAMES.join(", ")),
                    );
                }
                if *gpus_per_shard == 0 || *gpus_per_shard > 64 {
                    err(format!("{p}.backend.gpus_per_shard"), format!("must be in 1..=64, got {gpus_per_shard}"));
                }
                if let Some(e) = tp_efficiency
                    && !(*e > 0.0 && *e <= 1.0)
                {
                    err(format!("{p}.backend.tp_efficiency"), format!("must be in (0, 1], got {e}"));
                }
                if let Some(pp) = prefill_pool {
                    match spec.pools.iter().find(|q| &q.name == pp) {
                        None => err(format!("{p}.backend.prefill_pool"), format!("no pool is named {pp:?}")),
                        Some(q) if q.name == pl.name => err(format!("{p}.backend.prefill_pool"), "a pool cannot prefill for itself".into()),
                        Some(q) if !matches!(q.backend, BackendSpec::Sim { .. }) => {
                            err(format!("{p}.backend.prefill_pool"), format!("pool {pp:?} must be simulated too"))
                        }
                        Some(_) => {}
                    }
                }
                if let Some(g) = kv_transfer_gbps
                    && !(g.is_finite() && *g > 0.0)
                {
                    err(format!("{p}.backend.kv_transfer_gbps"), format!("must be positive, got {g}"));
                }
                if *max_batch == Some(0) {
                    err(format!("{p}.backend.max_batch"), "must be at least 1".into());
                }
                for (name, v) in [("mfu", mfu), ("mbu", mbu)] {
                    if let Some(v) = v
                        && !(*v > 0.0 && *v <= 1.0)
                    {
                        err(format!("{p}.backend.{name}"), format!("must be in (0, 1], got {v}"));
                    }
                }
                if let Some(g) = weight_sync_gbps
                    && !(g.is_finite() && *g > 0.0)
                {
                    err(format!("{p}.backend.weight_sync_gbps"), format!("must be positive, got {g}"));
                }
                if !(0.0..=1.0).contains(hang_probability) {
                    err(format!("{p}.backend.hang_probability"), format!("must be a probability in [0, 1], got {hang_probability}"));
                }
            }
            BackendSpec::Builtin { model, max_batch } => {
                for m in model.config().problems() {
                    err(format!("{p}.backend.model"), m);
                }
                if *max_batch == 0 {
                    err(format!("{p}.backend.max_batch"), "must be at least 1".into());
                }
                if !matches!(spec.trainer, TrainerSpec::Builtin(_)) {
                    err(format!("{p}.backend"), "the built-in model trains only with trainer.kind = \"builtin\"".into());
                }
                if let Some(first) = spec.pools.iter().find_map(|q| match &q.backend {
                    BackendSpec::Builtin { model, .. } => Some(*model),
                    _ => None,
                }) && first != *model
                {
                    err(format!("{p}.backend.model"), "every built-in pool must use the same model size (they share weights)".into());
                }
            }
        }
    }
    let prefill_only: Vec<&str> = spec
        .pools
        .iter()
        .filter_map(|p| match &p.backend {
            BackendSpec::Sim { prefill_pool: Some(pp), .. } => Some(pp.as_str()),
            _ => None,
        })
        .collect();
    for (domain, pool) in &spec.mapping.declared {
        if prefill_only.contains(&pool.as_str()) {
            err(format!("mapping.declared.{domain}"), format!("pool {pool:?} only prefills for another pool; map the task to the decoding pool"));
        }
        if !domains.contains(domain.as_str()) {
            err(format!("mapping.declared.{domain}"), format!("no task has domain {domain:?}"));
        }
        if !pools.contains(pool.as_str()) {
            err(format!("mapping.declared.{domain}"), format!("no pool is named {pool:?}"));
        }
    }
    if let Some(f) = &spec.mapping.fallback
        && !pools.contains(f.as_str())
    {
        err("mapping.fallback".into(), format!("no pool is named {f:?}"));
    }
    let r = &spec.rollout;
    if r.batch_size == Some(0) {
        err("rollout.batch_size".into(), "must be at least 1 group".into());
    }
    if r.steps == Some(0) {
        err("rollout.steps".into(), "must be at least 1".into());
    }
    if r.alpha.is_some_and(|a| a > 1000) {
        err("rollout.alpha".into(), "must be at most 1000".into());
    }
    if spec.sim.clock == Some(Clock::Virtual) && !spec.all_simulated() {
        err("sim.clock".into(), "a virtual clock needs every backend simulated (real compute takes real time)".into());
    }
    let positive = |v: f64| v.is_finite() && v > 0.0;
    for (i, d) in spec.sim.devices.iter().enumerate() {
        for (k, v) in [("tflops", d.tflops), ("hbm_gb", d.hbm_gb), ("hbm_tbps", d.hbm_tbps), ("cost", d.cost)] {
            if !positive(v) {
                err(format!("sim.devices[{i}].{k}"), format!("must be positive, got {v}"));
            }
        }
    }
    for (i, m) in spec.sim.models.iter().enumerate() {
        if !positive(m.params_b) {
            err(format!("sim.models[{i}].params_b"), format!("must be positive, got {}", m.params_b));
        }
        if let Some(a) = m.active_b
            && !(positive(a) && a <= m.params_b)
        {
            err(format!("sim.models[{i}].active_b"), format!("must be in (0, params_b], got {a}"));
        }
        if !(m.bytes_per_param > 0.0 && m.bytes_per_param <= 4.0) {
            err(format!("sim.models[{i}].bytes_per_param"), format!("must be in (0, 4], got {}", m.bytes_per_param));
        }
        for (k, v) in [("layers", m.layers), ("kv_heads", m.kv_heads), ("head_dim", m.head_dim)] {
            if v == 0 {
                err(format!("sim.models[{i}].{k}"), "must be at least 1".into());
            }
        }
    }
    for (i, f) in spec.sim.faults.iter().enumerate() {
        match spec.pools.iter().find(|p| p.name == f.pool) {
            None => err(format!("sim.faults[{i}].pool"), format!("no pool is named {:?}", f.pool)),
            Some(p) if !matches!(p.backend, BackendSpec::Sim { .. }) => {
                err(format!("sim.faults[{i}].pool"), "faults are injected into simulated pools only".into())
            }
            Some(p) if f.shard >= p.count => err(format!("sim.faults[{i}].shard"), format!("pool {:?} has {} shards", f.pool, p.count)),
            Some(_) => {}
        }
    }
    if let Some(w) = &spec.sim.weight_sync {
        for (k, v) in [("bucket_gb", w.bucket_gb), ("inter_gbps", w.inter_gbps), ("intra_gbps", w.intra_gbps)] {
            if !positive(v) {
                err(format!("sim.weight_sync.{k}"), format!("must be positive, got {v}"));
            }
        }
    }
    if r.max_concurrent_episodes == Some(0) {
        err("rollout.max_concurrent_episodes".into(), "must be at least 1".into());
    }
    for (name, v) in [("env_call_timeout_s", r.env_call_timeout_s), ("frozen_after_s", r.frozen_after_s)] {
        if let Some(v) = v
            && !(v.is_finite() && v > 0.0)
        {
            err(format!("rollout.{name}"), format!("must be a positive number of seconds, got {v}"));
        }
    }
    for (name, f) in &spec.reward.functions {
        let p = format!("reward.functions.{name}");
        if BUILTIN_REWARDS.contains(&name.as_str()) {
            err(p.clone(), format!("{name:?} is a built-in reward and cannot be redefined"));
        }
        match f {
            FunctionSpec::Sim { latency_s, cold_start_s, concurrency, scale_to_zero_after_s, scaling } => {
                if let Some(s) = scaling {
                    for (k, m) in s.problems() {
                        err(format!("{p}.scaling.{k}"), m);
                    }
                }
                if let Some(d) = latency_s {
                    for m in d.problems() {
                        err(format!("{p}.latency_s"), m);
                    }
                }
                if !(cold_start_s.is_finite() && *cold_start_s >= 0.0) {
                    err(format!("{p}.cold_start_s"), format!("must be >= 0, got {cold_start_s}"));
                }
                if *concurrency == 0 {
                    err(format!("{p}.concurrency"), "must be at least 1".into());
                }
                if !(scale_to_zero_after_s.is_finite() && *scale_to_zero_after_s >= 0.0) {
                    err(format!("{p}.scale_to_zero_after_s"), format!("must be >= 0, got {scale_to_zero_after_s}"));
                }
            }
            FunctionSpec::Builtin { function, config, scaling, timeout_s, range, hedge_percentile } => {
                check_hedge(&p, *hedge_percentile, &mut err);
                if !BUILTIN_FUNCTIONS.contains(&function.as_str()) {
                    err(format!("{p}.function"), format!("unknown built-in function {function:?}; one of {}", BUILTIN_FUNCTIONS.join(", ")));
                }
                if config.as_ref().is_some_and(|c| !c.is_object()) {
                    err(format!("{p}.config"), "must be a table (JSON object)".into());
                }
                check_function_common(&p, Some(scaling), *timeout_s, *range, &mut err);
            }
            FunctionSpec::Command { command, scaling, timeout_s, range, hedge_percentile, .. } => {
                check_hedge(&p, *hedge_percentile, &mut err);
                if command.trim().is_empty() {
                    err(format!("{p}.command"), "must name an executable".into());
                }
                check_function_common(&p, Some(scaling), *timeout_s, *range, &mut err);
            }
            FunctionSpec::Http { url, timeout_s, range, hedge_percentile } => {
                check_hedge(&p, *hedge_percentile, &mut err);
                if !(url.starts_with("http://") || url.starts_with("https://")) || reqwest::Url::parse(url).is_err() {
                    err(format!("{p}.url"), format!("{url:?} is not an http(s) URL"));
                }
                check_function_common(&p, None, *timeout_s, *range, &mut err);
            }
        }
    }
    match &spec.trainer {
        TrainerSpec::Builtin(t) => {
            if !spec.pools.iter().all(|p| matches!(p.backend, BackendSpec::Builtin { .. })) {
                err("trainer".into(), "the built-in trainer needs every pool to use backend.kind = \"builtin\"".into());
            }
            if !(t.lr.is_finite() && t.lr > 0.0) {
                err("trainer.lr".into(), format!("must be positive, got {}", t.lr));
            }
            if !(t.grad_clip.is_finite() && t.grad_clip >= 0.0) {
                err("trainer.grad_clip".into(), format!("must be >= 0, got {}", t.grad_clip));
            }
            if !(t.eps_low > 0.0 && t.eps_low < 1.0 && t.eps_high > 0.0) {
                err("trainer.eps_low".into(), "clip range needs 0 < eps_low < 1 and eps_high > 0".into());
            }
            if t.tis_cap.is_some_and(|c| !(c.is_finite() && c >= 1.0)) {
                err("trainer.tis_cap".into(), "must be >= 1".into());
            }
            if !(t.kl_beta.is_finite() && t.kl_beta >= 0.0) {
                err("trainer.kl_beta".into(), "must be >= 0".into());
            }
        }
        TrainerSpec::Sim { seconds_per_token, gpus, step_overhead_s, device, model, mfu } => {
            if let Some(d) = device
                && spec.device_profile(d).is_none()
            {
                err("trainer.device".into(), format!("unknown device class {d:?}"));
            }
            if let Some(m) = model
                && spec.model_profile(m).is_none()
            {
                err("trainer.model".into(), format!("unknown model {m:?}"));
            }
            if let Some(v) = mfu
                && !(*v > 0.0 && *v <= 1.0)
            {
                err("trainer.mfu".into(), format!("must be in (0, 1], got {v}"));
            }
            if !(seconds_per_token.is_finite() && *seconds_per_token >= 0.0) {
                err("trainer.seconds_per_token".into(), format!("must be >= 0, got {seconds_per_token}"));
            }
            if *gpus == 0 {
                err("trainer.gpus".into(), "must be at least 1".into());
            }
            if !(step_overhead_s.is_finite() && *step_overhead_s >= 0.0) {
                err("trainer.step_overhead_s".into(), format!("must be >= 0, got {step_overhead_s}"));
            }
        }
    }
    errs
}

/// The concrete knobs a job runs with, after the preset and the defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Knobs {
    pub preset: Option<Preset>,
    pub barrier: Barrier,
    pub alpha: u64,
    pub overlap_training: bool,
    pub placement: Placement,
    pub mapping: MappingMode,
    pub batch_size: usize,
    pub steps: u64,
    pub on_weight_update: OnWeightUpdate,
    pub max_concurrent_episodes: usize,
    pub filter_all_equal: bool,
    pub max_retries_per_group: u32,
    pub env_call_timeout_s: f64,
    pub frozen_after_s: f64,
}

impl JobSpec {
    /// Resolves knobs: explicit values, else the preset's, else the `rollarc` preset's.
    pub fn knobs(&self) -> Knobs {
        let PresetKnobs { barrier, alpha, overlap, placement, mapping, on_weight_update } = self.preset.unwrap_or(Preset::Rollarc).knobs();
        let r = &self.rollout;
        let batch_size = r.batch_size.unwrap_or(8);
        let alpha = r.alpha.unwrap_or(alpha);
        let group_eps: usize = self.tasks.iter().map(|t| t.group_size + t.redundancy).max().unwrap_or(8);
        Knobs {
            preset: self.preset,
            barrier: r.barrier.unwrap_or(barrier),
            alpha,
            overlap_training: r.overlap_training.unwrap_or(overlap),
            placement: self.reward.placement.unwrap_or(placement),
            mapping: self.mapping.mode.unwrap_or(if mapping == MappingMode::Declared && self.mapping.declared.is_empty() {
                MappingMode::CostModel
            } else {
                mapping
            }),
            batch_size,
            steps: r.steps.unwrap_or(10),
            on_weight_update: r.on_weight_update.unwrap_or(on_weight_update),
            max_concurrent_episodes: r.max_concurrent_episodes.unwrap_or(batch_size * group_eps * (alpha as usize + 1)),
            filter_all_equal: r.filter_all_equal.unwrap_or(false),
            max_retries_per_group: r.max_retries_per_group.unwrap_or(2),
            env_call_timeout_s: r.env_call_timeout_s.unwrap_or(600.0),
            frozen_after_s: r.frozen_after_s.unwrap_or(120.0),
        }
    }

    /// A device class by name: `sim.devices` first, then the built-in catalogue.
    pub fn device_profile(&self, name: &str) -> Option<DeviceProfile> {
        match self.sim.devices.iter().find(|d| d.name.eq_ignore_ascii_case(name)) {
            Some(d) => Some(DeviceProfile { name: d.name.clone(), flops: d.tflops * 1e12, bandwidth: d.hbm_tbps * 1e12, memory: d.hbm_gb * 1e9, cost: d.cost }),
            None => DeviceProfile::builtin(name),
        }
    }

    /// A model profile by name: `sim.models` first, then the built-in catalogue.
    pub fn model_profile(&self, name: &str) -> Option<ModelProfile> {
        match self.sim.models.iter().find(|m| m.name.eq_ignore_ascii_case(name)) {
            Some(m) => Some(ModelProfile {
                name: m.name.clone(),
                params: m.params_b * 1e9,
                active_params: m.active_b.unwrap_or(m.params_b) * 1e9,
                layers: m.layers,
                kv_bytes_per_token: 2.0 * m.layers as f64 * m.kv_heads as f64 * m.head_dim as f64 * 2.0,
                bytes_per_param: m.bytes_per_param,
            }),
            None => ModelProfile::builtin(name),
        }
    }

    /// The weight-sync model of the job.
    pub fn weight_sync(&self) -> actors::device::WeightSync {
        self.sim.weight_sync.as_ref().map(WeightSyncSpec::model).unwrap_or_default()
    }

    /// Whether every backend is simulated (so the job can run on the virtual clock).
    pub fn all_simulated(&self) -> bool {
        self.pools.iter().all(|p| matches!(p.backend, BackendSpec::Sim { .. }))
            && matches!(self.trainer, TrainerSpec::Sim { .. })
            && self.reward.functions.values().all(|f| matches!(f, FunctionSpec::Sim { .. }))
    }

    /// The clock the job runs on.
    pub fn clock(&self) -> Clock {
        self.sim.clock.unwrap_or(if self.all_simulated() { Clock::Virtual } else { Clock::Real })
    }

    /// The built-in model's size, when the job uses it.
    pub fn builtin_model(&self) -> Option<BuiltinModelSpec> {
        self.pools.iter().find_map(|p| match &p.backend {
            BackendSpec::Builtin { model, .. } => Some(*model),
            BackendSpec::Sim { .. } => None,
        })
    }

    /// Applies a preset on top of a spec: the preset's knobs win over the spec's.
    pub fn with_preset(&self, preset: Preset) -> JobSpec {
        let mut s = self.clone();
        s.preset = Some(preset);
        let PresetKnobs { barrier, alpha, overlap, placement, mapping, on_weight_update } = preset.knobs();
        s.rollout.barrier = Some(barrier);
        s.rollout.alpha = Some(alpha);
        s.rollout.overlap_training = Some(overlap);
        s.rollout.on_weight_update = Some(on_weight_update);
        s.reward.placement = Some(placement);
        s.mapping.mode = Some(if mapping == MappingMode::Declared && s.mapping.declared.is_empty() { MappingMode::CostModel } else { mapping });
        s.rollout.max_concurrent_episodes = None;
        s
    }
}

#[cfg(test)]
mod tests;
