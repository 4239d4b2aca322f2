//! The x86-64 kernels: AVX2 + FMA, and AVX-512 VNNI for the integer dot products.

use std::arch::x86_64::*;

use super::{BLOCK, F32_COLS, F32_ROWS, QFormat, ROW_TILE, Tile};

/// `out[i] = x_i · w` with 8-lane fused multiply-adds, `w` loaded once for every row.
#[target_feature(enable = "avx2,fma")]
pub(super) fn dot_f32_avx2(w: &[f32], xs: &[f32], out: &mut [f32]) {
    match out.len() {
        1 => dot_f32_rows::<1>(w, xs, out),
        2 => dot_f32_rows::<2>(w, xs, out),
        3 => dot_f32_rows::<3>(w, xs, out),
        4 => dot_f32_rows::<4>(w, xs, out),
        5 => dot_f32_rows::<5>(w, xs, out),
        6 => dot_f32_rows::<6>(w, xs, out),
        7 => dot_f32_rows::<7>(w, xs, out),
        _ => dot_f32_rows::<ROW_TILE>(w, xs, out),
    }
}

#[inline(always)]
fn dot_f32_rows<const R: usize>(w: &[f32], xs: &[f32], out: &mut [f32]) {
    let k = w.len();
    assert!(out.len() == R && xs.len() >= R * k);
    let body = k - k % 8;
    #[allow(unsafe_code)]
    // SAFETY: called only from `dot_f32_avx2` (AVX2 and FMA). The loads read 8 floats at
    // c < body ≤ k − 8 of `w` and of row i < R of `xs`, inside the lengths asserted above.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); R];
        for c in (0..body).step_by(8) {
            let wv = _mm256_loadu_ps(w.as_ptr().add(c));
            for (i, a) in acc.iter_mut().enumerate() {
                let xv = _mm256_loadu_ps(xs.as_ptr().add(i * k + c));
                *a = _mm256_fmadd_ps(xv, wv, *a);
            }
        }
        for (i, (o, a)) in out.iter_mut().zip(acc).enumerate() {
            let mut lanes = [0.0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), a);
            let tail: f32 = (body..k).map(|c| w[c] * xs[i * k + c]).sum();
            *o = lanes.iter().sum::<f32>() + tail;
        }
    }
}

/// `out[i·c + j] = x_i · w_j` for the first `r` ≤ [`F32_ROWS`] rows of `xs` and the first
/// `c` ≤ [`F32_COLS`] rows of `ws` (all `k` long): a register block of r·c 8-lane
/// accumulators, so each step of 8 values loads r + c vectors for r·c fused multiply-adds
/// (one weight row against 8 rows loads 9 for 8).
#[target_feature(enable = "avx2,fma")]
pub(super) fn dot_f32_block_avx2(ws: &[f32], xs: &[f32], k: usize, out: &mut [f32]) {
    let (r, c) = (xs.len() / k.max(1), ws.len() / k.max(1));
    match (r, c) {
        (1, 1) => block::<1, 1>(ws, xs, k, out),
        (1, 2) => block::<1, 2>(ws, xs, k, out),
        (1, _) => block::<1, 3>(ws, xs, k, out),
        (2, 1) => block::<2, 1>(ws, xs, k, out),
        (2, 2) => block::<2, 2>(ws, xs, k, out),
        (2, _) => block::<2, 3>(ws, xs, k, out),
        (3, 1) => block::<3, 1>(ws, xs, k, out),
        (3, 2) => block::<3, 2>(ws, xs, k, out),
        (3, _) => block::<3, 3>(ws, xs, k, out),
        (_, 1) => block::<4, 1>(ws, xs, k, out),
        (_, 2) => block::<4, 2>(ws, xs, k, out),
        _ => block::<4, 3>(ws, xs, k, out),
    }
}

