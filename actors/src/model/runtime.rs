//! The built-in model inside a job: initial (or checkpointed) weights, the trainer running its
//! steps on a blocking thread and checkpointing after each, and an engine stand-in that
//! reports why the real one could not be built.

use crate::error::SharedError;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::generation::{
    GenError, GenRequest, GenerationEngine, InFlightPolicy, LoadReport, StepReport,
};
use crate::model::engine::BuiltinEngine;
use crate::model::llm::{self, LlmDecoder, LlmModel, LlmTokenizer, LlmWeights, LoraConfig};
use crate::model::trainer::{BuiltinTrainer, TrainModel, TrainerConfig};
use crate::model::transformer::{ModelConfig, Params};
use crate::trainer::{TrainError, Trainer};
use crate::types::{Batch, PolicyVersion};
use crate::weights::Weights;
use candle_core::{DType, Device};

pub struct BuiltinParts {
    pub initial: Arc<Weights>,
    pub trainer: Box<dyn Trainer>,
}

impl BuiltinParts {
    /// Fresh seeded weights, or the checkpoint of `start_version` when resuming.
    pub fn new(
        model: ModelConfig,
        cfg: TrainerConfig,
        seed: u64,
        start_version: PolicyVersion,
        checkpoint_dir: Option<PathBuf>,
    ) -> candle_core::Result<Self> {
        let init = Params::init(&model, seed, DType::F32, &Device::Cpu)?;
        let trainer = BuiltinTrainer::new(model, &init, cfg)?;
        Self::resumed(trainer, start_version, checkpoint_dir)
    }

    /// A real checkpoint's trainer (every weight, or LoRA adapters) and the policy engines
    /// serve; resumes from the checkpoint of `start_version`.
    pub fn checkpoint(
        spec: &CheckpointSpec,
        cfg: TrainerConfig,
        start_version: PolicyVersion,
        checkpoint_dir: Option<PathBuf>,
    ) -> Result<(Self, Arc<LlmPolicy>), PolicyError> {
        let (weights, tokenizer) = llm::load(&spec.path)?;
        let engine_copy = share(&weights)?;
        let (model, init) = LlmModel::new(
            weights,
            spec.lora.clone(),
            spec.max_seq,
            spec.micro_batch_rows,
        )?;
        let trainer = BuiltinTrainer::with_model(model, &init, cfg)?;
        let parts = Self::resumed(trainer, start_version, checkpoint_dir)?;
        let policy = LlmPolicy {
            weights: engine_copy,
            tokenizer: Arc::new(tokenizer),
            max_seq: spec.max_seq,
        };
        Ok((parts, Arc::new(policy)))
    }

    fn resumed<M: TrainModel>(
        mut trainer: BuiltinTrainer<M>,
        start_version: PolicyVersion,
        checkpoint_dir: Option<PathBuf>,
    ) -> candle_core::Result<Self> {
        if start_version > 0 {
            match checkpoint_dir
                .as_ref()
                .map(|d| checkpoint_path(d, start_version))
            {
                Some(p) if p.exists() => trainer.load(&p)?,
                _ => candle_core::bail!("no checkpoint of version {start_version} to resume from"),
            }
        }
        let mut initial = trainer.published()?;
        initial.version = start_version;
        Ok(Self {
            initial: Arc::new(initial),
            trainer: Box::new(BuiltinTrainerTask {
                inner: Arc::new(Mutex::new(trainer)),
                checkpoint_dir,
            }),
        })
    }
}

/// The same weights over the same (shared, immutable) tensors.
fn share(w: &LlmWeights) -> candle_core::Result<LlmWeights> {
    w.with_tensors(w.named().into_iter().map(|(n, t)| (n, t.clone())))
}

