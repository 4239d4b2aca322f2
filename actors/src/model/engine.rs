//! The built-in generation engine: any [`Decoder`] behind [`GenerationEngine`], with
//! continuous batching (prefill of newly added sequences, then one batched decode step for
//! every running sequence), per-request seeded sampling (temperature, top-k, top-p, max
//! tokens, stop ids and stop strings), per-token log-probabilities, a prefix cache per
//! session, and weight swaps under the abort / recompute policies.
//! Runs on its own thread (`LoopPlacement::Thread`): its steps are real compute.

use crate::error::SharedError;
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::decoder::Decoder;
use super::tokenizer::EOT;
use super::transformer::{ModelConfig, Params, SeqCache, Transformer};
use crate::generation::{
    FinishReason, GenError, GenOutput, GenRequest, GenerationEngine, InFlightPolicy, LoadReport,
    StepReport,
};
use crate::types::{PolicyVersion, Precision, VersionSpan};
use crate::weights::Weights;

struct Seq<C> {
    req: GenRequest,
    cache: C,
    /// Context tokens not yet fed (prefill pending).
    pending_context: usize,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    versions: Vec<VersionSpan>,
    /// Last sampled token, to feed at the next decode step.
    last: Option<u32>,
    rng: SmallRng,
    prefilled: u32,
    /// The answer contains one of the request's stop strings.
    stopped: bool,
}

/// A cached prefix kept between the turns of a session.
struct Cached<C> {
    tokens: Vec<u32>,
    cache: C,
}

/// Time spent in each phase since start.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PhaseTimes {
    pub prefill: Duration,
    pub decode: Duration,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
}

/// The tiny byte-level transformer as a [`Decoder`].
pub struct TinyDecoder {
    model: Transformer,
    params: Params,
}

impl Decoder for TinyDecoder {
    type Cache = SeqCache;

    fn max_seq(&self) -> usize {
        self.model.cfg.max_seq
    }
    fn new_cache(&self) -> SeqCache {
        SeqCache::new(&self.model.cfg)
    }
    fn cache_len(cache: &SeqCache) -> usize {
        cache.len()
    }
    fn prefill(&self, tokens: &[u32], cache: &mut SeqCache) -> candle_core::Result<Vec<f32>> {
        self.model
            .prefill(&self.params, tokens, cache)?
            .to_dtype(DType::F32)?
            .to_vec1()
    }
    fn decode(
        &self,
        tokens: &[u32],
        caches: &mut [&mut SeqCache],
    ) -> candle_core::Result<Vec<Vec<f32>>> {
        self.model
            .decode(&self.params, tokens, caches)?
            .to_dtype(DType::F32)?
            .to_vec2()
    }
    fn install(&mut self, weights: &Weights) -> candle_core::Result<()> {
        self.params = Params::from_weights(&self.model.cfg, weights, &Device::Cpu)?;
        Ok(())
    }
    fn stop_ids(&self) -> &[u32] {
        &[EOT]
    }
    fn text(&self, ids: &[u32]) -> Option<String> {
        Some(super::tokenizer::ByteTokenizer.decode(ids))
    }
    fn kv_bytes_per_token(&self) -> u64 {
        (2 * self.model.cfg.n_layers * self.model.cfg.d_model * 4) as u64
    }
}

pub struct BuiltinEngine<D: Decoder = TinyDecoder> {
    model: D,
    version: PolicyVersion,
    waiting: VecDeque<Seq<D::Cache>>,
    running: Vec<Seq<D::Cache>>,
    sessions: HashMap<u64, Cached<D::Cache>>,
    max_batch: usize,
    pub times: PhaseTimes,
}

