//! The roofline generation simulator: continuous batching with chunked prefill and decode,
//! KV-cache reservation against the shard's memory, a prefix cache per session in the memory
//! left free (whole blocks, evicted least recently used first, a block at a time), prefill-only requests (the prefill side of P/D disaggregation) and weight swaps
//! timed by the weight-sync model. Runs on the virtual clock.
//!
//! Between prefills and admissions, decode iterations are *fused*: the engine loop asks how
//! many iterations may run with nothing else changing (up to the next sequence that finishes),
//! sleeps their summed duration in one go, and, if a command arrives meanwhile, ends the fused
//! step at the first iteration boundary after it — exactly where an engine stepping one
//! iteration at a time would have applied the command. A week of cluster time thus costs a
//! handful of events per turn instead of one per token.

use std::collections::VecDeque;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::{
    FinishReason, GenError, GenOutput, GenRequest, GenerationEngine, InFlightPolicy, LoadReport,
    StepReport,
};
use crate::tokens::{Draw, Logprobs, Tokens};
use crate::types::{PolicyVersion, VersionSpan};
use crate::weights::Weights;

mod config;
mod cost;
mod prefix_cache;

pub use config::{MeasuredCost, SimEngineConfig};
use prefix_cache::PrefixCache;

struct Seq {
    req: GenRequest,
    target: u32,
    tokens: Tokens,
    logprobs: Logprobs,
    versions: Vec<VersionSpan>,
    /// Context tokens still to prefill before decoding.
    to_prefill: u64,
    prefilled_total: u32,
    rng: SmallRng,
}

impl Seq {
    fn len(&self) -> u64 {
        (self.req.context.len() + self.tokens.len()) as u64
    }

    /// Tokens whose KV is computed.
    fn kv_tokens(&self) -> u64 {
        self.len() - self.to_prefill.min(self.len())
    }

    /// KV reserved at admission: the whole context and the longest answer.
    fn reserved(&self) -> u64 {
        self.req.context.len() as u64 + u64::from(self.target)
    }

    fn remaining(&self) -> u64 {
        u64::from(self.target).saturating_sub(self.tokens.len() as u64)
    }
}

/// The simulated engine. One instance models one shard (one GPU or one tensor-parallel group).
pub struct SimEngine {
    cfg: SimEngineConfig,
    version: PolicyVersion,
    /// Boxed: a sequence is a few hundred bytes, and these grow to the largest batch ever
    /// queued (10,000 episodes: twice 16,384 slots inline, plus the freed smaller ones).
    waiting: VecDeque<Box<Seq>>,
    #[allow(clippy::vec_box)]
    running: Vec<Box<Seq>>,
    /// KV reserved by running sequences.
    reserved: u64,
    cache: PrefixCache,
    kv_capacity: u64,
    rng: SmallRng,
    hung: bool,
    prefill_total: u64,
    decode_total: u64,
    steps: u64,
}

impl SimEngine {
    pub fn new(cfg: SimEngineConfig) -> Self {
        let free = (cfg.device.memory - cfg.model.weight_bytes()).max(cfg.device.memory * 0.05)
            * cfg.kv_memory_fraction;
        let kv_capacity = (free / cfg.model.kv_bytes_per_token).max(1.0) as u64;
        let rng = SmallRng::seed_from_u64(cfg.seed);
        let cfg_block = cfg.block_tokens;
        Self {
            cfg,
            version: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            reserved: 0,
            cache: PrefixCache::new(cfg_block),
            kv_capacity,
            rng,
            hung: false,
            prefill_total: 0,
            decode_total: 0,
            steps: 0,
        }
    }

    /// Counts a step; true when the injected fault fires now.
    fn faulted(&mut self) -> bool {
        self.steps += 1;
        if self.cfg.hang_after_steps.is_some_and(|n| self.steps > n) {
            self.hung = true;
        }
        self.hung
    }

    /// KV capacity in tokens.
    pub fn kv_capacity(&self) -> u64 {
        self.kv_capacity
    }

