//! Checkpoint files: GGUF (metadata, tokenizer, tensors dequantised to f32).

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{Device, Tensor};

use super::config::{Family, LlmConfig, RopeLayout};

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("cannot open checkpoint {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a readable GGUF file")]
    Gguf {
        path: PathBuf,
        #[source]
        source: Box<candle_core::Error>,
    },
    #[error("{path}: architecture {arch:?} is not supported (llama, qwen2, qwen3 are)")]
    Architecture { path: PathBuf, arch: String },
    #[error("{path}: metadata key {key} is missing or has the wrong type")]
    Metadata { path: PathBuf, key: String },
    #[error("{path}: the model configuration is unusable: {problems}")]
    Config { path: PathBuf, problems: String },
    #[error("{path}: tensor {name} is missing")]
    MissingTensor { path: PathBuf, name: String },
    #[error("{path}: tensor {name} has shape {got:?}, expected {want:?}")]
    Shape {
        path: PathBuf,
        name: String,
        got: Vec<usize>,
        want: Vec<usize>,
    },
    #[error("{path}: cannot read tensor {name}")]
    Tensor {
        path: PathBuf,
        name: String,
        #[source]
        source: Box<candle_core::Error>,
    },
}

/// An open GGUF checkpoint: its metadata and tensor directory (tensors are read on demand).
pub struct Checkpoint {
    pub path: PathBuf,
    content: Content,
    pub config: LlmConfig,
}

impl Checkpoint {
    /// Opens a GGUF file and reads its model configuration.
    pub fn open_gguf(path: &Path) -> Result<Self, CheckpointError> {
        let file = File::open(path).map_err(|source| CheckpointError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let content =
            Content::read(&mut BufReader::new(file)).map_err(|source| CheckpointError::Gguf {
                path: path.to_path_buf(),
                source: Box::new(source),
            })?;
        let config = Meta {
            path,
            md: &content.metadata,
        }
        .config(content.tensor_infos.contains_key("output.weight"))?;
        let problems = config.problems();
        if !problems.is_empty() {
            return Err(CheckpointError::Config {
                path: path.to_path_buf(),
                problems: problems.join("; "),
            });
        }
        Ok(Self {
            path: path.to_path_buf(),
            content,
            config,
        })
    }

    /// The file's metadata, with typed accessors.
    pub fn meta(&self) -> Meta<'_> {
        Meta {
            path: &self.path,
            md: &self.content.metadata,
        }
    }
}

/// Typed access to GGUF metadata; a missing key or a wrong type is an error naming the key.
pub struct Meta<'a> {
    path: &'a Path,
    md: &'a HashMap<String, Value>,
}

impl<'a> Meta<'a> {
    fn missing(&self, key: &str) -> CheckpointError {
        CheckpointError::Metadata {
            path: self.path.to_path_buf(),
            key: key.into(),
        }
    }

    pub fn get_str(&self, key: &str) -> Result<&'a str, CheckpointError> {
        self.md
            .get(key)
            .and_then(|v| v.to_string().ok())
            .map(String::as_str)
            .ok_or_else(|| self.missing(key))
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, CheckpointError> {
        let v = self.md.get(key).ok_or_else(|| self.missing(key))?;
        v.to_u64()
            .or_else(|_| v.to_u32().map(u64::from))
            .or_else(|_| v.to_i32().map(|x| x.max(0) as u64))
            .map_err(|_| self.missing(key))
    }

    pub fn get_f64(&self, key: &str) -> Result<f64, CheckpointError> {
        let v = self.md.get(key).ok_or_else(|| self.missing(key))?;
        v.to_f32()
            .map(f64::from)
            .or_else(|_| v.to_f64())
            .map_err(|_| self.missing(key))
    }

