//! The modelled duration of engine steps: one step of chunked prefill and decode on the
//! device roofline (or on measured costs), and runs of fused decode iterations in closed form.

use super::SimEngine;
use crate::device::{decode_step_seconds, prefill_seconds};

impl SimEngine {
    /// Seconds of one step that prefills `prefill` tokens and decodes one token for each of
    /// `batch` sequences holding `kv` tokens of KV.
    pub(super) fn step_seconds(&self, prefill: u64, batch: usize, kv: u64) -> f64 {
        match self.cfg.measured {
            Some(m) => {
                m.step_s
                    + m.prefill_s_per_token * prefill as f64
                    + m.decode_s_per_token * batch as f64
            }
            None => {
                prefill_seconds(
                    &self.cfg.device,
                    &self.cfg.model,
                    self.cfg.efficiency,
                    prefill as f64,
                ) + self.decode_seconds(batch, kv)
            }
        }
    }

    /// Seconds of one decode iteration of `batch` sequences holding `kv` tokens of KV.
    fn decode_seconds(&self, batch: usize, kv: u64) -> f64 {
        decode_step_seconds(
            &self.cfg.device,
            &self.cfg.model,
            self.cfg.efficiency,
            batch as f64,
            kv as f64,
        )
    }

    /// Seconds of `j` fused iterations of `batch` sequences holding `kv0` tokens of KV at the
    /// start (each iteration adds one token per sequence).
    pub(super) fn fused_seconds(&self, batch: usize, kv0: u64, j: u64) -> f64 {
        if j == 0 || batch == 0 {
            return 0.0;
        }
        if let Some(m) = self.cfg.measured {
            return j as f64 * (m.step_s + m.decode_s_per_token * batch as f64);
        }
        let (dev, m, e) = (&self.cfg.device, &self.cfg.model, self.cfg.efficiency);
        let b = batch as f64;
        let touched = (m.active_params * b).min(m.params).max(m.active_params);
        let a = touched * m.bytes_per_param / (dev.bandwidth * e.mbu);
        let c = m.kv_bytes_per_token / (dev.bandwidth * e.mbu);
        let compute = 2.0 * m.active_params * b / (dev.flops * e.mfu);
        // Iteration i costs max(a + c·(kv0 + b·i), compute): compute-bound up to i*, then
        // memory-bound (the KV only grows).
        let mem = |i: f64| a + c * (kv0 as f64 + b * i);
        let jf = j as f64;
        let first_mem = if c * b > 0.0 {
            ((compute - a - c * kv0 as f64) / (c * b))
                .ceil()
                .clamp(0.0, jf)
        } else if mem(0.0) >= compute {
            0.0
        } else {
            jf
        };
        let sum_mem = |from: f64, to: f64| {
            // Σ_{i=from}^{to-1} (a + c·kv0 + c·b·i)
            let n = to - from;
            n * (a + c * kv0 as f64) + c * b * (from + to - 1.0) * n / 2.0
        };
        compute * first_mem
            + if first_mem < jf {
                sum_mem(first_mem, jf)
            } else {
                0.0
            }
    }

    /// The decoding batch a fused run would step: its size and the KV it holds now.
    pub(super) fn fused_plan(&self) -> (usize, u64) {
        let idx = self.decoding();
        let kv0: u64 = idx.iter().map(|&i| self.running[i].kv_tokens()).sum();
        (idx.len(), kv0)
    }

    /// The most of `k` fused iterations of `b` sequences holding `kv0` tokens of KV that fit
    /// the longest fused step, `max_fused_s`.
    pub(super) fn cap_fused(&self, b: usize, kv0: u64, mut k: u64) -> u64 {
        // Cap the step's modelled length (binary search on the monotone duration).
        if self.fused_seconds(b, kv0, k) > self.cfg.max_fused_s {
            let (mut lo, mut hi) = (1, k);
            while lo < hi {
                let mid = (lo + hi).div_ceil(2);
                if self.fused_seconds(b, kv0, mid) <= self.cfg.max_fused_s {
                    lo = mid
                } else {
                    hi = mid - 1
                }
            }
            k = lo;
        }
        k
    }
}