    /// Prefix-cache hits (admissions that found some of their context cached) and entries
    /// evicted whole.
    pub fn cache_counters(&self) -> (u64, u64) {
        (self.cache.hits, self.cache.evictions)
    }

    /// Context tokens looked up in the prefix cache and found there, and blocks evicted.
    pub fn cache_tokens(&self) -> (u64, u64, u64) {
        (
            self.cache.lookup_tokens,
            self.cache.hit_tokens,
            self.cache.evicted_blocks,
        )
    }

    /// Admits waiting sequences while the batch and the KV memory have room, evicting cached
    /// blocks (least recently used first) to make it; the head of the queue waits otherwise.
    fn admit(&mut self) {
        while self.running.len() < self.cfg.max_batch {
            let Some(front) = self.waiting.front() else {
                break;
            };
            let (session, need) = (front.req.session, front.reserved().min(self.kv_capacity));
            // The sequence's own cached prefix becomes part of its reservation.
            let own = self.cache.take(session);
            let over = (self.reserved + need + self.cache.tokens).saturating_sub(self.kv_capacity);
            if over > 0 {
                self.cache.evict(over);
            }
            if self.reserved + need > self.kv_capacity && !self.running.is_empty() {
                if own > 0 {
                    self.cache.put(session, own);
                }
                break;
            }
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            let len = s.req.context.len() as u64;
            // A disaggregated request arrives with its KV: nothing to prefill here. Otherwise
            // the cache serves the whole blocks of the prefix this context shares with the
            // session's last one (all of it when the context extends it), or the request
            // carries the KV of a prefix (handed back by a decode side), whichever is longer.
            let cached = if s.req.prefilled {
                len
            } else {
                let shared = s.req.reusable.unwrap_or(u64::MAX).min(len);
                let hit = self
                    .cache
                    .whole_blocks(own.min(shared))
                    .max(s.req.carried.min(len));
                self.cache.record(len, hit);
                hit
            };
            s.to_prefill = len - cached;
            self.reserved += need;
            self.running.push(s);
        }
    }

    /// Appends `n` sampled tokens to every decoding sequence (`idx`).
    fn emit(&mut self, idx: &[usize], n: u64) {
        let version = self.version;
        let vocab = self.cfg.vocab.max(2);
        for &i in idx {
            let s = &mut self.running[i];
            let before = s.tokens.len();
            if s.req.params.stop_tokens.is_empty() {
                // The common case (no stop tokens): a cheap xorshift stream seeded from the
                // request's RNG, drawn: a simulated week emits billions of tokens, which only
                // count until something reads them.
                let draw = Draw {
                    seed: s.rng.random::<u64>() | 1,
                    len: u32::try_from(n).unwrap_or(u32::MAX),
                    modulus: vocab - 1,
                };
                s.tokens.push_draw(draw);
                s.logprobs.push_draw(draw);
            } else {
                for _ in 0..n {
                    let tok = s.rng.random_range(1..vocab);
                    s.tokens.push(tok);
                    s.logprobs.push(-(s.rng.random::<f32>() * 3.0));
                    if s.req.params.stop_tokens.contains(&tok) {
                        break;
                    }
                }
            }
            let added = (s.tokens.len() - before) as u32;
            match s.versions.last_mut() {
                Some(span) if span.version == version => span.tokens += added,
                _ => s.versions.push(VersionSpan {
                    version,
                    tokens: added,
                    precision: None,
                }),
            }
        }
        self.decode_total += idx.len() as u64 * n;
    }