impl BuiltinEngine<TinyDecoder> {
    /// The engine over the tiny transformer of `cfg` with `weights`.
    pub fn new(cfg: ModelConfig, weights: &Weights, max_batch: usize) -> Result<Self, GenError> {
        let params = Params::from_weights(&cfg, weights, &Device::Cpu)
            .map_err(|e| GenError::Backend(SharedError::new(e)))?;
        let model = TinyDecoder {
            model: Transformer::new(cfg),
            params,
        };
        Ok(Self::with_decoder(model, weights.version, max_batch))
    }
}

/// Samples from `logits` [V] with temperature, top-k and top-p (and the constrained
/// alphabet, if any); returns the token and its log-probability under the
/// temperature-scaled distribution before truncation (at temperature 1: the model's own,
/// which the trainer recomputes).
pub fn sample(
    logits: &[f32],
    params: &crate::generation::SamplingParams,
    rng: &mut SmallRng,
) -> (u32, f32) {
    let (temperature, top_p, top_k) = (params.temperature, params.top_p, params.top_k);
    let allowed = params.allowed_tokens.as_deref();
    let masked: Vec<f32>;
    let logits = match allowed {
        Some(a) if !a.is_empty() => {
            let mut m = vec![f32::NEG_INFINITY; logits.len()];
            for &i in a {
                if let Some(&l) = logits.get(i as usize) {
                    m[i as usize] = l;
                }
            }
            masked = m;
            &masked[..]
        }
        _ => logits,
    };
    let t = if temperature > 0.0 { temperature } else { 1.0 };
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let scaled = |i: usize| f64::from((logits[i] - max) / t);
    // One pass of exp (each term in f64, as the trainer's log-softmax): the weights and their
    // sum.
    let e: Vec<f64> = (0..logits.len()).map(|i| scaled(i).exp()).collect();
    let z: f64 = e.iter().sum();
    let logz = z.ln();
    if temperature <= 0.0 {
        let best = (0..logits.len()).fold(0, |b, i| if logits[i] > logits[b] { i } else { b });
        return (best as u32, (scaled(best) - logz) as f32);
    }
    let k = top_k as usize;
    if top_p >= 1.0 && (k == 0 || k >= logits.len()) {
        // The whole distribution: walk the weights in token order (no ranking to build).
        let mut u = rng.random::<f64>() * z;
        // Rounding can leave u above 0 after the last term: the last token that has weight.
        let mut pick = e.iter().rposition(|&w| w > 0.0).unwrap_or(0);
        for (i, w) in e.iter().enumerate() {
            u -= w;
            if u <= 0.0 {
                pick = i;
                break;
            }
        }
        return (pick as u32, (scaled(pick) - logz) as f32);
    }
    let probs: Vec<f64> = e.iter().map(|w| w / z).collect();
    let mut order: Vec<usize> = (0..probs.len()).collect();
    let mut nucleus = probs.len();
    let by_prob = |a: &usize, b: &usize| probs[*b].total_cmp(&probs[*a]).then(a.cmp(b));
    if k > 0 && k < probs.len() {
        order.select_nth_unstable_by(k - 1, by_prob);
        order.truncate(k);
        nucleus = k;
    }
    order.sort_by(by_prob);
    if top_p < 1.0 {
        // The nucleus of the (top-k) distribution, renormalised.
        let kept: f64 = order.iter().map(|&i| probs[i]).sum();
        let mut acc = 0.0;
        for (n, &i) in order.iter().enumerate() {
            acc += probs[i];
            if acc >= top_p as f64 * kept {
                nucleus = n + 1;
                break;
            }
        }
    }
    let mass: f64 = order[..nucleus].iter().map(|&i| probs[i]).sum();
    let mut u = rng.random::<f64>() * mass;
    let mut pick = order[nucleus - 1];
    for &i in &order[..nucleus] {
        u -= probs[i];
        if u <= 0.0 {
            pick = i;
            break;
        }
    }
    (pick as u32, (scaled(pick) - logz) as f32)
}