/// What a checkpoint job trains and serves.
#[derive(Clone, Debug)]
pub struct CheckpointSpec {
    pub path: PathBuf,
    pub max_seq: usize,
    pub lora: Option<LoraConfig>,
    pub micro_batch_rows: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("cannot load the checkpoint")]
    Load(#[from] llm::LoadError),
    #[error("cannot set up the trainer")]
    Tensor(#[from] candle_core::Error),
}

/// A checkpoint as every shard of a job serves it: the loaded weights (shared between
/// engines until the first publication replaces them) and the tokenizer.
pub struct LlmPolicy {
    weights: LlmWeights,
    pub tokenizer: Arc<LlmTokenizer>,
    pub max_seq: usize,
}

impl LlmPolicy {
    /// The served model's configuration.
    pub fn config(&self) -> &llm::LlmConfig {
        &self.weights.cfg
    }

    /// A fresh engine over the loaded weights (no copy of the f32 tensors), generating at
    /// `precision`.
    pub fn engine(
        &self,
        max_batch: usize,
        precision: crate::types::Precision,
    ) -> candle_core::Result<BuiltinEngine<LlmDecoder>> {
        let d = LlmDecoder::new(share(&self.weights)?, self.tokenizer.clone(), self.max_seq)
            .with_precision(precision)?;
        Ok(BuiltinEngine::with_decoder(d, 0, max_batch))
    }

    /// Writes the policy with `weights` installed (a full, partial or LoRA publication) as a
    /// GGUF file.
    pub fn save_gguf(
        &self,
        weights: &Weights,
        path: &std::path::Path,
        ty: llm::GgufType,
    ) -> Result<(), ExportPolicyError> {
        self.save(weights, path, Some(ty))
    }

    /// Writes the policy with `weights` installed as GGUF (`ty`) or, without a type, as a
    /// Hugging Face directory.
    pub fn save(
        &self,
        weights: &Weights,
        path: &std::path::Path,
        ty: Option<llm::GgufType>,
    ) -> Result<(), ExportPolicyError> {
        use crate::model::decoder::Decoder;
        let base = share(&self.weights).map_err(PolicyError::from)?;
        let mut d = LlmDecoder::new(base, self.tokenizer.clone(), self.max_seq);
        d.install(weights).map_err(PolicyError::from)?;
        match ty {
            Some(ty) => d.weights().save_gguf(&self.tokenizer, path, ty)?,
            None => d.weights().save_hf(&self.tokenizer, path)?,
        }
        Ok(())
    }

    /// Exports each published version once, as `dir/v{version}.gguf`, for inference servers
    /// that load GGUF files (llama.cpp restarts on them). Shared by every shard of a job;
    /// the three newest files are kept.
    pub fn gguf_exporter(
        self: &Arc<Self>,
        dir: PathBuf,
        ty: llm::GgufType,
    ) -> crate::generation::remote::WeightsExporter {
        self.exporter(dir, Some(ty))
    }

    /// Exports each published version once, as a GGUF file `dir/v{version}.gguf` (`ty`) or a
    /// Hugging Face directory `dir/v{version}` (SGLang and vLLM load it from disk). Shared by
    /// every shard of a job; the three newest are kept.
    pub fn exporter(
        self: &Arc<Self>,
        dir: PathBuf,
        ty: Option<llm::GgufType>,
    ) -> crate::generation::remote::WeightsExporter {
        use crate::generation::remote::ServerError;
        let done: Arc<tokio::sync::Mutex<Vec<PolicyVersion>>> = Default::default();
        let policy = self.clone();
        Arc::new(move |version, weights| {
            let (policy, dir, done) = (policy.clone(), dir.clone(), done.clone());
            Box::pin(async move {
                let name = |v: PolicyVersion| match ty {
                    Some(_) => format!("v{v}.gguf"),
                    None => format!("v{v}"),
                };
                let path = dir.join(name(version));
                let mut done = done.lock().await;
                if done.contains(&version) {
                    return Ok(path);
                }
                let (p, out) = (policy.clone(), path.clone());
                tokio::task::spawn_blocking(move || {
                    std::fs::create_dir_all(&dir)
                        .map_err(|e| ServerError::Other(format!("{}: {e}", dir.display())))?;
                    let tmp = out.with_extension("part");
                    let _ = std::fs::remove_dir_all(&tmp);
                    p.save(&weights, &tmp, ty).map_err(|e| {
                        ServerError::Other(format!(
                            "exporting v{version} as GGUF: {}",
                            infra::error_chain(&e)
                        ))
                    })?;
                    std::fs::rename(&tmp, &out)
                        .map_err(|e| ServerError::Other(format!("{}: {e}", out.display())))
                })
                .await
                .map_err(|e| ServerError::Other(format!("the export thread failed: {e}")))??;
                done.push(version);
                done.sort_unstable();
                while done.len() > 3 {
                    let old = done.remove(0);
                    let old = path.with_file_name(name(old));
                    let _ = std::fs::remove_file(&old);
                    let _ = std::fs::remove_dir_all(&old);
                }
                Ok(path)
            })
        })
    }
}

pub fn checkpoint_path(dir: &std::path::Path, version: PolicyVersion) -> PathBuf {
    dir.join(format!("v{version}.safetensors"))
}

/// Runs the built-in trainer's steps on a blocking thread so the job's runtime keeps serving
/// the rollout while a step computes; checkpoints every new version.
pub struct BuiltinTrainerTask<M: TrainModel> {
    inner: Arc<Mutex<BuiltinTrainer<M>>>,
    checkpoint_dir: Option<PathBuf>,
}

impl<M: TrainModel> Trainer for BuiltinTrainerTask<M> {
    fn train(
        &mut self,
        batch: &Batch,
        next_version: PolicyVersion,
    ) -> futures::future::BoxFuture<'_, crate::trainer::StepResult> {
        let inner = self.inner.clone();
        let batch = batch.clone();
        let dir = self.checkpoint_dir.clone();
        Box::pin(async move {
            let t = tokio::time::Instant::now();
            let r = tokio::task::spawn_blocking(move || {
                let mut tr = inner.lock().map_err(|_| TrainError::Poisoned)?;
                let (mut s, mut w) = tr
                    .step(&batch)
                    .map_err(|e| TrainError::Step(SharedError::new(e)))?;
                if let Some(d) = dir {
                    let path = checkpoint_path(&d, next_version);
                    std::fs::create_dir_all(&d).map_err(|e| TrainError::Checkpoint {
                        path: path.clone(),
                        source: SharedError::new(e),
                    })?;
                    tr.save(&path).map_err(|e| TrainError::Checkpoint {
                        path: path.clone(),
                        source: SharedError::new(e),
                    })?;
                    // Keep the two newest checkpoints.
                    if next_version >= 2 {
                        let _ = std::fs::remove_file(checkpoint_path(&d, next_version - 2));
                    }
                }
                s.version = next_version;
                w.version = next_version;
                Ok((s, w))
            })
            .await
            .map_err(|e| TrainError::Thread(SharedError::new(e)))?;
            r.map(|(mut s, w)| {
                s.seconds = t.elapsed().as_secs_f64();
                (s, Some(w))
            })
        })
    }
}

