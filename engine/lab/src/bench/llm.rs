//! `rollarc bench --what llm`: SmolLM2-135M-Instruct on the built-in engine — prefill and
//! decode tokens/s at 1, 8 and 32 concurrent sequences, each against this machine's roofline
//! measured in the same run (FLOP/s for prefill, bytes/s for decode), and side by side with
//! llama.cpp on the same GGUF file (the server the `xllamacpp` wheel embeds, run by
//! `tests/bench-llamacpp.py` with the same workloads). The same for the quantised generation
//! path (q8_0 and q4_1 matrices) beside llama.cpp on a file of the same type, with the
//! log-probability gap between what the quantised engine sampled and the trainer's f32
//! recomputation. `--what llm-train`: the built-in trainer's tokens/s (full fine-tuning and
//! LoRA) against the CPU bound.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use actors::generation::{GenRequest, GenerationEngine, SamplingParams};
use actors::model::engine::BuiltinEngine;
use actors::model::llm::{
    self, LlmConfig, LlmDecoder, LlmModel, LlmTokenizer, LlmWeights, LoraConfig,
};
use actors::model::trainer::{BuiltinTrainer, TrainerConfig};
use actors::types::Precision;
use infra::clock::wall_now;

use super::model::{Roofline, machine_roofline};
use crate::scenario::peak_rss_kib;

