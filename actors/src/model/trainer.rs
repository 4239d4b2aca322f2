//! The built-in trainer: GRPO-family advantages, the PPO-clip loss on the transformer's
//! recomputed log-probabilities (only generated tokens carry loss), optional k3 KL to a frozen
//! reference, optional truncated importance sampling, AdamW with decoupled weight decay,
//! global-norm gradient clipping, warmup + cosine learning-rate schedule, and checkpoints
//! (safetensors: parameters and optimiser moments) that it resumes from.
//!
//! AdamW is written here (in the `step` module, with the rest of an optimisation step) rather
//! than taken from candle-nn because candle-nn keeps the moments private, and a checkpoint
//! must carry them. Batches on tensors are built in `batch`; the loss and its diagnostics are
//! in `loss`.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Result, Tensor, Var};

use super::transformer::{ModelConfig, Params, Transformer};
use crate::rl::{AdvantageKind, PpoConfig};
use crate::trainer::{TrainError, Trainer};
use crate::types::{Batch, PolicyVersion};
use crate::weights::Weights;

mod batch;
mod loss;
mod step;

pub use batch::{
    BatchShape, TensorBatch, flatten, micro_batches, tensor_batch, tensor_batches,
    tensor_batches_for,
};
use loss::ChunkDiag;
pub use loss::{kl_k3, ppo_loss};

/// Knobs of the built-in trainer.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainerConfig {
    pub lr: f64,
    pub warmup_steps: u64,
    /// Cosine decay to 10% of `lr` over this many steps (none: constant after warmup).
    pub decay_steps: Option<u64>,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Global gradient-norm clip (0 = off).
    pub grad_clip: f64,
    pub advantage: AdvantageKind,
    pub ppo: PpoConfig,
    /// β of the k3 KL penalty to the initial policy (0 = off).
    pub kl_beta: f64,
    /// Recompute the "old" log-probabilities with the trainer's weights before the step (then
    /// TIS, if enabled, corrects old vs behaviour); otherwise old = behaviour.
    pub recompute_old: bool,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            warmup_steps: 0,
            decay_steps: None,
            weight_decay: 0.0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            grad_clip: 1.0,
            advantage: AdvantageKind::Grpo,
            ppo: PpoConfig::default(),
            kl_beta: 0.0,
            recompute_old: false,
        }
    }
}

impl TrainerConfig {
    /// Learning rate at `step` (0-based).
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        match self.decay_steps {
            Some(n) if n > 0 => {
                let p = ((step - self.warmup_steps) as f64 / n as f64).min(1.0);
                let floor = 0.1 * self.lr;
                floor + (self.lr - floor) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
            }
            _ => self.lr,
        }
    }
}

/// Rows per training chunk of the tiny model (gradients accumulate over chunks).
pub const TRAIN_CHUNK_ROWS: usize = 32;

/// What the trainer needs of a model: its parameters built from (variable) tensors by name,
/// all-position logits of a padded batch, the batch layout, and the weights it publishes.
pub trait TrainModel: Send + 'static {
    /// The parameters a forward runs with.
    type Params: Send;

    /// Parameters from the trainable tensors, by name (frozen ones the model keeps itself).
    fn build(&self, get: &dyn Fn(&str) -> Result<Tensor>) -> Result<Self::Params>;
    /// Logits `[B, T, vocab]` of inputs `[B, T]` (right-padded rows).
    fn logits(&self, p: &Self::Params, inputs: &Tensor) -> Result<Tensor>;
    fn shape(&self) -> BatchShape;
    /// Rows per micro-batch: gradients accumulate over micro-batches, so this bounds the
    /// activations a step keeps alive.
    fn micro_batch_rows(&self) -> usize;
    /// Tokens per micro-batch, at most (a longer row alone).
    fn micro_batch_tokens(&self) -> usize {
        usize::MAX
    }
    /// The weights engines install for `version`, from the trainable tensors by name.
    fn publish(&self, trained: &[(String, Tensor)], version: PolicyVersion) -> Result<Weights>;
    /// The log-probabilities of `tb`'s targets `[B, T]` (differentiable) and the policy's
    /// entropy at each position `[B, T]` (detached). Only positions where `tb.mask` is set
    /// must be right; a model may leave others at 0. By default from [`Self::logits`].
    fn token_logprobs(&self, p: &Self::Params, tb: &TensorBatch) -> Result<(Tensor, Tensor)> {
        let logits = self.logits(p, &tb.inputs)?;
        let logits = match &tb.allow {
            Some(a) => (logits + a)?,
            None => logits,
        };
        logprobs_and_entropy(&logits, &tb.targets)
    }
}

