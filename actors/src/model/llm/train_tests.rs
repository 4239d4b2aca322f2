//! The built-in trainer on SmolLM2: its recomputed logprobs equal the engine's, a step
//! moves the policy the way the advantages say, the published weights (every tensor, or
//! only LoRA adapters) give engines the trainer's model, every LoRA parameter gets a
//! gradient, and a checkpoint resumes the same run.

use std::sync::Arc;

use super::tests::{ids, max_gap, reference, smollm2_path};
use super::*;
use crate::generation::contract::{drain, request};
use crate::generation::{GenOutput, GenerationEngine, InFlightPolicy};
use crate::model::engine::BuiltinEngine;
use crate::model::trainer::{BuiltinTrainer, TrainModel, TrainerConfig, tensor_batches_for};
use crate::types::{Batch, Group, Trajectory, Turn};

fn model() -> (LlmWeights, Arc<LlmTokenizer>) {
    let (w, t) = load(&smollm2_path()).expect("SmolLM2 loads");
    (w, Arc::new(t))
}

fn copy(w: &LlmWeights) -> LlmWeights {
    w.with_tensors(w.named().into_iter().map(|(n, t)| (n, t.clone())))
        .unwrap()
}

fn prompts() -> Vec<Vec<u32>> {
    let r = reference();
    vec![
        ids(&r["tokenizer"]["chat"][0]["ids"]),
        ids(&r["sequences"][1]["tokens"]),
    ]
}

/// Two sampled answers (temperature 1) from `w`.
fn answers(w: &LlmWeights, tok: &Arc<LlmTokenizer>) -> Vec<GenOutput> {
    let mut e = BuiltinEngine::with_decoder(LlmDecoder::new(copy(w), tok.clone(), 256), 0, 4);
    for (i, p) in prompts().into_iter().enumerate() {
        e.add(request(i as u64, p, 8, 11 + i as u64));
    }
    drain(&mut e)
        .into_iter()
        .map(|(_, o)| o.expect("generates"))
        .collect()
}

fn batch(outs: &[GenOutput], rewards: &[f64]) -> Batch {
    let trajectories: Vec<Trajectory> = prompts()
        .into_iter()
        .zip(outs)
        .zip(rewards)
        .enumerate()
        .map(|(i, ((p, o), r))| {
            let turn = Turn {
                observation_tokens: p.into(),
                response_tokens: o.tokens.clone(),
                logprobs: o.logprobs.clone(),
                ..Default::default()
            };
            Trajectory::for_test(&format!("t{i}"), turn, Some(*r))
        })
        .collect();
    Batch {
        step: 0,
        groups: vec![Group {
            id: 0,
            task: "t".into(),
            seed: 0,
            start_version: 0,
            trajectories,
            masked: 0,
        }],
    }
}

/// The trainer's log-probabilities of each row's generated tokens, in order.
fn trainer_logprobs<M: TrainModel>(t: &BuiltinTrainer<M>, b: &Batch) -> Vec<Vec<f32>> {
    let shape = t.model.shape();
    let dev = candle_core::Device::Cpu;
    let tb = tensor_batches_for(
        b,
        t.cfg.advantage,
        &shape,
        usize::MAX,
        candle_core::DType::F32,
        &dev,
    )
    .unwrap()
    .pop()
    .unwrap();
    let lp: Vec<Vec<f32>> = t
        .logprobs(&t.params().unwrap(), &tb)
        .unwrap()
        .to_vec2()
        .unwrap();
    let mask: Vec<Vec<f32>> = tb.mask.to_vec2().unwrap();
    lp.iter()
        .zip(&mask)
        .map(|(l, m)| {
            l.iter()
                .zip(m)
                .filter(|(_, m)| **m > 0.0)
                .map(|(l, _)| *l)
                .collect()
        })
        .collect()
}

/// Each trajectory's generated tokens' log-probabilities under `w`, row by row through the
/// unpacked forward (the reference the trainer's packed forward must equal).
fn rowwise_logprobs(w: &LlmWeights, b: &Batch) -> Vec<Vec<f32>> {
    b.trajectories()
        .map(|t| {
            let turn = &t.turns[0];
            let toks: Vec<u32> = turn
                .observation_tokens
                .iter()
                .chain(turn.response_tokens.iter())
                .copied()
                .collect();
            let lsm = candle_nn::ops::log_softmax(&w.forward(&toks[..toks.len() - 1]).unwrap(), 1)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            (turn.observation_tokens.len() - 1..toks.len() - 1)
                .map(|j| lsm[j][toks[j + 1] as usize])
                .collect()
        })
        .collect()
}

/// Largest |Δ| between two models' logits on `tokens`.
fn logit_gap(a: &LlmWeights, b: &LlmWeights, tokens: &[u32]) -> f32 {
    max_gap(&a.forward(tokens).unwrap(), &b.forward(tokens).unwrap())
}

fn config(lr: f64) -> TrainerConfig {
    TrainerConfig {
        lr,
        grad_clip: 1.0,
        ..TrainerConfig::default()
    }
}

