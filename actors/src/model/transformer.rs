//! A small decoder-only transformer on candle (CPU): token and learned position embeddings,
//! pre-norm blocks of causal multi-head attention and a ReLU MLP, RMSNorm written out (candle's
//! fused `rms_norm` passes no gradient), a final norm and an untied output head.
//!
//! Three entry points share the same parameters and the same maths:
//! [`Transformer::forward`] (full sequences, for training), [`Transformer::prefill`] (one
//! sequence's new tokens against its KV cache) and [`Transformer::decode`] (one token for each of
//! many sequences of different lengths: projections batched, attention per sequence).

use candle_core::{D, DType, Device, Result, Tensor};
use candle_nn::kv_cache::KvCache;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand_distr::{Distribution, Normal};

use super::tokenizer::VOCAB;
use crate::weights;

/// Size of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelConfig {
    pub vocab: usize,
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub d_ff: usize,
    /// Longest sequence (positions and KV cache).
    pub max_seq: usize,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            vocab: VOCAB,
            d_model: 64,
            n_layers: 2,
            n_heads: 4,
            d_ff: 256,
            max_seq: 512,
        }
    }
}

impl ModelConfig {
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads
    }

    /// Parameter count.
    pub fn params(&self) -> usize {
        let d = self.d_model;
        let per_layer = 4 * d * d + 2 * d * self.d_ff + 2 * d;
        self.vocab * d + self.max_seq * d + self.n_layers * per_layer + d + d * self.vocab
    }

    /// Problems with the sizes, as messages (every size bounded; see the `MAX_*` limits).
    pub fn problems(&self) -> Vec<String> {
        let mut v = Vec::new();
        if self.d_model == 0 || self.n_heads == 0 || !self.d_model.is_multiple_of(self.n_heads) {
            v.push(format!(
                "d_model ({}) must be a positive multiple of n_heads ({})",
                self.d_model, self.n_heads
            ));
        }
        if self.n_layers == 0 || self.d_ff == 0 || self.max_seq < 2 || self.vocab < VOCAB {
            v.push(
                "n_layers, d_ff must be positive, max_seq >= 2, vocab >= the tokenizer's".into(),
            );
        }
        // Bounds before any allocation is sized by them (and before `params` could overflow).
        for (name, value, max) in [
            ("d_model", self.d_model, MAX_DIM),
            ("n_heads", self.n_heads, MAX_HEADS),
            ("n_layers", self.n_layers, MAX_LAYERS),
            ("d_ff", self.d_ff, MAX_DIM * 4),
            ("max_seq", self.max_seq, MAX_SEQ),
        ] {
            if value > max {
                v.push(format!("{name} must be at most {max}, got {value}"));
            }
        }
        let (d, ff, l) = (self.d_model as f64, self.d_ff as f64, self.n_layers as f64);
        let params = (self.vocab as f64 + self.max_seq as f64) * d
            + l * (4.0 * d * d + 2.0 * d * ff + 2.0 * d)
            + d
            + d * self.vocab as f64;
        if params > MAX_PARAMS as f64 {
            v.push(format!(
                "the model would have {params:.3e} parameters; the built-in model allows at most {MAX_PARAMS}"
            ));
        }
        v
    }
}

/// Largest width of the built-in model.
pub const MAX_DIM: usize = 1 << 14;
/// Most attention heads.
pub const MAX_HEADS: usize = 1 << 10;
/// Most layers.
pub const MAX_LAYERS: usize = 1 << 10;
/// Longest context.
pub const MAX_SEQ: usize = 1 << 20;
/// Most parameters (f32: 4 GiB of weights, three times that to train).
pub const MAX_PARAMS: u64 = 1 << 30;

/// Parameters of one block.
#[derive(Clone, Debug)]
pub struct Block {
    pub attn_norm: Tensor,
    pub wq: Tensor,
    pub wk: Tensor,
    pub wv: Tensor,
    pub wo: Tensor,
    pub mlp_norm: Tensor,
    pub w1: Tensor,
    pub w2: Tensor,
}

/// All parameters, as tensors (plain for inference, `Var`-backed for training).
#[derive(Clone, Debug)]
pub struct Params {
    pub tok_emb: Tensor,
    pub pos_emb: Tensor,
    pub blocks: Vec<Block>,
    pub final_norm: Tensor,
    pub head: Tensor,
}

