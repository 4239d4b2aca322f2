//! The hyper-parameters of a decoder checkpoint.

use serde::{Deserialize, Serialize};

/// Architecture family: the Llama block, with the family's differences.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Llama,
    /// Biases on the q, k and v projections.
    Qwen2,
    /// RMS norm of each head's q and k before RoPE.
    Qwen3,
}

/// How RoPE pairs a head's dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeLayout {
    /// Adjacent pairs `(x[2i], x[2i+1])` (GGUF Llama weights: the converter permuted q/k).
    Interleaved,
    /// Halves `(x[i], x[i + d/2])` (Hugging Face weights, GGUF Qwen).
    Neox,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LlmConfig {
    pub family: Family,
    pub n_layers: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub d_ff: usize,
    pub vocab: usize,
    pub rope_theta: f64,
    pub rope: RopeLayout,
    pub rms_eps: f64,
    pub context_length: usize,
    /// The output projection is the token embedding.
    pub tied_embeddings: bool,
}

impl LlmConfig {
    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads.max(1)
    }

    /// Problems that make the configuration unusable, as messages.
    pub fn problems(&self) -> Vec<String> {
        let mut v = Vec::new();
        for (name, x) in [
            ("n_layers", self.n_layers),
            ("d_model", self.d_model),
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("d_ff", self.d_ff),
            ("vocab", self.vocab),
        ] {
            if x == 0 {
                v.push(format!("{name} is 0"));
            }
        }
        if self.n_kv_heads > 0 && !self.n_heads.is_multiple_of(self.n_kv_heads) {
            v.push(format!(
                "n_heads ({}) is not a multiple of n_kv_heads ({})",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            v.push(format!(
                "head_dim ({}) is odd: RoPE needs pairs",
                self.head_dim
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            v.push(format!("rope_theta ({}) must be positive", self.rope_theta));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            v.push(format!("rms_eps ({}) must be positive", self.rms_eps));
        }
        v
    }

    /// Parameters of the model (embedding counted once when tied).
    pub fn params(&self) -> usize {
        let (d, h) = (self.d_model, self.head_dim);
        let attn = d * self.n_heads * h * 2 + d * self.n_kv_heads * h * 2;
        let ffn = 3 * d * self.d_ff;
        let per_layer = attn + ffn + 2 * d;
        let out = if self.tied_embeddings {
            0
        } else {
            self.vocab * d
        };
        self.vocab * d + self.n_layers * per_layer + d + out
    }
}
