//! A real checkpoint as the built-in engine's [`Decoder`]: prefill through the cached
//! extension (the head runs on the last position only), decode through the batched step,
//! weight swaps from published tensors, stop ids and text from the checkpoint's tokenizer.

use std::sync::Arc;

use candle_core::{Device, Tensor};

use super::forward::{LlmWeights, SeqCache};
use super::tokenizer::LlmTokenizer;
use super::train::{LORA_SCALE, merge};
use crate::model::decoder::Decoder;
use crate::types::Precision;
use crate::weights::Weights;

pub struct LlmDecoder {
    weights: LlmWeights,
    /// The weights served first: LoRA publications are merged into these.
    base: Vec<(String, Tensor)>,
    tokenizer: Arc<LlmTokenizer>,
    max_seq: usize,
}

impl LlmDecoder {
    /// Serves `weights`; sequences hold at most `max_seq` tokens (bounded by the
    /// checkpoint's context length).
    pub fn new(weights: LlmWeights, tokenizer: Arc<LlmTokenizer>, max_seq: usize) -> Self {
        let max_seq = max_seq.clamp(2, weights.cfg.context_length.max(2));
        let base = weights
            .named()
            .into_iter()
            .map(|(n, t)| (n, t.clone()))
            .collect();
        Self {
            weights,
            base,
            tokenizer,
            max_seq,
        }
    }

    /// Generates with the matrices quantised to `precision` (re-quantised after every
    /// weight swap); f32 leaves them as they are.
    pub fn with_precision(mut self, precision: Precision) -> candle_core::Result<Self> {
        self.weights = self.weights.quantized(precision)?;
        Ok(self)
    }

    pub fn weights(&self) -> &LlmWeights {
        &self.weights
    }

    /// New tensors served at the current precision.
    fn swap(&mut self, tensors: Vec<(String, Tensor)>) -> candle_core::Result<()> {
        let precision = self.weights.precision();
        self.weights = self.weights.with_tensors(tensors)?.quantized(precision)?;
        Ok(())
    }
}

impl LlmDecoder {
    /// A LoRA publication: every adapter pair merged into the base (`W + scale · B · A`).
    fn install_adapters(
        &mut self,
        new: &[(String, Tensor)],
        scale: f64,
        version: u64,
    ) -> candle_core::Result<()> {
        for (name, _) in new {
            let Some(target) = name
                .strip_suffix(".lora_a")
                .or_else(|| name.strip_suffix(".lora_b"))
            else {
                if name == LORA_SCALE {
                    continue;
                }
                candle_core::bail!("weights v{version}: {name} is not an adapter");
            };
            if !self.base.iter().any(|(n, _)| n == target) {
                candle_core::bail!("weights v{version}: adapter {name} of unknown weight {target}");
            }
        }
        let lookup = |n: &str| {
            let a = new.iter().find(|(x, _)| *x == format!("{n}.lora_a"))?;
            let b = new.iter().find(|(x, _)| *x == format!("{n}.lora_b"))?;
            Some((a.1.clone(), b.1.clone()))
        };
        self.swap(merge(&self.base, &lookup, scale)?)
    }
}

impl Decoder for LlmDecoder {
    type Cache = SeqCache;

    fn max_seq(&self) -> usize {
        self.max_seq
    }
    fn new_cache(&self) -> SeqCache {
        self.weights.new_cache()
    }
    fn cache_len(cache: &SeqCache) -> usize {
        cache.len()
    }
    fn prefill(&self, tokens: &[u32], cache: &mut SeqCache) -> candle_core::Result<Vec<f32>> {
        self.weights.extend_last(cache, tokens)?.to_vec1()
    }
    fn decode(
        &self,
        tokens: &[u32],
        caches: &mut [&mut SeqCache],
    ) -> candle_core::Result<Vec<Vec<f32>>> {
        self.weights.decode_batch(tokens, caches)?.to_vec2()
    }
    fn install(&mut self, weights: &Weights) -> candle_core::Result<()> {
        let new = weights.candle_tensors(&Device::Cpu)?;
        if let Some((_, scale)) = new.iter().find(|(n, _)| n == LORA_SCALE) {
            return self.install_adapters(
                &new,
                scale.flatten_all()?.to_vec1::<f32>()?[0] as f64,
                weights.version,
            );
        }
        let mut current: Vec<(String, candle_core::Tensor)> = self
            .weights
            .named()
            .into_iter()
            .map(|(n, t)| (n, t.clone()))
            .collect();
        // A publication may carry every tensor or only some (adapters merged by the trainer
        // into the projections it trains); names it lacks keep their current tensors.
        for (name, t) in new {
            match current.iter_mut().find(|(n, _)| *n == name) {
                Some(slot) => {
                    if slot.1.dims() != t.dims() {
                        candle_core::bail!(
                            "weights v{}: {name} has shape {:?}, the model's is {:?}",
                            weights.version,
                            t.dims(),
                            slot.1.dims()
                        );
                    }
                    slot.1 = t;
                }
                None => candle_core::bail!(
                    "weights v{} carry {name}, which the model does not have",
                    weights.version
                ),
            }
        }
        self.swap(current)
    }
    fn stop_ids(&self) -> &[u32] {
        &self.tokenizer.stop_ids
    }
    fn text(&self, ids: &[u32]) -> Option<String> {
        self.tokenizer.decode(ids).ok()
    }
    fn kv_bytes_per_token(&self) -> u64 {
        let c = &self.weights.cfg;
        (2 * c.n_layers * c.n_kv_heads * c.head_dim * 4) as u64
    }
    fn precision(&self) -> Precision {
        self.weights.precision()
    }
}
