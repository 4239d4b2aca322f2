//! The decoder's weights and its full-sequence forward in f32: every position's logits at
//! once, causal attention without a cache, written only with candle ops that have a backward
//! (`rms_norm` by hand, RoPE by hand, `candle_nn::ops::softmax`), so the same code is the
//! trainer's differentiable forward and the reference for the generation engine.

use candle_core::{D, DType, Device, Tensor, Var};

use super::checkpoint::{Checkpoint, CheckpointError};
use super::config::{LlmConfig, RopeLayout};

mod decode;
mod lora;
mod packed;
mod quant;

pub use lora::{LoraSet, Proj, linear};
pub use quant::{QUANT_BLOCK, QuantSet};

/// One decoder block.
#[derive(Clone)]
pub struct Block {
    pub attn_norm: Tensor,
    pub wq: Tensor,
    pub wk: Tensor,
    pub wv: Tensor,
    pub wo: Tensor,
    /// Qwen2: biases of q, k, v.
    pub bq: Option<Tensor>,
    pub bk: Option<Tensor>,
    pub bv: Option<Tensor>,
    /// Qwen3: per-head RMS norms of q and k.
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    pub ffn_norm: Tensor,
    pub w_gate: Tensor,
    pub w_up: Tensor,
    pub w_down: Tensor,
}

/// The model's weights (f32), laid out as rows × columns (`y = x · Wᵀ`).
#[derive(Clone)]
pub struct LlmWeights {
    pub cfg: LlmConfig,
    pub embed: Tensor,
    pub blocks: Vec<Block>,
    pub out_norm: Tensor,
    /// None: tied to `embed`.
    pub lm_head: Option<Tensor>,
    /// LoRA adapters applied beside the weights (the trainer's view; engines merge them).
    pub lora: Option<LoraSet>,
    /// The engine's quantised copies of the matrices ([`Self::quantized`]): when set, every
    /// projection and the head multiply by them instead. Dropped by [`Self::with_tensors`].
    pub quant: Option<std::sync::Arc<QuantSet>>,
}

