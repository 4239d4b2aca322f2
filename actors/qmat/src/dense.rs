//! The f32 products of a decode step: `x·Wᵀ` with the weights read in place
//! ([`matmul_f32_on`]), and the dot products it (and attention) build on.

use super::{Isa, Pool, ROW_TILE, by_columns, isa};

/// `x·Wᵀ` for an f32 `w` `[n, k]` (row-major, borrowed: no copy) and `x` `[rows, k]`:
/// `[rows, n]`, with fused multiply-adds over 8 lanes (AVX2 and FMA where the CPU has them,
/// plain Rust elsewhere), the columns in chunks run by `pool` as in [`QMatrix::matmul_on`].
/// For a decode batch, where a general matmul packs the whole weight for a few rows.
pub fn matmul_f32_on(w: &[f32], n: usize, k: usize, x: &[f32], pool: &Pool<'_>) -> Vec<f32> {
    assert!(
        w.len() == n * k && x.len().is_multiple_of(k.max(1)),
        "[{n}, {k}] by rows of {k}"
    );
    let rows = x.len() / k.max(1);
    let isa = isa();
    // Up to 8 rows: each weight row once against every row of x (x stays in L1; a batch
    // this small is bound by reading the weights). More: blocks of F32_COLS weight rows
    // against F32_ROWS rows of x, fewer loads per multiply-add (x no longer fits L1): at
    // batch 32 1.3× the tokens/s of the first form, at batch 8 0.9×, measured.
    if rows <= ROW_TILE {
        let run = |cols: std::ops::Range<usize>, out: &mut [f32], width: usize| {
            let first = cols.start;
            let mut vals = [0.0f32; ROW_TILE];
            for col in cols {
                dot_f32(isa, &w[col * k..(col + 1) * k], x, &mut vals[..rows]);
                for (i, v) in vals[..rows].iter().enumerate() {
                    out[i * width + col - first] = *v;
                }
            }
        };
        return by_columns(n, rows, n * k * rows, pool, &run);
    }
    let run = |cols: std::ops::Range<usize>, out: &mut [f32], width: usize| {
        let first = cols.start;
        let mut vals = [0.0f32; F32_ROWS * F32_COLS];
        for c0 in cols.clone().step_by(F32_COLS) {
            let nc = (cols.end - c0).min(F32_COLS);
            let ws = &w[c0 * k..(c0 + nc) * k];
            for r0 in (0..rows).step_by(F32_ROWS) {
                let nr = (rows - r0).min(F32_ROWS);
                dot_f32_block(isa, ws, &x[r0 * k..(r0 + nr) * k], k, &mut vals);
                for i in 0..nr {
                    let at = (r0 + i) * width + c0 - first;
                    out[at..at + nc].copy_from_slice(&vals[i * nc..(i + 1) * nc]);
                }
            }
        }
    };
    by_columns(n, rows, n * k * rows, pool, &run)
}

/// Rows of `x` and of an f32 weight in one register block of [`matmul_f32_on`].
pub(super) const F32_ROWS: usize = 4;
pub(super) const F32_COLS: usize = 3;

/// `out[i·c + j] = x_i · w_j` for the `r` ≤ [`F32_ROWS`] rows of `xs` and the `c` ≤
/// [`F32_COLS`] rows of `ws`, all `k` long.
fn dot_f32_block(isa: Isa, ws: &[f32], xs: &[f32], k: usize, out: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)]
        // SAFETY: `isa()` returns Avx2 or Vnni only where the CPU has AVX2 and FMA, the
        // features `dot_f32_block_avx2` is compiled for; its loads stay inside `ws` and `xs`
        // (asserted there).
        Isa::Avx2 | Isa::Vnni => unsafe { super::x86::dot_f32_block_avx2(ws, xs, k, out) },
        _ => {
            let c = ws.len() / k.max(1);
            for (i, x) in xs.chunks_exact(k.max(1)).enumerate() {
                for (j, w) in ws.chunks_exact(k.max(1)).enumerate() {
                    out[i * c + j] = w.iter().zip(x).map(|(a, b)| a * b).sum();
                }
            }
        }
    }
}

/// `out[i] = x_i · w` for the rows `x_i` of `xs` (`out.len()` rows of `w.len()` values).
pub(super) fn dot_f32(isa: Isa, w: &[f32], xs: &[f32], out: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)]
        // SAFETY: `isa()` returns Avx2 or Vnni only where the CPU has AVX2 and FMA, the
        // features `dot_f32_avx2` is compiled for; its loads stay inside `w` and `xs`
        // (asserted there).
        Isa::Avx2 | Isa::Vnni => unsafe { super::x86::dot_f32_avx2(w, xs, out) },
        _ => {
            for (o, x) in out.iter_mut().zip(xs.chunks_exact(w.len().max(1))) {
                *o = w.iter().zip(x).map(|(a, b)| a * b).sum();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::random;

    /// The f32 product equals the f64 one (to f32 rounding) on every instruction set, for
    /// rows of a length that is not a multiple of 8, on the calling thread and on a pool.
    #[test]
    fn the_f32_product_equals_the_exact_one() {
        let pool = |items: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)| {
            std::thread::scope(|s| {
                let half = items / 2;
                s.spawn(move || f(0..half));
                f(half..items);
            })
        };
        for (n, k) in [(40, 36), (2048, 100)] {
            let w = random(n * k, 3);
            for rows in [1, 5, 8, 11] {
                let x = random(rows * k, 4 + rows as u64);
                let y = matmul_f32_on(&w, n, k, &x, &pool);
                let scalar = {
                    let mut out = vec![0.0f32; rows];
                    (0..n)
                        .map(|c| {
                            dot_f32_block(Isa::Scalar, &w[c * k..(c + 1) * k], &x, k, &mut out);
                            out.clone()
                        })
                        .collect::<Vec<_>>()
                };
                for r in 0..rows {
                    for c in 0..n {
                        let exact: f64 = (0..k)
                            .map(|j| f64::from(x[r * k + j]) * f64::from(w[c * k + j]))
                            .sum();
                        for got in [y[r * n + c], scalar[c][r]] {
                            assert!(
                                (f64::from(got) - exact).abs() <= 1e-5 * (1.0 + exact.abs()),
                                "[{n}, {k}] rows {rows} [{r}, {c}]: {got} vs {exact}"
                            );
                        }
                    }
                }
            }
        }
    }
}