/// From logits `[.., V]` and targets `[..]`: the targets' log-probabilities (differentiable)
/// and the entropy (detached), one log-softmax for both.
pub fn logprobs_and_entropy(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let lsm = candle_nn::ops::log_softmax(logits, candle_core::D::Minus1)?;
    let new = lsm
        .gather(
            &targets.unsqueeze(candle_core::D::Minus1)?,
            candle_core::D::Minus1,
        )?
        .squeeze(candle_core::D::Minus1)?;
    let l = lsm.detach();
    let entropy = (l.exp()? * &l)?.sum(candle_core::D::Minus1)?.neg()?;
    Ok((new, entropy))
}

/// The tiny byte-level transformer as a [`TrainModel`].
pub struct TinyModel(pub Transformer);

impl TrainModel for TinyModel {
    type Params = Params;

    fn build(&self, get: &dyn Fn(&str) -> Result<Tensor>) -> Result<Params> {
        Params::from_named(&self.0.cfg, get)
    }
    fn logits(&self, p: &Params, inputs: &Tensor) -> Result<Tensor> {
        self.0.forward(p, inputs)
    }
    fn shape(&self) -> BatchShape {
        BatchShape::tiny(self.0.cfg.max_seq)
    }
    fn micro_batch_rows(&self) -> usize {
        TRAIN_CHUNK_ROWS
    }
    fn publish(&self, trained: &[(String, Tensor)], version: PolicyVersion) -> Result<Weights> {
        let p = self.build(&|n| find(trained, n))?;
        p.to_weights(version)
    }
}

/// The tensor named `name` in `named`.
pub fn find(named: &[(String, Tensor)], name: &str) -> Result<Tensor> {
    named
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, t)| t.clone())
        .ok_or_else(|| candle_core::Error::Msg(format!("no parameter {name}")))
}

pub struct BuiltinTrainer<M: TrainModel = TinyModel> {
    pub model: M,
    names: Vec<String>,
    vars: Vec<Var>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    pub cfg: TrainerConfig,
    step: u64,
    version: PolicyVersion,
    reference: Option<M::Params>,
    dtype: DType,
    dev: Device,
}

impl BuiltinTrainer<TinyModel> {
    /// A trainer of the tiny transformer starting from `init` (version 0 unless resumed).
    pub fn new(model_cfg: ModelConfig, init: &Params, cfg: TrainerConfig) -> Result<Self> {
        let named: Vec<(String, Tensor)> = init
            .named()
            .into_iter()
            .map(|(n, t)| (n, t.clone()))
            .collect();
        Self::with_model(TinyModel(Transformer::new(model_cfg)), &named, cfg)
    }
}

impl<M: TrainModel> BuiltinTrainer<M> {
    /// A trainer of `model` whose trainable tensors start as `init` (copied; version 0
    /// unless resumed).
    pub fn with_model(model: M, init: &[(String, Tensor)], cfg: TrainerConfig) -> Result<Self> {
        let (dtype, dev) = match init.first() {
            Some((_, t)) => (t.dtype(), t.device().clone()),
            None => candle_core::bail!("a model with no trainable tensors"),
        };
        let mut names = Vec::new();
        let mut vars = Vec::new();
        let mut m = Vec::new();
        let mut v = Vec::new();
        for (n, t) in init {
            names.push(n.clone());
            vars.push(Var::from_tensor(&t.copy()?)?);
            m.push(t.zeros_like()?);
            v.push(t.zeros_like()?);
        }
        let reference = if cfg.kl_beta > 0.0 {
            let copies: Vec<(String, Tensor)> = init
                .iter()
                .map(|(n, t)| Ok((n.clone(), t.copy()?)))
                .collect::<Result<_>>()?;
            Some(model.build(&|n| find(&copies, n))?)
        } else {
            None
        };
        Ok(Self {
            model,
            names,
            vars,
            m,
            v,
            cfg,
            step: 0,
            version: 0,
            reference,
            dtype,
            dev,
        })
    }

    /// The current parameters (Var-backed: gradients flow into them).
    pub fn params(&self) -> Result<M::Params> {
        let map: HashMap<&str, &Var> = self
            .names
            .iter()
            .map(String::as_str)
            .zip(self.vars.iter())
            .collect();
        self.model.build(&|n| {
            map.get(n)
                .map(|v| v.as_tensor().clone())
                .ok_or_else(|| candle_core::Error::Msg(format!("no parameter {n}")))
        })
    }

    /// The trainable tensors by name, as they are now (shared with the variables: copy
    /// before the next step if they must outlive it).
    pub fn trained(&self) -> Vec<(String, Tensor)> {
        self.names
            .iter()
            .cloned()
            .zip(self.vars.iter().map(|v| v.as_tensor().clone()))
            .collect()
    }

    /// The weights of the current version, for engines.
    pub fn published(&self) -> Result<Weights> {
        // Copies: a variable's storage is updated in place by the next step.
        let copies: Vec<(String, Tensor)> = self
            .trained()
            .into_iter()
            .map(|(n, t)| Ok((n, t.copy()?)))
            .collect::<Result<_>>()?;
        self.model.publish(&copies, self.version)
    }

