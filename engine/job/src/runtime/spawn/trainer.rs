//! The run's trainer and the weights its shards start from: the built-in trainer (tiny model
//! or checkpoint), an external trainer behind the batch desk, or a simulated one; and the files
//! a checkpoint model's managed inference servers use.

use std::sync::Arc;

use actors::model::runtime::{BuiltinParts, LlmPolicy};
use actors::rl::AdvantageKind;
use actors::trainer::Trainer;
use actors::weights::Weights;

use crate::runtime::{JobError, JobRun};
use crate::spec::ModelChoice;
use crate::wiring::TrainerPlan;

/// What every shard starts from: the run's initial weights and, for a checkpoint model,
/// the loaded policy engines serve.
pub(super) struct ShardStart {
    pub(super) initial: Arc<Weights>,
    pub(super) policy: Option<Arc<LlmPolicy>>,
    /// Inference-server shards: where exported weights and the launcher script go.
    pub(super) served: Option<ServedFiles>,
}

/// Files a job's managed inference servers use: the launcher script of the default command
/// and each version's exported weights (one export per version, shared by every shard).
#[derive(Clone)]
pub(super) struct ServedFiles {
    pub(super) script: std::path::PathBuf,
    pub(super) export_f32: actors::generation::remote::WeightsExporter,
    pub(super) export_q8: actors::generation::remote::WeightsExporter,
    /// Hugging Face directories (SGLang, vLLM).
    pub(super) export_hf: actors::generation::remote::WeightsExporter,
}

impl ServedFiles {
    /// Writes the launcher script and sets up the exporters of `policy`'s versions.
    fn new(job: &JobRun, policy: &Arc<LlmPolicy>) -> Result<Self, JobError> {
        // Beside the trainer's checkpoints when the job keeps them, else a temporary folder.
        let dir = match &job.checkpoint_dir {
            Some(c) => c.join("served"),
            None => std::env::temp_dir().join(format!(
                "rollarc-served-{}-{}",
                std::process::id(),
                job.id
            )),
        };
        let script = dir.join("xllamacpp_serve.py");
        std::fs::create_dir_all(&dir)
            .and_then(|()| {
                std::fs::write(
                    &script,
                    actors::generation::remote::llamacpp::XLLAMACPP_SERVE,
                )
            })
            .map_err(|e| JobError::Served {
                path: script.clone(),
                source: e,
            })?;
        Ok(Self {
            script,
            export_f32: policy.gguf_exporter(dir.join("f32"), actors::model::llm::GgufType::F32),
            export_q8: policy.gguf_exporter(dir.join("q8_0"), actors::model::llm::GgufType::Q8_0),
            export_hf: policy.exporter(dir.join("hf"), None),
        })
    }
}

/// The run's initial weights and its trainer: the built-in trainer owns the real weights
/// (resumed from its checkpoint if any); a simulated one starts from modelled weights. A
/// checkpoint model also gives the policy its engines serve.
pub(super) fn trainer_and_weights(
    job: &JobRun,
    trainer: TrainerPlan,
    seed: u64,
    weight_bytes: f64,
) -> Result<(ShardStart, Box<dyn Trainer>), JobError> {
    let start_version = job.start_step;
    Ok(match trainer {
        TrainerPlan::Builtin {
            model: ModelChoice::Tiny(model),
            config,
            ..
        } => {
            let parts = BuiltinParts::new(
                model,
                config,
                seed,
                start_version,
                job.checkpoint_dir.clone(),
            )
            .map_err(JobError::BuiltinModel)?;
            let start = ShardStart {
                initial: parts.initial,
                policy: None,
                served: None,
            };
            (start, parts.trainer)
        }
        plan @ TrainerPlan::Builtin {
            model: ModelChoice::Checkpoint { .. },
            ..
        } => {
            let spec = crate::wiring::checkpoint_spec(&plan).expect("a checkpoint plan");
            let TrainerPlan::Builtin { config, .. } = plan else {
                unreachable!("matched above")
            };
            let (parts, policy) =
                BuiltinParts::checkpoint(&spec, config, start_version, job.checkpoint_dir.clone())
                    .map_err(|e| JobError::Checkpoint(Box::new(e)))?;
            let served = Some(ServedFiles::new(job, &policy)?);
            let start = ShardStart {
                initial: parts.initial,
                policy: Some(policy),
                served,
            };
            (start, parts.trainer)
        }
        TrainerPlan::External {
            estimator, model, ..
        } => external(job, estimator, model, seed, weight_bytes)?,
        TrainerPlan::Sim {
            mut trainer,
            panic_runs,
        } => {
            if job.epoch >= panic_runs {
                trainer.panic_at_step = None;
            }
            let w = Weights::simulated(start_version, weight_bytes);
            let start = ShardStart {
                initial: Arc::new(w),
                policy: None,
                served: None,
            };
            (start, Box::new(trainer))
        }
    })
}

/// An external trainer behind the job's batch desk, and the weights its shards start from:
/// the base model's, or the newest version the trainer announced (a resumed job).
fn external(
    job: &JobRun,
    estimator: Option<AdvantageKind>,
    model: Option<ModelChoice>,
    seed: u64,
    weight_bytes: f64,
) -> Result<(ShardStart, Box<dyn Trainer>), JobError> {
    let desk = job.batches.clone().ok_or(JobError::NoTrainerApi)?;
    // The base weights (no trainer state is kept: the trainer is elsewhere).
    let mut start = external_base(job, model, seed, weight_bytes)?;
    let mut served = crate::trainer_api::ServedModel::of(&start.initial);
    if let Some(p) = &start.policy {
        served = served.with_hf_names(p.config());
    }
    // A resumed job serves the newest version its trainer announced.
    let mut version = 0;
    let newest = desk.newest_weights(&job.id).map_err(JobError::TrainerApi)?;
    if let Some(a) = newest {
        start.initial = Arc::new(
            served
                .load(&a)
                .map_err(|e| JobError::Announced(Box::new(e)))?,
        );
        version = a.version;
    }
    let trainer = crate::trainer_api::ExternalTrainer {
        desk,
        job: job.id.clone(),
        estimator,
        served,
        version,
    };
    Ok((start, Box::new(trainer)))
}

/// The base weights of an external trainer's job: modelled ones (no model), the tiny model's
/// initial ones, or a checkpoint's (whose engines also get the loaded policy).
fn external_base(
    job: &JobRun,
    model: Option<ModelChoice>,
    seed: u64,
    weight_bytes: f64,
) -> Result<ShardStart, JobError> {
    Ok(match model {
        None => ShardStart {
            initial: Arc::new(Weights::simulated(0, weight_bytes)),
            policy: None,
            served: None,
        },
        Some(ModelChoice::Tiny(model)) => {
            let parts = BuiltinParts::new(model, Default::default(), seed, 0, None)
                .map_err(JobError::BuiltinModel)?;
            ShardStart {
                initial: parts.initial,
                policy: None,
                served: None,
            }
        }
        Some(ModelChoice::Checkpoint { path, max_seq, .. }) => {
            let spec = actors::model::runtime::CheckpointSpec {
                path,
                max_seq,
                lora: None,
                micro_batch_rows: 1,
            };
            let (parts, policy) = BuiltinParts::checkpoint(&spec, Default::default(), 0, None)
                .map_err(|e| JobError::Checkpoint(Box::new(e)))?;
            let served = Some(ServedFiles::new(job, &policy)?);
            ShardStart {
                initial: parts.initial,
                policy: Some(policy),
                served,
            }
        }
    })
}
