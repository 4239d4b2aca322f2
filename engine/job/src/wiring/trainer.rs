//! The trainer a job runs: the built-in one (real weights) or the time model of a GPU
//! trainer, and the weight-sync model of simulated clusters.

use std::sync::Arc;
use std::time::Duration;

use actors::device::{SyncMode, WeightSync};
use actors::model::llm::LoraConfig;
use actors::model::trainer::TrainerConfig;
use actors::rl::{AdvantageKind, Aggregation, PpoConfig};
use actors::trainer::SimTrainer;

use super::{PoolPlan, WiringError, device, model};
use crate::spec::{
    AdvantageSpec, AggregationSpec, BatchAdvantage, BuiltinTrainerSpec, JobSpec, ModelChoice,
    SyncModeSpec, TrainerSpec,
};

/// Which trainer a job runs.
pub enum TrainerPlan {
    /// The built-in trainer over the built-in model's weights.
    Builtin {
        model: ModelChoice,
        config: TrainerConfig,
        /// LoRA adapters instead of every weight (checkpoints).
        lora: Option<LoraConfig>,
        micro_batch_rows: Option<usize>,
    },
    /// A trainer in another process, fed through the trainer API; advantages per group by
    /// `estimator` (none: left to the trainer).
    External {
        estimator: Option<AdvantageKind>,
        lease: Duration,
        /// The pools' real model, if they run one (the trainer announces weights for it).
        model: Option<ModelChoice>,
    },
    /// A time model; `panic_runs`: the injected panic fires only in runs (epochs) below it.
    Sim {
        trainer: SimTrainer,
        panic_runs: u64,
    },
}

/// Training MFU of a simulated trainer when the spec gives none.
const DEFAULT_TRAIN_MFU: f64 = 0.35;

pub(super) fn plan(spec: &JobSpec, pools: &[PoolPlan]) -> Result<TrainerPlan, WiringError> {
    let builtin_model = pools.iter().find_map(|p| p.engine.real_model().cloned());
    let t = match (&spec.trainer, builtin_model) {
        (TrainerSpec::Builtin(t), Some(model)) => {
            return Ok(TrainerPlan::Builtin {
                model,
                config: builtin_trainer_config(t),
                lora: t.lora.as_ref().map(|l| LoraConfig {
                    rank: l.rank,
                    alpha: l.alpha,
                    targets: l.targets.clone(),
                    seed: spec.seed,
                }),
                micro_batch_rows: t.micro_batch_rows,
            });
        }
        (TrainerSpec::Builtin(_), None) => return Err(WiringError::BuiltinTrainerWithoutModel),
        (TrainerSpec::Sim { .. }, Some(_)) => return Err(WiringError::BuiltinModelWithoutTrainer),
        (TrainerSpec::Sim { .. }, None) => &spec.trainer,
        (TrainerSpec::External(t), model) => {
            return Ok(TrainerPlan::External {
                estimator: match t.advantage {
                    BatchAdvantage::Grpo => Some(AdvantageKind::Grpo),
                    BatchAdvantage::DrGrpo => Some(AdvantageKind::DrGrpo),
                    BatchAdvantage::Rloo => Some(AdvantageKind::Rloo),
                    BatchAdvantage::None => None,
                },
                lease: Duration::from_secs_f64(t.lease_s),
                model,
            });
        }
    };
    let TrainerSpec::Sim {
        seconds_per_token,
        gpus,
        step_overhead_s,
        device: device_name,
        model: model_name,
        mfu,
        host_cores,
    } = t
    else {
        unreachable!("matched above")
    };
    let bytes = pools.first().map_or(0.0, |p| p.model.weight_bytes());
    // With a device class: the roofline's seconds per token on one GPU of it, for the
    // trainer's model or else the pools' model.
    let roofline = match device_name {
        None => None,
        Some(d) => {
            let d = device(spec, "trainer.device".into(), d)?;
            let m = match model_name {
                Some(m) => Some(model(spec, "trainer.model".into(), m)?),
                None => pools.first().map(|p| p.model.clone()),
            };
            m.map(|m| {
                actors::device::train_seconds(&d, &m, 1, mfu.unwrap_or(DEFAULT_TRAIN_MFU), 1.0)
            })
        }
    };
    Ok(TrainerPlan::Sim {
        trainer: SimTrainer {
            seconds_per_token: roofline.unwrap_or(*seconds_per_token),
            gpus: *gpus,
            step_overhead: Duration::from_secs_f64(
                *step_overhead_s + weight_sync(spec).publish_seconds(bytes),
            ),
            modelled_weight_bytes: bytes,
            panic_at_step: spec.sim.trainer_panic_at_step,
            host: host_cores.map(|c| Arc::new(actors::trainer::HostCpu::new(f64::from(c)))),
        },
        panic_runs: spec.sim.trainer_panic_runs.unwrap_or(1),
    })
}

