//! The `trainer` section: the built-in trainer's objective and optimiser, or the time model of
//! a simulated GPU trainer.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::knob::{Knob, KnobInfo, knob};
use super::{JobSpec, Problems};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum TrainerSpec {
    /// Time model of a GPU trainer: with `device`, a roofline (8 FLOPs per active parameter
    /// per token at `mfu` on `gpus` devices of that class, for `model` or the pools' model);
    /// without, `seconds_per_token` per GPU.
    Sim {
        #[serde(default = "default_seconds_per_token")]
        seconds_per_token: f64,
        #[serde(default = "default_trainer_gpus")]
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
        /// The trainer shares a host of this many cores with the simulated generation pools
        /// (a CPU deployment, as `rollarc profile` measures one): their compute while a step
        /// trains slows it by busy seconds / cores.
        #[serde(default)]
        host_cores: Option<u32>,
    },
    /// The built-in trainer for the built-in model (CPU).
    Builtin(BuiltinTrainerSpec),
    /// A trainer in another process, fed through the trainer API
    /// (`GET /v1/jobs/{id}/batches/next`, `POST /v1/batches/{batch_id}/ack`).
    External(ExternalTrainerSpec),
}

/// An external trainer's batches.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExternalTrainerSpec {
    /// Seconds a trainer holds a leased batch; then it is offered again (1..=86400).
    #[serde(default = "default_lease_s")]
    pub lease_s: f64,
    /// Advantages computed per group before a batch is offered; `none` leaves them to the
    /// trainer (every sample's `advantage` is 0).
    #[serde(default = "default_batch_advantage")]
    pub advantage: BatchAdvantage,
}

fn default_lease_s() -> f64 {
    300.0
}

fn default_batch_advantage() -> BatchAdvantage {
    BatchAdvantage::Grpo
}

/// The advantage estimator of an external trainer's batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum BatchAdvantage {
    Grpo,
    DrGrpo,
    Rloo,
    None,
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
    #[serde(default = "default_lr")]
    pub lr: f64,
    #[serde(default)]
    pub warmup_steps: u64,
    #[serde(default)]
    pub decay_steps: Option<u64>,
    #[serde(default)]
    pub weight_decay: f64,
    #[serde(default = "default_grad_clip")]
    pub grad_clip: f64,
    #[serde(default = "default_advantage")]
    pub advantage: AdvantageSpec,
    #[serde(default = "default_aggregation")]
    pub aggregation: AggregationSpec,
    #[serde(default = "default_eps_low")]
    pub eps_low: f64,
    #[serde(default = "default_eps_high")]
    pub eps_high: f64,
    #[serde(default)]
    pub tis_cap: Option<f64>,
    #[serde(default)]
    pub kl_beta: f64,
    #[serde(default)]
    pub recompute_old: bool,
    /// Train low-rank adapters instead of every weight (checkpoint models only).
    #[serde(default)]
    pub lora: Option<LoraSpec>,
    #[serde(default)]
    pub micro_batch_rows: Option<usize>,
}

/// LoRA: `W' = W + (alpha / rank) · B · A` on the named projections of every block.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LoraSpec {
    #[serde(default = "default_lora_rank")]
    pub rank: usize,
    #[serde(default = "default_lora_alpha")]
    pub alpha: f64,
    /// Among attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down.
    #[serde(default = "default_lora_targets")]
    pub targets: Vec<String>,
}

pub const TRAINER_MICRO_BATCH_ROWS: Knob<usize> = knob(
    ("BuiltinTrainerSpec", "trainer", "micro_batch_rows"),
    (1, false, 4096),
    None,
    "32 for the tiny model, 64 for checkpoints (and at most 1,024 tokens a pass)",
    "Rows per backward pass (gradients accumulate over micro-batches; bounds the activations a step holds). A checkpoint's rows are packed into one sequence, so its passes also stop at 1,024 tokens (a longer row alone).",
);
pub const LORA_RANK: Knob<usize> = knob(
    ("LoraSpec", "trainer.lora", "rank"),
    (1, false, 1024),
    Some(8),
    "",
    "Rank of the low-rank adapters.",
);

/// The knobs of the built-in trainer, in the manual's order.
pub(super) fn knobs() -> Vec<KnobInfo> {
    vec![TRAINER_MICRO_BATCH_ROWS.info(), LORA_RANK.info()]
}

fn default_lora_rank() -> usize {
    LORA_RANK.or_default(None)
}
fn default_lora_alpha() -> f64 {
    16.0
}
fn default_lora_targets() -> Vec<String> {
    vec!["attn_q".into(), "attn_v".into()]
}

fn default_lr() -> f64 {
    1e-3
}
fn default_grad_clip() -> f64 {
    1.0
}
fn default_advantage() -> AdvantageSpec {
    AdvantageSpec::Grpo
}
fn default_aggregation() -> AggregationSpec {
    AggregationSpec::TokenMean
}
fn default_eps_low() -> f64 {
    0.2
}
fn default_eps_high() -> f64 {
    0.28
}

fn default_seconds_per_token() -> f64 {
    2e-4
}
fn default_trainer_gpus() -> u32 {
    8
}

impl Default for TrainerSpec {
    fn default() -> Self {
        Self::Sim {
            seconds_per_token: default_seconds_per_token(),
            gpus: default_trainer_gpus(),
            step_overhead_s: 0.0,
            device: None,
            model: None,
            mfu: None,
            host_cores: None,
        }
    }
}