impl LlmWeights {
    /// Reads and dequantises every tensor of a GGUF checkpoint, checking each shape.
    pub fn from_gguf(ck: &Checkpoint) -> Result<Self, CheckpointError> {
        let c = ck.config.clone();
        let (d, h, q, kv, ff) = (
            c.d_model,
            c.head_dim,
            c.n_heads * c.head_dim,
            c.n_kv_heads * c.head_dim,
            c.d_ff,
        );
        let optional = |name: &str, shape: &[usize]| {
            if ck.has_tensor(name) {
                ck.tensor_f32(name, shape).map(Some)
            } else {
                Ok(None)
            }
        };
        let mut blocks = Vec::with_capacity(c.n_layers);
        for i in 0..c.n_layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            blocks.push(Block {
                attn_norm: ck.tensor_f32(&n("attn_norm.weight"), &[d])?,
                wq: ck.tensor_f32(&n("attn_q.weight"), &[q, d])?,
                wk: ck.tensor_f32(&n("attn_k.weight"), &[kv, d])?,
                wv: ck.tensor_f32(&n("attn_v.weight"), &[kv, d])?,
                wo: ck.tensor_f32(&n("attn_output.weight"), &[d, q])?,
                bq: optional(&n("attn_q.bias"), &[q])?,
                bk: optional(&n("attn_k.bias"), &[kv])?,
                bv: optional(&n("attn_v.bias"), &[kv])?,
                q_norm: optional(&n("attn_q_norm.weight"), &[h])?,
                k_norm: optional(&n("attn_k_norm.weight"), &[h])?,
                ffn_norm: ck.tensor_f32(&n("ffn_norm.weight"), &[d])?,
                w_gate: ck.tensor_f32(&n("ffn_gate.weight"), &[ff, d])?,
                w_up: ck.tensor_f32(&n("ffn_up.weight"), &[ff, d])?,
                w_down: ck.tensor_f32(&n("ffn_down.weight"), &[d, ff])?,
            });
        }
        Ok(Self {
            embed: ck.tensor_f32("token_embd.weight", &[c.vocab, d])?,
            out_norm: ck.tensor_f32("output_norm.weight", &[d])?,
            lm_head: if c.tied_embeddings {
                None
            } else {
                Some(ck.tensor_f32("output.weight", &[c.vocab, d])?)
            },
            blocks,
            cfg: c,
            lora: None,
            quant: None,
        })
    }

    /// Every weight with its stable name, in a fixed order (the trainer's parameter list,
    /// checkpoints and weight sync use these names).
    pub fn named(&self) -> Vec<(String, &Tensor)> {
        let mut v = vec![("token_embd".to_string(), &self.embed)];
        for (i, b) in self.blocks.iter().enumerate() {
            let n = |s: &str| format!("blk.{i}.{s}");
            let all: [(&str, Option<&Tensor>); 14] = [
                ("attn_norm", Some(&b.attn_norm)),
                ("attn_q", Some(&b.wq)),
                ("attn_k", Some(&b.wk)),
                ("attn_v", Some(&b.wv)),
                ("attn_output", Some(&b.wo)),
                ("attn_q.bias", b.bq.as_ref()),
                ("attn_k.bias", b.bk.as_ref()),
                ("attn_v.bias", b.bv.as_ref()),
                ("attn_q_norm", b.q_norm.as_ref()),
                ("attn_k_norm", b.k_norm.as_ref()),
                ("ffn_norm", Some(&b.ffn_norm)),
                ("ffn_gate", Some(&b.w_gate)),
                ("ffn_up", Some(&b.w_up)),
                ("ffn_down", Some(&b.w_down)),
            ];
            for (name, t) in all {
                if let Some(t) = t {
                    v.push((n(name), t));
                }
            }
        }
        v.push(("output_norm".to_string(), &self.out_norm));
        if let Some(h) = &self.lm_head {
            v.push(("output".to_string(), h));
        }
        v
    }

    /// Rebuilds weights of `cfg` from named tensors (the names of [`Self::named`]); optional
    /// tensors (biases, QK norms, an untied head) are taken when `has` says they exist.
    pub fn from_named(
        cfg: &LlmConfig,
        has: impl Fn(&str) -> bool,
        mut get: impl FnMut(&str) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Self> {
        let mut blocks = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            let mut opt = |s: &str| {
                let name = n(s);
                if has(&name) {
                    get(&name).map(Some)
                } else {
                    Ok(None)
                }
            };
            let (bq, bk, bv) = (
                opt("attn_q.bias")?,
                opt("attn_k.bias")?,
                opt("attn_v.bias")?,
            );
            let (q_norm, k_norm) = (opt("attn_q_norm")?, opt("attn_k_norm")?);
            blocks.push(Block {
                attn_norm: get(&n("attn_norm"))?,
                wq: get(&n("attn_q"))?,
                wk: get(&n("attn_k"))?,
                wv: get(&n("attn_v"))?,
                wo: get(&n("attn_output"))?,
                bq,
                bk,
                bv,
                q_norm,
                k_norm,
                ffn_norm: get(&n("ffn_norm"))?,
                w_gate: get(&n("ffn_gate"))?,
                w_up: get(&n("ffn_up"))?,
                w_down: get(&n("ffn_down"))?,
            });
        }
        Ok(Self {
            cfg: cfg.clone(),
            embed: get("token_embd")?,
            blocks,
            out_norm: get("output_norm")?,
            lm_head: if has("output") {
                Some(get("output")?)
            } else {
                None
            },
            lora: None,
            quant: None,
        })
    }

    /// A copy whose every weight is a trainable variable (listed by name, in the order of
    /// [`Self::named`]): the trainer's parameters, and what gradient checks walk.
    pub fn trainable(&self) -> candle_core::Result<(LlmWeights, Vec<(String, Var)>)> {
        let mut vars: Vec<(String, Var)> = Vec::new();
        for (name, t) in self.named() {
            vars.push((name, Var::from_tensor(t)?));
        }
        let weights =
            self.with_tensors(vars.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())))?;
        Ok((weights, vars))
    }

    /// The same architecture over other tensors (named as in [`Self::named`]).
    pub fn with_tensors(
        &self,
        tensors: impl IntoIterator<Item = (String, Tensor)>,
    ) -> candle_core::Result<LlmWeights> {
        let map: std::collections::HashMap<String, Tensor> = tensors.into_iter().collect();
        Self::from_named(
            &self.cfg,
            |n| map.contains_key(n),
            |n| {
                map.get(n)
                    .cloned()
                    .ok_or_else(|| candle_core::Error::Msg(format!("no tensor {n}")))
            },
        )
    }

    /// Logits `[T, vocab]` of every position of `tokens` (causal: position t sees 0..=t).
    pub fn forward(&self, tokens: &[u32]) -> candle_core::Result<Tensor> {
        self.run(tokens, None, false)
    }

    /// An empty key/value cache for one sequence.
    pub fn new_cache(&self) -> SeqCache {
        SeqCache {
            layers: (0..self.blocks.len()).map(|_| None).collect(),
            len: 0,
        }
    }

    /// Appends `tokens` to the sequence `cache` holds; logits `[n, vocab]` of the new
    /// positions. The same computation as [`Self::forward`] over the whole sequence.
    pub fn extend(&self, cache: &mut SeqCache, tokens: &[u32]) -> candle_core::Result<Tensor> {
        self.run(tokens, Some(cache), false)
    }

    /// Like [`Self::extend`], but only the last position's logits `[vocab]` (prefill: the
    /// output head runs once, not per token).
    pub fn extend_last(&self, cache: &mut SeqCache, tokens: &[u32]) -> candle_core::Result<Tensor> {
        self.run(tokens, Some(cache), true)?.squeeze(0)
    }

    fn run(
        &self,
        tokens: &[u32],
        mut cache: Option<&mut SeqCache>,
        last_only: bool,
    ) -> candle_core::Result<Tensor> {
        let dev = self.embed.device();
        let n = tokens.len();
        let past = cache.as_ref().map_or(0, |c| c.len);
        let ids = Tensor::from_slice(tokens, n, dev)?;
        let mut x = self.embed.index_select(&ids, 0)?;
        let (cos, sin) = rope_tables(&self.cfg, past, n, dev)?;
        let mask = causal_mask(past, n, dev)?;
        for i in 0..self.blocks.len() {
            let kv = cache.as_deref_mut().map(|c| (&mut c.layers[i], past));
            x = (&x + self.attention(i, &x, &cos, &sin, &mask, kv)?)?;
            x = (&x + self.mlp(i, &x)?)?;
        }
        if let Some(c) = cache {
            c.len += n;
        }
        let x = if last_only { x.narrow(0, n - 1, 1)? } else { x };
        self.head(&x)
    }

    /// Final norm and output projection of hidden states `[n, d]`.
    fn head(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = rms_norm(x, &self.out_norm, self.cfg.rms_eps)?;
        match &self.quant {
            Some(q) => q.forward(None, Proj::Q, &x),
            None => linear(&x, self.lm_head.as_ref().unwrap_or(&self.embed), None),
        }
    }

    /// `x·wᵀ (+ bias)` of block `block`'s projection `p`, with its LoRA adapter if any.
    fn proj(
        &self,
        block: usize,
        p: Proj,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        let y = match &self.quant {
            Some(q) => {
                let y = q.forward(Some(block), p, x)?;
                match bias {
                    Some(b) => y.broadcast_add(b)?,
                    None => y,
                }
            }
            None => linear(x, w, bias)?,
        };
        match &self.lora {
            Some(l) => l.apply(block, p, x, y),
            None => Ok(y),
        }
    }

    /// The MLP of block `i` on hidden states `x` `[n, d]` (its norm included).
    fn mlp(&self, i: usize, x: &Tensor) -> candle_core::Result<Tensor> {
        let b = &self.blocks[i];
        let h = rms_norm(x, &b.ffn_norm, self.cfg.rms_eps)?;
        let gate = self.proj(i, Proj::Gate, &h, &b.w_gate, None)?.silu()?;
        let up = self.proj(i, Proj::Up, &h, &b.w_up, None)?;
        self.proj(i, Proj::Down, &(gate * up)?, &b.w_down, None)
    }

    /// Block `li`'s queries, keys and values of hidden states `x` `[n, d]` (its norm, the
    /// projections with their adapters, QK norms), each `[heads, n, hd]`, before RoPE.
    fn qkv(&self, li: usize, x: &Tensor) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let c = &self.cfg;
        let b = &self.blocks[li];
        let n = x.dim(0)?;
        let h = rms_norm(x, &b.attn_norm, c.rms_eps)?;
        // [n, heads·hd] → [heads, n, hd]
        let heads =
            |p: Proj, w: &Tensor, bias: Option<&Tensor>, k: usize, norm: Option<&Tensor>| {
                let y = self
                    .proj(li, p, &h, w, bias)?
                    .reshape((n, k, c.head_dim))?
                    .transpose(0, 1)?;
                match norm {
                    Some(g) => rms_norm(&y, g, c.rms_eps),
                    None => Ok(y),
                }
            };
        Ok((
            heads(Proj::Q, &b.wq, b.bq.as_ref(), c.n_heads, b.q_norm.as_ref())?,
            heads(
                Proj::K,
                &b.wk,
                b.bk.as_ref(),
                c.n_kv_heads,
                b.k_norm.as_ref(),
            )?,
            heads(Proj::V, &b.wv, b.bv.as_ref(), c.n_kv_heads, None)?,
        ))
    }

    /// Self-attention of the new positions `x` `[n, d]` over the cached ones and themselves.
    fn attention(
        &self,
        li: usize,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
        cache: Option<(&mut Option<KvBuf>, usize)>,
    ) -> candle_core::Result<Tensor> {
        let c = &self.cfg;
        let b = &self.blocks[li];
        let t = x.dim(0)?;
        let (q, k, mut v) = self.qkv(li, x)?;
        let q = rope(&q, cos, sin, c.rope)?;
        let mut k = rope(&k, cos, sin, c.rope)?;
        if let Some((slot, past)) = cache {
            let buf = KvBuf::reserve(slot, &k, past + t)?;
            buf.k.slice_set(&k.contiguous()?, 1, past)?;
            buf.v.slice_set(&v.contiguous()?, 1, past)?;
            k = buf.k.narrow(1, 0, past + t)?;
            v = buf.v.narrow(1, 0, past + t)?;
        }
        // Query head h reads key/value head h / group.
        let (k, v) = (repeat_kv(&k, c.group())?, repeat_kv(&v, c.group())?);
        let scale = 1.0 / (c.head_dim as f64).sqrt();
        let scores = (q.matmul(&k.transpose(1, 2)?.contiguous()?)? * scale)?.broadcast_add(mask)?;
        let p = candle_nn::ops::softmax(&scores, D::Minus1)?;
        let o = p
            .matmul(&v.contiguous()?)?
            .transpose(0, 1)?
            .reshape((t, c.n_heads * c.head_dim))?;
        self.proj(li, Proj::O, &o, &b.wo, None)
    }
}

