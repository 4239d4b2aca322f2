//! `rollarc bench --what model`: the built-in model's prefill and decode throughput, decode
//! scaling with the number of concurrent sequences, trainer throughput and peak memory,
//! against the measured roofline of this machine.

use std::sync::Arc;

use actors::generation::{GenError, GenRequest, GenerationEngine, SamplingParams};
use actors::model::engine::BuiltinEngine;
use actors::model::tokenizer::{BOS, SEP};
use actors::model::trainer::{BuiltinTrainer, TrainerConfig};
use actors::model::transformer::{ModelConfig, Params};
use actors::weights::Weights;
use candle_core::{DType, Device, Tensor};
use infra::clock::wall_now;

use crate::scenario::peak_rss_kib;

/// Why the model benchmark stopped.
#[derive(Debug, thiserror::Error)]
pub enum ModelBenchError {
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
    #[error(transparent)]
    Engine(#[from] GenError),
}

/// Measured peak of this machine: dense f32 matmul FLOP/s (candle, all cores) and memory
/// read bandwidth (all cores). The roofline the built-in model is reported against.
pub(super) struct Roofline {
    pub flops: f64,
    pub bandwidth: f64,
}

pub(super) fn machine_roofline() -> Result<Roofline, candle_core::Error> {
    let n = 1024;
    let a = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
    let _ = a.matmul(&b)?;
    let t = wall_now();
    let reps = 5;
    for _ in 0..reps {
        let _ = a.matmul(&b)?;
    }
    let flops = 2.0 * (n * n * n) as f64 * reps as f64 / t.elapsed().as_secs_f64();
    // Read bandwidth with every core streaming its share of 512 MiB (what decode does
    // with the weights); the best of three passes.
    let data = vec![1.0f32; 128 << 20];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut bandwidth = 0.0f64;
    for _ in 0..3 {
        let t = wall_now();
        let total: f32 = std::thread::scope(|s| {
            let handles: Vec<_> = data
                .chunks(data.len().div_ceil(threads))
                .map(|part| {
                    s.spawn(move || {
                        // Sixteen independent sums: the loop vectorises and streams.
                        let lanes = part.chunks_exact(16).fold([0.0f32; 16], |mut acc, c| {
                            for (a, x) in acc.iter_mut().zip(c) {
                                *a += x;
                            }
                            acc
                        });
                        lanes.iter().sum::<f32>()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
        });
        std::hint::black_box(total);
        bandwidth = bandwidth.max((data.len() * 4) as f64 / t.elapsed().as_secs_f64());
    }
    Ok(Roofline { flops, bandwidth })
}

/// Parameters in the dense layers (what a token's forward pass multiplies through).
fn dense_params(cfg: &ModelConfig) -> f64 {
    (cfg.params() - cfg.vocab * cfg.d_model - cfg.max_seq * cfg.d_model) as f64
}

/// A request with a context of `ctx_len` tokens (varied by `id`) and `max_tokens` to generate.
fn request(id: u64, ctx_len: usize, max_tokens: u32) -> GenRequest {
    GenRequest {
        id,
        session: id,
        context: Arc::new(
            std::iter::once(BOS)
                .chain((0..ctx_len.saturating_sub(2)).map(|i| 97 + (i as u32 + id as u32) % 26))
                .chain(std::iter::once(SEP))
                .collect(),
        ),
        params: SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            max_tokens,
            stop_tokens: vec![],
            seed: id,
            allowed_tokens: None,
            top_k: 0,
            stop_strings: Vec::new(),
            ignore_eos: false,
        },
        sim_response_len: None,
        prefilled: false,
        reusable: None,
        carried: 0,
    }
}

/// Prefill: 32 sequences of 256 tokens, one new token each (so decode is negligible).
fn prefill(cfg: ModelConfig, w: &Weights, peak: &Roofline) -> Result<(), GenError> {
    let mut e = BuiltinEngine::new(cfg, w, 32)?;
    for i in 0..32 {
        e.add(request(i, 256, 1));
    }
    while e.has_work() {
        e.step();
    }
    let pf_tok_s = e.times.prefill_tokens as f64 / e.times.prefill.as_secs_f64();
    // FLOPs per prefilled token: 2 × dense params + attention (≈ 2 × 2 × context × d per layer).
    let d = cfg.d_model as f64;
    let pf_flops = pf_tok_s * (2.0 * dense_params(&cfg) + 4.0 * 128.0 * d * cfg.n_layers as f64);
    println!(
        "prefill: {:.0} tokens/s = {:.2} GFLOP/s ({:.1}% of the matmul peak)",
        pf_tok_s,
        pf_flops / 1e9,
        100.0 * pf_flops / peak.flops
    );
    Ok(())
}

/// Decode throughput by concurrent sequences.
fn decode(cfg: ModelConfig, w: &Weights, peak: &Roofline) -> Result<(), GenError> {
    println!("decode throughput by concurrent sequences (context 32, 64 new tokens each):");
    let d = cfg.d_model as f64;
    for c in [1usize, 8, 32, 128] {
        let mut e = BuiltinEngine::new(cfg, w, c)?;
        for i in 0..c as u64 {
            e.add(request(i, 32, 64));
        }
        while e.has_work() {
            e.step();
        }
        let tok_s = e.times.decode_tokens as f64 / e.times.decode.as_secs_f64().max(1e-9);
        // Bytes per decode step: all weights once, plus each sequence's KV (≈ 64 tokens avg).
        let step_bytes =
            cfg.params() as f64 * 4.0 + c as f64 * 64.0 * 2.0 * d * cfg.n_layers as f64 * 4.0;
        let steps_s = tok_s / c as f64;
        println!(
            "  {c:4} sequences: {tok_s:9.0} tokens/s  ({:.2} GB/s of weights+KV = {:.1}% of read bandwidth)",
            steps_s * step_bytes / 1e9,
            100.0 * steps_s * step_bytes / peak.bandwidth
        );
    }
    Ok(())
}

/// A training batch: 8 groups of 8 trajectories, each one turn of 64 + 64 tokens.
fn training_batch() -> actors::types::Batch {
    let traj = |k: u64| actors::types::Trajectory {
        id: format!("b{k}"),
        group_id: k / 8,
        task: "bench".into(),
        seed: k,
        start_version: 0,
        pool: "cpu".into(),
        shard: 0,
        turns: vec![actors::types::Turn {
            observation_tokens: (0..64).map(|i| 97 + ((i + k) % 26) as u32).collect(),
            response_tokens: (0..64).map(|i| 97 + ((i * 7 + k) % 26) as u32).collect(),
            logprobs: vec![-5.5; 64].into(),
            ..Default::default()
        }],
        reward: Some((k % 3) as f64),
        success: false,
        invalid_actions: 0,
        failure: None,
        reference: None,
        final_text: String::new(),
        allowed_tokens: None,
        truncated: false,
        agent: None,
        verdict: None,
        timings: Default::default(),
    };
    let groups = (0..8u64)
        .map(|g| actors::types::Group {
            id: g,
            task: "bench".into(),
            seed: g,
            start_version: 0,
            masked: 0,
            trajectories: (0..8).map(|i| traj(g * 8 + i)).collect(),
        })
        .collect();
    actors::types::Batch { step: 0, groups }
}

/// Trainer: 64 sequences of 128 tokens (64 generated).
fn train(cfg: ModelConfig, init: &Params, peak: &Roofline) -> Result<(), candle_core::Error> {
    let mut tr = BuiltinTrainer::new(cfg, init, TrainerConfig::default())?;
    let batch = training_batch();
    tr.step(&batch)?;
    let t = wall_now();
    let steps = 3;
    for _ in 0..steps {
        tr.step(&batch)?;
    }
    let per = t.elapsed().as_secs_f64() / steps as f64;
    let tokens = 64.0 * 128.0;
    let dense = dense_params(&cfg);
    println!(
        "trainer: {:.3} s per step of 64 × 128 tokens = {:.0} tokens/s (forward + backward + AdamW ≈ {:.2} GFLOP/s, {:.1}% of peak)",
        per,
        tokens / per,
        6.0 * dense * tokens / per / 1e9,
        100.0 * 6.0 * dense * tokens / per / peak.flops
    );
    Ok(())
}

/// The built-in model's benchmark: prefill and decode throughput, decode scaling with the
/// number of concurrent sequences, trainer throughput, peak memory, against the roofline.
pub fn bench_model() -> Result<(), ModelBenchError> {
    let cfg = ModelConfig::default();
    let init = Params::init(&cfg, 1, DType::F32, &Device::Cpu)?;
    let w = init.to_weights(0)?;
    let peak = machine_roofline()?;
    println!(
        "built-in model: d_model {} layers {} heads {} d_ff {} max_seq {} — {} parameters ({:.1} MiB f32)",
        cfg.d_model,
        cfg.n_layers,
        cfg.n_heads,
        cfg.d_ff,
        cfg.max_seq,
        cfg.params(),
        cfg.params() as f64 * 4.0 / 1048576.0
    );
    println!(
        "machine roofline (measured): {:.1} GFLOP/s f32 matmul, {:.1} GB/s memory read",
        peak.flops / 1e9,
        peak.bandwidth / 1e9
    );
    prefill(cfg, &w, &peak)?;
    decode(cfg, &w, &peak)?;
    train(cfg, &init, &peak)?;
    println!("peak RSS: {:.1} MiB", peak_rss_kib() as f64 / 1024.0);
    Ok(())
}
