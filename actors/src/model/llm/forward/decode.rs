//! One decode step for a batch of sequences over their key/value caches.

use candle_core::Tensor;

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
/// The CPU matmul multiplies a single row by the weight without copying it, but from two
/// rows on it repacks the whole weight on every call, which costs more than the product:
/// [2, 576]·[1536, 576]ᵀ took 6× one row's time (candle 0.11, one core). So a few rows go one
/// at a time (each a row's cost: up to 4 rows, 3 for the lm head's large `n`), and up to 32
/// rows as `(w·xᵀ)ᵀ`, which repacks only the rows: 1.3–1.7× faster than `x·wᵀ` from 4 to 32
/// rows, equal at 64, slower past that for the lm head (and for prefill's hundreds of rows),
/// which keep `x·wᵀ`. One row at a time also gives each sequence exactly what it would get
/// decoded alone.
fn decode_linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let (m, _) = x.dims2()?;
    let n = w.dim(0)?;
    let per_row = if n > 8192 { 3 } else { 4 };
    let y = if m <= 1 {
        x.matmul(&w.t()?)?
    } else if m <= per_row {
        let rows = (0..m)
            .map(|i| x.narrow(0, i, 1)?.matmul(&w.t()?))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Tensor::cat(&rows, 0)?
    } else if m <= 32 {
        w.matmul(&x.t()?)?.t()?.contiguous()?
    } else {
        x.matmul(&w.t()?)?
    };
    match bias {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}
