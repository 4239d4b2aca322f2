//! What the built-in generation engine needs of a model: a per-sequence KV cache, prefill of
//! one sequence's new tokens, one batched decode step over sequences of any lengths, and a
//! weight swap. The tiny byte-level transformer and real checkpoints implement it.

use crate::weights::Weights;

/// A decoder-only model the engine can serve.
pub trait Decoder: Send + 'static {
    /// One sequence's keys and values.
    type Cache: Send;

    /// Longest sequence (context and answer) a cache may hold.
    fn max_seq(&self) -> usize;
    fn new_cache(&self) -> Self::Cache;
    fn cache_len(cache: &Self::Cache) -> usize;
    /// Feeds `tokens` after what `cache` holds; the last position's logits `[vocab]`.
    fn prefill(&self, tokens: &[u32], cache: &mut Self::Cache) -> candle_core::Result<Vec<f32>>;
    /// Feeds `tokens[i]` after `caches[i]`; each sequence's logits.
    fn decode(
        &self,
        tokens: &[u32],
        caches: &mut [&mut Self::Cache],
    ) -> candle_core::Result<Vec<Vec<f32>>>;
    /// Replaces the weights with a published version's.
    fn install(&mut self, weights: &Weights) -> candle_core::Result<()>;
    /// Ids that always end an answer (the model's end of turn).
    fn stop_ids(&self) -> &[u32];
    /// The text of generated ids, for stop strings; `None` when the model has no text form.
    fn text(&self, ids: &[u32]) -> Option<String>;
    /// Bytes of KV cache per token (load reports).
    fn kv_bytes_per_token(&self) -> u64;
    /// The precision of the weights it samples with (recorded on every token's span).
    fn precision(&self) -> crate::types::Precision {
        crate::types::Precision::F32
    }
}
