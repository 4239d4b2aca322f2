//! The loss's view of the output head in one pass: from logits `[M, V]` and one target per
//! row, each target's log-probability (differentiable) and the row's entropy (no gradient),
//! without materialising the log-softmax. Written out with candle ops, the same took a dozen
//! passes over `[M, V]` forward and backward (max, subtract, exp, sum, log, gather, the
//! entropy's exp, product and sum, and a zeroed gradient buffer per node): on SmolLM2's
//! 49,152-entry vocabulary each pass reads 200 KB a position.

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

/// `[M, 2]`: per row, `log p(target)` and the entropy of the row's distribution.
pub(super) fn target_logprobs_and_entropy(logits: &Tensor, targets: Vec<u32>) -> Result<Tensor> {
    let (m, _) = logits.dims2()?;
    if targets.len() != m {
        candle_core::bail!("{} targets for {m} rows of logits", targets.len());
    }
    logits.contiguous()?.apply_op1(TargetLogprobs { targets })
}

struct TargetLogprobs {
    targets: Vec<u32>,
}

/// Log-sum-exp of a row, its entropy, and the target's logit.
fn row_stats(row: &[f32]) -> (f32, f32) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let (mut sum, mut weighted) = (0f64, 0f64);
    for &x in row {
        let e = f64::from((x - max).exp());
        sum += e;
        weighted += e * f64::from(x - max);
    }
    // lse = max + ln Σ e; H = lse − Σ p·x = ln Σ e − Σ e·(x − max) / Σ e.
    let lse = max + sum.ln() as f32;
    let entropy = (sum.ln() - weighted / sum) as f32;
    (lse, entropy)
}

impl CustomOp1 for TargetLogprobs {
    fn name(&self) -> &'static str {
        "target-logprobs"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (start, end) = l.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::Msg("target-logprobs: logits not contiguous".into())
        })?;
        let (m, v) = l.shape().dims2()?;
        let x = &s.as_slice::<f32>()?[start..end];
        let mut out = Vec::with_capacity(2 * m);
        for (i, &t) in self.targets.iter().enumerate() {
            let row = &x[i * v..(i + 1) * v];
            let (lse, entropy) = row_stats(row);
            let t = t as usize;
            if t >= v {
                candle_core::bail!("target {t} outside the vocabulary of {v}");
            }
            out.push(row[t] - lse);
            out.push(entropy);
        }
        Ok((CpuStorage::F32(out), Shape::from((m, 2))))
    }

    /// `d log p(t) / d x_j = δ(j = t) − p_j`, times the incoming gradient of column 0 (the
    /// entropy column has none).
    fn bwd(&self, logits: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (m, v) = logits.dims2()?;
        let x = logits.flatten_all()?.to_vec1::<f32>()?;
        let res = res.to_vec2::<f32>()?;
        let g = grad.to_vec2::<f32>()?;
        let mut d = vec![0f32; m * v];
        for (i, &t) in self.targets.iter().enumerate() {
            let gi = g[i][0];
            if gi == 0.0 {
                continue;
            }
            let row = &x[i * v..(i + 1) * v];
            // lse from the forward: log p(t) = x_t − lse.
            let lse = row[t as usize] - res[i][0];
            for (dj, &xj) in d[i * v..(i + 1) * v].iter_mut().zip(row) {
                *dj = -gi * (xj - lse).exp();
            }
            d[i * v + t as usize] += gi;
        }
        Ok(Some(Tensor::from_vec(d, (m, v), logits.device())?))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use super::*;
    use crate::model::llm::tests::max_gap;
    use crate::model::trainer::logprobs_and_entropy;

    /// The fused op equals log-softmax + gather + entropy written with candle ops, values
    /// and gradients.
    #[test]
    fn fused_head_matches_the_composed_ops() {
        let (m, v) = (5, 37);
        let vals: Vec<f32> = (0..m * v)
            .map(|k| ((k * 7919) % 113) as f32 / 9.0 - 6.0)
            .collect();
        let x = Var::from_tensor(&Tensor::from_vec(vals, (m, v), &Device::Cpu).unwrap()).unwrap();
        let targets: Vec<u32> = vec![0, 36, 5, 17, 17];
        let w = Tensor::new(&[0.5f32, -1.0, 2.0, 0.0, 0.25], &Device::Cpu).unwrap();
        let fused = target_logprobs_and_entropy(x.as_tensor(), targets.clone()).unwrap();
        let t = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
        let (lp, ent) = logprobs_and_entropy(x.as_tensor(), &t).unwrap();
        let f: Vec<Vec<f32>> = fused.to_vec2().unwrap();
        let (lp_v, ent_v) = (lp.to_vec1::<f32>().unwrap(), ent.to_vec1::<f32>().unwrap());
        for i in 0..m {
            assert!(
                (f[i][0] - lp_v[i]).abs() < 1e-5,
                "row {i}: {} vs {}",
                f[i][0],
                lp_v[i]
            );
            assert!(
                (f[i][1] - ent_v[i]).abs() < 1e-4,
                "row {i}: {} vs {}",
                f[i][1],
                ent_v[i]
            );
        }
        let g1 = (fused.narrow(1, 0, 1).unwrap().squeeze(1).unwrap() * &w)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let g2 = (lp * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let (a, b) = (
            g1.get(x.as_tensor()).unwrap(),
            g2.get(x.as_tensor()).unwrap(),
        );
        let gap = max_gap(a, b);
        assert!(gap < 1e-5, "gradients differ by {gap}");
    }
}