impl<D: Decoder> BuiltinEngine<D> {
    /// The engine over `model`, whose weights are of `version`.
    pub fn with_decoder(model: D, version: PolicyVersion, max_batch: usize) -> Self {
        Self {
            model,
            version,
            waiting: VecDeque::new(),
            running: Vec::new(),
            sessions: HashMap::new(),
            max_batch: max_batch.max(1),
            times: PhaseTimes::default(),
        }
    }

    /// The model served.
    pub fn decoder(&self) -> &D {
        &self.model
    }

    fn done(&self, s: &Seq<D::Cache>) -> Option<FinishReason> {
        let last = s.tokens.last()?;
        if s.stopped
            || (!s.req.params.ignore_eos && self.model.stop_ids().contains(last))
            || s.req.params.stop_tokens.contains(last)
        {
            return Some(FinishReason::Stop);
        }
        let at_limit = s.tokens.len() as u32 >= s.req.params.max_tokens
            || D::cache_len(&s.cache) + 1 >= self.model.max_seq();
        at_limit.then_some(FinishReason::Length)
    }
}

/// Appends a sampled token; marks the sequence stopped once its text holds a stop string.
fn push<D: Decoder>(model: &D, version: PolicyVersion, s: &mut Seq<D::Cache>, tok: u32, lp: f32) {
    push_token(s, version, model.precision(), tok, lp);
    if !s.req.params.stop_strings.is_empty()
        && let Some(text) = model.text(&s.tokens)
    {
        s.stopped = s
            .req
            .params
            .stop_strings
            .iter()
            .any(|x| text.contains(x.as_str()));
    }
}

impl<D: Decoder> GenerationEngine for BuiltinEngine<D> {
    fn add(&mut self, req: GenRequest) {
        let mut cache = self.model.new_cache();
        let mut pending = req.context.len();
        // Prefix cache: the session's previous context, if the new one extends it.
        if let Some(c) = self.sessions.remove(&req.session)
            && req.context.len() > c.tokens.len()
            && req.context[..c.tokens.len()] == c.tokens[..]
        {
            pending = req.context.len() - c.tokens.len();
            cache = c.cache;
        }
        let rng = SmallRng::seed_from_u64(req.params.seed);
        self.waiting.push_back(Seq {
            req,
            cache,
            pending_context: pending,
            tokens: Vec::new(),
            logprobs: Vec::new(),
            versions: Vec::new(),
            last: None,
            rng,
            prefilled: 0,
            stopped: false,
        });
    }

    fn abort(&mut self, id: u64) -> bool {
        let before = self.waiting.len() + self.running.len();
        self.waiting.retain(|s| s.req.id != id);
        self.running.retain(|s| s.req.id != id);
        before != self.waiting.len() + self.running.len()
    }

    fn release(&mut self, session: u64) {
        self.sessions.remove(&session);
    }

    fn install(
        &mut self,
        version: PolicyVersion,
        weights: &Weights,
        policy: InFlightPolicy,
    ) -> Result<Duration, GenError> {
        self.model
            .install(weights)
            .map_err(|e| GenError::Backend(SharedError::new(e)))?;
        self.version = version;
        // KV computed under the old weights is stale.
        self.sessions.clear();
        for s in self.running.iter_mut().chain(self.waiting.iter_mut()) {
            s.cache = self.model.new_cache();
            s.last = None;
            match policy {
                InFlightPolicy::Abort => {
                    s.stopped = false;
                    s.tokens.clear();
                    s.logprobs.clear();
                    s.versions.clear();
                    s.pending_context = s.req.context.len();
                }
                // Keep the tokens; their KV is rebuilt by prefilling context + tokens.
                InFlightPolicy::Recompute => {
                    s.pending_context = s.req.context.len() + s.tokens.len()
                }
            }
        }
        Ok(Duration::ZERO)
    }

    fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    fn step(&mut self) -> StepReport {
        let mut report = StepReport::default();
        self.admit(&mut report);
        // Sequences whose model call failed this step, with the reason.
        let mut failed: Vec<(usize, SharedError)> = Vec::new();
        self.prefill_step(&mut report, &mut failed);
        self.decode_step(&mut report, &mut failed);
        self.retire(&mut report, &failed);
        report
    }

    fn load(&self) -> LoadReport {
        LoadReport {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_tokens: self
                .running
                .iter()
                .map(|s| D::cache_len(&s.cache) as u64)
                .sum(),
            kv_capacity_tokens: (self.max_batch * self.model.max_seq()) as u64,
            version: self.version,
            prefill_tokens: self.times.prefill_tokens,
            decode_tokens: self.times.decode_tokens,
            ..LoadReport::default()
        }
    }
}

/// The phases of one engine step.
impl<D: Decoder> BuiltinEngine<D> {
    /// Moves waiting requests into the running batch (up to `max_batch`); a request whose
    /// context cannot fit fails at once.
    fn admit(&mut self, report: &mut StepReport) {
        while self.running.len() < self.max_batch {
            let Some(s) = self.waiting.pop_front() else {
                break;
            };
            if s.req.context.is_empty() || s.req.context.len() >= self.model.max_seq() {
                let len = s.req.context.len();
                report.finished.push((
                    s.req.id,
                    Err(GenError::ContextTooLong {
                        len,
                        limit: self.model.max_seq() - 1,
                    }),
                ));
                continue;
            }
            self.running.push(s);
        }
    }

    fn prefill_step(&mut self, report: &mut StepReport, failed: &mut Vec<(usize, SharedError)>) {
        // Prefill: feed pending context, sample the first (next) token.
        let t0 = infra::clock::wall_now(); // real compute: phase times are wall time
        for i in 0..self.running.len() {
            if self.running[i].pending_context == 0 {
                continue;
            }
            let s = &mut self.running[i];
            let mut full: Vec<u32> = s.req.context.to_vec();
            full.extend_from_slice(&s.tokens);
            let start = full.len() - s.pending_context;
            let feed = &full[start..];
            match self.model.prefill(feed, &mut s.cache) {
                Ok(logits) => {
                    report.prefill_tokens += feed.len() as u64;
                    s.prefilled += feed.len() as u32;
                    s.pending_context = 0;
                    let (tok, lp) = sample(&logits, &s.req.params, &mut s.rng);
                    push(&self.model, self.version, s, tok, lp);
                }
                Err(e) => failed.push((i, SharedError::new(e))),
            }
        }
        self.times.prefill += t0.elapsed();
        self.times.prefill_tokens += report.prefill_tokens;
    }

