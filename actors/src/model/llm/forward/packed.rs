//! The trainer's forward over several sequences packed into one: projections and MLPs run
//! once over all their positions (no padding computed, one large product per weight instead
//! of one small one per row), attention runs per sequence, and the output head only over the
//! positions whose log-probabilities the loss reads. Differentiable; the same maths as
//! [`LlmWeights::forward`] row by row.

use std::collections::HashMap;

use candle_core::{D, Tensor};

use super::{LlmWeights, Proj, causal_mask, repeat_kv, rope, rope_at};

impl LlmWeights {
    /// Logits `[Σ len, vocab]` of `rows` (each a sequence of its own, positions from 0) at
    /// the positions `heads` names: `heads[r] = (start, len)` within row `r`, concatenated in
    /// row order.
    pub fn forward_rows(
        &self,
        rows: &[&[u32]],
        heads: &[(usize, usize)],
    ) -> candle_core::Result<Tensor> {
        let dev = self.embed.device();
        if rows.len() != heads.len() {
            candle_core::bail!("{} rows for {} head spans", rows.len(), heads.len());
        }
        for (r, (&(s, l), row)) in heads.iter().zip(rows).enumerate() {
            if l == 0 || s + l > row.len() {
                candle_core::bail!(
                    "row {r}: head span {s}+{l} outside its {} tokens",
                    row.len()
                );
            }
        }
        // Row r occupies positions offsets[r]..offsets[r] + rows[r].len() of the pack.
        let mut offsets = Vec::with_capacity(rows.len());
        let mut n = 0;
        for r in rows {
            offsets.push(n);
            n += r.len();
        }
        let ids = Tensor::from_vec(rows.concat(), n, dev)?;
        let positions: Vec<u32> = rows.iter().flat_map(|r| 0..r.len() as u32).collect();
        let (cos, sin) = rope_at(&self.cfg, &positions, dev)?;
        let mut masks: HashMap<usize, Tensor> = HashMap::new();
        for r in rows {
            if let std::collections::hash_map::Entry::Vacant(e) = masks.entry(r.len()) {
                e.insert(causal_mask(0, r.len(), dev)?);
            }
        }
        let spans: Vec<(usize, usize)> = offsets
            .iter()
            .zip(rows)
            .map(|(&o, r)| (o, r.len()))
            .collect();
        let mut x = self.embed.index_select(&ids, 0)?;
        for i in 0..self.blocks.len() {
            x = (&x + self.packed_attention(i, &x, &cos, &sin, &spans, &masks)?)?;
            x = (&x + self.mlp(i, &x)?)?;
        }
        let picked = spans
            .iter()
            .zip(heads)
            .map(|(&(o, _), &(s, l))| x.narrow(0, o + s, l))
            .collect::<candle_core::Result<Vec<_>>>()?;
        self.head(&Tensor::cat(&picked, 0)?)
    }

    /// Causal self-attention of block `li` over packed hidden states `x` `[N, d]`, each
    /// sequence (`spans`: offset, length) attending only to itself.
    fn packed_attention(
        &self,
        li: usize,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        spans: &[(usize, usize)],
        masks: &HashMap<usize, Tensor>,
    ) -> candle_core::Result<Tensor> {
        let c = &self.cfg;
        let b = &self.blocks[li];
        let n = x.dim(0)?;
        // [heads, N, hd], rotated by each position's own angle.
        let (q, k, v) = self.qkv(li, x)?;
        let q = rope(&q, cos, sin, c.rope)?;
        let k = rope(&k, cos, sin, c.rope)?;
        let scale = 1.0 / (c.head_dim as f64).sqrt();
        let mut outs = Vec::with_capacity(spans.len());
        for &(o, len) in spans {
            let qi = q.narrow(1, o, len)?.contiguous()?;
            let ki = repeat_kv(&k.narrow(1, o, len)?.contiguous()?, c.group())?;
            let vi = repeat_kv(&v.narrow(1, o, len)?.contiguous()?, c.group())?;
            let mask = &masks[&len];
            let scores =
                (qi.matmul(&ki.transpose(1, 2)?.contiguous()?)? * scale)?.broadcast_add(mask)?;
            let p = candle_nn::ops::softmax(&scores, D::Minus1)?;
            outs.push(p.matmul(&vi.contiguous()?)?);
        }
        let o = Tensor::cat(&outs, 1)?
            .transpose(0, 1)?
            .reshape((n, c.n_heads * c.head_dim))?;
        self.proj(li, Proj::O, &o, &b.wo, None)
    }
}
