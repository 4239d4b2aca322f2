//! The roofline generation simulator: continuous batching with prefill and decode phases,
//! KV-cache growth and capacity, prefix caching per session, and weight swaps, all timed by
//! the device and model profiles. Runs on the virtual clock.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::{FinishReason, GenError, GenOutput, GenRequest, GenerationEngine, InFlightPolicy, LoadReport, StepReport};
use crate::device::{DeviceProfile, Efficiency, ModelProfile, decode_step_seconds, prefill_seconds};
use crate::types::{PolicyVersion, VersionSpan};
use crate::weights::Weights;

/// Knobs of the simulator.
#[derive(Clone, Debug)]
pub struct SimEngineConfig {
    pub device: DeviceProfile,
    pub model: ModelProfile,
    pub efficiency: Efficiency,
    /// Largest decode batch.
    pub max_batch: usize,
    /// Prefill tokens per engine step (chunked prefill).
    pub prefill_chunk: u64,
    /// Fraction of device memory left for KV after weights.
    pub kv_memory_fraction: f64,
    /// Bandwidth of the weight pull (bytes/s) when installing a new version.
    pub weight_sync_bandwidth: f64,
    /// Probability that an engine step hangs (frozen shard), for fault injection.
    pub hang_probability: f64,
    pub seed: u64,
    /// Vocabulary the simulated tokens are drawn from.
    pub vocab: u32,
}

impl SimEngineConfig {
    pub fn new(device: DeviceProfile, model: ModelProfile) -> Self {
        Self {
            device,
            model,
            efficiency: Efficiency::default(),
            max_batch: 256,
            prefill_chunk: 16_384,
            kv_memory_fraction: 0.9,
            weight_sync_bandwidth: 25e9,
            hang_probability: 0.0,
            seed: 0,
            vocab: 32_000,
        }
    }
}

struct Seq {
    req: GenRequest,
    target: u32,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    versions: Vec<VersionSpan>,
    /// Context tokens still to prefill before decoding.
    to_prefill: u64,
    prefilled_total: u32,
    rng: SmallRng,
}

impl Seq {
    fn kv_tokens(&self) -> u64 {
        (self.req.context.len() + self.tokens.len()) as u64 - self.to_prefill.min((self.req.context.len() + self.tokens.len()) as u64)
    }
}

/// The simulated engine. One instance models one shard (one GPU or one tensor-parallel group).
pub struct SimEngine {
    cfg: SimEngineConfig,
    version: PolicyVersion,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// Prefix cache: context tokens per session already in KV.
    cache: HashMap<u64, u64>,
    kv_capacity: u64,
    rng: SmallRng,
    hung: bool,
    prefill_total: u64,
    decode_total: u64,
}

impl SimEngine {
    pub fn new(cfg: SimEngineConfig) -> Self {
        let free = (cfg.device.memory - cfg.model.weight_bytes()).max(cfg.device.memory * 0.05) * cfg.kv_memory_fraction;
        let kv_capacity = (free / cfg.model.kv_bytes_per_token).max(1.0) as u64;
        let rng = SmallRng::seed_from_u64(cfg.seed);
        Self {
            cfg,
            version: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            cache: HashMap::new(),
            kv_capacity,
            rng,
            hung: false,
            prefill_total: 0,
            decode_total: 0,
        }
    }

    fn used_kv(&self) -> u64 {
        self.running.iter().map(|s| (s.req.context.len() + s.tokens.len()) as u64).sum()
    }
}

impl GenerationEngine for SimEngine {
    fn add(&mut self, req: GenRequest) {
        let cached = self.cache.get(&req.session).copied().unwrap_or(0).min(req.context.len() as u64);
        let target = req.sim_response_len.unwrap_or(req.params.max_tokens).min(req.params.max_tokens).max(1);
        let rng = SmallRng::seed_from_u64(req.params.seed);
        let to_prefill = req.context.len() as u64 - cached;
        self.waiting.push_back(Seq { req, target, tokens: Vec::new(), logprobs: Vec::new(), versions: Vec::new(), to_prefill, prefilled_total: 0, rng });
    }

