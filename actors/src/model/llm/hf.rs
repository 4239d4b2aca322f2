//! Hugging Face checkpoint directories: `config.json`, `model.safetensors` (or shards listed
//! by `model.safetensors.index.json`), `tokenizer.json`, `tokenizer_config.json` (chat
//! template, special tokens). Loading, and saving the current weights in the same layout.
//!
//! Hugging Face keeps q/k rows in the halves ("NeoX") RoPE layout; llama.cpp's converter
//! permutes Llama's rows for adjacent pairs. Saving weights loaded from such a GGUF undoes
//! the permutation, so the directory is what `transformers` would write.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use super::config::{Family, LlmConfig, RopeLayout};
use super::forward::{Block, LlmWeights};
use super::tokenizer::LlmTokenizer;

#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("{path} is missing")]
    Missing { path: PathBuf },
    #[error("cannot read {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not valid")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("model_type {0:?} is not supported (llama, qwen2, qwen3 are)")]
    Architecture(String),
    #[error("config.json describes an unusable model: {0}")]
    Config(String),
    #[error("cannot read or write the weights in {path}")]
    Safetensors {
        path: PathBuf,
        #[source]
        source: Box<candle_core::Error>,
    },
    #[error("weight {name} is missing")]
    MissingWeight { name: String },
    #[error("weight {name} has shape {got:?}, expected {want:?}")]
    Shape {
        name: String,
        got: Vec<usize>,
        want: Vec<usize>,
    },
    #[error("cannot read or write the tokenizer {path}")]
    Tokenizer {
        path: PathBuf,
        #[source]
        source: tokenizers::Error,
    },
    #[error("tensor arithmetic failed")]
    Tensor(#[source] Box<candle_core::Error>),
}

impl From<candle_core::Error> for HfError {
    fn from(e: candle_core::Error) -> Self {
        Self::Tensor(Box::new(e))
    }
}

/// The fields of `config.json` this loader reads (others are ignored).
#[derive(Debug, Deserialize, Serialize)]
struct HfConfig {
    model_type: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    architectures: Vec<String>,
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    head_dim: Option<usize>,
    intermediate_size: usize,
    vocab_size: usize,
    #[serde(default = "default_theta")]
    rope_theta: f64,
    rms_norm_eps: f64,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    max_position_embeddings: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    torch_dtype: Option<String>,
}

fn default_theta() -> f64 {
    10_000.0
}

/// The parts of `tokenizer_config.json` used here.
#[derive(Debug, Default, Deserialize, Serialize)]
struct HfTokenizerConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    chat_template: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    bos_token: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    eos_token: Option<serde_json::Value>,
}

