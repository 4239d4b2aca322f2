//! Projections for training: LoRA adapters applied beside a frozen weight
//! (`y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ`, the base never merged), and a product with a frozen weight
//! whose backward computes only the input's gradient.
//!
//! candle's matmul backward computes the gradient of both operands whether or not either
//! is trained, so a LoRA step built on merged weights paid for a full weight gradient of
//! every projection (a third of the step's FLOPs) and kept it in memory. [`FrozenLinear`]
//! has the same forward (candle's own matmul, bit for bit) and a backward of one product.

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};

/// The projections of a block, in the order of `LORA_TARGETS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proj {
    Q = 0,
    K = 1,
    V = 2,
    O = 3,
    Gate = 4,
    Up = 5,
    Down = 6,
}

/// Low-rank adapters of a model, applied beside its frozen weights.
#[derive(Clone)]
pub struct LoraSet {
    /// α / rank.
    pub scale: f64,
    /// Per block, per [`Proj`]: `(A [r, in], B [out, r])`.
    pub blocks: Vec<[Option<(Tensor, Tensor)>; 7]>,
}

impl LoraSet {
    fn get(&self, block: usize, p: Proj) -> Option<&(Tensor, Tensor)> {
        self.blocks.get(block)?[p as usize].as_ref()
    }

    /// `y + s·(x·Aᵀ)·Bᵀ` when block `block` adapts `p`, else `y`.
    pub fn apply(
        &self,
        block: usize,
        p: Proj,
        x: &Tensor,
        y: Tensor,
    ) -> candle_core::Result<Tensor> {
        match self.get(block, p) {
            Some((a, b)) => y + (x.matmul(&a.t()?)?.matmul(&b.t()?)? * self.scale)?,
            None => Ok(y),
        }
    }
}

/// `x·wᵀ (+ bias)` for `x` of rank 2 or 3. When `x` is part of a graph and `w` is not (a
/// frozen weight), the backward computes only `x`'s gradient ([`FrozenLinear`]).
pub fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let frozen = x.track_op()
        && !w.track_op()
        && x.rank() == 2
        && x.dtype() == DType::F32
        && w.dtype() == DType::F32
        && x.device().is_cpu();
    let y = if frozen {
        x.contiguous()?.apply_op1(FrozenLinear { w: w.clone() })?
    } else {
        use candle_core::Module;
        candle_nn::Linear::new(w.clone(), None).forward(x)?
    };
    match bias {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// `x·wᵀ` for `x` `[m, k]` and a frozen `w` `[n, k]`; backward `dx = dy·w`, nothing for `w`.
struct FrozenLinear {
    w: Tensor,
}

impl CustomOp1 for FrozenLinear {
    fn name(&self) -> &'static str {
        "frozen-linear"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (start, end) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("frozen-linear: input not contiguous".into()))?;
        let x = Tensor::from_slice(&s.as_slice::<f32>()?[start..end], l.shape(), &Device::Cpu)?;
        // The same call as `candle_nn::Linear` makes for a rank-2 input.
        let y = x.matmul(&self.w.t()?)?;
        let shape = y.shape().clone();
        Ok((CpuStorage::F32(y.flatten_all()?.to_vec1::<f32>()?), shape))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(dy.matmul(&self.w)?))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use super::*;
    use crate::model::llm::tests::max_gap;

    fn seeded(shape: (usize, usize), seed: u64) -> Tensor {
        let n = shape.0 * shape.1;
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// The frozen product gives candle's result bit for bit, the same input gradient as a
    /// plain matmul, and no gradient for the weight.
    #[test]
    fn frozen_linear_matches_matmul_and_skips_the_weight_gradient() {
        let w = seeded((7, 5), 1);
        let x = Var::from_tensor(&seeded((3, 5), 2)).unwrap();
        let dy = seeded((3, 7), 3);
        let ours = linear(x.as_tensor(), &w, None).unwrap();
        let plain = x.as_tensor().matmul(&w.t().unwrap()).unwrap();
        let gap = max_gap(&ours, &plain);
        assert_eq!(gap, 0.0);
        let g1 = (ours * &dy).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (plain * &dy)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let (a, b) = (
            g1.get(x.as_tensor()).unwrap(),
            g2.get(x.as_tensor()).unwrap(),
        );
        let gap = max_gap(a, b);
        assert!(gap < 1e-6, "input gradients differ by {gap}");
        assert!(g1.get(&w).is_none(), "no gradient for the frozen weight");
    }

    /// An adapter with B = 0 leaves the output unchanged; its gradients reach A and B.
    #[test]
    fn adapters_apply_beside_the_frozen_weight() {
        let w = seeded((6, 4), 4);
        let a = Var::from_tensor(&seeded((2, 4), 5)).unwrap();
        let b = Var::from_tensor(&seeded((6, 2), 6)).unwrap();
        let mut blocks = vec![[None, None, None, None, None, None, None]];
        blocks[0][Proj::V as usize] = Some((a.as_tensor().clone(), b.as_tensor().clone()));
        let set = LoraSet { scale: 2.0, blocks };
        let x = seeded((3, 4), 7);
        let base = linear(&x, &w, None).unwrap();
        let y = set.apply(0, Proj::V, &x, base.clone()).unwrap();
        // By hand: x·Wᵀ + 2·(x·Aᵀ)·Bᵀ.
        let want = (x.matmul(&w.t().unwrap()).unwrap()
            + (x.matmul(&a.as_tensor().t().unwrap())
                .unwrap()
                .matmul(&b.as_tensor().t().unwrap())
                .unwrap()
                * 2.0)
                .unwrap())
        .unwrap();
        let gap = max_gap(&y, &want);
        assert!(gap < 1e-5, "{gap}");
        assert_eq!(
            set.apply(0, Proj::Q, &x, base.clone())
                .unwrap()
                .to_vec2::<f32>()
                .unwrap(),
            base.to_vec2::<f32>().unwrap()
        );
        let g = y.sum_all().unwrap().backward().unwrap();
        assert!(g.get(a.as_tensor()).is_some() && g.get(b.as_tensor()).is_some());
        assert!(g.get(&w).is_none());
    }
}
