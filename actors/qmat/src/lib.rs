//! Block-quantised matrices for the built-in engine's quantised generation path, and their product
//! with a few f32 rows (a decode batch, or a prefill chunk): `y = x·Wᵀ` with `W` `[n, k]`.
//!
//! Formats (ggml's, with f32 instead of f16 block constants; blocks of 32 along a row):
//! - **q8_0**: `w = d·q`, q a signed byte in −127..=127;
//! - **q4_1**: `w = d·q + m`, q in 0..=15, two to a byte (byte j of a block holds element j
//!   in its low half and element 16 + j in its high half).
//!
//! The rows of `x` are quantised to q8_0 per block as well, so a block's product is an
//! integer dot product of 32 bytes times `d_w·d_x` (plus `m_w·d_x·Σq_x` for q4_1). On x86-64
//! the dot products run on AVX2 (`vpmaddubsw`), or on AVX-512 VNNI (`vpdpbusd`) where the CPU
//! has it; elsewhere in plain Rust (also the tests' reference). Every weight block is loaded
//! once per tile of rows and stays in L1 for the next tile, so a decode batch reads the
//! matrix from memory once. Columns are split between the threads of a pool the caller
//! gives ([`QMatrix::matmul_on`]).
//!
//! Beside them, the f32 kernels of the same decode step: the product with f32 weights read
//! in place ([`matmul_f32_on`]) and attention over each sequence's key/value buffers
//! ([`decode_attention_on`]).

/// Values in a block.
pub const BLOCK: usize = 32;
/// Rows of `x` multiplied per pass over a column (one accumulator each).
const ROW_TILE: usize = 8;
/// Products of fewer multiply-adds run on the calling thread.
pub const PARALLEL_MACS: usize = 1 << 20;
/// Columns a pool's work item computes.
const COLUMN_CHUNK: usize = 64;

/// Writes columns `cols` of a product into `out` `[rows, width]` (see [`by_columns`]).
type Columns<'a> = dyn Fn(std::ops::Range<usize>, &mut [f32], usize) + Sync + 'a;

/// Runs `f` over ranges covering `0..items` (see [`QMatrix::matmul_on`]).
pub type Pool<'a> = dyn Fn(usize, &(dyn Fn(std::ops::Range<usize>) + Sync)) + 'a;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QFormat {
    Q8_0,
    Q4_1,
}

/// A quantised `[n, k]` matrix.
pub struct QMatrix {
    fmt: QFormat,
    n: usize,
    k: usize,
    /// Per row, its blocks' values: 32 bytes a block (q8_0) or 16 (q4_1).
    qs: Vec<u8>,
    /// Per row, per block: the scale.
    d: Vec<f32>,
    /// q4_1: per row, per block, the minimum.
    m: Vec<f32>,
}

/// The rows of `x` quantised to q8_0 blocks.
struct QRows {
    k: usize,
    qs: Vec<i8>,
    /// Per row, per block: the scale, and the scale times the block's sum of values.
    d: Vec<f32>,
    s: Vec<f32>,
}

/// `v` rounded half away from zero, as `f32::round` does (without its libm call, which
/// costs more than the rest of the quantisation), clamped to −127..=127.
fn round_i8(v: f32) -> i8 {
    let r = v + 0.5f32.copysign(v);
    (r as i32).clamp(-127, 127) as i8
}

impl QRows {
    fn new(x: &[f32], k: usize) -> Self {
        let rows = x.len() / k;
        let nb = k / BLOCK;
        let mut q = QRows {
            k,
            qs: vec![0; rows * k],
            d: vec![0.0; rows * nb],
            s: vec![0.0; rows * nb],
        };
        for (i, (xs, qs)) in x
            .chunks_exact(BLOCK)
            .zip(q.qs.chunks_exact_mut(BLOCK))
            .enumerate()
        {
            let amax = xs.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut sum = 0i32;
            for (o, v) in qs.iter_mut().zip(xs) {
                let v = round_i8(v * inv);
                sum += i32::from(v);
                *o = v;
            }
            q.d[i] = d;
            q.s[i] = d * sum as f32;
        }
        q
    }

    fn row(&self, r: usize) -> &[i8] {
        &self.qs[r * self.k..(r + 1) * self.k]
    }
}