    /// An array of strings (e.g. the tokenizer's tokens).
    pub fn get_strings(&self, key: &str) -> Result<Vec<&'a str>, CheckpointError> {
        let arr = self
            .md
            .get(key)
            .and_then(|v| v.to_vec().ok())
            .ok_or_else(|| self.missing(key))?;
        arr.iter()
            .map(|v| {
                v.to_string()
                    .map(String::as_str)
                    .map_err(|_| self.missing(key))
            })
            .collect()
    }

    /// An array of integers (e.g. the tokenizer's token types).
    pub fn get_ints(&self, key: &str) -> Result<Vec<i64>, CheckpointError> {
        let arr = self
            .md
            .get(key)
            .and_then(|v| v.to_vec().ok())
            .ok_or_else(|| self.missing(key))?;
        arr.iter()
            .map(|v| {
                v.to_i32()
                    .map(i64::from)
                    .or_else(|_| v.to_u32().map(i64::from))
                    .or_else(|_| v.to_i64())
                    .map_err(|_| self.missing(key))
            })
            .collect()
    }

    /// The model configuration (`has_output`: the file has its own output projection).
    fn config(&self, has_output: bool) -> Result<LlmConfig, CheckpointError> {
        let arch = self.get_str("general.architecture")?.to_string();
        let family = match arch.as_str() {
            "llama" => Family::Llama,
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            _ => {
                return Err(CheckpointError::Architecture {
                    path: self.path.to_path_buf(),
                    arch,
                });
            }
        };
        let k = |s: &str| format!("{arch}.{s}");
        let d_model = self.get_u64(&k("embedding_length"))? as usize;
        let n_heads = self.get_u64(&k("attention.head_count"))? as usize;
        let n_kv_heads = self
            .get_u64(&k("attention.head_count_kv"))
            .map_or(n_heads, |v| v as usize);
        let head_dim = self
            .get_u64(&k("attention.key_length"))
            .map_or(d_model / n_heads.max(1), |v| v as usize);
        let vocab = match self.get_u64(&k("vocab_size")) {
            Ok(v) => v as usize,
            Err(_) => self.get_strings("tokenizer.ggml.tokens")?.len(),
        };
        Ok(LlmConfig {
            family,
            n_layers: self.get_u64(&k("block_count"))? as usize,
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
            d_ff: self.get_u64(&k("feed_forward_length"))? as usize,
            vocab,
            rope_theta: self.get_f64(&k("rope.freq_base")).unwrap_or(10_000.0),
            // llama.cpp's converter permutes Llama's q/k rows for adjacent pairs; Qwen models
            // keep the halves layout (ggml's NEOX mode).
            rope: if family == Family::Llama {
                RopeLayout::Interleaved
            } else {
                RopeLayout::Neox
            },
            rms_eps: self.get_f64(&k("attention.layer_norm_rms_epsilon"))?,
            context_length: self
                .get_u64(&k("context_length"))
                .map_or(4096, |v| v as usize),
            tied_embeddings: !has_output,
        })
    }
}

impl Checkpoint {
    /// Whether the file holds tensor `name`.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Tensor `name` dequantised to f32, with its shape checked (rows × columns, as in
    /// PyTorch: GGUF's `ne` reversed).
    pub fn tensor_f32(&self, name: &str, want: &[usize]) -> Result<Tensor, CheckpointError> {
        if !self.has_tensor(name) {
            return Err(CheckpointError::MissingTensor {
                path: self.path.clone(),
                name: name.into(),
            });
        }
        let err = |source| CheckpointError::Tensor {
            path: self.path.clone(),
            name: name.into(),
            source: Box::new(source),
        };
        let file = File::open(&self.path).map_err(|source| CheckpointError::Open {
            path: self.path.clone(),
            source,
        })?;
        let q = self
            .content
            .tensor(&mut BufReader::new(file), name, &Device::Cpu)
            .map_err(err)?;
        let t = q.dequantize(&Device::Cpu).map_err(err)?;
        if t.dims() != want {
            return Err(CheckpointError::Shape {
                path: self.path.clone(),
                name: name.into(),
                got: t.dims().to_vec(),
                want: want.to_vec(),
            });
        }
        Ok(t)
    }
}
