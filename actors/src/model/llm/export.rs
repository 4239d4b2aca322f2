//! Export of the current policy as a GGUF file (f32, or q8_0 for the projection matrices) —
//! what llama.cpp-based servers load — with the architecture and tokenizer metadata the
//! loader here and llama.cpp read. Llama rows in the halves RoPE layout (Hugging Face) are
//! permuted to llama.cpp's adjacent pairs; Qwen rows stay as they are (NeoX mode there).

use std::path::{Path, PathBuf};

use candle_core::Tensor;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};

use super::config::{Family, RopeLayout};
use super::forward::LlmWeights;
use super::tokenizer::{LlmTokenizer, TokenizerError};

/// Storage of the exported matrices (norms and biases stay f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufType {
    F32,
    /// 8-bit blocks of 32 with an f16 scale (matrices whose rows are a multiple of 32).
    Q8_0,
}

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("cannot write {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot encode the tensors")]
    Tensor(#[from] candle_core::Error),
    #[error("cannot describe the tokenizer")]
    Tokenizer(#[from] TokenizerError),
}

/// Adjacent-pairs layout of q/k rows from the halves layout, for `heads` heads.
fn permute(w: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    let hd = rows / heads;
    w.reshape((heads, 2, hd / 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))
}

impl LlmWeights {
    /// Writes the weights and `tok` as a GGUF file.
    pub fn save_gguf(
        &self,
        tok: &LlmTokenizer,
        path: &Path,
        ty: GgufType,
    ) -> Result<(), ExportError> {
        let c = &self.cfg;
        let arch = match c.family {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
        };
        let permute_qk = c.family == Family::Llama && c.rope == RopeLayout::Neox;
        let mut tensors: Vec<(String, QTensor)> = Vec::new();
        for (name, t) in self.named() {
            let mut t = t.clone();
            if permute_qk && name.starts_with("blk.") {
                if name.ends_with(".attn_q") {
                    t = permute(&t, c.n_heads)?;
                } else if name.ends_with(".attn_k") {
                    t = permute(&t, c.n_kv_heads)?;
                }
            }
            let file_name = if name.ends_with(".bias") {
                name
            } else {
                format!("{name}.weight")
            };
            let q8 = ty == GgufType::Q8_0 && t.rank() == 2 && t.dim(1)? % 32 == 0;
            let dtype = if q8 { GgmlDType::Q8_0 } else { GgmlDType::F32 };
            tensors.push((file_name, QTensor::quantize(&t, dtype)?));
        }
        let k = |s: &str| format!("{arch}.{s}");
        let u = |v: usize| Value::U32(v as u32);
        let mut meta: Vec<(String, Value)> = vec![
            ("general.architecture".into(), Value::String(arch.into())),
            (
                "general.name".into(),
                Value::String("rollarc export".into()),
            ),
            (
                "general.file_type".into(),
                Value::U32(if ty == GgufType::Q8_0 { 7 } else { 0 }),
            ),
            (k("block_count"), u(c.n_layers)),
            (k("context_length"), u(c.context_length)),
            (k("embedding_length"), u(c.d_model)),
            (k("feed_forward_length"), u(c.d_ff)),
            (k("attention.head_count"), u(c.n_heads)),
            (k("attention.head_count_kv"), u(c.n_kv_heads)),
            (k("attention.key_length"), u(c.head_dim)),
            (k("attention.value_length"), u(c.head_dim)),
            (k("rope.freq_base"), Value::F32(c.rope_theta as f32)),
            (
                k("attention.layer_norm_rms_epsilon"),
                Value::F32(c.rms_eps as f32),
            ),
            (k("vocab_size"), u(c.vocab)),
        ];
        meta.extend(tok.gguf_metadata()?);
        let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let tensor_refs: Vec<(&str, &QTensor)> =
            tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let io = |source| ExportError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::create(path).map_err(io)?;
        let mut w = std::io::BufWriter::new(file);
        gguf_file::write(&mut w, &meta_refs, &tensor_refs)?;
        std::io::Write::flush(&mut w).map_err(io)?;
        Ok(())
    }
}