impl Params {
    /// Seeded initialisation: N(0, 0.02) matrices (output projections scaled by
    /// 1/√(2·layers)), unit norms.
    pub fn init(cfg: &ModelConfig, seed: u64, dtype: DType, dev: &Device) -> Result<Self> {
        let mut rng = SmallRng::seed_from_u64(seed);
        let normal = Normal::new(0.0f64, 0.02).map_err(candle_core::Error::wrap)?;
        let mut mat = |rows: usize, cols: usize, scale: f64| -> Result<Tensor> {
            let v: Vec<f64> = (0..rows * cols)
                .map(|_| normal.sample(&mut rng) * scale)
                .collect();
            Tensor::from_vec(v, (rows, cols), dev)?.to_dtype(dtype)
        };
        let d = cfg.d_model;
        let out_scale = 1.0 / (2.0 * cfg.n_layers as f64).sqrt();
        let tok_emb = mat(cfg.vocab, d, 1.0)?;
        let pos_emb = mat(cfg.max_seq, d, 1.0)?;
        let mut blocks = Vec::new();
        for _ in 0..cfg.n_layers {
            blocks.push(Block {
                attn_norm: Tensor::ones(d, dtype, dev)?,
                wq: mat(d, d, 1.0)?,
                wk: mat(d, d, 1.0)?,
                wv: mat(d, d, 1.0)?,
                wo: mat(d, d, out_scale)?,
                mlp_norm: Tensor::ones(d, dtype, dev)?,
                w1: mat(d, cfg.d_ff, 1.0)?,
                w2: mat(cfg.d_ff, d, out_scale)?,
            });
        }
        Ok(Self {
            tok_emb,
            pos_emb,
            blocks,
            final_norm: Tensor::ones(d, dtype, dev)?,
            head: mat(d, cfg.vocab, 1.0)?,
        })
    }

    /// Every parameter with its stable name (the checkpoint and weight-store layout).
    pub fn named(&self) -> Vec<(String, &Tensor)> {
        let mut v = vec![
            ("tok_emb".to_string(), &self.tok_emb),
            ("pos_emb".to_string(), &self.pos_emb),
        ];
        for (i, b) in self.blocks.iter().enumerate() {
            for (n, t) in [
                ("attn_norm", &b.attn_norm),
                ("wq", &b.wq),
                ("wk", &b.wk),
                ("wv", &b.wv),
                ("wo", &b.wo),
                ("mlp_norm", &b.mlp_norm),
                ("w1", &b.w1),
                ("w2", &b.w2),
            ] {
                v.push((format!("blocks.{i}.{n}"), t));
            }
        }
        v.push(("final_norm".to_string(), &self.final_norm));
        v.push(("head".to_string(), &self.head));
        v
    }

    /// Rebuilds parameters from named tensors (same layout as [`Params::named`]).
    pub fn from_named(
        cfg: &ModelConfig,
        mut get: impl FnMut(&str) -> Result<Tensor>,
    ) -> Result<Self> {
        let mut blocks = Vec::new();
        for i in 0..cfg.n_layers {
            let mut g = |n: &str| get(&format!("blocks.{i}.{n}"));
            blocks.push(Block {
                attn_norm: g("attn_norm")?,
                wq: g("wq")?,
                wk: g("wk")?,
                wv: g("wv")?,
                wo: g("wo")?,
                mlp_norm: g("mlp_norm")?,
                w1: g("w1")?,
                w2: g("w2")?,
            });
        }
        Ok(Self {
            tok_emb: get("tok_emb")?,
            pos_emb: get("pos_emb")?,
            blocks,
            final_norm: get("final_norm")?,
            head: get("head")?,
        })
    }

    /// Copies the parameters out as a weight-store entry.
    pub fn to_weights(&self, version: u64) -> Result<weights::Weights> {
        let mut tensors = Vec::new();
        let mut bytes = 0.0;
        for (name, t) in self.named() {
            let data: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            bytes += data.len() as f64 * 4.0;
            tensors.push(weights::Tensor {
                name,
                shape: t.dims().to_vec(),
                data,
            });
        }
        Ok(weights::Weights {
            version,
            tensors,
            shared: None,
            modelled_bytes: bytes,
        })
    }

    /// Builds inference parameters from a weight-store entry.
    pub fn from_weights(cfg: &ModelConfig, w: &weights::Weights, dev: &Device) -> Result<Self> {
        Self::from_named(cfg, |name| {
            let t = w.tensors.iter().find(|t| t.name == name).ok_or_else(|| {
                candle_core::Error::Msg(format!("weights v{} lack tensor {name}", w.version))
            })?;
            Tensor::from_slice(&t.data, t.shape.as_slice(), dev)
        })
    }
}