#[inline(always)]
fn block<const R: usize, const C: usize>(ws: &[f32], xs: &[f32], k: usize, out: &mut [f32]) {
    assert!(
        R <= F32_ROWS
            && C <= F32_COLS
            && ws.len() >= C * k
            && xs.len() >= R * k
            && out.len() >= R * C
    );
    let body = k - k % 8;
    #[allow(unsafe_code)]
    // SAFETY: called only from `dot_f32_block_avx2` (AVX2 and FMA). The loads read 8 floats
    // at p < body ≤ k − 8 of row j < C of `ws` and row i < R of `xs`, inside the lengths
    // asserted above.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        for p in (0..body).step_by(8) {
            let mut wv = [_mm256_setzero_ps(); C];
            for (j, v) in wv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(ws.as_ptr().add(j * k + p));
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let xv = _mm256_loadu_ps(xs.as_ptr().add(i * k + p));
                for (a, w) in row.iter_mut().zip(&wv) {
                    *a = _mm256_fmadd_ps(xv, *w, *a);
                }
            }
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, a) in row.iter().enumerate() {
                let mut lanes = [0.0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), *a);
                let tail: f32 = (body..k).map(|p| ws[j * k + p] * xs[i * k + p]).sum();
                out[i * C + j] = lanes.iter().sum::<f32>() + tail;
            }
        }
    }
}

/// The tile with `vpmaddubsw` (pairs of u8·i8 products summed to i16) and `vpmaddwd`.
#[target_feature(enable = "avx2,fma")]
pub(super) fn tile_avx2(t: &Tile<'_>, out: &mut [f32]) {
    tile::<false>(t, out)
}

/// The tile with AVX-512 VNNI's `vpdpbusd` (four u8·i8 products summed into i32).
#[target_feature(enable = "avx2,fma,avx512vnni,avx512vl")]
pub(super) fn tile_vnni(t: &Tile<'_>, out: &mut [f32]) {
    tile::<true>(t, out)
}

/// Σ u·s over 32 byte pairs, as 8 i32 lanes (`u` unsigned, `s` signed; |u·s| stays
/// under 2¹⁴ so the i16 pairs of the AVX2 form cannot saturate).
#[inline(always)]
fn dot<const VNNI: bool>(u: __m256i, s: __m256i) -> __m256i {
    if VNNI {
        #[allow(unsafe_code)]
        // SAFETY: instantiated with VNNI = true only inside `tile_vnni`, whose target
        // features include avx512vnni and avx512vl.
        unsafe {
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
        }
    } else {
        #[allow(unsafe_code)]
        // SAFETY: every caller is compiled with AVX2.
        unsafe {
            _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
        }
    }
}

#[inline(always)]
fn tile<const VNNI: bool>(t: &Tile<'_>, out: &mut [f32]) {
    match out.len() {
        1 => tile_rows::<VNNI, 1>(t, out),
        2 => tile_rows::<VNNI, 2>(t, out),
        3 => tile_rows::<VNNI, 3>(t, out),
        4 => tile_rows::<VNNI, 4>(t, out),
        5 => tile_rows::<VNNI, 5>(t, out),
        6 => tile_rows::<VNNI, 6>(t, out),
        7 => tile_rows::<VNNI, 7>(t, out),
        _ => tile_rows::<VNNI, ROW_TILE>(t, out),
    }
}