impl QMatrix {
    /// Quantises `w` `[n, k]` (row-major); `k` must be a multiple of [`BLOCK`].
    pub fn quantize(w: &[f32], n: usize, k: usize, fmt: QFormat) -> Self {
        assert!(
            k.is_multiple_of(BLOCK) && w.len() == n * k,
            "[{n}, {k}] in blocks of {BLOCK}"
        );
        let nb = n * k / BLOCK;
        let bytes = match fmt {
            QFormat::Q8_0 => BLOCK,
            QFormat::Q4_1 => BLOCK / 2,
        };
        let mut q = QMatrix {
            fmt,
            n,
            k,
            qs: vec![0; nb * bytes],
            d: vec![0.0; nb],
            m: if fmt == QFormat::Q4_1 {
                vec![0.0; nb]
            } else {
                Vec::new()
            },
        };
        for (i, (xs, out)) in w
            .chunks_exact(BLOCK)
            .zip(q.qs.chunks_exact_mut(bytes))
            .enumerate()
        {
            match fmt {
                QFormat::Q8_0 => {
                    let amax = xs.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                    let d = amax / 127.0;
                    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                    for (o, v) in out.iter_mut().zip(xs) {
                        *o = round_i8(v * inv) as u8;
                    }
                    q.d[i] = d;
                }
                QFormat::Q4_1 => {
                    let lo = xs.iter().fold(f32::INFINITY, |a, &v| a.min(v));
                    let hi = xs.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
                    let d = (hi - lo) / 15.0;
                    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                    let level = |v: f32| ((v - lo) * inv).round().clamp(0.0, 15.0) as u8;
                    for j in 0..BLOCK / 2 {
                        out[j] = level(xs[j]) | (level(xs[j + BLOCK / 2]) << 4);
                    }
                    q.d[i] = d;
                    q.m[i] = lo;
                }
            }
        }
        q
    }

    pub fn rows(&self) -> usize {
        self.n
    }

    /// The matrix as f32 (what its blocks stand for).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut w = Vec::with_capacity(self.n * self.k);
        for b in 0..self.n * self.k / BLOCK {
            let d = self.d[b];
            match self.fmt {
                QFormat::Q8_0 => {
                    let qs = &self.qs[b * BLOCK..(b + 1) * BLOCK];
                    w.extend(qs.iter().map(|&q| d * f32::from(q as i8)));
                }
                QFormat::Q4_1 => {
                    let qs = &self.qs[b * BLOCK / 2..(b + 1) * BLOCK / 2];
                    let m = self.m[b];
                    w.extend(qs.iter().map(|&q| d * f32::from(q & 15) + m));
                    w.extend(qs.iter().map(|&q| d * f32::from(q >> 4) + m));
                }
            }
        }
        w
    }

    /// `x·Wᵀ` for `x` `[rows, k]` (row-major): `[rows, n]`, on the calling thread.
    pub fn matmul(&self, x: &[f32]) -> Vec<f32> {
        self.matmul_on(x, &|n, f| f(0..n))
    }

    /// `x·Wᵀ` with the columns split into chunks that `pool` runs: `pool(items, f)` must call
    /// `f` on ranges that cover `0..items` once (on any threads, e.g. candle's barrier pool,
    /// so that one pool of threads serves every op of a step). Products of fewer than
    /// [`PARALLEL_MACS`] multiply-adds run on the calling thread.
    pub fn matmul_on(&self, x: &[f32], pool: &Pool<'_>) -> Vec<f32> {
        assert!(x.len().is_multiple_of(self.k), "rows of {} values", self.k);
        let rows = x.len() / self.k;
        let acts = QRows::new(x, self.k);
        let isa = isa();
        by_columns(
            self.n,
            rows,
            self.n * self.k * rows,
            pool,
            &|cols, out, width| self.columns(isa, cols, &acts, out, width),
        )
    }

    /// Columns `cols` of the product into `out` `[rows, width]` (column `cols.start + j` at
    /// `j`).
    fn columns(
        &self,
        isa: Isa,
        cols: std::ops::Range<usize>,
        acts: &QRows,
        out: &mut [f32],
        width: usize,
    ) {
        let rows = out.len() / width.max(1);
        let mut col_vals = vec![0.0f32; rows];
        let first = cols.start;
        for col in cols {
            self.column(isa, col, acts, &mut col_vals);
            for (r, v) in col_vals.iter().enumerate() {
                out[r * width + col - first] = *v;
            }
        }
    }

    /// Column `col` of the product: `out[r] = x_r · W[col]`.
    fn column(&self, isa: Isa, col: usize, acts: &QRows, out: &mut [f32]) {
        let nb = self.k / BLOCK;
        let d = &self.d[col * nb..(col + 1) * nb];
        let (qs, m) = match self.fmt {
            QFormat::Q8_0 => (&self.qs[col * self.k..(col + 1) * self.k], &[][..]),
            QFormat::Q4_1 => (
                &self.qs[col * self.k / 2..(col + 1) * self.k / 2],
                &self.m[col * nb..(col + 1) * nb],
            ),
        };
        for (t, out) in out.chunks_mut(ROW_TILE).enumerate() {
            let r0 = t * ROW_TILE;
            let tile = Tile {
                fmt: self.fmt,
                qs,
                d,
                acts,
                r0,
            };
            dot_tile(isa, &tile, out);
            if self.fmt == QFormat::Q4_1 {
                for (i, o) in out.iter_mut().enumerate() {
                    let s = &acts.s[(r0 + i) * nb..(r0 + i + 1) * nb];
                    *o += m.iter().zip(s).map(|(a, b)| a * b).sum::<f32>();
                }
            }
        }
    }
}