    /// Retires finished sequences; their context stays cached for the session's next turn.
    fn retire(&mut self, report: &mut StepReport) {
        let mut i = 0;
        while i < self.running.len() {
            let s = &self.running[i];
            // (A drawn answer has no stop tokens: its values are not read.)
            let stop = !s.req.params.stop_tokens.is_empty()
                && s.tokens
                    .last()
                    .is_some_and(|t| s.req.params.stop_tokens.contains(t));
            // A prefill-only request (P/D: the decode shard generates) is done when its whole
            // context is prefilled, not after its first step (0 tokens ≥ a target of 0).
            let done = if s.target == 0 {
                s.to_prefill == 0
            } else {
                s.tokens.len() as u32 >= s.target || stop
            };
            if done {
                let mut s = *self.running.swap_remove(i);
                self.reserved = self
                    .reserved
                    .saturating_sub(s.reserved().min(self.kv_capacity));
                self.cache.put(s.req.session, s.len());
                let finish = if stop {
                    FinishReason::Stop
                } else {
                    FinishReason::Length
                };
                // Finished answers live on in trajectories: no spare room.
                s.tokens.shrink_to_fit();
                s.logprobs.shrink_to_fit();
                s.versions.shrink_to_fit();
                report.finished.push((
                    s.req.id,
                    Ok(GenOutput {
                        tokens: s.tokens,
                        logprobs: s.logprobs,
                        versions: s.versions,
                        finish,
                        prefill_tokens: s.prefilled_total,
                    }),
                ));
            } else {
                i += 1;
            }
        }
        // Keep completion order independent of swap_remove positions.
        report.finished.sort_by_key(|(id, _)| *id);
    }

    /// Indices of the running sequences that decode (prefill done, an answer to generate).
    fn decoding(&self) -> Vec<usize> {
        (0..self.running.len())
            .filter(|&i| self.running[i].to_prefill == 0 && self.running[i].target > 0)
            .collect()
    }
}

impl GenerationEngine for SimEngine {
    fn add(&mut self, req: GenRequest) {
        let target = match req.sim_response_len {
            _ if req.params.max_tokens == 0 => 0,
            Some(n) => n.min(req.params.max_tokens).max(1),
            None => req.params.max_tokens.max(1),
        };
        let rng = SmallRng::seed_from_u64(req.params.seed);
        let to_prefill = req.context.len() as u64;
        self.waiting.push_back(Box::new(Seq {
            req,
            target,
            tokens: Tokens::new(),
            logprobs: Logprobs::new(),
            versions: Vec::new(),
            to_prefill,
            prefilled_total: 0,
            rng,
        }));
    }

    fn abort(&mut self, id: u64) -> bool {
        let before = self.waiting.len() + self.running.len();
        self.waiting.retain(|s| s.req.id != id);
        let cap = self.kv_capacity;
        let mut freed = 0;
        self.running.retain(|s| {
            let keep = s.req.id != id;
            if !keep {
                freed += s.reserved().min(cap);
            }
            keep
        });
        self.reserved = self.reserved.saturating_sub(freed);
        before != self.waiting.len() + self.running.len()
    }

    fn release(&mut self, session: u64) {
        self.cache.take(session);
    }

    fn cached(&self, session: u64) -> u64 {
        self.cache.entries.get(&session).map_or(0, |e| e.0)
    }

    fn install(
        &mut self,
        version: PolicyVersion,
        weights: &Weights,
        policy: InFlightPolicy,
    ) -> Result<Duration, GenError> {
        self.version = version;
        // KV computed under the old weights is stale for every sequence and session.
        self.cache.clear();
        for s in self.running.iter_mut() {
            match policy {
                InFlightPolicy::Abort => {
                    s.tokens.clear();
                    s.logprobs.clear();
                    s.versions.clear();
                    s.to_prefill = s.req.context.len() as u64;
                }
                InFlightPolicy::Recompute => {
                    s.to_prefill = (s.req.context.len() + s.tokens.len()) as u64;
                }
            }
        }
        let bytes = if weights.modelled_bytes > 0.0 {
            weights.modelled_bytes
        } else {
            self.cfg.model.weight_bytes()
        };
        Ok(crate::dist::seconds(
            self.cfg.weight_sync.install_seconds(bytes),
        ))
    }

    fn has_work(&self) -> bool {
        !self.hung && (!self.waiting.is_empty() || !self.running.is_empty())
    }

