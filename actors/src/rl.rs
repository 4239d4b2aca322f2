//! RL maths shared by the built-in trainer and its tests: group advantages (GRPO, Dr. GRPO,
//! RLOO), the PPO-clip policy loss with clip-higher, token-mean or sequence-mean-token-mean
//! aggregation and truncated importance sampling, and the k3 KL estimator. Scalar reference
//! implementations in f64; the trainer computes the same formulas on tensors and is checked
//! against these.

/// Which advantage estimator a trainer uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdvantageKind {
    /// (r − mean) / (sample std + ε).
    Grpo,
    /// r − mean.
    DrGrpo,
    /// r − mean of the other G − 1 rewards.
    Rloo,
}

/// ε of the GRPO normalisation.
pub const GRPO_EPS: f64 = 1e-6;

/// Advantages of one group. A group of one has zero advantage.
pub fn advantages(kind: AdvantageKind, rewards: &[f64]) -> Vec<f64> {
    let g = rewards.len();
    if g < 2 {
        return vec![0.0; g];
    }
    let mean = rewards.iter().sum::<f64>() / g as f64;
    match kind {
        AdvantageKind::Grpo => {
            let var = rewards.iter().map(|r| (r - mean) * (r - mean)).sum::<f64>() / (g - 1) as f64;
            let std = var.sqrt();
            rewards
                .iter()
                .map(|r| (r - mean) / (std + GRPO_EPS))
                .collect()
        }
        AdvantageKind::DrGrpo => rewards.iter().map(|r| r - mean).collect(),
        AdvantageKind::Rloo => {
            let sum: f64 = rewards.iter().sum();
            rewards
                .iter()
                .map(|r| r - (sum - r) / (g - 1) as f64)
                .collect()
        }
    }
}

/// How per-token losses are reduced to one number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Aggregation {
    /// Mean over every action token of the batch (DAPO).
    TokenMean,
    /// Mean over sequences of each sequence's token mean (original GRPO).
    SeqMeanTokenMean,
}

/// PPO-clip settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PpoConfig {
    pub eps_low: f64,
    pub eps_high: f64,
    pub aggregation: Aggregation,
    /// Truncated importance sampling cap C (weight min(exp(old − behaviour), C)); `None` = off.
    pub tis_cap: Option<f64>,
}

impl Default for PpoConfig {
    fn default() -> Self {
        Self {
            eps_low: 0.2,
            eps_high: 0.28,
            aggregation: Aggregation::TokenMean,
            tis_cap: None,
        }
    }
}

/// One sequence's per-token inputs to the loss.
#[derive(Clone, Debug, PartialEq)]
pub struct SeqLossInput<'a> {
    pub logp_new: &'a [f64],
    pub logp_old: &'a [f64],
    pub logp_behaviour: &'a [f64],
    /// 1 for tokens the policy generated, 0 for prompt / observation tokens.
    pub mask: &'a [f64],
    pub advantage: f64,
}

/// Per-token clipped surrogate: −min(ρA, clip(ρ, 1 − ε_low, 1 + ε_high)A), times the TIS
/// weight when enabled.
pub fn token_loss(
    cfg: &PpoConfig,
    logp_new: f64,
    logp_old: f64,
    logp_behaviour: f64,
    adv: f64,
) -> f64 {
    let rho = (logp_new - logp_old).exp();
    let clipped = rho.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high);
    let l = -(rho * adv).min(clipped * adv);
    match cfg.tis_cap {
        Some(c) => l * (logp_old - logp_behaviour).exp().min(c),
        None => l,
    }
}

/// The aggregated PPO-clip loss of a batch of sequences.
pub fn ppo_loss(cfg: &PpoConfig, seqs: &[SeqLossInput<'_>]) -> f64 {
    match cfg.aggregation {
        Aggregation::TokenMean => {
            let mut sum = 0.0;
            let mut n = 0.0;
            for s in seqs {
                for t in 0..s.mask.len() {
                    if s.mask[t] > 0.0 {
                        sum += s.mask[t]
                            * token_loss(
                                cfg,
                                s.logp_new[t],
                                s.logp_old[t],
                                s.logp_behaviour[t],
                                s.advantage,
                            );
                        n += s.mask[t];
                    }
                }
            }
            if n > 0.0 { sum / n } else { 0.0 }
        }
        Aggregation::SeqMeanTokenMean => {
            let mut total = 0.0;
            let mut count = 0.0;
            for s in seqs {
                let mut sum = 0.0;
                let mut n = 0.0;
                for t in 0..s.mask.len() {
                    if s.mask[t] > 0.0 {
                        sum += s.mask[t]
                            * token_loss(
                                cfg,
                                s.logp_new[t],
                                s.logp_old[t],
                                s.logp_behaviour[t],
                                s.advantage,
                            );
                        n += s.mask[t];
                    }
                }
                if n > 0.0 {
                    total += sum / n;
                    count += 1.0;
                }
            }
            if count > 0.0 { total / count } else { 0.0 }
        }
    }
}

/// k3 estimator of KL(π_θ ‖ π_ref) for one token: exp(ref − θ) − (ref − θ) − 1 (≥ 0).
pub fn kl_k3(logp: f64, logp_ref: f64) -> f64 {
    let d = logp_ref - logp;
    d.exp() - d - 1.0
}

#[cfg(test)]
mod tests;
