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

use super::forward::{LlmWeights, LoraSet};
use crate::model::trainer::{BatchShape, TensorBatch, TrainModel, logprobs_and_entropy};
use crate::types::PolicyVersion;
use crate::weights::Weights;

mod head;

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

/// Tokens per forward/backward pass at most (a longer row alone), whatever the rows: rows are
/// packed into one sequence, so a pass's activations grow with its tokens, not its rows. A
/// pass of 1,024 SmolLM2-135M tokens with LoRA peaks at ≈ 6 GB resident (`rollarc bench
/// --what llm-train`), and packing 8 rows of 128 tokens ran 1.3× faster than one row a pass.
pub const MICRO_BATCH_TOKENS: usize = 1024;

/// Rows per pass when a job does not say ([`MICRO_BATCH_TOKENS`] bounds them first on
/// SmolLM2-sized rows).
pub const MICRO_BATCH_ROWS: usize = 64;

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
            // The base as it is (frozen, shared), the adapters beside it: never merged, so
            // no gradient is computed for a base weight.
            Some(l) => {
                let mut blocks = Vec::with_capacity(self.base.blocks.len());
                for i in 0..self.base.blocks.len() {
                    let mut adapters: [Option<(Tensor, Tensor)>; 7] = Default::default();
                    for (k, proj) in LORA_TARGETS.iter().enumerate() {
                        let a = format!("blk.{i}.{proj}.lora_a");
                        if self.trainable.contains(&a) {
                            adapters[k] = Some((get(&a)?, get(&format!("blk.{i}.{proj}.lora_b"))?));
                        }
                    }
                    blocks.push(adapters);
                }
                let mut w = self.base.clone();
                w.lora = Some(LoraSet {
                    scale: l.scale(),
                    blocks,
                });
                Ok(w)
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

    fn micro_batch_tokens(&self) -> usize {
        MICRO_BATCH_TOKENS
    }

    /// Packed rows, and the output head only over each row's span of generated tokens.
    fn token_logprobs(&self, p: &LlmWeights, tb: &TensorBatch) -> Result<(Tensor, Tensor)> {
        packed_logprobs(p, tb)
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

/// [`TrainModel::token_logprobs`] of a checkpoint over packed rows: each row runs up to its
/// last generated token, and the head (and log-softmax) only from its first generated token
/// on; positions outside that span are 0.
fn packed_logprobs(p: &LlmWeights, tb: &TensorBatch) -> Result<(Tensor, Tensor)> {
    let dev = tb.inputs.device();
    let inputs: Vec<Vec<u32>> = tb.inputs.to_vec2()?;
    let targets: Vec<Vec<u32>> = tb.targets.to_vec2()?;
    let mask: Vec<Vec<f32>> = tb.mask.to_dtype(DType::F32)?.to_vec2()?;
    let t = tb.inputs.dim(1)?;
    // Per row: the span of positions from its first generated target to its last.
    let spans: Vec<Option<(usize, usize)>> = mask
        .iter()
        .map(|m| {
            let first = m.iter().position(|&x| x > 0.0)?;
            let last = m.iter().rposition(|&x| x > 0.0)?;
            Some((first, last + 1 - first))
        })
        .collect();
    let (mut rows, mut heads, mut tgt, mut allow) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (r, span) in spans.iter().enumerate() {
        let Some((s, l)) = *span else { continue };
        rows.push(&inputs[r][..s + l]);
        heads.push((s, l));
        tgt.extend_from_slice(&targets[r][s..s + l]);
        if let Some(a) = &tb.allow {
            allow.push(a.get(r)?.narrow(0, s, l)?);
        }
    }
    let zeros = || Tensor::zeros((tb.inputs.dim(0)?, t), tb.mask.dtype(), dev);
    if rows.is_empty() {
        return Ok((zeros()?, zeros()?));
    }
    let mut logits = p.forward_rows(&rows, &heads)?;
    if !allow.is_empty() {
        logits = (logits + Tensor::cat(&allow, 0)?)?;
    }
    let (new, entropy) = if logits.dtype() == DType::F32 {
        let both = head::target_logprobs_and_entropy(&logits, tgt)?;
        (
            both.narrow(1, 0, 1)?.squeeze(1)?,
            both.narrow(1, 1, 1)?.squeeze(1)?.detach(),
        )
    } else {
        let m = tgt.len();
        logprobs_and_entropy(&logits, &Tensor::from_vec(tgt, m, dev)?)?
    };
    Ok((unpack(&new, &spans, t)?, unpack(&entropy, &spans, t)?))
}

/// Values of the concatenated spans back into rows `[B, T]`, 0 outside each span.
fn unpack(v: &Tensor, spans: &[Option<(usize, usize)>], t: usize) -> Result<Tensor> {
    let mut off = 0;
    let mut rows = Vec::with_capacity(spans.len());
    for span in spans {
        let Some((s, l)) = *span else {
            rows.push(Tensor::zeros(t, v.dtype(), v.device())?);
            continue;
        };
        let mut parts = Vec::with_capacity(3);
        if s > 0 {
            parts.push(Tensor::zeros(s, v.dtype(), v.device())?);
        }
        parts.push(v.narrow(0, off, l)?);
        if s + l < t {
            parts.push(Tensor::zeros(t - s - l, v.dtype(), v.device())?);
        }
        rows.push(Tensor::cat(&parts, 0)?);
        off += l;
    }
    Tensor::stack(&rows, 0)
}