    fn decode_step(&mut self, report: &mut StepReport, failed: &mut Vec<(usize, SharedError)>) {
        // Decode: one token for every sequence that has a sampled token to feed and is not done.
        let t1 = infra::clock::wall_now();
        let ready: Vec<usize> = (0..self.running.len())
            .filter(|&i| {
                self.running[i].last.is_some()
                    && self.done(&self.running[i]).is_none()
                    && !failed.iter().any(|f| f.0 == i)
            })
            .collect();
        if !ready.is_empty() {
            let toks: Vec<u32> = ready
                .iter()
                .map(|&i| self.running[i].last.unwrap_or(EOT))
                .collect();
            // The ready sequences' caches, borrowed together (ready is ascending).
            let mut caches: Vec<&mut D::Cache> = self
                .running
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| ready.binary_search(i).is_ok())
                .map(|(_, s)| &mut s.cache)
                .collect();
            let out = self.model.decode(&toks, &mut caches);
            drop(caches);
            match out {
                Ok(rows) => {
                    report.decode_tokens += ready.len() as u64;
                    let picks = self.sample_rows(&ready, &rows);
                    for (&i, (tok, lp)) in ready.iter().zip(picks) {
                        push(&self.model, self.version, &mut self.running[i], tok, lp);
                    }
                }
                Err(e) => {
                    let e = SharedError::new(e);
                    failed.extend(ready.iter().map(|&i| (i, e.clone())));
                }
            }
        }
        self.times.decode += t1.elapsed();
        self.times.decode_tokens += report.decode_tokens;
    }

    /// Samples the next token of each `ready` sequence from its row of `rows`, with its own
    /// generator (so the split changes no draw): the rows split between the threads of
    /// candle's pool when there are several, since each costs an exp over the whole
    /// vocabulary (49,152 for SmolLM2).
    fn sample_rows(&mut self, ready: &[usize], rows: &[Vec<f32>]) -> Vec<(u32, f32)> {
        let jobs: Vec<std::sync::Mutex<&mut Seq<D::Cache>>> = self
            .running
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| ready.binary_search(i).is_ok())
            .map(|(_, s)| std::sync::Mutex::new(s))
            .collect();
        let picks: Vec<std::sync::OnceLock<(u32, f32)>> =
            jobs.iter().map(|_| std::sync::OnceLock::new()).collect();
        let one = |k: usize| {
            let mut s = jobs[k]
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let s = &mut **s;
            let _ = picks[k].set(sample(&rows[k], &s.req.params, &mut s.rng));
        };
        if jobs.len() > 1 {
            candle_core::utils::barrier_pool()
                .execute_chunked(jobs.len(), |range| range.for_each(one));
        } else {
            (0..jobs.len()).for_each(one);
        }
        drop(jobs);
        picks
            .into_iter()
            .map(|p| p.into_inner().expect("every row sampled"))
            .collect()
    }

    fn retire(&mut self, report: &mut StepReport, failed: &[(usize, SharedError)]) {
        // Retire finished and failed sequences; keep finished contexts for the session.
        let mut i = 0;
        let mut idx = 0;
        while i < self.running.len() {
            let fail = failed.iter().find(|f| f.0 == idx).map(|f| f.1.clone());
            let finish = self.done(&self.running[i]);
            if fail.is_some() || finish.is_some() {
                let s = self.running.remove(i);
                match fail {
                    Some(msg) => report
                        .finished
                        .push((s.req.id, Err(GenError::Backend(msg)))),
                    None => {
                        let finish = finish.unwrap_or(FinishReason::Length);
                        // The cache holds the context and every token but the last sampled one.
                        let mut held: Vec<u32> = s.req.context.to_vec();
                        held.extend_from_slice(&s.tokens[..s.tokens.len().saturating_sub(1)]);
                        if held.len() == D::cache_len(&s.cache) {
                            self.sessions.insert(
                                s.req.session,
                                Cached {
                                    tokens: held,
                                    cache: s.cache,
                                },
                            );
                        }
                        report.finished.push((
                            s.req.id,
                            Ok(GenOutput {
                                tokens: s.tokens.into(),
                                logprobs: s.logprobs.into(),
                                versions: s.versions,
                                finish,
                                prefill_tokens: s.prefilled,
                            }),
                        ));
                    }
                }
            } else {
                i += 1;
            }
            idx += 1;
        }
    }
}

fn push_token<C>(s: &mut Seq<C>, version: PolicyVersion, precision: Precision, tok: u32, lp: f32) {
    s.tokens.push(tok);
    s.logprobs.push(lp);
    match s.versions.last_mut() {
        Some(span) if span.version == version && span.precision == Some(precision) => {
            span.tokens += 1
        }
        _ => s.versions.push(VersionSpan {
            version,
            tokens: 1,
            precision: Some(precision),
        }),
    }
    s.last = Some(tok);
}

/// Convenience for tests and benchmarks: logits [V] of one full context (no cache reuse).
pub fn context_logits(
    model: &Transformer,
    params: &Params,
    context: &[u32],
) -> candle_core::Result<Tensor> {
    let mut c = SeqCache::new(&model.cfg);
    model.prefill(params, context, &mut c)
}
