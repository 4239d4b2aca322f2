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
use crate::model::trainer::{BuiltinTrainer, TrainerConfig};
use crate::model::transformer::{ModelConfig, Params};
use crate::trainer::{TrainError, TrainStats, Trainer};
use crate::types::{Batch, PolicyVersion};
use crate::weights::Weights;
use candle_core::{DType, Device};

pub struct BuiltinParts {
    pub initial: Arc<Weights>,
    pub trainer: BuiltinTrainerTask,
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
        let mut trainer = BuiltinTrainer::new(model, &init, cfg)?;
        if start_version > 0 {
            match checkpoint_dir
                .as_ref()
                .map(|d| checkpoint_path(d, start_version))
            {
                Some(p) if p.exists() => trainer.load(&p)?,
                _ => candle_core::bail!("no checkpoint of version {start_version} to resume from"),
            }
        }
        let initial = Arc::new(trainer.params()?.to_weights(start_version)?);
        Ok(Self {
            initial,
            trainer: BuiltinTrainerTask {
                inner: Arc::new(Mutex::new(trainer)),
                checkpoint_dir,
            },
        })
    }
}

pub fn checkpoint_path(dir: &std::path::Path, version: PolicyVersion) -> PathBuf {
    dir.join(format!("v{version}.safetensors"))
}

/// Runs the built-in trainer's steps on a blocking thread so the job's runtime keeps serving
/// the rollout while a step computes; checkpoints every new version.
pub struct BuiltinTrainerTask {
    inner: Arc<Mutex<BuiltinTrainer>>,
    checkpoint_dir: Option<PathBuf>,
}

impl Trainer for BuiltinTrainerTask {
    fn train(
        &mut self,
        batch: &Batch,
        next_version: PolicyVersion,
    ) -> futures::future::BoxFuture<'_, Result<(TrainStats, Weights), TrainError>> {
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
                (s, w)
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