fn read(path: &Path) -> Result<String, HfError> {
    if !path.is_file() {
        return Err(HfError::Missing {
            path: path.to_path_buf(),
        });
    }
    std::fs::read_to_string(path).map_err(|source| HfError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, HfError> {
    serde_json::from_str(&read(path)?).map_err(|source| HfError::Json {
        path: path.to_path_buf(),
        source,
    })
}

fn write_json<T: Serialize>(path: &Path, v: &T) -> Result<(), HfError> {
    let text = serde_json::to_string_pretty(v).map_err(|source| HfError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    std::fs::write(path, text).map_err(|source| HfError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// A special token as `tokenizer_config.json` writes it: a string or `{"content": …}`.
fn token_text(v: &Option<serde_json::Value>) -> Option<&str> {
    match v.as_ref()? {
        serde_json::Value::String(s) => Some(s),
        o => o.get("content")?.as_str(),
    }
}

/// Every tensor of the directory's safetensors file(s), by name.
fn load_tensors(dir: &Path) -> Result<HashMap<String, Tensor>, HfError> {
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<PathBuf> = if index.is_file() {
        #[derive(Deserialize)]
        struct Index {
            weight_map: HashMap<String, String>,
        }
        let idx: Index = json(&index)?;
        let mut f: Vec<String> = idx.weight_map.into_values().collect();
        f.sort();
        f.dedup();
        f.into_iter().map(|n| dir.join(n)).collect()
    } else {
        vec![dir.join("model.safetensors")]
    };
    let mut out = HashMap::new();
    for f in files {
        if !f.is_file() {
            return Err(HfError::Missing { path: f });
        }
        let t = candle_core::safetensors::load(&f, &Device::Cpu).map_err(|source| {
            HfError::Safetensors {
                path: f.clone(),
                source: Box::new(source),
            }
        })?;
        out.extend(t);
    }
    Ok(out)
}

/// Loads a Hugging Face checkpoint directory: weights (f32) and tokenizer.
/// The model's hyper-parameters from a directory's `config.json` (weights not read).
pub fn hf_config(dir: &Path) -> Result<LlmConfig, HfError> {
    let c: HfConfig = json(&dir.join("config.json"))?;
    let family = match c.model_type.as_str() {
        "llama" => Family::Llama,
        "qwen2" => Family::Qwen2,
        "qwen3" => Family::Qwen3,
        other => return Err(HfError::Architecture(other.into())),
    };
    let cfg = LlmConfig {
        family,
        n_layers: c.num_hidden_layers,
        d_model: c.hidden_size,
        n_heads: c.num_attention_heads,
        n_kv_heads: c.num_key_value_heads.unwrap_or(c.num_attention_heads),
        head_dim: c
            .head_dim
            .unwrap_or(c.hidden_size / c.num_attention_heads.max(1)),
        d_ff: c.intermediate_size,
        vocab: c.vocab_size,
        rope_theta: c.rope_theta,
        rope: RopeLayout::Neox,
        rms_eps: c.rms_norm_eps,
        context_length: c.max_position_embeddings.unwrap_or(4096),
        tied_embeddings: c.tie_word_embeddings,
    };
    let problems = cfg.problems();
    if !problems.is_empty() {
        return Err(HfError::Config(problems.join("; ")));
    }
    Ok(cfg)
}

pub fn load_hf(dir: &Path) -> Result<(LlmWeights, LlmTokenizer), HfError> {
    let cfg = hf_config(dir)?;
    let mut t = load_tensors(dir)?;
    let (d, h, q, kv, ff) = (
        cfg.d_model,
        cfg.head_dim,
        cfg.n_heads * cfg.head_dim,
        cfg.n_kv_heads * cfg.head_dim,
        cfg.d_ff,
    );
    let mut take = |name: &str, want: &[usize]| -> Result<Tensor, HfError> {
        let x = t
            .remove(name)
            .ok_or_else(|| HfError::MissingWeight { name: name.into() })?;
        if x.dims() != want {
            return Err(HfError::Shape {
                name: name.into(),
                got: x.dims().to_vec(),
                want: want.to_vec(),
            });
        }
        Ok(x.to_dtype(candle_core::DType::F32)?)
    };
    let mut blocks = Vec::with_capacity(cfg.n_layers);
    for i in 0..cfg.n_layers {
        let n = |s: &str| format!("model.layers.{i}.{s}");
        let bias = cfg.family == Family::Qwen2;
        let qk_norm = cfg.family == Family::Qwen3;
        blocks.push(Block {
            attn_norm: take(&n("input_layernorm.weight"), &[d])?,
            wq: take(&n("self_attn.q_proj.weight"), &[q, d])?,
            wk: take(&n("self_attn.k_proj.weight"), &[kv, d])?,
            wv: take(&n("self_attn.v_proj.weight"), &[kv, d])?,
            wo: take(&n("self_attn.o_proj.weight"), &[d, q])?,
            bq: bias
                .then(|| take(&n("self_attn.q_proj.bias"), &[q]))
                .transpose()?,
            bk: bias
                .then(|| take(&n("self_attn.k_proj.bias"), &[kv]))
                .transpose()?,
            bv: bias
                .then(|| take(&n("self_attn.v_proj.bias"), &[kv]))
                .transpose()?,
            q_norm: qk_norm
                .then(|| take(&n("self_attn.q_norm.weight"), &[h]))
                .transpose()?,
            k_norm: qk_norm
                .then(|| take(&n("self_attn.k_norm.weight"), &[h]))
                .transpose()?,
            ffn_norm: take(&n("post_attention_layernorm.weight"), &[d])?,
            w_gate: take(&n("mlp.gate_proj.weight"), &[ff, d])?,
            w_up: take(&n("mlp.up_proj.weight"), &[ff, d])?,
            w_down: take(&n("mlp.down_proj.weight"), &[d, ff])?,
        });
    }
    let embed = take("model.embed_tokens.weight", &[cfg.vocab, d])?;
    let out_norm = take("model.norm.weight", &[d])?;
    let lm_head = if cfg.tied_embeddings {
        None
    } else {
        Some(take("lm_head.weight", &[cfg.vocab, d])?)
    };
    let weights = LlmWeights {
        cfg,
        embed,
        blocks,
        out_norm,
        lm_head,
        lora: None,
        quant: None,
    };
    let tok_path = dir.join("tokenizer.json");
    if !tok_path.is_file() {
        return Err(HfError::Missing { path: tok_path });
    }
    let inner =
        tokenizers::Tokenizer::from_file(&tok_path).map_err(|source| HfError::Tokenizer {
            path: tok_path.clone(),
            source,
        })?;
    let tc_path = dir.join("tokenizer_config.json");
    let tc: HfTokenizerConfig = if tc_path.is_file() {
        json(&tc_path)?
    } else {
        HfTokenizerConfig::default()
    };
    let id = |v: &Option<serde_json::Value>| token_text(v).and_then(|s| inner.token_to_id(s));
    let (bos, eos) = (id(&tc.bos_token), id(&tc.eos_token));
    let tok = LlmTokenizer::from_parts(inner, bos, eos, tc.chat_template);
    Ok((weights, tok))
}

/// Tensors as Hugging Face names them (what a PyTorch trainer's `state_dict` holds), renamed
/// to the names of [`LlmWeights::named`], q/k rows permuted to the adjacent-pairs layout where
/// the model uses it, a tied model's `lm_head.weight` copy dropped. Names it does not know are
/// kept as they are (the caller's name check reports them).
pub fn from_hf_names(
    cfg: &LlmConfig,
    tensors: Vec<(String, Tensor)>,
) -> Result<Vec<(String, Tensor)>, HfError> {
    let interleaved = cfg.rope == RopeLayout::Interleaved;
    let mut out = Vec::with_capacity(tensors.len());
    for (name, x) in tensors {
        let mapped = match name.as_str() {
            "model.embed_tokens.weight" => "token_embd".to_string(),
            "model.norm.weight" => "output_norm".to_string(),
            "lm_head.weight" if cfg.tied_embeddings => continue,
            "lm_head.weight" => "output".to_string(),
            _ => {
                let block = name.strip_prefix("model.layers.").and_then(|r| {
                    let (i, rest) = r.split_once('.')?;
                    let g = match rest {
                        "input_layernorm.weight" => "attn_norm",
                        "self_attn.q_proj.weight" => "attn_q",
                        "self_attn.k_proj.weight" => "attn_k",
                        "self_attn.v_proj.weight" => "attn_v",
                        "self_attn.o_proj.weight" => "attn_output",
                        "self_attn.q_proj.bias" => "attn_q.bias",
                        "self_attn.k_proj.bias" => "attn_k.bias",
                        "self_attn.v_proj.bias" => "attn_v.bias",
                        "self_attn.q_norm.weight" => "attn_q_norm",
                        "self_attn.k_norm.weight" => "attn_k_norm",
                        "post_attention_layernorm.weight" => "ffn_norm",
                        "mlp.gate_proj.weight" => "ffn_gate",
                        "mlp.up_proj.weight" => "ffn_up",
                        "mlp.down_proj.weight" => "ffn_down",
                        _ => return None,
                    };
                    Some(format!("blk.{i}.{g}"))
                });
                block.unwrap_or(name)
            }
        };
        let x = match (interleaved, mapped.rsplit('.').next()) {
            (true, Some("attn_q")) => permute(&x, cfg.n_heads)?,
            (true, Some("attn_k")) => permute(&x, cfg.n_kv_heads)?,
            _ => x,
        };
        out.push((mapped, x));
    }
    Ok(out)
}

/// llama.cpp's q/k row permutation (halves → adjacent pairs) for `heads` heads.
fn permute(w: &Tensor, heads: usize) -> Result<Tensor, HfError> {
    let (rows, cols) = w.dims2()?;
    let hd = rows / heads;
    Ok(w.reshape((heads, 2, hd / 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))?)
}

/// Undoes llama.cpp's q/k row permutation (adjacent pairs → halves) for `heads` heads.
fn unpermute(w: &Tensor, heads: usize) -> Result<Tensor, HfError> {
    let (rows, cols) = w.dims2()?;
    let hd = rows / heads;
    Ok(w.reshape((heads, hd / 2, 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))?)
}

impl LlmWeights {
    /// Saves the weights and `tok` as a Hugging Face directory (f32 safetensors).
    pub fn save_hf(&self, tok: &LlmTokenizer, dir: &Path) -> Result<(), HfError> {
        std::fs::create_dir_all(dir).map_err(|source| HfError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let c = &self.cfg;
        // Hugging Face rows are in the halves layout.
        let (qk, interleaved) = (
            |w: &Tensor, heads: usize, interleaved: bool| -> Result<Tensor, HfError> {
                if interleaved {
                    unpermute(w, heads)
                } else {
                    Ok(w.clone())
                }
            },
            c.rope == RopeLayout::Interleaved,
        );
        let mut t: HashMap<String, Tensor> = HashMap::new();
        t.insert("model.embed_tokens.weight".into(), self.embed.clone());
        t.insert("model.norm.weight".into(), self.out_norm.clone());
        if let Some(h) = &self.lm_head {
            t.insert("lm_head.weight".into(), h.clone());
        }
        for (i, b) in self.blocks.iter().enumerate() {
            let n = |s: &str| format!("model.layers.{i}.{s}");
            t.insert(n("input_layernorm.weight"), b.attn_norm.clone());
            t.insert(
                n("self_attn.q_proj.weight"),
                qk(&b.wq, c.n_heads, interleaved)?,
            );
            t.insert(
                n("self_attn.k_proj.weight"),
                qk(&b.wk, c.n_kv_heads, interleaved)?,
            );
            t.insert(n("self_attn.v_proj.weight"), b.wv.clone());
            t.insert(n("self_attn.o_proj.weight"), b.wo.clone());
            for (name, x) in [
                ("self_attn.q_proj.bias", &b.bq),
                ("self_attn.k_proj.bias", &b.bk),
                ("self_attn.v_proj.bias", &b.bv),
                ("self_attn.q_norm.weight", &b.q_norm),
                ("self_attn.k_norm.weight", &b.k_norm),
            ] {
                if let Some(x) = x {
                    t.insert(n(name), x.clone());
                }
            }
            t.insert(n("post_attention_layernorm.weight"), b.ffn_norm.clone());
            t.insert(n("mlp.gate_proj.weight"), b.w_gate.clone());
            t.insert(n("mlp.up_proj.weight"), b.w_up.clone());
            t.insert(n("mlp.down_proj.weight"), b.w_down.clone());
        }
        let st = dir.join("model.safetensors");
        candle_core::safetensors::save(&t, &st).map_err(|source| HfError::Safetensors {
            path: st.clone(),
            source: Box::new(source),
        })?;
        let (model_type, arch) = match c.family {
            Family::Llama => ("llama", "LlamaForCausalLM"),
            Family::Qwen2 => ("qwen2", "Qwen2ForCausalLM"),
            Family::Qwen3 => ("qwen3", "Qwen3ForCausalLM"),
        };
        let config = HfConfig {
            model_type: model_type.into(),
            architectures: vec![arch.into()],
            hidden_size: c.d_model,
            num_hidden_layers: c.n_layers,
            num_attention_heads: c.n_heads,
            num_key_value_heads: Some(c.n_kv_heads),
            head_dim: Some(c.head_dim),
            intermediate_size: c.d_ff,
            vocab_size: c.vocab,
            rope_theta: c.rope_theta,
            rms_norm_eps: c.rms_eps,
            tie_word_embeddings: c.tied_embeddings,
            max_position_embeddings: Some(c.context_length),
            torch_dtype: Some("float32".into()),
        };
        write_json(&dir.join("config.json"), &config)?;
        let tp = dir.join("tokenizer.json");
        tok.inner()
            .save(&tp, false)
            .map_err(|source| HfError::Tokenizer { path: tp, source })?;
        let piece = |id: Option<u32>| id.and_then(|i| tok.piece(i)).map(|s| serde_json::json!(s));
        let tc = HfTokenizerConfig {
            chat_template: tok.chat_template().map(str::to_string),
            bos_token: piece(tok.bos_id),
            eos_token: piece(tok.eos_id),
        };
        write_json(&dir.join("tokenizer_config.json"), &tc)
    }
}
