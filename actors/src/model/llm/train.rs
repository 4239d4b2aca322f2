//! A real checkpoint as the built-in trainer's [`TrainModel`]: full fine-tuning (every weight
//! trainable) or LoRA (low-rank adapters on chosen projections, the base frozen), the
//! all-position forward row by row (no padding computed), and the weights it publishes —
//! every tensor for full fine-tuning, only the adapters for LoRA (engines merge them into
//! their own copy of the base).

use std::collections::HashSet;

use candle_core::{DType, Device, Result, Tensor};
use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand_distr::{Distribution, Normal};

use super::forward::LlmWeights;
use crate::model::trainer::{BatchShape, TrainModel};
use crate::types::PolicyVersion;
use crate::weights::Weights;

/// The projections LoRA may adapt (GGUF tensor names within a block).
pub const LORA_TARGETS: [&str; 7] = [
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
];

/// Name of the scalar that tells engines the adapters' scale (α / rank).
pub const LORA_SCALE: &str = "lora.scale";

/// Low-rank adapters: `W' = W + (α / r) · B · A`, A `[r, in]` random, B `[out, r]` zero.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    pub rank: usize,
    pub alpha: f64,
    /// Projections adapted in every block (from [`LORA_TARGETS`]).
    pub targets: Vec<String>,
    pub seed: u64,
}

impl LoraConfig {
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank.max(1) as f64
    }
}

pub struct LlmModel {
    base: LlmWeights,
    lora: Option<LoraConfig>,
    trainable: HashSet<String>,
    max_seq: usize,
    micro_batch_rows: usize,
}

impl LlmModel {
    /// Trains `base` (every weight, or LoRA adapters on it); rows longer than `max_seq` are
    /// cut; `micro_batch_rows` rows per backward pass. Returns the model and the initial
    /// trainable tensors by name.
    pub fn new(
        base: LlmWeights,
        lora: Option<LoraConfig>,
        max_seq: usize,
        micro_batch_rows: usize,
    ) -> Result<(Self, Vec<(String, Tensor)>)> {
        let init: Vec<(String, Tensor)> = match &lora {
            None => base
                .named()
                .into_iter()
                .map(|(n, t)| (n, t.clone()))
                .collect(),
            Some(l) => adapters(&base, l)?,
        };
        let trainable = init.iter().map(|(n, _)| n.clone()).collect();
        let model = Self {
            base,
            lora,
            trainable,
            max_seq,
            micro_batch_rows: micro_batch_rows.max(1),
        };
        Ok((model, init))
    }

    pub fn base(&self) -> &LlmWeights {
        &self.base
    }
}

/// Seeded initial adapters of every block's target projections.
fn adapters(base: &LlmWeights, l: &LoraConfig) -> Result<Vec<(String, Tensor)>> {
    let mut rng = SmallRng::seed_from_u64(l.seed);
    let normal = Normal::new(0.0f64, 1.0 / (l.rank.max(1) as f64).sqrt())
        .map_err(candle_core::Error::wrap)?;
    let named = base.named();
    let mut out = Vec::new();
    for (name, w) in &named {
        let Some((_, proj)) = name.strip_prefix("blk.").and_then(|r| r.split_once('.')) else {
            continue;
        };
        if !l.targets.iter().any(|t| t == proj) {
            continue;
        }
        let (rows, cols) = w.dims2()?;
        let a: Vec<f32> = (0..l.rank * cols)
            .map(|_| normal.sample(&mut rng) as f32)
            .collect();
        out.push((
            format!("{name}.lora_a"),
            Tensor::from_vec(a, (l.rank, cols), w.device())?,
        ));
        out.push((
            format!("{name}.lora_b"),
            Tensor::zeros((rows, l.rank), DType::F32, w.device())?,
        ));
    }
    Ok(out)
}

/// `base + scale · B · A` for every adapted projection among `named`.
pub fn merge(
    base: &[(String, Tensor)],
    adapters: &dyn Fn(&str) -> Option<(Tensor, Tensor)>,
    scale: f64,
) -> Result<Vec<(String, Tensor)>> {
    base.iter()
        .map(|(n, w)| match adapters(n) {
            Some((a, b)) => Ok((n.clone(), (w + (b.matmul(&a)? * scale)?)?)),
            None => Ok((n.clone(), w.clone())),
        })
        .collect()
}

impl TrainModel for LlmModel {
    type Params = LlmWeights;

    fn build(&self, get: &dyn Fn(&str) -> Result<Tensor>) -> Result<LlmWeights> {
        match &self.lora {
            None => LlmWeights::from_named(&self.base.cfg, |n| self.trainable.contains(n), get),
            Some(l) => {
                let base: Vec<(String, Tensor)> = self
                    .base
                    .named()
                    .into_iter()
                    .map(|(n, t)| (n, t.clone()))
                    .collect();
                let lookup = |n: &str| {
                    let a = format!("{n}.lora_a");
                    if !self.trainable.contains(&a) {
                        return None;
                    }
                    Some((get(&a).ok()?, get(&format!("{n}.lora_b")).ok()?))
                };
                self.base.with_tensors(merge(&base, &lookup, l.scale())?)
            }
        }
    }

    fn logits(&self, p: &LlmWeights, inputs: &Tensor) -> Result<Tensor> {
        let rows: Vec<Vec<u32>> = inputs.to_vec2()?;
        let out = rows
            .iter()
            .map(|r| p.forward(r))
            .collect::<Result<Vec<_>>>()?;
        Tensor::stack(&out, 0)
    }

    fn shape(&self) -> BatchShape {
        BatchShape {
            max_seq: self.max_seq,
            vocab: self.base.cfg.vocab,
            pad: 0,
        }
    }

    fn micro_batch_rows(&self) -> usize {
        self.micro_batch_rows
    }

    fn publish(&self, trained: &[(String, Tensor)], version: PolicyVersion) -> Result<Weights> {
        let mut tensors = trained.to_vec();
        if let Some(l) = &self.lora {
            tensors.push((
                LORA_SCALE.into(),
                Tensor::new(&[l.scale() as f32], &Device::Cpu)?,
            ));
        }
        Ok(Weights::from_shared(version, tensors))
    }
}
