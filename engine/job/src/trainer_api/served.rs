//! What a job's engines serve ([`ServedModel`]), so weights an external trainer announces are
//! checked against it and loaded; and the hash of an announced file.

use std::collections::HashMap;

use actors::types::PolicyVersion;
use actors::weights::Weights;

use crate::store::AnnouncedWeights;

/// What the job's engines run, so announced weights can be checked against it.
#[derive(Clone, Debug)]
pub enum ServedModel {
    /// Simulated engines: an announced version is a modelled publication of this size.
    Simulated { bytes: f64 },
    /// Real engines: every tensor, by name and shape, an announced file must hold; `plain`:
    /// the engines read plain rows (the tiny model), else shared candle tensors.
    Real {
        tensors: Vec<(String, Vec<usize>)>,
        plain: bool,
        /// A checkpoint model: files may also name tensors as Hugging Face does (a PyTorch
        /// `state_dict`), mapped onto the model's names.
        hf: Option<Box<actors::model::llm::LlmConfig>>,
    },
}

impl ServedModel {
    pub fn of(w: &Weights) -> Self {
        let real = w
            .candle_tensors(&candle_core::Device::Cpu)
            .unwrap_or_default();
        if real.is_empty() {
            Self::Simulated {
                bytes: w.modelled_bytes,
            }
        } else {
            Self::Real {
                tensors: real
                    .into_iter()
                    .map(|(n, t)| (n, t.dims().to_vec()))
                    .collect(),
                plain: w.shared.is_none(),
                hf: None,
            }
        }
    }

    /// Also accepts Hugging Face tensor names for a checkpoint model of `cfg`.
    pub fn with_hf_names(self, cfg: &actors::model::llm::LlmConfig) -> Self {
        match self {
            Self::Real { tensors, plain, .. } => Self::Real {
                tensors,
                plain,
                hf: Some(Box::new(cfg.clone())),
            },
            s => s,
        }
    }

    /// The announced weights, checked tensor by tensor: a safetensors file (the model's
    /// tensor names, or Hugging Face's for a checkpoint), or a GGUF checkpoint (dequantised to
    /// f32) for a checkpoint model.
    pub fn load(&self, a: &AnnouncedWeights) -> Result<Weights, AnnouncedError> {
        let version = a.version;
        let (tensors, plain, hf) = match self {
            Self::Simulated { bytes } => return Ok(Weights::simulated(version, *bytes)),
            Self::Real { tensors, plain, hf } => (tensors, *plain, hf),
        };
        let bad = |why: String| AnnouncedError {
            version,
            path: a.uri.clone(),
            why,
        };
        // The file the announcement checked, and no other: re-opened without following a
        // symlink, compared by identity, then read through that descriptor (its
        // `/proc/self/fd` name), never by the path again.
        let opened = match &a.identity {
            Some(id) => infra::files::still_same(
                std::path::Path::new(&a.uri),
                id,
                infra::files::FileKind::Weights,
            ),
            // Announced before identities were recorded: resolved now.
            None => infra::files::resolve(std::path::Path::new(&a.uri))
                .and_then(|p| infra::files::open_resolved(&p, infra::files::FileKind::Weights)),
        }
        .map_err(|e| bad(infra::error_chain(&e)))?;
        let fd_path = format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&opened.file)
        );
        let path = fd_path.as_str();
        let mut map = if a.format == "gguf" {
            if hf.is_none() {
                return Err(bad(
                    "GGUF files are for checkpoint models; this one takes safetensors".into(),
                ));
            }
            let (w, _) = actors::model::llm::load(std::path::Path::new(path))
                .map_err(|e| bad(format!("not a GGUF checkpoint: {e}")))?;
            w.named()
                .into_iter()
                .map(|(n, t)| (n, t.clone()))
                .collect::<HashMap<_, _>>()
        } else {
            candle_core::safetensors::load(path, &candle_core::Device::Cpu)
                .map_err(|e| bad(format!("not a safetensors file: {e}")))?
        };
        if let Some(cfg) = hf
            && map.contains_key("model.embed_tokens.weight")
        {
            map = actors::model::llm::from_hf_names(cfg, map.into_iter().collect())
                .map_err(|e| bad(format!("Hugging Face names: {e}")))?
                .into_iter()
                .collect();
        }
        let mut out = Vec::with_capacity(tensors.len());
        for (name, shape) in tensors {
            let t = map
                .remove(name)
                .ok_or_else(|| bad(format!("it has no tensor {name}")))?;
            if t.dims() != shape.as_slice() {
                return Err(bad(format!(
                    "{name} has shape {:?}, the model's is {shape:?}",
                    t.dims()
                )));
            }
            let t = t
                .to_dtype(candle_core::DType::F32)
                .map_err(|e| bad(format!("{name}: {e}")))?;
            out.push((name.clone(), t));
        }
        if let Some(extra) = map.keys().next() {
            return Err(bad(format!("it has a tensor the model lacks: {extra}")));
        }
        if !plain {
            return Ok(Weights::from_shared(version, out));
        }
        let mut rows = Vec::with_capacity(out.len());
        let mut bytes = 0.0;
        for (name, t) in out {
            let data: Vec<f32> = t
                .flatten_all()
                .and_then(|t| t.to_vec1())
                .map_err(|e| bad(format!("{name}: {e}")))?;
            bytes += data.len() as f64 * 4.0;
            rows.push(actors::weights::Tensor {
                name,
                shape: t.dims().to_vec(),
                data,
            });
        }
        Ok(Weights {
            version,
            tensors: rows,
            shared: None,
            modelled_bytes: bytes,
        })
    }
}

/// Announced weights the job cannot serve.
#[derive(Debug, thiserror::Error)]
#[error("the announced weights of version {version} at {path} cannot be served: {why}")]
pub struct AnnouncedError {
    pub version: PolicyVersion,
    pub path: String,
    pub why: String,
}

/// The SHA-256 of a file (lower-case hex), read as a stream.
pub fn file_sha256(path: &std::path::Path) -> std::io::Result<String> {
    reader_sha256(std::fs::File::open(path)?)
}

/// The SHA-256 of what `f` reads, in lowercase hex.
pub fn reader_sha256(mut f: impl std::io::Read) -> std::io::Result<String> {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = std::io::Read::read(&mut f, &mut buf)?;
        if n == 0 {
            break;
        }
        ctx.update(&buf[..n]);
    }
    Ok(ctx
        .finish()
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}