    fn step(&mut self) -> StepReport {
        let mut report = StepReport::default();
        if self.cfg.hang_probability > 0.0
            && self.rng.random_bool(self.cfg.hang_probability.min(1.0))
        {
            // A frozen engine: never steps again; the supervisor's watchdog must notice.
            self.hung = true;
            return report;
        }
        if self.faulted() {
            return report;
        }
        self.admit();
        // Chunked prefill: spend the step's prefill budget on sequences that need it.
        let mut budget = self.cfg.prefill_chunk;
        let mut prefill = 0u64;
        for s in self.running.iter_mut().filter(|s| s.to_prefill > 0) {
            if budget == 0 {
                break;
            }
            let n = s.to_prefill.min(budget);
            s.to_prefill -= n;
            s.prefilled_total += n as u32;
            budget -= n;
            prefill += n;
        }
        // One decode token for each sequence whose prefill is done.
        let decoding = self.decoding();
        let kv: u64 = decoding.iter().map(|&i| self.running[i].kv_tokens()).sum();
        let secs = self.step_seconds(prefill, decoding.len(), kv);
        self.emit(&decoding, 1);
        report.prefill_tokens = prefill;
        report.decode_tokens = decoding.len() as u64;
        self.prefill_total += prefill;
        report.modelled = crate::dist::seconds(secs);
        if let Some(h) = &self.cfg.host {
            h.charge(secs);
        }
        self.retire(&mut report);
        report
    }

    fn fusable(&mut self) -> u64 {
        if self.hung || self.cfg.max_fused_iterations < 2 {
            return 0;
        }
        self.admit();
        // Fusion needs a batch that only decodes and cannot stop early on a sampled token.
        if self.running.is_empty()
            || self
                .running
                .iter()
                .any(|s| s.to_prefill > 0 || s.target == 0 || !s.req.params.stop_tokens.is_empty())
        {
            return 0;
        }
        // Admission can only change when a sequence finishes (it frees a batch slot and KV).
        let mut k = self
            .running
            .iter()
            .map(|s| s.remaining())
            .min()
            .unwrap_or(0)
            .min(self.cfg.max_fused_iterations);
        if k < 2 {
            return 0;
        }
        let (b, kv0) = self.fused_plan();
        k = self.cap_fused(b, kv0, k);
        if k < 2 { 0 } else { k }
    }

    fn fused_time(&self, iterations: u64) -> Duration {
        let (b, kv0) = self.fused_plan();
        crate::dist::seconds(self.fused_seconds(b, kv0, iterations))
    }

    fn advance(&mut self, iterations: u64) -> StepReport {
        let mut report = StepReport::default();
        if iterations == 0 || self.faulted() {
            return report;
        }
        if self.cfg.hang_probability > 0.0 {
            let p = 1.0 - (1.0 - self.cfg.hang_probability.min(1.0)).powf(iterations as f64);
            if self.rng.random_bool(p.clamp(0.0, 1.0)) {
                self.hung = true;
                return report;
            }
        }
        let (b, kv0) = self.fused_plan();
        report.modelled = crate::dist::seconds(self.fused_seconds(b, kv0, iterations));
        if let Some(h) = &self.cfg.host {
            h.charge(report.modelled.as_secs_f64());
        }
        let idx = self.decoding();
        self.emit(&idx, iterations);
        report.decode_tokens = idx.len() as u64 * iterations;
        self.retire(&mut report);
        report
    }

    fn load(&self) -> LoadReport {
        LoadReport {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_tokens: self.running.iter().map(|s| s.kv_tokens()).sum::<u64>() + self.cache.tokens,
            kv_capacity_tokens: self.kv_capacity,
            version: self.version,
            prefill_tokens: self.prefill_total,
            decode_tokens: self.decode_total,
            cache_lookup_tokens: self.cache.lookup_tokens,
            cache_hit_tokens: self.cache.hit_tokens,
            ..LoadReport::default()
        }
    }
}

#[cfg(test)]
mod tests;