/// RMSNorm written with differentiable primitives.
fn rms_norm(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (ms + 1e-5)?.sqrt()?.recip()?;
    x.broadcast_mul(&inv)?.broadcast_mul(w)
}

/// One sequence's KV cache: per layer, K and V of shape [1, heads, len, head_dim].
pub struct SeqCache {
    layers: Vec<KvCache>,
    len: usize,
}

impl SeqCache {
    pub fn new(cfg: &ModelConfig) -> Self {
        Self {
            layers: (0..cfg.n_layers)
                .map(|_| KvCache::new(2, cfg.max_seq))
                .collect(),
            len: 0,
        }
    }

    /// A cache with no layers (a placeholder while a cache is borrowed elsewhere).
    pub fn empty() -> Self {
        Self {
            layers: Vec::new(),
            len: 0,
        }
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn reset(&mut self) {
        for l in &mut self.layers {
            l.reset();
        }
        self.len = 0;
    }
}

/// The model's forward passes.
#[derive(Clone, Copy, Debug)]
pub struct Transformer {
    pub cfg: ModelConfig,
}

impl Transformer {
    pub fn new(cfg: ModelConfig) -> Self {
        Self { cfg }
    }

    fn split_heads(&self, x: &Tensor, b: usize, t: usize) -> Result<Tensor> {
        x.reshape((b, t, self.cfg.n_heads, self.cfg.head_dim()))?
            .transpose(1, 2)?
            .contiguous()
    }

    fn mlp(&self, blk: &Block, x: &Tensor) -> Result<Tensor> {
        let h = rms_norm(x, &blk.mlp_norm)?;
        let h = h
            .broadcast_matmul(&blk.w1)?
            .relu()?
            .broadcast_matmul(&blk.w2)?;
        x + h
    }