/// Full fine-tuning: recomputed = generated logprobs (two rows of different lengths padded
/// into one batch), a step raises the rewarded answer and lowers the other, and the weights
/// it publishes make an engine compute the trainer's logits.
#[test]
fn full_fine_tuning_recomputes_generation_logprobs_and_publishes_its_model() {
    let (w, tok) = model();
    let outs = answers(&w, &tok);
    let b = batch(&outs, &[1.0, 0.0]);
    let (m, init) = LlmModel::new(copy(&w), None, 256, 1).unwrap();
    let mut t = BuiltinTrainer::with_model(m, &init, config(2e-5)).unwrap();
    let before = trainer_logprobs(&t, &b);
    let mut worst = 0.0f32;
    for (row, o) in before.iter().zip(&outs) {
        assert_eq!(row.len(), o.logprobs.len());
        for (a, g) in row.iter().zip(&o.logprobs) {
            worst = worst.max((a - g).abs());
        }
    }
    assert!(worst <= 1e-4, "trainer vs engine logprob: {worst}");
    eprintln!("max |trainer − engine| logprob: {worst:.2e}");
    let (stats, published) = t.step(&b).unwrap();
    assert!(
        stats.loss.is_finite()
            && stats.tokens as usize == outs.iter().map(|o| o.tokens.len()).sum::<usize>()
    );
    let after = trainer_logprobs(&t, &b);
    let sum = |v: &[f32]| v.iter().map(|x| *x as f64).sum::<f64>();
    assert!(
        sum(&after[0]) > sum(&before[0]),
        "the rewarded answer became likelier"
    );
    assert!(
        sum(&after[1]) < sum(&before[1]),
        "the other became less likely"
    );
    // The engine installs the publication and computes the trainer's model.
    let mut e = BuiltinEngine::with_decoder(LlmDecoder::new(copy(&w), tok.clone(), 256), 0, 2);
    e.install(1, &published, InFlightPolicy::Abort).unwrap();
    let p = t.params().unwrap();
    let gap = logit_gap(e.decoder().weights(), &p, &prompts()[1]);
    assert!(gap <= 1e-4, "engine vs trainer logits after sync: {gap}");
}

/// LoRA on q, v and up: at start the model is the base; only adapters (and their scale)
/// are published and engines merge them; every adapter gets a gradient; a checkpoint
/// restores the run exactly.
#[test]
fn lora_trains_adapters_only_and_engines_merge_them() {
    let (w, tok) = model();
    let outs = answers(&w, &tok);
    let b = batch(&outs, &[0.0, 1.0]);
    let lora = LoraConfig {
        rank: 4,
        alpha: 8.0,
        targets: vec!["attn_q".into(), "attn_v".into(), "ffn_up".into()],
        seed: 3,
    };
    let (m, init) = LlmModel::new(copy(&w), Some(lora.clone()), 256, 2).unwrap();
    assert_eq!(init.len(), w.cfg.n_layers * 3 * 2);
    let mut t = BuiltinTrainer::with_model(m, &init, config(1e-3)).unwrap();
    assert!(
        logit_gap(&t.params().unwrap(), &w, &prompts()[0]) == 0.0,
        "B = 0: the base model"
    );
    let (_, published) = t.step(&b).unwrap();
    let names: Vec<&str> = published
        .shared
        .as_ref()
        .unwrap()
        .0
        .iter()
        .map(|(n, _)| n.as_str())
        .collect();
    assert!(
        names
            .iter()
            .all(|n| n.ends_with(".lora_a") || n.ends_with(".lora_b") || *n == train::LORA_SCALE),
        "{names:?}"
    );
    let bytes = published.modelled_bytes;
    assert!(
        bytes < 0.01 * (w.cfg.params() as f64 * 4.0),
        "adapter-only sync: {bytes} bytes"
    );
    let mut e = BuiltinEngine::with_decoder(LlmDecoder::new(copy(&w), tok.clone(), 256), 0, 2);
    e.install(1, &published, InFlightPolicy::Recompute).unwrap();
    let gap = logit_gap(e.decoder().weights(), &t.params().unwrap(), &prompts()[1]);
    assert!(gap <= 1e-4, "engine (merged adapters) vs trainer: {gap}");
    assert!(
        logit_gap(e.decoder().weights(), &w, &prompts()[1]) > 1e-4,
        "the step changed the model"
    );
    // The trainer's packed forward (two rows of different lengths, adapters beside the
    // frozen base, the head only over generated tokens) equals the merged model row by row.
    let (packed, rowwise) = (
        trainer_logprobs(&t, &b),
        rowwise_logprobs(e.decoder().weights(), &b),
    );
    let mut worst = 0.0f32;
    for (p, r) in packed.iter().zip(&rowwise) {
        assert_eq!(p.len(), r.len());
        for (x, y) in p.iter().zip(r) {
            worst = worst.max((x - y).abs());
        }
    }
    assert!(
        worst <= 1e-4,
        "packed LoRA vs merged row-by-row logprob: {worst}"
    );
    // Every adapter gets a gradient (B ≠ 0 after a step, so A's is not zero either).
    let tb = tensor_batches_for(
        &b,
        t.cfg.advantage,
        &t.model.shape(),
        usize::MAX,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap()
    .pop()
    .unwrap();
    let (loss, _) = t.objective(&tb).unwrap();
    let grads = loss.backward().unwrap();
    for (name, v) in t.trained() {
        let g = grads
            .get(&v)
            .unwrap_or_else(|| panic!("{name} got no gradient"));
        let n: f32 = g.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
        assert!(n > 0.0 && n.is_finite(), "{name}: |grad|² = {n}");
    }
    // Checkpoint and resume: the next step is the same from the original and the restored.
    let dir = std::env::temp_dir().join(format!("rollarc-lora-ck-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("v1.safetensors");
    t.save(&path).unwrap();
    let (m2, init2) = LlmModel::new(copy(&w), Some(lora), 256, 2).unwrap();
    let mut r = BuiltinTrainer::with_model(m2, &init2, config(1e-3)).unwrap();
    r.load(&path).unwrap();
    let (_, a) = t.step(&b).unwrap();
    let (_, c) = r.step(&b).unwrap();
    for ((n, x), (_, y)) in a.shared.unwrap().0.iter().zip(c.shared.unwrap().0.iter()) {
        let d = max_gap(x, y);
        assert!(d == 0.0, "{n} differs after resume by {d}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
