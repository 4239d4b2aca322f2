//! One optimisation step of the built-in trainer: gradients accumulated over chunks of
//! similar length, global-norm clipping, the AdamW update with decoupled weight decay, and the
//! step's statistics.

use candle_core::{DType, Result, Tensor};

use super::batch::{TensorBatch, micro_batches};
use super::loss::ChunkDiag;
use super::{BuiltinTrainer, TrainModel};
use crate::rl::Aggregation;
use crate::trainer::{TrainStats, TrainerNumbers};
use crate::types::{Batch, Trajectory};
use crate::weights::Weights;

/// What a step's chunks add up to: the summed gradients, the losses and the diagnostics.
struct Accumulated {
    /// One gradient per trainable tensor (zeros where a tensor got none).
    grads: Vec<Tensor>,
    /// The weighted objective (policy loss + β·KL).
    loss: f64,
    policy: f64,
    kl: Option<f64>,
    diag: ChunkDiag,
    /// Generated tokens of the whole batch.
    tokens: usize,
}

impl<M: TrainModel> BuiltinTrainer<M> {
    /// One optimisation step on `batch`; returns the stats and the new version's weights.
    pub fn step(&mut self, batch: &Batch) -> Result<(TrainStats, Weights)> {
        // Chunks of similar length; the objective is the same as on the whole batch: each
        // chunk's mean is weighted by its share of the tokens (token-mean) or sequences.
        let chunks = micro_batches(
            batch,
            self.cfg.advantage,
            &self.model.shape(),
            (
                self.model.micro_batch_rows(),
                self.model.micro_batch_tokens(),
            ),
            self.dtype,
            &self.dev,
        )?;
        let acc = self.accumulate(&chunks)?;
        let norm = global_norm(&acc.grads)?;
        let scale = if self.cfg.grad_clip > 0.0 && norm > self.cfg.grad_clip {
            self.cfg.grad_clip / norm
        } else {
            1.0
        };
        let lr = self.cfg.lr_at(self.step);
        self.adamw(&acc.grads, scale, lr)?;
        self.step += 1;
        self.version += 1;
        let stats = self.stats(batch, &acc, norm, lr);
        let w = self.published()?;
        Ok((stats, w))
    }

    /// Runs forward and backward on every chunk with generated tokens, weighting each chunk's
    /// mean by its share of the batch, and sums the gradients.
    fn accumulate(&self, chunks: &[TensorBatch]) -> Result<Accumulated> {
        let total_tokens: usize = chunks.iter().map(|c| c.tokens).sum();
        let total_seqs: usize = chunks.iter().map(|c| c.seqs).sum();
        let mut gs: Vec<Tensor> = self
            .vars
            .iter()
            .map(|v| v.as_tensor().zeros_like())
            .collect::<Result<_>>()?;
        let mut loss_value = 0.0;
        let (mut policy_value, mut kl_value) = (0.0, None::<f64>);
        let mut diag = ChunkDiag::default();
        for tb in chunks.iter().filter(|c| c.tokens > 0) {
            let w = match self.cfg.ppo.aggregation {
                Aggregation::TokenMean => tb.tokens as f64 / total_tokens.max(1) as f64,
                Aggregation::SeqMeanTokenMean => tb.seqs as f64 / total_seqs.max(1) as f64,
            };
            let (policy, kl, d) = self.objective_parts(tb)?;
            diag.add(&d);
            let mut loss = (policy * w)?;
            policy_value += loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            if let Some(kl) = kl {
                let share = tb.tokens as f64 / total_tokens.max(1) as f64;
                *kl_value.get_or_insert(0.0) +=
                    kl.to_dtype(DType::F64)?.to_scalar::<f64>()? * share;
                loss = (loss + (kl * (self.cfg.kl_beta * share))?)?;
            }
            loss_value += loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            let grads = loss.backward()?;
            for (i, var) in self.vars.iter().enumerate() {
                // Detached: a gradient built from the step's graph would otherwise keep every
                // activation of the step alive through the optimiser moments, step after step.
                if let Some(g) = grads.get(var.as_tensor()) {
                    gs[i] = (&gs[i] + g.detach())?;
                }
            }
        }
        Ok(Accumulated {
            grads: gs,
            loss: loss_value,
            policy: policy_value,
            kl: kl_value,
            diag,
            tokens: total_tokens,
        })
    }

    /// The AdamW update of every trainable tensor with its gradient times `scale` (the clip),
    /// at learning rate `lr`, bias-corrected for the step about to be taken.
    fn adamw(&mut self, gs: &[Tensor], scale: f64, lr: f64) -> Result<()> {
        let t = (self.step + 1) as i32;
        let (b1, b2) = (self.cfg.beta1, self.cfg.beta2);
        let (c1, c2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
        for (i, g) in gs.iter().enumerate() {
            let g = (g * scale)?;
            self.m[i] = ((&self.m[i] * b1)? + (&g * (1.0 - b1))?)?.detach();
            self.v[i] = ((&self.v[i] * b2)? + (g.sqr()? * (1.0 - b2))?)?.detach();
            let mhat = (&self.m[i] / c1)?;
            let vhat = (&self.v[i] / c2)?;
            let upd = (mhat / (vhat.sqrt()? + self.cfg.eps)?)?;
            let theta = self.vars[i].as_tensor();
            let new = ((theta * (1.0 - lr * self.cfg.weight_decay))? - (upd * lr)?)?;
            self.vars[i].set(&new)?;
        }
        Ok(())
    }

    /// The statistics of the step just taken on `batch` (the new version's).
    fn stats(&self, batch: &Batch, acc: &Accumulated, norm: f64, lr: f64) -> TrainStats {
        let trajs: Vec<&Trajectory> = batch.trajectories().collect();
        let n = trajs.len().max(1) as f64;
        let lens: Vec<usize> = trajs.iter().map(|t| t.response_tokens()).collect();
        let diag = &acc.diag;
        let tok = diag.tokens.max(1.0);
        let numbers = TrainerNumbers {
            policy_loss: Some(acc.policy),
            kl: acc.kl,
            entropy: Some(diag.entropy / tok),
            grad_norm: Some(norm),
            lr: Some(lr),
            clip_frac_low: Some(diag.clip_low / tok),
            clip_frac_high: Some(diag.clip_high / tok),
            is_weight_mean: Some(diag.is_sum / tok),
            is_weight_max: Some(diag.is_max),
            response_len_mean: Some(lens.iter().sum::<usize>() as f64 / n),
            response_len_max: lens.iter().max().map(|&m| m as u64),
        };
        TrainStats {
            step: batch.step,
            version: self.version,
            loss: acc.loss,
            tokens: acc.tokens as u64,
            trajectories: trajs.len() as u64,
            mean_reward: trajs.iter().map(|t| t.reward.unwrap_or(0.0)).sum::<f64>() / n,
            seconds: 0.0,
            numbers,
        }
    }
}

/// The global L2 norm of the gradients (all tensors as one vector).
fn global_norm(gs: &[Tensor]) -> Result<f64> {
    let mut sq = 0.0;
    for g in gs {
        sq += g
            .sqr()?
            .sum_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?;
    }
    Ok(sq.sqrt())
}