    fn abort(&mut self, id: u64) -> bool {
        let before = self.waiting.len() + self.running.len();
        self.waiting.retain(|s| s.req.id != id);
        self.running.retain(|s| s.req.id != id);
        before != self.waiting.len() + self.running.len()
    }

    fn release(&mut self, session: u64) {
        self.cache.remove(&session);
    }

    fn install(&mut self, version: PolicyVersion, weights: &Weights, policy: InFlightPolicy) -> Result<Duration, GenError> {
        self.version = version;
        // KV computed under the old weights is stale for every sequence and session.
        self.cache.clear();
        for s in self.running.iter_mut().chain(self.waiting.iter_mut()) {
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
        let bytes = if weights.modelled_bytes > 0.0 { weights.modelled_bytes } else { self.cfg.model.weight_bytes() };
        Ok(Duration::from_secs_f64(bytes / self.cfg.weight_sync_bandwidth))
    }

    fn has_work(&self) -> bool {
        !self.hung && (!self.waiting.is_empty() || !self.running.is_empty())
    }

    fn step(&mut self) -> StepReport {
        let mut report = StepReport::default();
        if self.cfg.hang_probability > 0.0 && self.rng.random_bool(self.cfg.hang_probability.min(1.0)) {
            // A frozen engine: never steps again; the supervisor's watchdog must notice.
            self.hung = true;
            return report;
        }
        // Admit waiting sequences while the batch and the KV cache have room.
        let mut used = self.used_kv();
        while self.running.len() < self.cfg.max_batch {
            let Some(front) = self.waiting.front() else { break };
            let need = (front.req.context.len() as u64 + front.target as u64).min(self.kv_capacity);
            if used + need > self.kv_capacity && !self.running.is_empty() {
                break;
            }
            used += need;
            if let Some(s) = self.waiting.pop_front() {
                self.running.push(s);
            }
        }
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
        let decoding: Vec<usize> = (0..self.running.len()).filter(|&i| self.running[i].to_prefill == 0).collect();
        let kv: u64 = decoding.iter().map(|&i| self.running[i].kv_tokens()).sum();
        let secs = prefill_seconds(&self.cfg.device, &self.cfg.model, self.cfg.efficiency, prefill as f64)
            + decode_step_seconds(&self.cfg.device, &self.cfg.model, self.cfg.efficiency, decoding.len() as f64, kv as f64);
        let version = self.version;
        let vocab = self.cfg.vocab.max(2);
        for &i in &decoding {
            let s = &mut self.running[i];
            let tok = s.rng.random_range(1..vocab);
            let lp = -(s.rng.random::<f32>() * 3.0);
            s.tokens.push(tok);
            s.logprobs.push(lp);
            match s.versions.last_mut() {
                Some(span) if span.version == version => span.tokens += 1,
                _ => s.versions.push(VersionSpan { version, tokens: 1 }),
            }
        }
        report.prefill_tokens = prefill;
        report.decode_tokens = decoding.len() as u64;
        self.prefill_total += prefill;
        self.decode_total += decoding.len() as u64;
        report.modelled = Duration::from_secs_f64(secs);
        // Retire finished sequences; their context stays cached for the session's next turn.
        let mut i = 0;
        while i < self.running.len() {
            let s = &self.running[i];
            let stop = s.tokens.last().is_some_and(|t| s.req.params.stop_tokens.contains(t));
            if s.tokens.len() as u32 >= s.target || stop {
                let s = self.running.swap_remove(i);
                self.cache.insert(s.req.session, (s.req.context.len() + s.tokens.len()) as u64);
                let finish = if stop { FinishReason::Stop } else { FinishReason::Length };
                report.finished.push((
                    s.req.id,
                    Ok(GenOutput { tokens: s.tokens, logprobs: s.logprobs, versions: s.versions, finish, prefill_tokens: s.prefilled_total }),
                ));
            } else {
                i += 1;
            }
        }
        // Keep completion order independent of swap_remove positions.
        report.finished.sort_by_key(|(id, _)| *id);
        report
    }

    fn load(&self) -> LoadReport {
        LoadReport {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_tokens: self.used_kv(),
            kv_capacity_tokens: self.kv_capacity,
            version: self.version,
            prefill_tokens: self.prefill_total,
            decode_tokens: self.decode_total,
            ..LoadReport::default()
        }
    }
}