/// Stands in for an engine that could not be built: fails every request with the reason.
pub struct FailedEngine(SharedError, Vec<u64>);

impl FailedEngine {
    /// An engine that fails every request and install with `why` (the reason the real
    /// engine could not be built).
    pub fn new(why: GenError) -> Self {
        Self(SharedError::new(why), Vec::new())
    }
}

impl GenerationEngine for FailedEngine {
    fn add(&mut self, req: GenRequest) {
        self.1.push(req.id);
    }
    fn abort(&mut self, id: u64) -> bool {
        let n = self.1.len();
        self.1.retain(|&i| i != id);
        n != self.1.len()
    }
    fn release(&mut self, _session: u64) {}
    fn install(
        &mut self,
        _v: PolicyVersion,
        _w: &Weights,
        _p: InFlightPolicy,
    ) -> Result<Duration, GenError> {
        Err(GenError::Backend(self.0.clone()))
    }
    fn has_work(&self) -> bool {
        !self.1.is_empty()
    }
    fn step(&mut self) -> StepReport {
        let finished = self
            .1
            .drain(..)
            .map(|id| (id, Err(GenError::Backend(self.0.clone()))))
            .collect();
        StepReport {
            finished,
            ..StepReport::default()
        }
    }
    fn load(&self) -> LoadReport {
        LoadReport::default()
    }
}

/// What an exported policy is written as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportFormat {
    /// A GGUF file, f32.
    Gguf,
    /// A GGUF file, q8_0 matrices.
    GgufQ8,
    /// A Hugging Face directory (f32 safetensors, tokenizer, config).
    Hf,
}

#[derive(Debug, thiserror::Error)]
pub enum ExportPolicyError {
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error("cannot read the trainer checkpoint {path}")]
    Checkpoint {
        path: PathBuf,
        #[source]
        source: candle_core::Error,
    },
    #[error(transparent)]
    Gguf(#[from] llm::ExportError),
    #[error(transparent)]
    Hf(#[from] llm::HfError),
}

/// Writes the policy a checkpoint job trained: the base checkpoint with the trained tensors
/// of `trained` (a trainer checkpoint: every weight, or LoRA adapters merged into the base).
pub fn export_policy(
    spec: &CheckpointSpec,
    trained: &std::path::Path,
    format: ExportFormat,
    out: &std::path::Path,
) -> Result<(), ExportPolicyError> {
    let (weights, tokenizer) = llm::load(&spec.path).map_err(PolicyError::from)?;
    let (model, _) =
        LlmModel::new(weights, spec.lora.clone(), spec.max_seq, 1).map_err(PolicyError::from)?;
    let read = |source| ExportPolicyError::Checkpoint {
        path: trained.to_path_buf(),
        source,
    };
    let map = candle_core::safetensors::load(trained, &Device::Cpu).map_err(read)?;
    let policy = model
        .build(&|n| {
            map.get(&format!("param.{n}"))
                .cloned()
                .ok_or_else(|| candle_core::Error::Msg(format!("the checkpoint lacks {n}")))
        })
        .map_err(read)?;
    match format {
        ExportFormat::Gguf => policy.save_gguf(&tokenizer, out, llm::GgufType::F32)?,
        ExportFormat::GgufQ8 => policy.save_gguf(&tokenizer, out, llm::GgufType::Q8_0)?,
        ExportFormat::Hf => policy.save_hf(&tokenizer, out)?,
    }
    Ok(())
}