/// The keys and values (after RoPE) of one sequence: per layer, buffers `[kv heads,
/// capacity, hd]` of which the first `len` positions hold the sequence. Appending writes in
/// place (capacity doubles when full), so a decode step does not copy the history.
/// Not `Clone`: two caches must never share a buffer.
pub struct SeqCache {
    layers: Vec<Option<KvBuf>>,
    len: usize,
}

/// One layer's key and value buffers.
struct KvBuf {
    k: Tensor,
    v: Tensor,
}

impl KvBuf {
    /// The layer's buffers with room for `need` positions (allocated or grown, keeping
    /// what they hold); `like`: new keys `[kv heads, n, hd]`.
    fn reserve<'a>(
        slot: &'a mut Option<KvBuf>,
        like: &Tensor,
        need: usize,
    ) -> candle_core::Result<&'a mut KvBuf> {
        let cap = slot.as_ref().map_or(0, |b| b.k.dim(1).unwrap_or(0));
        if need > cap {
            let (heads, _, hd) = like.dims3()?;
            let new_cap = need.max(2 * cap).max(64).next_multiple_of(64);
            let k = Tensor::zeros((heads, new_cap, hd), like.dtype(), like.device())?;
            let v = k.zeros_like()?;
            if let Some(old) = slot.as_ref() {
                k.slice_set(&old.k, 1, 0)?;
                v.slice_set(&old.v, 1, 0)?;
            }
            *slot = Some(KvBuf { k, v });
        }
        Ok(slot.as_mut().expect("reserved"))
    }
}