/// The built-in trainer's configuration.
pub fn builtin_trainer_config(t: &BuiltinTrainerSpec) -> TrainerConfig {
    TrainerConfig {
        lr: t.lr,
        warmup_steps: t.warmup_steps,
        decay_steps: t.decay_steps,
        weight_decay: t.weight_decay,
        grad_clip: t.grad_clip,
        advantage: match t.advantage {
            AdvantageSpec::Grpo => AdvantageKind::Grpo,
            AdvantageSpec::DrGrpo => AdvantageKind::DrGrpo,
            AdvantageSpec::Rloo => AdvantageKind::Rloo,
        },
        ppo: PpoConfig {
            eps_low: t.eps_low,
            eps_high: t.eps_high,
            aggregation: match t.aggregation {
                AggregationSpec::TokenMean => Aggregation::TokenMean,
                AggregationSpec::SeqMeanTokenMean => Aggregation::SeqMeanTokenMean,
            },
            tis_cap: t.tis_cap,
        },
        kl_beta: t.kl_beta,
        recompute_old: t.recompute_old,
        ..Default::default()
    }
}

/// The weight-sync model of the job (`sim.weight_sync`, else the default relay).
pub fn weight_sync(spec: &JobSpec) -> WeightSync {
    let Some(w) = &spec.sim.weight_sync else {
        return WeightSync::default();
    };
    WeightSync {
        mode: match w.mode {
            SyncModeSpec::Direct => SyncMode::Direct,
            SyncModeSpec::Relay => SyncMode::Relay,
        },
        bucket_bytes: w.bucket_gb * 1e9,
        inter_bandwidth: w.inter_gbps * 1e9 / 8.0,
        intra_bandwidth: w.intra_gbps * 1e9 / 8.0,
        shards: 1,
        gpus_per_shard: 1,
    }
}

/// What a checkpoint job trains (its model, adapters and micro-batches), if it is one.
pub fn checkpoint_spec(plan: &TrainerPlan) -> Option<actors::model::runtime::CheckpointSpec> {
    match plan {
        TrainerPlan::Builtin {
            model: ModelChoice::Checkpoint { path, max_seq, .. },
            lora,
            micro_batch_rows,
            ..
        } => Some(actors::model::runtime::CheckpointSpec {
            path: path.clone(),
            max_seq: *max_seq,
            lora: lora.clone(),
            micro_batch_rows: micro_batch_rows
                .unwrap_or(actors::model::llm::train::MICRO_BATCH_ROWS),
        }),
        _ => None,
    }
}

/// The advantage estimator a job's trainer applies to its groups: the built-in trainer's
/// `advantage`, the one an external trainer's batches carry (`None` for `advantage =
/// "none"`), or GRPO for a simulated trainer (it stands for a GRPO trainer's time).
pub fn advantage_kind(spec: &JobSpec) -> Option<AdvantageKind> {
    match &spec.trainer {
        TrainerSpec::Builtin(t) => Some(match t.advantage {
            AdvantageSpec::Grpo => AdvantageKind::Grpo,
            AdvantageSpec::DrGrpo => AdvantageKind::DrGrpo,
            AdvantageSpec::Rloo => AdvantageKind::Rloo,
        }),
        TrainerSpec::External(t) => match t.advantage {
            BatchAdvantage::Grpo => Some(AdvantageKind::Grpo),
            BatchAdvantage::DrGrpo => Some(AdvantageKind::DrGrpo),
            BatchAdvantage::Rloo => Some(AdvantageKind::Rloo),
            BatchAdvantage::None => None,
        },
        TrainerSpec::Sim { .. } => Some(AdvantageKind::Grpo),
    }
}