/// The `[rows, n]` result of a product computed column by column: `run(cols, out, width)`
/// writes columns `cols` into `out` `[rows, width]`. A product of fewer than
/// [`PARALLEL_MACS`] multiply-adds (`macs`) runs on the calling thread; a larger one in chunks
/// of [`COLUMN_CHUNK`] columns that `pool` runs, each copied into place row by row.
fn by_columns(n: usize, rows: usize, macs: usize, pool: &Pool<'_>, run: &Columns<'_>) -> Vec<f32> {
    let mut y = vec![0.0f32; rows * n];
    if macs < PARALLEL_MACS {
        // Handing a small product to the pool's threads (and waking them) costs more than
        // it saves.
        run(0..n, &mut y, n);
        return y;
    }
    let chunks = n.div_ceil(COLUMN_CHUNK);
    let done: Vec<std::sync::OnceLock<Vec<f32>>> =
        (0..chunks).map(|_| std::sync::OnceLock::new()).collect();
    pool(chunks, &|range| {
        for c in range {
            let cols = c * COLUMN_CHUNK..((c + 1) * COLUMN_CHUNK).min(n);
            let width = cols.len();
            let mut out = vec![0.0f32; rows * width];
            run(cols, &mut out, width);
            let _ = done[c].set(out);
        }
    });
    for (c, part) in done.into_iter().enumerate() {
        let part = part.into_inner().expect("the pool ran every chunk");
        let (first, width) = (c * COLUMN_CHUNK, part.len() / rows.max(1));
        for (r, vals) in part.chunks_exact(width.max(1)).enumerate() {
            y[r * n + first..r * n + first + width].copy_from_slice(vals);
        }
    }
    y
}

/// One weight row against up to [`ROW_TILE`] rows of `x` (`out.len()` of them, from `r0`).
struct Tile<'a> {
    fmt: QFormat,
    qs: &'a [u8],
    d: &'a [f32],
    acts: &'a QRows,
    r0: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Vnni,
}

/// The best instruction set of this CPU (read once).
fn isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
            if avx2
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx512vl")
                && std::env::var_os("ROLLARC_NO_VNNI").is_none()
            {
                return Isa::Vnni;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    })
}

fn dot_tile(isa: Isa, t: &Tile<'_>, out: &mut [f32]) {
    match isa {
        Isa::Scalar => scalar_tile(t, out),
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)]
        // SAFETY: `isa()` returns Avx2 only where the CPU has AVX2 and FMA, and Vnni only
        // where it also has AVX-512 VNNI and VL: the features these functions are compiled
        // for. Their loads stay inside the tile's slices (asserted in `tile_rows`).
        Isa::Avx2 => unsafe { x86::tile_avx2(t, out) },
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)]
        // SAFETY: as above.
        Isa::Vnni => unsafe { x86::tile_vnni(t, out) },
    }
}

/// The reference: integer dot products per block, in plain Rust.
fn scalar_tile(t: &Tile<'_>, out: &mut [f32]) {
    let nb = t.d.len();
    for (i, o) in out.iter_mut().enumerate() {
        let r = t.r0 + i;
        let x = t.acts.row(r);
        let dx = &t.acts.d[r * nb..(r + 1) * nb];
        let mut acc = 0.0f32;
        for b in 0..nb {
            let xs = &x[b * BLOCK..(b + 1) * BLOCK];
            let sum: i32 = match t.fmt {
                QFormat::Q8_0 => t.qs[b * BLOCK..(b + 1) * BLOCK]
                    .iter()
                    .zip(xs)
                    .map(|(&w, &x)| i32::from(w as i8) * i32::from(x))
                    .sum(),
                QFormat::Q4_1 => {
                    let qs = &t.qs[b * BLOCK / 2..(b + 1) * BLOCK / 2];
                    (0..BLOCK / 2)
                        .map(|j| {
                            i32::from(qs[j] & 15) * i32::from(xs[j])
                                + i32::from(qs[j] >> 4) * i32::from(xs[j + BLOCK / 2])
                        })
                        .sum()
                }
            };
            acc += t.d[b] * dx[b] * sum as f32;
        }
        *o = acc;
    }
}

