//! The optional quantised generation path: the projections and the output head as
//! block-quantised matrices (the `qmat` crate: q8_0 or q4_1, blocks of 32 along a row),
//! multiplied by integer dot products. Norms, RoPE, attention and the key/value cache stay
//! f32. Only the engine uses it: the trainer's forward, its recomputed log-probabilities and
//! every gradient stay f32, and every token records the precision that sampled it
//! ([`crate::types::Precision`]).

use std::sync::Arc;

use candle_core::Tensor;

use super::{LlmWeights, Proj};
use crate::types::Precision;
use qmat::{BLOCK, QFormat, QMatrix};

/// Rows of a quantised matrix are cut in blocks of this many values.
pub const QUANT_BLOCK: usize = BLOCK;

/// The quantised copies of a model's matrices.
pub struct QuantSet {
    pub precision: Precision,
    /// Per block, per [`Proj`].
    blocks: Vec<[QMatrix; 7]>,
    head: QMatrix,
}

impl QuantSet {
    /// Quantises every projection and the head of `w` (merged weights: no adapters), the
    /// matrices in parallel.
    fn build(w: &LlmWeights, precision: Precision) -> candle_core::Result<Self> {
        let fmt = match precision {
            Precision::F32 => candle_core::bail!("f32 is not a quantised precision"),
            Precision::Q8_0 => QFormat::Q8_0,
            Precision::Q4_1 => QFormat::Q4_1,
        };
        let q = |t: &Tensor| -> candle_core::Result<QMatrix> {
            let (n, k) = t.dims2()?;
            if k % QUANT_BLOCK != 0 {
                candle_core::bail!(
                    "{precision} needs rows that are a multiple of {QUANT_BLOCK} values; a matrix of this model has rows of {k}"
                );
            }
            let v = t.flatten_all()?.to_vec1::<f32>()?;
            Ok(QMatrix::quantize(&v, n, k, fmt))
        };
        // The blocks' matrices in parallel, on candle's pool.
        let built: Vec<std::sync::OnceLock<candle_core::Result<[QMatrix; 7]>>> = w
            .blocks
            .iter()
            .map(|_| std::sync::OnceLock::new())
            .collect();
        candle_core::utils::barrier_pool().execute_chunked(w.blocks.len(), |range| {
            for i in range {
                let b = &w.blocks[i];
                let one = || -> candle_core::Result<[QMatrix; 7]> {
                    Ok([
                        q(&b.wq)?,
                        q(&b.wk)?,
                        q(&b.wv)?,
                        q(&b.wo)?,
                        q(&b.w_gate)?,
                        q(&b.w_up)?,
                        q(&b.w_down)?,
                    ])
                };
                let _ = built[i].set(one());
            }
        });
        let blocks = built
            .into_iter()
            .map(|b| b.into_inner().expect("the pool built every block"))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self {
            precision,
            blocks,
            head: q(w.lm_head.as_ref().unwrap_or(&w.embed))?,
        })
    }

    /// `x·wᵀ` of block `block`'s projection `p`, or of the head when `block` is `None`;
    /// `x` `[m, k]`.
    pub(super) fn forward(
        &self,
        block: Option<usize>,
        p: Proj,
        x: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let w = match block {
            Some(i) => &self.blocks[i][p as usize],
            None => &self.head,
        };
        let (m, _) = x.dims2()?;
        let xs = x.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        // The threads of candle's own pool, which every other op of the step uses.
        let pool = |items: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)| {
            candle_core::utils::barrier_pool().execute_chunked(items, f)
        };
        Tensor::from_vec(w.matmul_on(&xs, &pool), (m, w.rows()), x.device())
    }
}
impl LlmWeights {
    /// The same weights, generating with their matrices quantised to `precision` (f32: the
    /// weights as they are). Adapters must be merged first: the quantised copy is of the
    /// matrices alone.
    pub fn quantized(&self, precision: Precision) -> candle_core::Result<LlmWeights> {
        let mut w = self.clone();
        w.quant = match precision {
            Precision::F32 => None,
            p => {
                if self.lora.is_some() {
                    candle_core::bail!("merge the LoRA adapters before quantising");
                }
                Some(Arc::new(QuantSet::build(self, p)?))
            }
        };
        Ok(w)
    }

    /// The precision the matrices generate with.
    pub fn precision(&self) -> Precision {
        self.quant.as_ref().map_or(Precision::F32, |q| q.precision)
    }
}
