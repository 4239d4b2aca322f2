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
        // On the CPU attention reads each sequence's buffers where they lie
        // ([`attend_in_place`]).
        let in_place = self.embed.device().is_cpu() && self.embed.dtype() == DType::F32;
        self.decode_batch_with(tokens, caches, in_place)
    }

    fn decode_batch_with(
        &self,
        tokens: &[u32],
        caches: &mut [&mut SeqCache],
        in_place: bool,
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
            let o = if in_place {
                attend_in_place(c, li, &q, &k, &v, caches, scale)?
            } else {
                attend_stacked(c, li, &q, &k, &v, caches, scale)?
            };
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

/// One layer's attention elsewhere (a GPU): each sequence's new key/value goes into its
/// buffer, and the batch attends over the buffers' first `longest` positions at once (the
/// longest sequence's `len + 1`; positions a sequence does not have are masked out).
/// `[B, heads·hd]`.
fn attend_stacked(
    c: &crate::model::llm::LlmConfig,
    li: usize,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    caches: &mut [&mut SeqCache],
    scale: f64,
) -> candle_core::Result<Tensor> {
    let b = caches.len();
    let longest = caches.iter().map(|s| s.len + 1).max().unwrap_or(1);
    let mask: Vec<f32> = caches
        .iter()
        .flat_map(|s| (0..longest).map(move |j| if j <= s.len { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    let mask = Tensor::from_vec(mask, (b, 1, 1, longest), q.device())?;
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
    p.matmul(&values)?.reshape((b, c.n_heads * hd))
}

/// One layer's attention on the CPU: the new keys and values `k`, `v` (`[kv heads, B, hd]`)
/// are written into each sequence's buffers in place, and each query of `q` (`[heads, B,
/// hd]`) attends over its own sequence's positions there (`qmat::decode_attention_on`),
/// with no stacked copy of the caches and no mask. `[B, heads·hd]`.
fn attend_in_place(
    c: &crate::model::llm::LlmConfig,
    li: usize,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    caches: &mut [&mut SeqCache],
    scale: f64,
) -> candle_core::Result<Tensor> {
    let (b, heads, kv, hd) = (caches.len(), c.n_heads, c.n_kv_heads, c.head_dim);
    let rows = |t: &Tensor| -> candle_core::Result<Vec<f32>> {
        t.transpose(0, 1)?
            .contiguous()?
            .flatten_all()?
            .to_vec1::<f32>()
    };
    // [B, heads, hd], [B, kv, hd], [B, kv, hd].
    let (qs, ks, vs) = (rows(q)?, rows(k)?, rows(v)?);
    for (i, cache) in caches.iter_mut().enumerate() {
        let at = cache.len;
        let buf = KvBuf::reserve(&mut cache.layers[li], &k.narrow(1, i, 1)?, at + 1)?;
        let new = i * kv * hd..(i + 1) * kv * hd;
        buf.k.inplace_op1(&WriteRow {
            rows: &ks[new.clone()],
            at,
            hd,
        })?;
        buf.v.inplace_op1(&WriteRow {
            rows: &vs[new],
            at,
            hd,
        })?;
    }
    let mut held = Vec::with_capacity(b);
    for cache in caches.iter() {
        let Some(buf) = cache.layers[li].as_ref() else {
            candle_core::bail!("layer {li} has no key/value buffer");
        };
        held.push((
            buf.k.storage_and_layout(),
            buf.v.storage_and_layout(),
            buf.k.dim(1)?,
        ));
    }
    let mut seqs = Vec::with_capacity(b);
    for ((k, v, cap), cache) in held.iter().zip(caches.iter()) {
        seqs.push(qmat::Kv {
            k: cpu_f32(k)?,
            v: cpu_f32(v)?,
            cap: *cap,
            len: cache.len + 1,
        });
    }
    let pool = |items: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)| {
        candle_core::utils::barrier_pool().execute_chunked(items, f)
    };
    let o = qmat::decode_attention_on(&qs, &seqs, heads, kv, hd, scale as f32, &pool);
    drop(seqs);
    drop(held);
    Tensor::from_vec(o, (b, heads * hd), q.device())
}

/// The f32 values of a contiguous CPU tensor, from its first element.
fn cpu_f32<'a>(
    (storage, layout): &'a (candle_core::StorageRef<'a>, &'a candle_core::Layout),
) -> candle_core::Result<&'a [f32]> {
    let candle_core::Storage::Cpu(cpu) = &**storage else {
        candle_core::bail!("a CPU tensor without CPU storage");
    };
    if !layout.is_contiguous() {
        candle_core::bail!("a key/value buffer that is not contiguous");
    }
    Ok(&cpu.as_slice::<f32>()?[layout.start_offset()..])
}

/// Writes one position's rows (`[kv heads, hd]`) at position `at` of a `[kv heads, cap, hd]`
/// buffer, in place.
struct WriteRow<'a> {
    rows: &'a [f32],
    at: usize,
    hd: usize,
}

impl candle_core::InplaceOp1 for WriteRow<'_> {
    fn name(&self) -> &'static str {
        "kv-write-row"
    }

    fn cpu_fwd(
        &self,
        storage: &mut candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let candle_core::CpuStorage::F32(data) = storage else {
            candle_core::bail!("a key/value buffer that is not f32");
        };
        let (heads, cap, hd) = layout.shape().dims3()?;
        if !layout.is_contiguous()
            || hd != self.hd
            || self.at >= cap
            || self.rows.len() != heads * hd
        {
            candle_core::bail!("a key/value row that does not fit its buffer");
        }
        let data = &mut data[layout.start_offset()..];
        for (h, row) in self.rows.chunks_exact(hd).enumerate() {
            data[(h * cap + self.at) * hd..][..hd].copy_from_slice(row);
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::super::super::tests::open;
    use super::*;

    /// Attention in place (the CPU's) and over stacked, masked caches (elsewhere) give the
    /// same logits, step after step, for a batch of sequences of different lengths.
    #[test]
    fn in_place_attention_equals_the_stacked_one() {
        let w = LlmWeights::from_gguf(&open()).expect("weights");
        let prompts: [&[u32]; 3] = [
            &[1, 2, 3],
            &[40, 41, 42, 43, 44, 45, 46, 47, 48, 49],
            &[7; 17],
        ];
        let fresh = || -> Vec<SeqCache> {
            prompts
                .iter()
                .map(|p| {
                    let mut c = w.new_cache();
                    w.extend(&mut c, p).expect("prefill");
                    c
                })
                .collect()
        };
        let (mut a, mut b) = (fresh(), fresh());
        for step in 0..4u32 {
            let toks = [100 + step, 200 + step, 300 + step];
            let mut ra: Vec<&mut SeqCache> = a.iter_mut().collect();
            let mut rb: Vec<&mut SeqCache> = b.iter_mut().collect();
            let la: Vec<Vec<f32>> = w
                .decode_batch_with(&toks, &mut ra, true)
                .unwrap()
                .to_vec2()
                .unwrap();
            let lb: Vec<Vec<f32>> = w
                .decode_batch_with(&toks, &mut rb, false)
                .unwrap()
                .to_vec2()
                .unwrap();
            let worst = la
                .iter()
                .flatten()
                .zip(lb.iter().flatten())
                .map(|(x, y)| (x - y).abs())
                .fold(0.0f32, f32::max);
            assert!(worst < 1e-3, "step {step}: logits differ by {worst}");
        }
        assert_eq!(a.iter().map(SeqCache::len).collect::<Vec<_>>(), [7, 14, 21]);
    }
}