impl SeqCache {
    /// Positions cached.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keeps the first `len` positions (a shared prefix; the rest is recomputed).
    pub fn truncate(&mut self, len: usize) -> candle_core::Result<()> {
        self.len = self.len.min(len);
        Ok(())
    }
}

/// RMS norm over the last dimension, scaled by `g` (plain ops: differentiable).
pub fn rms_norm(x: &Tensor, g: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(g)
}

/// cos and sin of the angles of positions `past..past + t`, `[t, hd/2]`:
/// angle(p, i) = p·θ^(−2i/hd).
fn rope_tables(
    c: &LlmConfig,
    past: usize,
    t: usize,
    dev: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let positions: Vec<u32> = (past as u32..(past + t) as u32).collect();
    rope_at(c, &positions, dev)
}

/// RMS norm by candle's fused kernel (no backward: inference only).
fn fused_rms_norm(x: &Tensor, g: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    candle_nn::ops::rms_norm(&x.contiguous()?, g, eps as f32)
}

/// RoPE by candle's fused kernels (no backward: inference only) on `x` `[heads, T, hd]`.
fn fused_rope(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    layout: RopeLayout,
) -> candle_core::Result<Tensor> {
    let x = x.unsqueeze(0)?;
    let y = match layout {
        RopeLayout::Interleaved => candle_nn::rotary_emb::rope_i(&x, cos, sin)?,
        RopeLayout::Neox => candle_nn::rotary_emb::rope(&x, cos, sin)?,
    };
    y.squeeze(0)
}

