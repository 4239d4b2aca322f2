//! Real language models in the built-in engine and trainer: checkpoints (GGUF and Hugging
//! Face directories), their tokenizers and chat templates, and the decoder forward of the
//! Llama family (Llama, with Qwen2/Qwen3 variants: QKV bias, QK norm).
//!
//! The forward here is the differentiable, full-sequence one (every position's logits, plain
//! candle ops that all have a backward): the reference the generation engine and the trainer
//! are checked against.

pub mod checkpoint;
pub mod config;
pub mod forward;
pub mod hf;
pub mod tokenizer;

pub use checkpoint::{Checkpoint, CheckpointError};
pub use config::{Family, LlmConfig, RopeLayout};
pub use forward::{LlmWeights, SeqCache};
pub use hf::{HfError, load_hf};
pub use tokenizer::{ChatMessage, LlmTokenizer, TokenizerError};

#[cfg(test)]
mod tests;