    /// Logits [B, T, V] for full sequences `tokens` [B, T] (u32), causal attention.
    pub fn forward(&self, p: &Params, tokens: &Tensor) -> Result<Tensor> {
        let (b, t) = tokens.dims2()?;
        let d = self.cfg.d_model;
        let dev = tokens.device();
        let dtype = p.tok_emb.dtype();
        let mut x = p
            .tok_emb
            .index_select(&tokens.flatten_all()?, 0)?
            .reshape((b, t, d))?;
        x = x.broadcast_add(&p.pos_emb.narrow(0, 0, t)?)?;
        let mask: Vec<f32> = (0..t)
            .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { -1e9 }))
            .collect();
        let mask = Tensor::from_vec(mask, (1, 1, t, t), dev)?.to_dtype(dtype)?;
        let scale = 1.0 / (self.cfg.head_dim() as f64).sqrt();
        for blk in &p.blocks {
            let h = rms_norm(&x, &blk.attn_norm)?;
            let q = self.split_heads(&h.broadcast_matmul(&blk.wq)?, b, t)?;
            let k = self.split_heads(&h.broadcast_matmul(&blk.wk)?, b, t)?;
            let v = self.split_heads(&h.broadcast_matmul(&blk.wv)?, b, t)?;
            let att = (q.matmul(&k.t()?)? * scale)?.broadcast_add(&mask)?;
            let att = candle_nn::ops::softmax(&att, D::Minus1)?;
            let o = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, d))?;
            x = (x + o.broadcast_matmul(&blk.wo)?)?;
            x = self.mlp(blk, &x)?;
        }
        rms_norm(&x, &p.final_norm)?.broadcast_matmul(&p.head)
    }

    /// Feeds `tokens` (the part of a sequence not yet in `cache`) and returns the logits of the
    /// last position [V].
    pub fn prefill(&self, p: &Params, tokens: &[u32], cache: &mut SeqCache) -> Result<Tensor> {
        let t = tokens.len();
        let start = cache.len;
        if start + t > self.cfg.max_seq {
            candle_core::bail!(
                "sequence of {} tokens exceeds max_seq {}",
                start + t,
                self.cfg.max_seq
            );
        }
        let d = self.cfg.d_model;
        let dev = p.tok_emb.device();
        let ids = Tensor::from_slice(tokens, t, dev)?;
        let mut x = p.tok_emb.index_select(&ids, 0)?.reshape((1, t, d))?;
        x = x.broadcast_add(&p.pos_emb.narrow(0, start, t)?)?;
        let total = start + t;
        let mask: Vec<f32> = (0..t)
            .flat_map(|i| (0..total).map(move |j| if j <= start + i { 0.0 } else { -1e9 }))
            .collect();
        let mask = Tensor::from_vec(mask, (1, 1, t, total), dev)?.to_dtype(p.tok_emb.dtype())?;
        let scale = 1.0 / (self.cfg.head_dim() as f64).sqrt();
        for (blk, kv) in p.blocks.iter().zip(cache.layers.iter_mut()) {
            let h = rms_norm(&x, &blk.attn_norm)?;
            let q = self.split_heads(&h.broadcast_matmul(&blk.wq)?, 1, t)?;
            let k = self.split_heads(&h.broadcast_matmul(&blk.wk)?, 1, t)?;
            let v = self.split_heads(&h.broadcast_matmul(&blk.wv)?, 1, t)?;
            let (k, v) = kv.append(&k, &v)?;
            let att = (q.matmul(&k.t()?)? * scale)?.broadcast_add(&mask)?;
            let att = candle_nn::ops::softmax(&att, D::Minus1)?;
            let o = att.matmul(&v)?.transpose(1, 2)?.reshape((1, t, d))?;
            x = (x + o.broadcast_matmul(&blk.wo)?)?;
            x = self.mlp(blk, &x)?;
        }
        cache.len = total;
        let last = x.narrow(1, t - 1, 1)?;
        rms_norm(&last, &p.final_norm)?
            .broadcast_matmul(&p.head)?
            .flatten_all()
    }

    /// One decode step for many sequences: feeds `tokens[i]` to `caches[i]` and returns logits
    /// [B, V]. Projections and the MLP run batched; attention runs per sequence over its own
    /// cache, so sequences of any lengths share the step.
    pub fn decode(
        &self,
        p: &Params,
        tokens: &[u32],
        caches: &mut [&mut SeqCache],
    ) -> Result<Tensor> {
        let b = tokens.len();
        let d = self.cfg.d_model;
        let dev = p.tok_emb.device();
        for c in caches.iter() {
            if c.len + 1 > self.cfg.max_seq {
                candle_core::bail!("sequence reached max_seq {}", self.cfg.max_seq);
            }
        }
        let ids = Tensor::from_slice(tokens, b, dev)?;
        let pos: Vec<u32> = caches.iter().map(|c| c.len as u32).collect();
        let pos = Tensor::from_slice(&pos, b, dev)?;
        let mut x = (p.tok_emb.index_select(&ids, 0)? + p.pos_emb.index_select(&pos, 0)?)?
            .reshape((b, 1, d))?;
        let scale = 1.0 / (self.cfg.head_dim() as f64).sqrt();
        for (li, blk) in p.blocks.iter().enumerate() {
            let h = rms_norm(&x, &blk.attn_norm)?;
            let q = self.split_heads(&h.broadcast_matmul(&blk.wq)?, b, 1)?;
            let k = self.split_heads(&h.broadcast_matmul(&blk.wk)?, b, 1)?;
            let v = self.split_heads(&h.broadcast_matmul(&blk.wv)?, b, 1)?;
            let mut outs = Vec::with_capacity(b);
            for (i, c) in caches.iter_mut().enumerate() {
                let (ki, vi) = c.layers[li].append(&k.narrow(0, i, 1)?, &v.narrow(0, i, 1)?)?;
                let att = (q.narrow(0, i, 1)?.matmul(&ki.t()?)? * scale)?;
                let att = candle_nn::ops::softmax(&att, D::Minus1)?;
                outs.push(att.matmul(&vi)?);
            }
            let o = Tensor::cat(&outs, 0)?.transpose(1, 2)?.reshape((b, 1, d))?;
            x = (x + o.broadcast_matmul(&blk.wo)?)?;
            x = self.mlp(blk, &x)?;
        }
        for c in caches.iter_mut() {
            c.len += 1;
        }
        rms_norm(&x, &p.final_norm)?
            .broadcast_matmul(&p.head)?
            .reshape((b, self.cfg.vocab))
    }

    /// Log-probabilities of `targets` under `logits` [.., V] (same leading shape).
    pub fn token_logprobs(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let lsm = candle_nn::ops::log_softmax(logits, D::Minus1)?;
        lsm.gather(&targets.unsqueeze(D::Minus1)?, D::Minus1)?
            .squeeze(D::Minus1)
    }
}