/// cos and sin of the angles of arbitrary `positions`, `[len, hd/2]`.
fn rope_at(
    c: &LlmConfig,
    positions: &[u32],
    dev: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let half = c.head_dim / 2;
    let inv: Vec<f32> = (0..half)
        .map(|i| (c.rope_theta.powf(-2.0 * i as f64 / c.head_dim as f64)) as f32)
        .collect();
    let inv = Tensor::from_vec(inv, (1, half), dev)?;
    let pos = Tensor::from_slice(positions, positions.len(), dev)?
        .to_dtype(DType::F32)?
        .reshape((positions.len(), 1))?;
    let ang = pos.broadcast_mul(&inv)?;
    Ok((ang.cos()?, ang.sin()?))
}

/// Rotates `x` `[heads, T, hd]` by the position angles, pairing dimensions by `layout`.
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, layout: RopeLayout) -> candle_core::Result<Tensor> {
    let (n, t, hd) = x.dims3()?;
    let half = hd / 2;
    let (a, b) = match layout {
        RopeLayout::Interleaved => {
            let p = x.reshape((n, t, half, 2))?;
            (
                p.narrow(3, 0, 1)?.squeeze(3)?,
                p.narrow(3, 1, 1)?.squeeze(3)?,
            )
        }
        RopeLayout::Neox => (x.narrow(2, 0, half)?, x.narrow(2, half, half)?),
    };
    let ra = (a.broadcast_mul(cos)? - b.broadcast_mul(sin)?)?;
    let rb = (a.broadcast_mul(sin)? + b.broadcast_mul(cos)?)?;
    match layout {
        RopeLayout::Interleaved => Tensor::stack(&[ra, rb], 3)?.reshape((n, t, hd)),
        RopeLayout::Neox => Tensor::cat(&[ra, rb], 2),
    }
}

/// `[kv, T, hd]` → `[kv·group, T, hd]`, each key/value head repeated for its query heads.
fn repeat_kv(x: &Tensor, group: usize) -> candle_core::Result<Tensor> {
    if group == 1 {
        return Ok(x.clone());
    }
    let (kv, t, hd) = x.dims3()?;
    x.unsqueeze(1)?
        .expand((kv, group, t, hd))?
        .reshape((kv * group, t, hd))
}

/// For `t` new positions after `past` cached ones, `[t, past + t]`: 0 where new position i
/// may attend (every cached position, new ones up to itself), −∞ elsewhere.
fn causal_mask(past: usize, t: usize, dev: &Device) -> candle_core::Result<Tensor> {
    let all = past + t;
    let m: Vec<f32> = (0..t)
        .flat_map(|i| {
            (0..all).map(move |j| {
                if j <= past + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Tensor::from_vec(m, (t, all), dev)
}