/// `R` rows against the weight row, the loop over the row's blocks with everything in
/// registers: per block one weight load, then per row one load, the integer dot product
/// and one fused multiply-add by the two scales.
#[inline(always)]
fn tile_rows<const VNNI: bool, const R: usize>(t: &Tile<'_>, out: &mut [f32]) {
    let nb = t.d.len();
    let k = nb * BLOCK;
    let bytes = match t.fmt {
        QFormat::Q8_0 => BLOCK,
        QFormat::Q4_1 => BLOCK / 2,
    };
    assert!(out.len() == R && t.qs.len() >= nb * bytes);
    let xs: [&[i8]; R] = std::array::from_fn(|i| t.acts.row(t.r0 + i));
    let dx: [&[f32]; R] = std::array::from_fn(|i| {
        let r = t.r0 + i;
        &t.acts.d[r * nb..(r + 1) * nb]
    });
    for i in 0..R {
        assert!(xs[i].len() >= k && dx[i].len() >= nb);
    }
    let q8 = t.fmt == QFormat::Q8_0;
    #[allow(unsafe_code)]
    // SAFETY: called only from `tile_avx2` / `tile_vnni`, compiled with AVX2 and FMA
    // (and VNNI for the second). The loads read 32 bytes at block b of a row of `k`
    // bytes (16 at b of a q4_1 row of k/2), and one scale at b < nb: all inside the
    // slices, whose lengths are asserted above.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); R];
        let mask = _mm_set1_epi8(15);
        for b in 0..nb {
            let (u, w) = if q8 {
                let w = _mm256_loadu_si256(t.qs.as_ptr().add(b * BLOCK).cast());
                (_mm256_sign_epi8(w, w), w)
            } else {
                let bytes = _mm_loadu_si128(t.qs.as_ptr().add(b * BLOCK / 2).cast());
                let lo = _mm_and_si128(bytes, mask);
                let hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
                (_mm256_set_m128i(hi, lo), _mm256_setzero_si256())
            };
            let dw = *t.d.get_unchecked(b);
            for i in 0..R {
                let x = _mm256_loadu_si256(xs[i].as_ptr().add(b * BLOCK).cast());
                let s = if q8 { _mm256_sign_epi8(x, w) } else { x };
                let p = _mm256_cvtepi32_ps(dot::<VNNI>(u, s));
                let scale = _mm256_set1_ps(dw * *dx[i].get_unchecked(b));
                acc[i] = _mm256_fmadd_ps(p, scale, acc[i]);
            }
        }
        for (o, a) in out.iter_mut().zip(acc) {
            let mut lanes = [0.0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), a);
            *o = lanes.iter().sum();
        }
    }
}

/// `out = Σ_j p[j] · vals[j]` (rows of `out.len()` values): 32 lanes at a time in four
/// independent accumulators (their fused multiply-adds overlap), then 8 lanes, then a scalar
/// tail.
#[target_feature(enable = "avx2,fma")]
pub(super) fn weighted_sum_avx2(p: &[f32], vals: &[f32], out: &mut [f32]) {
    let hd = out.len();
    assert!(vals.len() >= p.len() * hd);
    let wide = hd - hd % 32;
    let body = hd - hd % 8;
    #[allow(unsafe_code)]
    // SAFETY: compiled with AVX2 and FMA. Row j's loads read 8 floats at c + 8·t < body ≤
    // hd of `vals[j·hd ..]`, j < p.len(), inside the length asserted above; the stores write
    // 8 floats at c + 8·t < body ≤ out.len().
    unsafe {
        for c in (0..wide).step_by(32) {
            let mut acc = [_mm256_setzero_ps(); 4];
            for (j, &w) in p.iter().enumerate() {
                let wv = _mm256_set1_ps(w);
                let row = vals.as_ptr().add(j * hd + c);
                for (t, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(row.add(8 * t)), *a);
                }
            }
            for (t, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.as_mut_ptr().add(c + 8 * t), *a);
            }
        }
        for c in (wide..body).step_by(8) {
            let mut acc = _mm256_setzero_ps();
            for (j, &w) in p.iter().enumerate() {
                let v = _mm256_loadu_ps(vals.as_ptr().add(j * hd + c));
                acc = _mm256_fmadd_ps(_mm256_set1_ps(w), v, acc);
            }
            _mm256_storeu_ps(out.as_mut_ptr().add(c), acc);
        }
    }
    for (c, o) in out.iter_mut().enumerate().skip(body) {
        *o = p
            .iter()
            .enumerate()
            .map(|(j, w)| w * vals[j * hd + c])
            .sum();
    }
}