mod attend;
mod dense;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use attend::{Kv, decode_attention_on};
pub use dense::matmul_f32_on;
use dense::{F32_COLS, F32_ROWS, dot_f32};

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    pub(crate) fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// x·Wᵀ in f64 over the dequantised weights and the dequantised rows of x.
    fn reference(w: &QMatrix, x: &[f32]) -> Vec<f64> {
        let k = w.k;
        let acts = QRows::new(x, k);
        let xd: Vec<f64> = acts
            .qs
            .iter()
            .enumerate()
            .map(|(i, &q)| f64::from(q) * f64::from(acts.d[i / BLOCK]))
            .collect();
        let wd = w.dequantize();
        let rows = x.len() / k;
        let mut y = vec![0.0; rows * w.n];
        for r in 0..rows {
            for c in 0..w.n {
                y[r * w.n + c] = (0..k)
                    .map(|i| xd[r * k + i] * f64::from(wd[c * k + i]))
                    .sum();
            }
        }
        y
    }

    /// Every instruction set this CPU has computes the same product as the f64 reference of
    /// the quantised operands (to f32 rounding), for a decode batch, a ragged tile and one
    /// row; and the product stays within the quantisation error of the f32 product.
    #[test]
    fn the_quantised_product_is_exact_for_its_operands_on_every_instruction_set() {
        let (n, k) = (72, 96);
        let wf = random(n * k, 1);
        let mut isas = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                isas.push(Isa::Avx2);
            }
            if isa() == Isa::Vnni {
                isas.push(Isa::Vnni);
            }
        }
        for fmt in [QFormat::Q8_0, QFormat::Q4_1] {
            let w = QMatrix::quantize(&wf, n, k, fmt);
            // Dequantised weights are within half a step of the originals.
            let step = if fmt == QFormat::Q8_0 {
                1.0 / 127.0
            } else {
                2.0 / 15.0
            };
            for (a, b) in w.dequantize().iter().zip(&wf) {
                assert!((a - b).abs() <= step * 0.5 + 1e-6, "{fmt:?}: {a} vs {b}");
            }
            for rows in [1, 7, 8] {
                let x = random(rows * k, 2 + rows as u64);
                let want = reference(&w, &x);
                let acts = QRows::new(&x, k);
                for &isa in &isas {
                    for c in 0..n {
                        let mut col = vec![0.0f32; rows];
                        w.column(isa, c, &acts, &mut col);
                        for r in 0..rows {
                            let (got, want) = (f64::from(col[r]), want[r * n + c]);
                            assert!(
                                (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                                "{fmt:?} {isa:?} rows {rows} [{r}, {c}]: {got} vs {want}"
                            );
                        }
                    }
                }
                // The product equals the columns, laid out as [rows, n], on the calling
                // thread and split into chunks run by a pool (here: two threads).
                let y = w.matmul(&x);
                let pool = |items: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)| {
                    std::thread::scope(|s| {
                        let half = items / 2;
                        s.spawn(move || f(0..half));
                        f(half..items);
                    })
                };
                let wide = QMatrix::quantize(&random(2048 * k, 9), 2048, k, fmt);
                let (serial, split) = (wide.matmul(&x), wide.matmul_on(&x, &pool));
                assert!(
                    2048 * k * rows >= PARALLEL_MACS || rows == 1,
                    "the split path runs"
                );
                assert_eq!(serial, split, "{fmt:?} rows {rows}");
                for (i, (got, want)) in y.iter().zip(&want).enumerate() {
                    assert!(
                        (f64::from(*got) - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "{fmt:?} matmul rows {rows} [{i}]: {got} vs {want}"
                    );
                }
                // Against the f32 product: the quantisation error, relative to its scale.
                let exact: Vec<f64> = (0..rows * n)
                    .map(|i| {
                        let (r, c) = (i / n, i % n);
                        (0..k)
                            .map(|j| f64::from(x[r * k + j]) * f64::from(wf[c * k + j]))
                            .sum()
                    })
                    .collect();
                let rms =
                    |v: &[f64]| (v.iter().map(|a| a * a).sum::<f64>() / v.len() as f64).sqrt();
                let err: Vec<f64> = y
                    .iter()
                    .zip(&exact)
                    .map(|(a, b)| f64::from(*a) - b)
                    .collect();
                let rel = rms(&err) / rms(&exact);
                let bound = if fmt == QFormat::Q8_0 { 0.02 } else { 0.15 };
                assert!(
                    rel <= bound,
                    "{fmt:?} rows {rows}: relative RMS error {rel}"
                );
            }
        }
    }
}