impl TrainerSpec {
    /// Checks the trainer against the pools it feeds.
    pub(super) fn check(&self, spec: &JobSpec, problems: &mut Problems) {
        match self {
            TrainerSpec::External(t) => {
                if !(t.lease_s.is_finite() && (1.0..=86_400.0).contains(&t.lease_s)) {
                    problems.push(
                        "trainer.lease_s".into(),
                        format!("must be in 1..=86400 seconds, got {}", t.lease_s),
                    );
                }
                let real = spec
                    .pools
                    .iter()
                    .filter(|p| p.backend.real_model().is_some());
                if real.count() != 0 && !spec.all_pools_builtin() {
                    problems.push(
                        "trainer".into(),
                        "an external trainer's pools all run the real model or all are simulated"
                            .into(),
                    );
                }
            }
            TrainerSpec::Builtin(t) => check_builtin(spec, t, problems),
            TrainerSpec::Sim { .. } => self.check_sim(spec, problems),
        }
    }

    /// Checks a simulated trainer's costs and names.
    fn check_sim(&self, spec: &JobSpec, problems: &mut Problems) {
        let TrainerSpec::Sim {
            seconds_per_token,
            gpus,
            step_overhead_s,
            device,
            model,
            mfu,
            host_cores,
        } = self
        else {
            return;
        };
        if let Some(c) = host_cores
            && (*c == 0 || *c > 4096)
        {
            problems.push(
                "trainer.host_cores".into(),
                format!("must be in 1..=4096, got {c}"),
            );
        }
        if let Some(d) = device
            && spec.device_profile(d).is_none()
        {
            problems.push(
                "trainer.device".into(),
                format!("unknown device class {d:?}"),
            );
        }
        if let Some(m) = model
            && spec.model_profile(m).is_none()
        {
            problems.push("trainer.model".into(), format!("unknown model {m:?}"));
        }
        if let Some(v) = mfu
            && !(*v > 0.0 && *v <= 1.0)
        {
            problems.push("trainer.mfu".into(), format!("must be in (0, 1], got {v}"));
        }
        // An hour per token is far past any real trainer; more overflows the clock.
        if !(seconds_per_token.is_finite() && (0.0..=3600.0).contains(seconds_per_token)) {
            problems.push(
                "trainer.seconds_per_token".into(),
                format!("must be in [0, 3600], got {seconds_per_token}"),
            );
        }
        if *gpus == 0 {
            problems.push("trainer.gpus".into(), "must be at least 1".into());
        }
        problems.seconds("trainer.step_overhead_s".into(), *step_overhead_s, false);
    }
}

/// Checks the built-in trainer's optimiser and loss settings.
fn check_builtin(spec: &JobSpec, t: &BuiltinTrainerSpec, problems: &mut Problems) {
    if !spec.all_pools_builtin() {
        problems.push(
        "trainer".into(),
        "the built-in trainer needs every pool to run a real model (backend.kind = \"builtin\", \"llamacpp\", \"sglang\" or \"vllm\")"
            .into(),
    );
    }
    if !(t.lr.is_finite() && t.lr > 0.0) {
        problems.push(
            "trainer.lr".into(),
            format!("must be positive, got {}", t.lr),
        );
    }
    if !(t.grad_clip.is_finite() && t.grad_clip >= 0.0) {
        problems.push(
            "trainer.grad_clip".into(),
            format!("must be >= 0, got {}", t.grad_clip),
        );
    }
    if !(t.eps_low > 0.0 && t.eps_low < 1.0 && t.eps_high > 0.0) {
        problems.push(
            "trainer.eps_low".into(),
            "clip range needs 0 < eps_low < 1 and eps_high > 0".into(),
        );
    }
    if t.tis_cap.is_some_and(|c| !(c.is_finite() && c >= 1.0)) {
        problems.push("trainer.tis_cap".into(), "must be >= 1".into());
    }
    TRAINER_MICRO_BATCH_ROWS.check(t.micro_batch_rows, problems);
    if let Some(l) = &t.lora {
        check_lora(spec, l, problems);
    }
    if !(t.kl_beta.is_finite() && t.kl_beta >= 0.0) {
        problems.push("trainer.kl_beta".into(), "must be >= 0".into());
    }
}

fn check_lora(spec: &JobSpec, l: &LoraSpec, problems: &mut Problems) {
    let checkpoint = spec
        .pools
        .iter()
        .any(|p| p.backend.real_model().is_some_and(|m| m.path.is_some()));
    if !checkpoint {
        problems.push(
            "trainer.lora".into(),
            "LoRA trains checkpoint models (backend.model.path); the tiny model trains fully"
                .into(),
        );
    }
    LORA_RANK.check(Some(l.rank), problems);
    if !(l.alpha.is_finite() && l.alpha > 0.0) {
        problems.push(
            "trainer.lora.alpha".into(),
            format!("must be positive, got {}", l.alpha),
        );
    }
    if l.targets.is_empty() {
        problems.push(
            "trainer.lora.targets".into(),
            "name at least one projection".into(),
        );
    }
    for (i, t) in l.targets.iter().enumerate() {
        if !actors::model::llm::train::LORA_TARGETS.contains(&t.as_str()) {
            problems.push(
                format!("trainer.lora.targets[{i}]"),
                format!(
                    "unknown projection {t:?}; one of {}",
                    actors::model::llm::train::LORA_TARGETS.join(", ")
                ),
            );
        }
    }
}
