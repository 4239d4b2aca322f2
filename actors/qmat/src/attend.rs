//! Decode attention read straight from each sequence's key/value buffers: one new query per
//! sequence against its cached positions, softmax, and the weighted sum of its values. The
//! alternative, a batched matmul, first stacks every sequence's whole cache into one tensor
//! (and masks the positions a shorter sequence lacks), a copy of the whole cache per layer
//! per step; here each key and value row is read once, where it lies.

use super::{Isa, PARALLEL_MACS, Pool, dot_f32, isa};

/// One sequence's cached keys and values, each `[kv heads, cap, hd]` row-major; positions
/// `0..len` are attended (the new one included).
#[derive(Clone, Copy, Debug)]
pub struct Kv<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub cap: usize,
    pub len: usize,
}

/// Attention of one new query per sequence: `q` `[seqs, heads, hd]` gives `[seqs, heads·hd]`,
/// query head `h` attending over kv head `h / (heads / kv_heads)` (grouped-query attention):
/// `softmax(scale · q·Kᵀ) · V`, in f32 with the maximum subtracted before `exp`. Work is
/// split by (sequence, kv head) between the threads of `pool`, unless it is small.
pub fn decode_attention_on(
    q: &[f32],
    seqs: &[Kv<'_>],
    heads: usize,
    kv_heads: usize,
    hd: usize,
    scale: f32,
    pool: &Pool<'_>,
) -> Vec<f32> {
    attention(isa(), q, seqs, (heads, kv_heads, hd), scale, pool)
}

/// [`decode_attention_on`] on instruction set `isa`.
fn attention(
    isa: Isa,
    q: &[f32],
    seqs: &[Kv<'_>],
    (heads, kv_heads, hd): (usize, usize, usize),
    scale: f32,
    pool: &Pool<'_>,
) -> Vec<f32> {
    let b = seqs.len();
    assert!(
        kv_heads > 0 && heads.is_multiple_of(kv_heads) && q.len() == b * heads * hd,
        "{heads} query heads over {kv_heads} kv heads, {b} queries of {hd}"
    );
    for s in seqs {
        assert!(
            s.len >= 1
                && s.len <= s.cap
                && s.k.len() >= kv_heads * s.cap * hd
                && s.v.len() >= kv_heads * s.cap * hd,
            "a buffer of {} positions attended over {}",
            s.cap,
            s.len
        );
    }
    let g = heads / kv_heads;
    let width = g * hd;
    // Item `it` = (sequence i, kv head h) writes query heads h·g .. (h+1)·g of sequence i:
    // `y[it·width ..][..width]`, since (i·kv_heads + h)·g·hd = (i·heads + h·g)·hd.
    let item = |it: usize, out: &mut [f32]| {
        let (i, h) = (it / kv_heads, it % kv_heads);
        let s = &seqs[i];
        let rows = h * s.cap * hd..(h * s.cap + s.len) * hd;
        let (keys, vals) = (&s.k[rows.clone()], &s.v[rows]);
        let mut p = vec![0.0f32; s.len];
        for qh in 0..g {
            let qv = &q[(i * heads + h * g + qh) * hd..][..hd];
            for (ps, ks) in p.chunks_mut(8).zip(keys.chunks(8 * hd)) {
                dot_f32(isa, qv, ks, ps);
            }
            let mut max = f32::NEG_INFINITY;
            for x in &mut p {
                *x *= scale;
                max = max.max(*x);
            }
            let mut sum = 0.0f32;
            for x in &mut p {
                *x = (*x - max).exp();
                sum += *x;
            }
            let inv = 1.0 / sum;
            for x in &mut p {
                *x *= inv;
            }
            weighted_sum(isa, &p, vals, &mut out[qh * hd..(qh + 1) * hd]);
        }
    };
    let items = b * kv_heads;
    let mut y = vec![0.0f32; b * heads * hd];
    let macs: usize = seqs.iter().map(|s| 2 * s.len * heads * hd).sum();
    if macs < PARALLEL_MACS {
        for (it, out) in y.chunks_mut(width.max(1)).enumerate().take(items) {
            item(it, out);
        }
        return y;
    }
    let done: Vec<std::sync::OnceLock<Vec<f32>>> =
        (0..items).map(|_| std::sync::OnceLock::new()).collect();
    pool(items, &|range| {
        for it in range {
            let mut out = vec![0.0f32; width];
            item(it, &mut out);
            let _ = done[it].set(out);
        }
    });
    for (it, part) in done.into_iter().enumerate() {
        let part = part.into_inner().expect("the pool ran every item");
        y[it * width..(it + 1) * width].copy_from_slice(&part);
    }
    y
}

/// `out = Σ_j p[j] · vals[j]` over the rows of `vals` (`out.len()` values each).
fn weighted_sum(isa: Isa, p: &[f32], vals: &[f32], out: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)]
        // SAFETY: `isa()` returns Avx2 or Vnni only where the CPU has AVX2 and FMA, the
        // features `weighted_sum_avx2` is compiled for; its loads stay inside `vals` and
        // `out` (asserted there).
        Isa::Avx2 | Isa::Vnni => unsafe { super::x86::weighted_sum_avx2(p, vals, out) },
        _ => {
            let hd = out.len();
            out.fill(0.0);
            for (w, row) in p.iter().zip(vals.chunks_exact(hd.max(1))) {
                for (o, v) in out.iter_mut().zip(row) {
                    *o += w * v;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, rng: &mut rand::rngs::SmallRng) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// Attention in f64 of one query head `q` over kv head `kv` of `s`.
    fn reference(q: &[f32], s: &Kv<'_>, kv: usize, hd: usize, scale: f64) -> Vec<f64> {
        let kq = &q[..hd];
        let at = |j: usize, d: usize| (kv * s.cap + j) * hd + d;
        let scores: Vec<f64> = (0..s.len)
            .map(|j| {
                scale
                    * (0..hd)
                        .map(|d| f64::from(kq[d]) * f64::from(s.k[at(j, d)]))
                        .sum::<f64>()
            })
            .collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        (0..hd)
            .map(|d| {
                (0..s.len)
                    .map(|j| e[j] / sum * f64::from(s.v[at(j, d)]))
                    .sum()
            })
            .collect()
    }

    /// Grouped-query decode attention equals the f64 reference to f32 rounding, for
    /// sequences of different lengths (some not a multiple of 8), a head size that is not a
    /// multiple of 32, on the calling thread and split on a pool, on every instruction set
    /// this CPU has.
    #[test]
    fn decode_attention_equals_the_exact_one() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        let pool = |items: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)| {
            std::thread::scope(|s| {
                let half = items / 2;
                s.spawn(move || f(0..half));
                f(half..items);
            });
        };
        for (heads, kv, hd, lens) in [
            (9, 3, 64, vec![1usize, 7, 64, 300]),
            (4, 4, 40, vec![13, 2]),
            (6, 2, 72, vec![2000, 1999, 5]),
        ] {
            let cap = lens.iter().max().unwrap() + 3;
            let bufs: Vec<(Vec<f32>, Vec<f32>)> = lens
                .iter()
                .map(|_| {
                    (
                        random(kv * cap * hd, &mut rng),
                        random(kv * cap * hd, &mut rng),
                    )
                })
                .collect();
            let seqs: Vec<Kv<'_>> = bufs
                .iter()
                .zip(&lens)
                .map(|((k, v), &len)| Kv { k, v, cap, len })
                .collect();
            let q = random(lens.len() * heads * hd, &mut rng);
            let scale = 1.0 / (hd as f32).sqrt();
            for isa in [Isa::Scalar, isa()] {
                let y = attention(isa, &q, &seqs, (heads, kv, hd), scale, &pool);
                for (i, s) in seqs.iter().enumerate() {
                    for h in 0..heads {
                        let qh = &q[(i * heads + h) * hd..][..hd];
                        let want = reference(qh, s, h / (heads / kv), hd, f64::from(scale));
                        let got = &y[(i * heads + h) * hd..][..hd];
                        for (g, w) in got.iter().zip(&want) {
                            assert!(
                                (f64::from(*g) - w).abs() < 1e-5,
                                "{isa:?}: seq {i} head {h} (len {}): {g} against {w}",
                                s.len
                            );
                        }
                    }
                }
            }
        }
    }
}