#[derive(Debug, thiserror::Error)]
pub enum LlmBenchError {
    #[error("{0} is missing: run `make setup` (or set ROLLARC_SMOLLM2)")]
    Missing(PathBuf),
    #[error(transparent)]
    Load(#[from] llm::LoadError),
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
}

const PREFILL_TOKENS: usize = 128;
const DECODE_CONTEXT: usize = 32;
const DECODE_NEW: u32 = 64;
const BATCHES: [usize; 3] = [1, 8, 32];

pub(super) fn smollm2() -> PathBuf {
    actors::model::llm::smollm2_path()
}

/// The ids the llama.cpp script sends: different per request, nothing shared.
fn prompt(i: usize, n: usize) -> Vec<u32> {
    (0..n)
        .map(|k| 100 + ((7 * i + 13 * k) % 20000) as u32)
        .collect()
}

fn request(i: usize, context: Vec<u32>, new: u32) -> GenRequest {
    GenRequest {
        id: i as u64,
        session: i as u64,
        context: Arc::new(context.into()),
        params: SamplingParams {
            max_tokens: new,
            seed: i as u64,
            ignore_eos: true,
            ..SamplingParams::default()
        },
        sim_response_len: None,
        prefilled: false,
        reusable: None,
        carried: 0,
    }
}

fn engine(
    w: &LlmWeights,
    tok: &Arc<LlmTokenizer>,
    batch: usize,
    precision: Precision,
) -> Result<BuiltinEngine<LlmDecoder>, candle_core::Error> {
    let copy = w.with_tensors(w.named().into_iter().map(|(n, t)| (n, t.clone())))?;
    Ok(BuiltinEngine::with_decoder(
        LlmDecoder::new(copy, tok.clone(), 2048).with_precision(precision)?,
        0,
        batch,
    ))
}

/// `b` requests run to the end; tokens/s over the wall time (prefilled + generated tokens).
fn run(e: &mut BuiltinEngine<LlmDecoder>, reqs: Vec<GenRequest>) -> (f64, u64, u64) {
    for r in reqs {
        e.add(r);
    }
    let t = wall_now();
    let (mut pre, mut dec) = (0, 0);
    while e.has_work() {
        let r = e.step();
        pre += r.prefill_tokens;
        dec += r.decode_tokens;
    }
    (t.elapsed().as_secs_f64(), pre, dec)
}

/// Multiply-adds per token through the decoder's matrices (the tied head excluded: prefill
/// runs it once per sequence), and per token of attention over `ctx` earlier positions.
fn flops_per_token(c: &LlmConfig, ctx: f64) -> f64 {
    let dense = (c.params() - c.vocab * c.d_model) as f64;
    2.0 * dense + 4.0 * ctx * (c.n_heads * c.head_dim * c.n_layers) as f64
}

struct Ours {
    prefill: Vec<f64>,
    decode: Vec<f64>,
}

/// Bytes a weight takes at `p` (blocks of 32 with an f32 scale, and an f32 minimum for
/// q4_1).
fn bytes_per_weight(p: Precision) -> f64 {
    match p {
        Precision::F32 => 4.0,
        Precision::Q8_0 => 36.0 / 32.0,
        Precision::Q4_1 => 24.0 / 32.0,
    }
}

fn bench_engine(
    w: &LlmWeights,
    tok: &Arc<LlmTokenizer>,
    peak: &Roofline,
    precision: Precision,
) -> Result<Ours, LlmBenchError> {
    let c = &w.cfg;
    let mut ours = Ours {
        prefill: Vec::new(),
        decode: Vec::new(),
    };
    println!("{precision} matrices:");
    println!("prefill ({PREFILL_TOKENS}-token prompts, one new token):");
    for b in BATCHES {
        let mut e = engine(w, tok, b, precision)?;
        let reqs = (0..b)
            .map(|i| request(i, prompt(i, PREFILL_TOKENS), 1))
            .collect();
        let (wall, pre, _) = run(&mut e, reqs);
        let tok_s = pre as f64 / wall;
        let flops = tok_s * flops_per_token(c, PREFILL_TOKENS as f64 / 2.0);
        println!(
            "  batch {b:2}: {tok_s:8.0} tokens/s = {:6.2} GFLOP/s ({:4.1}% of the matmul peak)",
            flops / 1e9,
            100.0 * flops / peak.flops
        );
        ours.prefill.push(tok_s);
    }
    println!(
        "decode ({DECODE_CONTEXT}-token prompts, {DECODE_NEW} new tokens each; wall time of the whole run):"
    );
    let weight_bytes = c.params() as f64 * bytes_per_weight(precision);
    let kv_per_token = (2 * c.n_layers * c.n_kv_heads * c.head_dim * 4) as f64;
    for b in BATCHES {
        let mut e = engine(w, tok, b, precision)?;
        let reqs = (0..b)
            .map(|i| request(i, prompt(i, DECODE_CONTEXT), DECODE_NEW))
            .collect();
        let (wall, _, dec) = run(&mut e, reqs);
        let generated = dec + b as u64; // each sequence's first token comes from its prefill
        let tok_s = generated as f64 / wall;
        // Per step: every weight once, each sequence's KV (≈ context + half the answer).
        let step_bytes = weight_bytes
            + b as f64 * (DECODE_CONTEXT as f64 + DECODE_NEW as f64 / 2.0) * kv_per_token;
        let bw = tok_s / b as f64 * step_bytes;
        println!(
            "  batch {b:2}: {tok_s:8.0} tokens/s = {:6.2} GB/s of weights + KV ({:4.1}% of read bandwidth)",
            bw / 1e9,
            100.0 * bw / peak.bandwidth
        );
        ours.decode.push(tok_s);
    }
    Ok(ours)
}

/// What the trainer sees of a quantised engine: answers it sampled (4 chat prompts, 48
/// tokens each at temperature 1), their behaviour log-probabilities against the trainer's
/// f32 recomputation of the same tokens — the largest and the mean |Δ|, and the mean Δ (a
/// bias would shift every importance ratio the same way).
fn logprob_gap(w: &LlmWeights, tok: &Arc<LlmTokenizer>, p: Precision) -> Result<(), LlmBenchError> {
    let questions = [
        "What is 17 + 25?",
        "Name three colours of the rainbow.",
        "Write one sentence about the sea.",
        "What is the capital of France?",
    ];
    let mut e = engine(w, tok, 4, p)?;
    let mut prompts = Vec::new();
    for (i, q) in questions.iter().enumerate() {
        let ids = tok
            .encode_chat(&[llm::ChatMessage::new("user", q)], true)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let mut r = request(i, ids.clone(), 48);
        r.params.ignore_eos = false;
        e.add(r);
        prompts.push(ids);
    }
    let (mut worst, mut sum_abs, mut sum, mut n) = (0.0f64, 0.0f64, 0.0f64, 0usize);
    while e.has_work() {
        let report = e.step();
        for (id, out) in report.finished {
            let o = out.map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            let mut all = prompts[id as usize].clone();
            let start = all.len();
            all.extend_from_slice(&o.tokens);
            let logits: Vec<Vec<f32>> = w.forward(&all)?.to_vec2()?;
            for (k, (&t, &lp)) in o.tokens.iter().zip(o.logprobs.iter()).enumerate() {
                let row = &logits[start + k - 1];
                let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
                let z: f64 = row.iter().map(|&l| (l as f64 - max).exp()).sum();
                let f32_lp = row[t as usize] as f64 - max - z.ln();
                let d = lp as f64 - f32_lp;
                worst = worst.max(d.abs());
                sum_abs += d.abs();
                sum += d;
                n += 1;
            }
        }
    }
    let n = n.max(1) as f64;
    println!(
        "  {p} sampled logprob − f32 recomputation over {n} tokens: max |Δ| {worst:.3}, mean |Δ| {:.4}, mean Δ {:+.4}",
        sum_abs / n,
        sum / n
    );
    Ok(())
}

/// A training batch of 8 single-turn rows, 64 prompt + 64 answer tokens.
fn batch() -> actors::types::Batch {
    let traj = |k: u64| actors::types::Trajectory {
        id: format!("b{k}"),
        group_id: k / 4,
        task: "bench".into(),
        seed: k,
        start_version: 0,
        pool: "cpu".into(),
        shard: 0,
        turns: vec![actors::types::Turn {
            observation_tokens: prompt(k as usize, 64).into(),
            response_tokens: prompt(k as usize + 100, 64).into(),
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
    let groups = (0..2u64)
        .map(|g| actors::types::Group {
            id: g,
            task: "bench".into(),
            seed: g,
            start_version: 0,
            masked: 0,
            trajectories: (0..4).map(|i| traj(g * 4 + i)).collect(),
        })
        .collect();
    actors::types::Batch { step: 0, groups }
}

/// One trainer step on [`batch`] with `micro_batch_rows` rows per forward/backward pass:
/// tokens/s, and the share of the CPU bound (forward + activation backward ≈ 4 × parameters
/// FLOP a token at the measured matmul peak; full fine-tuning adds the weight gradients,
/// 6 ×).
fn bench_trainer(
    w: &LlmWeights,
    lora: Option<LoraConfig>,
    micro_batch_rows: usize,
    peak: &Roofline,
) -> Result<f64, LlmBenchError> {
    let what = if lora.is_some() {
        "LoRA r8 q,v"
    } else {
        "full fine-tuning"
    };
    let passes = if lora.is_some() { 4.0 } else { 6.0 };
    let (m, init) = LlmModel::new(w.clone(), lora, 2048, micro_batch_rows)?;
    let mut tr = BuiltinTrainer::with_model(m, &init, TrainerConfig::default())?;
    let b = batch();
    // One step unmeasured (first-touch allocations), then the mean of two.
    tr.step(&b)?;
    let t = wall_now();
    tr.step(&b)?;
    tr.step(&b)?;
    let per = t.elapsed().as_secs_f64() / 2.0;
    let tokens = 8.0 * 128.0;
    let bound = peak.flops / (passes * w.cfg.params() as f64);
    println!(
        "trainer ({what}, {micro_batch_rows} rows per pass): {per:.2} s per step of 8 × 128 tokens = {:.0} tokens/s ({:.0}% of the CPU bound, {bound:.0} tokens/s); peak RSS so far {:.0} MiB",
        tokens / per,
        100.0 * tokens / per / bound,
        peak_rss_kib() as f64 / 1024.0
    );
    Ok(tokens / per)
}

/// `rollarc bench --what llm-train`: the built-in trainer on SmolLM2, full fine-tuning and
/// LoRA, one row per pass (each row alone) and the whole batch packed into one pass.
pub fn bench_llm_train() -> Result<(), LlmBenchError> {
    let path = smollm2();
    if !path.is_file() {
        return Err(LlmBenchError::Missing(path));
    }
    let (w, _) = llm::load(&path)?;
    let peak = machine_roofline()?;
    println!(
        "SmolLM2-135M-Instruct trainer ({} parameters, f32 on CPU); machine roofline (measured): {:.1} GFLOP/s f32 matmul",
        w.cfg.params(),
        peak.flops / 1e9
    );
    let lora = || LoraConfig {
        rank: 8,
        alpha: 16.0,
        targets: vec!["attn_q".into(), "attn_v".into()],
        seed: 1,
    };
    for rows in [1, 8] {
        bench_trainer(&w, Some(lora()), rows, &peak)?;
    }
    for rows in [1, 8] {
        bench_trainer(&w, None, rows, &peak)?;
    }
    println!("peak RSS: {:.1} MiB", peak_rss_kib() as f64 / 1024.0);
    Ok(())
}

/// llama.cpp's numbers on `models` from the script, when its Python environment is there.
fn llamacpp(models: &[&Path]) -> Vec<serde_json::Value> {
    let python = std::env::var_os("ROLLARC_XLLAMACPP_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/rollarc/xllamacpp-venv/bin/python")
        });
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/bench-llamacpp.py");
    let out = std::process::Command::new(&python)
        .arg(&script)
        .args(models)
        .stderr(std::process::Stdio::null())
        .output();
    match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect(),
        Ok(o) => {
            println!(
                "llama.cpp comparison failed ({}): run `make setup`",
                o.status
            );
            Vec::new()
        }
        Err(e) => {
            println!(
                "llama.cpp comparison skipped ({}: {e}): run `make setup`",
                python.display()
            );
            Vec::new()
        }
    }
}

pub fn bench_llm() -> Result<(), LlmBenchError> {
    let path = smollm2();
    if !path.is_file() {
        return Err(LlmBenchError::Missing(path));
    }
    let (w, tok) = llm::load(&path)?;
    let tok = Arc::new(tok);
    let peak = machine_roofline()?;
    println!(
        "SmolLM2-135M-Instruct ({} parameters, f32 on CPU); machine roofline (measured): {:.1} GFLOP/s f32 matmul, {:.1} GB/s memory read",
        w.cfg.params(),
        peak.flops / 1e9,
        peak.bandwidth / 1e9
    );
    // Each precision of ours beside llama.cpp on a file of the same type: the f32 weights
    // and a q8_0 file as our export writes them, and the shipped Q4_1 file.
    let export = |ty: llm::GgufType, name: &str| -> Result<PathBuf, LlmBenchError> {
        let f =
            std::env::temp_dir().join(format!("rollarc-bench-{}-{name}.gguf", std::process::id()));
        w.save_gguf(&tok, &f, ty)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        Ok(f)
    };
    let f32_file = export(llm::GgufType::F32, "f32")?;
    let q8_file = export(llm::GgufType::Q8_0, "q8_0")?;
    let pairs = [
        (Precision::F32, f32_file.clone(), "f32 export"),
        (Precision::Q8_0, q8_file.clone(), "q8_0 export"),
        (Precision::Q4_1, path.clone(), "shipped Q4_1"),
    ];
    let mut ours = Vec::new();
    for (p, _, _) in &pairs {
        ours.push(bench_engine(&w, &tok, &peak, *p)?);
        if *p != Precision::F32 {
            logprob_gap(&w, &tok, *p)?;
        }
    }
    let files: Vec<&Path> = pairs.iter().map(|(_, f, _)| f.as_path()).collect();
    let theirs = llamacpp(&files);
    let _ = std::fs::remove_file(&f32_file);
    let _ = std::fs::remove_file(&q8_file);
    for ((p, file, name), mine) in pairs.iter().zip(&ours) {
        let Some(t) = theirs.iter().find(|t| t["model"].as_str() == file.to_str()) else {
            continue;
        };
        println!(
            "ours with {p} matrices beside llama.cpp ({name}), tokens/s — ours / llama.cpp = ratio:"
        );
        for (phase, mine) in [("prefill", &mine.prefill), ("decode", &mine.decode)] {
            for (b, m) in BATCHES.iter().zip(mine.iter()) {
                let l = t[phase][b.to_string()].as_f64().unwrap_or(f64::NAN);
                println!("  {phase:7} batch {b:2}: {m:8.0} / {l:8.0} = {:.2}", m / l);
            }
        }
    }
    println!("peak RSS: {:.1} MiB", peak_rss_kib() as f64 / 1024.0);
    Ok(())
}
