//! The trainer's objective on tensors: the PPO-clip loss, the k3 KL to a reference, and the
//! per-chunk diagnostics (entropy, clip fractions, importance weights).

use candle_core::{D, DType, Result, Tensor};

use super::batch::TensorBatch;
use crate::rl::{Aggregation, PpoConfig};

/// The PPO-clip loss on tensors (the same formula as [`crate::rl::ppo_loss`]).
pub fn ppo_loss(
    cfg: &PpoConfig,
    new: &Tensor,
    old: &Tensor,
    behaviour: &Tensor,
    mask: &Tensor,
    adv: &Tensor,
) -> Result<Tensor> {
    let a = adv.unsqueeze(1)?.broadcast_as(new.shape())?;
    let rho = (new - old)?.exp()?;
    let s1 = (&rho * &a)?;
    let s2 = (rho.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)? * &a)?;
    let mut l = s1.minimum(&s2)?.neg()?;
    if let Some(c) = cfg.tis_cap {
        let w = (old - behaviour)?.exp()?.clamp(0.0, c)?.detach();
        l = (l * w)?;
    }
    let lm = (l * mask)?;
    match cfg.aggregation {
        Aggregation::TokenMean => {
            let n = mask.sum_all()?.maximum(1e-12)?;
            lm.sum_all()?.div(&n)
        }
        Aggregation::SeqMeanTokenMean => {
            let per = mask.sum(D::Minus1)?;
            let has = per.gt(0.0)?.to_dtype(lm.dtype())?;
            let seq = lm.sum(D::Minus1)?.div(&per.maximum(1.0)?)?;
            (seq * &has)?.sum_all()?.div(&has.sum_all()?.maximum(1.0)?)
        }
    }
}

/// A chunk's diagnostics as sums over its generated tokens (and a max), so chunks add up.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct ChunkDiag {
    pub tokens: f64,
    pub entropy: f64,
    pub clip_low: f64,
    pub clip_high: f64,
    pub is_sum: f64,
    pub is_max: f64,
}

impl ChunkDiag {
    /// From detached log-probabilities: `new` (the current policy), `old` (the ratio's
    /// denominator), the batch's behaviour ones and advantages, and the per-position entropy.
    pub(super) fn of(
        cfg: &PpoConfig,
        new: &Tensor,
        old: &Tensor,
        tb: &TensorBatch,
        entropy: &Tensor,
    ) -> Result<Self> {
        let f = |t: Tensor| -> Result<Vec<Vec<f32>>> { t.to_dtype(DType::F32)?.to_vec2() };
        let (new, old, beh, mask, ent) = (
            f(new.clone())?,
            f(old.detach())?,
            f(tb.behaviour.clone())?,
            f(tb.mask.clone())?,
            f(entropy.clone())?,
        );
        let adv: Vec<f32> = tb.advantages.to_dtype(DType::F32)?.to_vec1()?;
        let mut d = Self::default();
        for (i, row) in mask.iter().enumerate() {
            for (j, &m) in row.iter().enumerate() {
                if m <= 0.0 {
                    continue;
                }
                let ratio = f64::from(new[i][j] - old[i][j]).exp();
                let is = f64::from(new[i][j] - beh[i][j]).exp();
                let a = adv.get(i).copied().unwrap_or(0.0);
                d.tokens += 1.0;
                d.entropy += f64::from(ent[i][j]);
                if a < 0.0 && ratio < 1.0 - cfg.eps_low {
                    d.clip_low += 1.0;
                }
                if a > 0.0 && ratio > 1.0 + cfg.eps_high {
                    d.clip_high += 1.0;
                }
                d.is_sum += is;
                d.is_max = d.is_max.max(is);
            }
        }
        Ok(d)
    }

    /// Adds another chunk's diagnostics to these.
    pub(super) fn add(&mut self, o: &Self) {
        self.tokens += o.tokens;
        self.entropy += o.entropy;
        self.clip_low += o.clip_low;
        self.clip_high += o.clip_high;
        self.is_sum += o.is_sum;
        self.is_max = self.is_max.max(o.is_max);
    }
}

/// k3 KL estimator per token, averaged over action tokens.
pub fn kl_k3(new: &Tensor, reference: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let d = (reference - new)?;
    let k = ((d.exp()? - &d)? - 1.0)?;
    (k * mask)?.sum_all()?.div(&mask.sum_all()?.maximum(1e-12)?)
}