    /// Replaces one parameter (tests: finite differences).
    pub fn set_param(&mut self, name: &str, value: &Var) -> Result<()> {
        let i = self
            .names
            .iter()
            .position(|n| n == name)
            .ok_or_else(|| candle_core::Error::Msg(format!("no parameter {name}")))?;
        self.vars[i].set(value.as_tensor())
    }

    pub fn version(&self) -> PolicyVersion {
        self.version
    }

    /// Log-probabilities of the targets under the current parameters [B, T].
    pub fn logprobs(&self, p: &M::Params, tb: &TensorBatch) -> Result<Tensor> {
        Ok(self.model.token_logprobs(p, tb)?.0)
    }

    /// The scalar objective of a batch (policy loss + β·KL) with the current parameters.
    pub fn objective(&self, tb: &TensorBatch) -> Result<(Tensor, Tensor)> {
        let p = self.params()?;
        let new = self.logprobs(&p, tb)?;
        let old = if self.cfg.recompute_old {
            new.detach()
        } else {
            tb.behaviour.clone()
        };
        let mut loss = ppo_loss(
            &self.cfg.ppo,
            &new,
            &old,
            &tb.behaviour,
            &tb.mask,
            &tb.advantages,
        )?;
        if let (Some(r), true) = (&self.reference, self.cfg.kl_beta > 0.0) {
            let ref_lp = self.logprobs(r, tb)?.detach();
            loss = (loss + (kl_k3(&new, &ref_lp, &tb.mask)? * self.cfg.kl_beta)?)?;
        }
        Ok((loss, new))
    }

    /// The policy loss (mean over the chunk) and, when a reference is kept, the k3 KL
    /// (token mean) — unweighted — with the chunk's diagnostics.
    pub(crate) fn objective_parts(
        &self,
        tb: &TensorBatch,
    ) -> Result<(Tensor, Option<Tensor>, ChunkDiag)> {
        let p = self.params()?;
        let (new, entropy) = self.model.token_logprobs(&p, tb)?;
        let old = if self.cfg.recompute_old {
            new.detach()
        } else {
            tb.behaviour.clone()
        };
        let loss = ppo_loss(
            &self.cfg.ppo,
            &new,
            &old,
            &tb.behaviour,
            &tb.mask,
            &tb.advantages,
        )?;
        let kl = match (&self.reference, self.cfg.kl_beta > 0.0) {
            (Some(r), true) => {
                let ref_lp = self.logprobs(r, tb)?.detach();
                Some(kl_k3(&new, &ref_lp, &tb.mask)?)
            }
            _ => None,
        };
        let diag = ChunkDiag::of(&self.cfg.ppo, &new.detach(), &old, tb, &entropy)?;
        Ok((loss, kl, diag))
    }

    /// Saves parameters and optimiser state (safetensors).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut map: HashMap<String, Tensor> = HashMap::new();
        for (i, n) in self.names.iter().enumerate() {
            map.insert(format!("param.{n}"), self.vars[i].as_tensor().clone());
            map.insert(format!("adam_m.{n}"), self.m[i].clone());
            map.insert(format!("adam_v.{n}"), self.v[i].clone());
        }
        map.insert(
            "meta.step_version".into(),
            Tensor::new(&[self.step as f64, self.version as f64], &self.dev)?,
        );
        candle_core::safetensors::save(&map, path)
    }

    /// Restores a checkpoint written by [`BuiltinTrainer::save`].
    pub fn load(&mut self, path: &Path) -> Result<()> {
        let map = candle_core::safetensors::load(path, &self.dev)?;
        let get = |k: &str| {
            map.get(k)
                .cloned()
                .ok_or_else(|| candle_core::Error::Msg(format!("checkpoint lacks {k}")))
        };
        for (i, n) in self.names.clone().iter().enumerate() {
            self.vars[i].set(&get(&format!("param.{n}"))?.to_dtype(self.dtype)?)?;
            self.m[i] = get(&format!("adam_m.{n}"))?.to_dtype(self.dtype)?;
            self.v[i] = get(&format!("adam_v.{n}"))?.to_dtype(self.dtype)?;
        }
        let meta: Vec<f64> = get("meta.step_version")?.to_vec1()?;
        self.step = meta.first().copied().unwrap_or(0.0) as u64;
        self.version = meta.get(1).copied().unwrap_or(0.0) as u64;
        Ok(())
    }
}

impl<M: TrainModel> Trainer for BuiltinTrainer<M> {
    fn train(
        &mut self,
        batch: &Batch,
        next_version: PolicyVersion,
    ) -> futures::future::BoxFuture<'_, crate::trainer::StepResult> {
        let r = self
            .step(batch)
            .map_err(|e| TrainError::Step(crate::error::SharedError::new(e)))
            .map(|(mut s, mut w)| {
                // The job's version numbering wins (a resumed job may start above 0).
                s.version = next_version;
                w.version = next_version;
                (s, Some(w))
            });
        Box::pin(async move { r })
    }
}
