//! One decode step for a batch of sequences over their key/value caches.

use candle_core::{DType, Tensor};

use super::{KvBuf, LlmWeights, Proj, SeqCache, fused_rms_norm, fused_rope, rope_at};

impl LlmWeights {
    /// One decode step for many sequences of any lengths: feeds `tokens[i]` after the
    /// positions `caches[i]` holds; logits `[B, vocab]`. Projections, MLP and head run over
    /// the batch ([`decode_linear`]); attention runs per sequence over its own cache. Same
    /// maths as [`Self::extend`] of one token.
    pub fn decode_batch(
        &self,
        tokens: &[u32],
        caches: &mut [&mut SeqCache],
    ) -> candle_core::Result<Tensor> {
        let c = &self.cfg;
        let dev = self.embed.device();
        let b = tokens.len();
        if b != caches.len() {
            candle_core::bail!("{b} tokens for {} caches", caches.len());
        }
        let ids = Tensor::from_slice(tokens, b, dev)?;
        let mut x = self.embed.index_select(&ids, 0)?;
        let positions: Vec<u32> = caches.iter().map(|s| s.len as u32).collect();
        let (cos, sin) = rope_at(c, &positions, dev)?;
        // Every sequence attends over the first `longest` buffered positions: its own
        // `len + 1`, the rest masked.
        let longest = caches.iter().map(|s| s.len + 1).max().unwrap_or(1);
        let mask: Vec<f32> = caches
            .iter()
            .flat_map(|s| {
                (0..longest).map(move |j| if j <= s.len { 0.0 } else { f32::NEG_INFINITY })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (b, 1, 1, longest), dev)?;
        // The matrices in f32, or their quantised copies when the engine generates with them.
        let lin =
            |li: Option<usize>, p: Proj, x: &Tensor, w: &Tensor, bias: Option<&Tensor>| match &self
                .quant
            {
                Some(q) => {
                    let y = q.forward(li, p, x)?;
                    match bias {
                        Some(b) => y.broadcast_add(b),
                        None => Ok(y),
                    }
                }
                None => decode_linear(x, w, bias),
            };
        for (li, blk) in self.blocks.iter().enumerate() {
            let h = fused_rms_norm(&x, &blk.attn_norm, c.rms_eps)?;
            // [B, heads·hd] → [heads, B, hd]: the batch stands where a sequence's positions
            // would, so RoPE rotates each row by its own position.
            let heads =
                |p: Proj, w: &Tensor, bias: Option<&Tensor>, n: usize, norm: Option<&Tensor>| {
                    let y = lin(Some(li), p, &h, w, bias)?
                        .reshape((b, n, c.head_dim))?
                        .transpose(0, 1)?;
                    let y = match norm {
                        Some(g) => fused_rms_norm(&y, g, c.rms_eps)?,
                        None => y,
                    };
                    fused_rope(&y.contiguous()?, &cos, &sin, c.rope)
                };
            let q = heads(
                Proj::Q,
                &blk.wq,
                blk.bq.as_ref(),
                c.n_heads,
                blk.q_norm.as_ref(),
            )?;
            let k = heads(
                Proj::K,
                &blk.wk,
                blk.bk.as_ref(),
                c.n_kv_heads,
                blk.k_norm.as_ref(),
            )?;
            let v = lin(Some(li), Proj::V, &h, &blk.wv, blk.bv.as_ref())?
                .reshape((b, c.n_kv_heads, c.head_dim))?
                .transpose(0, 1)?;
            let scale = 1.0 / (c.head_dim as f64).sqrt();
            // Each sequence's new key/value goes into its buffer; the batch then attends
            // over the buffers' first `longest` positions at once (positions a sequence
            // does not have are masked out).
            let mut ks = Vec::with_capacity(b);
            let mut vs = Vec::with_capacity(b);
            for (i, cache) in caches.iter_mut().enumerate() {
                let past = cache.len;
                let ki = k.narrow(1, i, 1)?;
                let buf = KvBuf::reserve(&mut cache.layers[li], &ki, longest)?;
                buf.k.slice_set(&ki.contiguous()?, 1, past)?;
                buf.v
                    .slice_set(&v.narrow(1, i, 1)?.contiguous()?, 1, past)?;
                ks.push(buf.k.narrow(1, 0, longest)?);
                vs.push(buf.v.narrow(1, 0, longest)?);
            }
            let (kv, g, hd) = (c.n_kv_heads, c.group(), c.head_dim);
            let keys = Tensor::stack(&ks, 0)?; // [B, kv, L, hd]
            let values = Tensor::stack(&vs, 0)?;
            // Query head h = kv head h / g: [H, B, hd] → [B, kv, g, hd].
            let q = q.transpose(0, 1)?.reshape((b, kv, g, hd))?;
            let scores = (q.matmul(&keys.transpose(2, 3)?)? * scale)?.broadcast_add(&mask)?;
            let p = candle_nn::ops::softmax_last_dim(&scores)?;
            let o = p.matmul(&values)?.reshape((b, c.n_heads * hd))?;
            x = (&x + lin(Some(li), Proj::O, &o, &blk.wo, None)?)?;
            let h = fused_rms_norm(&x, &blk.ffn_norm, c.rms_eps)?;
            let gate = lin(Some(li), Proj::Gate, &h, &blk.w_gate, None)?.silu()?;
            let up = lin(Some(li), Proj::Up, &h, &blk.w_up, None)?;
            x = (&x + lin(Some(li), Proj::Down, &(gate * up)?, &blk.w_down, None)?)?;
        }
        for cache in caches.iter_mut() {
            cache.len += 1;
        }
        let x = fused_rms_norm(&x, &self.out_norm, self.cfg.rms_eps)?;
        // The head (`Proj` is not read for it).
        lin(
            None,
            Proj::Q,
            &x,
            self.lm_head.as_ref().unwrap_or(&self.embed),
            None,
        )
    }
}

/// `x·wᵀ (+ bias)` for a decode batch `x` of `[m, k]` (one row per sequence), `w` `[n, k]`.
///
/// Up to 32 rows on the CPU go through `qmat`'s f32 product on candle's thread pool: each
/// weight row is read once per 8 rows, in place (candle's matmul repacks the whole weight
/// for `x·wᵀ` from two rows on, and runs it on rayon's threads beside candle's own, which on
/// two cores switch more than they compute): 1.4–1.5× the tokens/s at batch 8, level at 32
/// (measured against `(w·xᵀ)ᵀ`, the earlier path). More rows (prefill's hundreds) keep
/// `x·wᵀ`.
fn decode_linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let (m, k) = x.dims2()?;
    let n = w.dim(0)?;
    let y = if m <= 32 && w.device().is_cpu() && w.dtype() == DType::F32 && w.is_contiguous() {
        let xs = x.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let (storage, layout) = w.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            candle_core::bail!("a CPU tensor without CPU storage");
        };
        let start = layout.start_offset();
        let ws = &cpu.as_slice::<f32>()?[start..start + n * k];
        let pool = |items: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)| {
            candle_core::utils::barrier_pool().execute_chunked(items, f)
        };
        let y = qmat::matmul_f32_on(ws, n, k, &xs, &pool);
        drop(storage);
        Tensor::from_vec(y, (m, n), x.device())?
    } else {
        x.matmul(&w.t()?)?
    };
    match bias {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}
