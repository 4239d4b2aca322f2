use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::engine::BuiltinEngine;
use super::tokenizer::{BOS, ByteTokenizer, EOT, SEP};
use super::trainer::{BuiltinTrainer, TrainerConfig, tensor_batch, tensor_batches};
use super::transformer::{ModelConfig, Params, SeqCache, Transformer};
use crate::generation::{GenOutput, GenRequest, GenerationEngine, SamplingParams};
use crate::rl::{AdvantageKind, Aggregation, PpoConfig};
use crate::types::{Batch, Group, Timings, Trajectory, Turn};

fn tiny() -> ModelConfig {
    ModelConfig {
        vocab: super::tokenizer::VOCAB,
        d_model: 8,
        n_layers: 2,
        n_heads: 2,
        d_ff: 16,
        max_seq: 16,
    }
}

fn traj(group: u64, obs: Vec<u32>, resp: Vec<u32>, lps: Vec<f32>, reward: f64) -> Trajectory {
    Trajectory {
        id: format!("t{group}-{}", resp.first().copied().unwrap_or(0)),
        group_id: group,
        task: "t".into(),
        seed: 0,
        start_version: 0,
        pool: "p".into(),
        shard: 0,
        turns: vec![Turn {
            observation_tokens: obs.into(),
            response_tokens: resp.into(),
            logprobs: lps.into(),
            versions: vec![],
            env_reward: reward,
            prefill_tokens: 0,
            ..Turn::default()
        }],
        reward: Some(reward),
        success: reward > 0.5,
        invalid_actions: 0,
        failure: None,
        reference: None,
        final_text: String::new(),
        allowed_tokens: None,
        truncated: false,
        agent: None,
        verdict: None,
        timings: Timings::default(),
    }
}

fn toy_batch() -> Batch {
    let g = |id: u64, rewards: [f64; 3]| Group {
        id,
        task: "t".into(),
        seed: 0,
        start_version: 0,
        masked: 0,
        trajectories: rewards
            .iter()
            .enumerate()
            .map(|(k, &r)| {
                traj(
                    id,
                    vec![BOS, 48 + k as u32, SEP],
                    vec![65 + k as u32, 66, 67],
                    vec![-5.0, -5.2, -5.4],
                    r,
                )
            })
            .collect(),
    };
    Batch {
        step: 0,
        groups: vec![g(0, [1.0, 0.0, 0.5]), g(1, [0.0, 1.0, 1.0])],
    }
}

#[test]
fn gradients_agree_with_finite_differences() {
    let cfg = tiny();
    let init = Params::init(&cfg, 3, DType::F64, &Device::Cpu).unwrap();
    let tcfg = TrainerConfig {
        ppo: PpoConfig {
            aggregation: Aggregation::SeqMeanTokenMean,
            ..PpoConfig::default()
        },
        kl_beta: 0.1,
        ..TrainerConfig::default()
    };
    let tr = BuiltinTrainer::new(cfg, &init, tcfg.clone()).unwrap();
    let batch = toy_batch();
    let tb = tensor_batch(
        &batch,
        AdvantageKind::Grpo,
        cfg.max_seq,
        DType::F64,
        &Device::Cpu,
    )
    .unwrap();
    let (loss, _) = tr.objective(&tb).unwrap();
    let grads = loss.backward().unwrap();
    let p = tr.params().unwrap();
    let mut checked = 0;
    let mut rng = SmallRng::seed_from_u64(9);
    for (name, t) in p.named() {
        let g = grads
            .get(t)
            .unwrap_or_else(|| panic!("parameter {name} received no gradient"));
        let g: Vec<f64> = g.flatten_all().unwrap().to_vec1().unwrap();
        assert!(
            g.iter().any(|x| *x != 0.0),
            "parameter {name} has an all-zero gradient"
        );
        // Central differences on a few random coordinates of each parameter.
        let base: Vec<f64> = t.flatten_all().unwrap().to_vec1().unwrap();
        for _ in 0..3 {
            let i = rng.random_range(0..base.len());
            let h = 1e-6;
            let eval = |delta: f64| {
                let mut v = base.clone();
                v[i] += delta;
                let var = Var::from_tensor(&Tensor::from_vec(v, t.shape(), &Device::Cpu).unwrap())
                    .unwrap();
                let mut tr2 = BuiltinTrainer::new(cfg, &init, tcfg.clone()).unwrap();
                tr2.set_param(&name, &var).unwrap();
                tr2.objective(&tb).unwrap().0.to_scalar::<f64>().unwrap()
            };
            let num = (eval(h) - eval(-h)) / (2.0 * h);
            let err = (num - g[i]).abs() / (num.abs().max(g[i].abs()).max(1e-4));
            assert!(
                err < 1e-4,
                "{name}[{i}]: autograd {} vs numeric {num}",
                g[i]
            );
            checked += 1;
        }
    }
    assert!(checked >= 3 * 18);
}

#[test]
fn tensor_loss_matches_the_numpy_fixtures() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/fixtures/rl/ppo_loss.json");
    let f: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("json");
    for c in f["cases"].as_array().expect("cases") {
        let rows = |k: &str| -> Vec<Vec<f64>> {
            c[k].as_array()
                .unwrap()
                .iter()
                .map(|r| {
                    r.as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_f64().unwrap())
                        .collect()
                })
                .collect()
        };
        let (new, old, beh, mask) = (
            rows("logp_new"),
            rows("logp_old"),
            rows("logp_behaviour"),
            rows("mask"),
        );
        let t = new.iter().map(Vec::len).max().unwrap();
        let pad = |m: &Vec<Vec<f64>>| {
            Tensor::from_vec(
                m.iter()
                    .flat_map(|r| (0..t).map(move |j| r.get(j).copied().unwrap_or(0.0)))
                    .collect::<Vec<f64>>(),
                (m.len(), t),
                &Device::Cpu,
            )
            .unwrap()
        };
        let adv: Vec<f64> = c["advantages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let adv = Tensor::from_vec(adv.clone(), adv.len(), &Device::Cpu).unwrap();
        for (key, want) in c["expected"].as_object().unwrap() {
            let mut cfg = PpoConfig::default();
            for part in key.split('/') {
                match part.split_once('=') {
                    None if part == "token_mean" => cfg.aggregation = Aggregation::TokenMean,
                    None => cfg.aggregation = Aggregation::SeqMeanTokenMean,
                    Some(("eps_low", v)) => cfg.eps_low = v.parse().unwrap(),
                    Some(("eps_high", v)) => cfg.eps_high = v.parse().unwrap(),
                    Some(("tis_cap", v)) => cfg.tis_cap = Some(v.parse().unwrap()),
                    Some(_) => panic!("{part}"),
                }
            }
            let got = super::trainer::ppo_loss(
                &cfg,
                &pad(&new),
                &pad(&old),
                &pad(&beh),
                &pad(&mask),
                &adv,
            )
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
            assert!(
                (got - want.as_f64().unwrap()).abs() <= 1e-6,
                "{key}: {got} vs {want}"
            );
        }
    }
}

fn run_to_completion(engine: &mut BuiltinEngine, reqs: Vec<GenRequest>) -> Vec<(u64, GenOutput)> {
    for r in reqs {
        engine.add(r);
    }
    let mut out = Vec::new();
    let mut guard = 0;
    while engine.has_work() {
        for (id, r) in engine.step().finished {
            out.push((id, r.expect("generation succeeds")));
        }
        guard += 1;
        assert!(guard < 10_000, "engine does not finish");
    }
    out.sort_by_key(|(id, _)| *id);
    out
}

fn req(id: u64, context: Vec<u32>, max_tokens: u32, seed: u64, temperature: f32) -> GenRequest {
    GenRequest {
        id,
        session: id,
        context: Arc::new(context.into()),
        params: SamplingParams {
            temperature,
            top_p: 1.0,
            max_tokens,
            stop_tokens: vec![],
            seed,
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

#[test]
fn cached_decoding_matches_the_full_forward() {
    let cfg = ModelConfig {
        max_seq: 32,
        ..tiny()
    };
    let p = Params::init(&cfg, 5, DType::F32, &Device::Cpu).unwrap();
    let m = Transformer::new(cfg);
    let seq: Vec<u32> = vec![BOS, 70, 71, 72, SEP, 80, 81, 82, 83];
    let full = m
        .forward(
            &p,
            &Tensor::from_slice(&seq, (1, seq.len()), &Device::Cpu).unwrap(),
        )
        .unwrap();
    let full: Vec<Vec<f32>> = full.squeeze(0).unwrap().to_vec2().unwrap();
    // Prefill 5, then decode the rest one by one (alongside a second, longer sequence).
    let mut a = SeqCache::new(&cfg);
    let mut b = SeqCache::new(&cfg);
    let last = m
        .prefill(&p, &seq[..5], &mut a)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    m.prefill(&p, &[BOS, 1, 2, 3, 4, 5, 6, 7, 8, 9], &mut b)
        .unwrap();
    let close = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(p, q)| (p - q).abs() < 1e-4);
    assert!(close(&last, &full[4]));
    for k in 5..seq.len() {
        let out = m
            .decode(&p, &[seq[k], 10], &mut [&mut a, &mut b])
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert!(close(&out[0], &full[k]), "position {k}");
    }
}

#[test]
fn generation_logprobs_equal_the_trainers_recomputed_ones() {
    let cfg = ModelConfig {
        max_seq: 64,
        ..ModelConfig::default()
    };
    let init = Params::init(&cfg, 11, DType::F32, &Device::Cpu).unwrap();
    let w = init.to_weights(0).unwrap();
    let mut engine = BuiltinEngine::new(cfg, &w, 8).unwrap();
    let tok = ByteTokenizer;
    let reqs = (0..6u64)
        .map(|i| {
            let mut ctx = vec![BOS];
            ctx.extend(tok.encode(&format!("prompt {i} {}", "x".repeat(i as usize))));
            ctx.push(SEP);
            req(i, ctx, 12 + i as u32, 100 + i, 1.0)
        })
        .collect::<Vec<_>>();
    let contexts: Vec<Vec<u32>> = reqs.iter().map(|r| r.context.to_vec()).collect();
    let outs = run_to_completion(&mut engine, reqs);
    let trainer = BuiltinTrainer::new(cfg, &init, TrainerConfig::default()).unwrap();
    let group = Group {
        id: 0,
        task: "t".into(),
        seed: 0,
        start_version: 0,
        masked: 0,
        trajectories: outs
            .iter()
            .map(|(id, o)| {
                traj(
                    0,
                    contexts[*id as usize].clone(),
                    o.tokens.to_vec(),
                    o.logprobs.to_vec(),
                    0.0,
                )
            })
            .collect(),
    };
    let batch = Batch {
        step: 0,
        groups: vec![group],
    };
    let tb = tensor_batch(
        &batch,
        AdvantageKind::Grpo,
        cfg.max_seq,
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let lp = trainer.logprobs(&trainer.params().unwrap(), &tb).unwrap();
    let diff = ((lp - &tb.behaviour).unwrap().abs().unwrap() * &tb.mask)
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(tb.tokens > 50);
    assert!(diff <= 1e-4, "max |generation − trainer| log-prob = {diff}");
}

#[test]
fn constrained_decoding_samples_only_allowed_tokens_and_the_trainer_agrees() {
    let cfg = ModelConfig {
        max_seq: 64,
        ..ModelConfig::default()
    };
    let init = Params::init(&cfg, 13, DType::F32, &Device::Cpu).unwrap();
    let w = init.to_weights(0).unwrap();
    let mut engine = BuiltinEngine::new(cfg, &w, 8).unwrap();
    let allowed: Arc<[u32]> = Arc::from(vec![
        b'D' as u32,
        b'L' as u32,
        b'R' as u32,
        b'U' as u32,
        EOT,
    ]);
    let reqs: Vec<GenRequest> = (0..8u64)
        .map(|i| {
            let mut r = req(i, vec![BOS, 80 + i as u32, SEP], 6, 200 + i, 1.0);
            r.params.allowed_tokens = Some(allowed.clone());
            r
        })
        .collect();
    let contexts: Vec<Vec<u32>> = reqs.iter().map(|r| r.context.to_vec()).collect();
    let outs = run_to_completion(&mut engine, reqs);
    let mut seen = std::collections::BTreeSet::new();
    for (_, o) in &outs {
        for t in &o.tokens {
            assert!(allowed.contains(t), "sampled {t} outside the alphabet");
            seen.insert(*t);
        }
        // Probabilities over 5 tokens: each log-prob is well above the unconstrained ~ln(1/260).
        assert!(o.logprobs.iter().all(|&lp| lp > -4.0), "{:?}", o.logprobs);
    }
    assert!(
        seen.len() >= 3,
        "the constrained policy still explores: {seen:?}"
    );
    let trainer = BuiltinTrainer::new(cfg, &init, TrainerConfig::default()).unwrap();
    let trajectories = outs
        .iter()
        .map(|(id, o)| {
            let mut t = traj(
                0,
                contexts[*id as usize].clone(),
                o.tokens.to_vec(),
                o.logprobs.to_vec(),
                0.0,
            );
            t.allowed_tokens = Some(allowed.to_vec());
            t
        })
        .collect();
    let batch = Batch {
        step: 0,
        groups: vec![Group {
            id: 0,
            task: "t".into(),
            seed: 0,
            start_version: 0,
            masked: 0,
            trajectories,
        }],
    };
    let tb = tensor_batch(
        &batch,
        AdvantageKind::Grpo,
        cfg.max_seq,
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    assert!(tb.allow.is_some());
    let lp = trainer.logprobs(&trainer.params().unwrap(), &tb).unwrap();
    let diff = ((lp - &tb.behaviour).unwrap().abs().unwrap() * &tb.mask)
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(
        diff <= 1e-4,
        "max |generation − trainer| constrained log-prob = {diff}"
    );
}

#[test]
fn chunked_objective_equals_the_whole_batch_objective() {
    // Rows of different lengths so chunks differ in padding, token and sequence counts.
    let mut batch = toy_batch();
    for (k, t) in batch.groups[1].trajectories.iter_mut().enumerate() {
        t.turns[0].response_tokens.truncate(1 + k);
        t.turns[0].logprobs.truncate(1 + k);
    }
    for aggregation in [Aggregation::TokenMean, Aggregation::SeqMeanTokenMean] {
        let cfg = tiny();
        let init = Params::init(&cfg, 3, DType::F64, &Device::Cpu).unwrap();
        let tcfg = TrainerConfig {
            ppo: PpoConfig {
                aggregation,
                ..PpoConfig::default()
            },
            kl_beta: 0.1,
            ..TrainerConfig::default()
        };
        let trainer = BuiltinTrainer::new(cfg, &init, tcfg).unwrap();
        let whole = tensor_batch(
            &batch,
            AdvantageKind::Grpo,
            cfg.max_seq,
            DType::F64,
            &Device::Cpu,
        )
        .unwrap();
        let (full, _) = trainer.objective(&whole).unwrap();
        let full = full.to_scalar::<f64>().unwrap();
        let chunks = tensor_batches(
            &batch,
            AdvantageKind::Grpo,
            cfg.max_seq,
            2,
            DType::F64,
            &Device::Cpu,
        )
        .unwrap();
        assert!(chunks.len() >= 3);
        let (tokens, seqs): (usize, usize) = (
            chunks.iter().map(|c| c.tokens).sum(),
            chunks.iter().map(|c| c.seqs).sum(),
        );
        let mut sum = 0.0;
        for c in &chunks {
            let (policy, kl, _) = trainer.objective_parts(c).unwrap();
            let w = match aggregation {
                Aggregation::TokenMean => c.tokens as f64 / tokens as f64,
                Aggregation::SeqMeanTokenMean => c.seqs as f64 / seqs as f64,
            };
            sum += policy.to_scalar::<f64>().unwrap() * w
                + kl.unwrap().to_scalar::<f64>().unwrap() * 0.1 * c.tokens as f64 / tokens as f64;
        }
        assert!(
            (sum - full).abs() < 1e-9,
            "{aggregation:?}: chunked {sum} vs whole {full}"
        );
    }
}

/// Micro-batches stop at their token budget (a longer row alone) as well as their row cap,
/// and together hold every row once.
#[test]
fn micro_batches_keep_to_their_token_budget() {
    let batch = toy_batch();
    let shape = super::trainer::BatchShape::tiny(tiny().max_seq);
    let whole = tensor_batch(
        &batch,
        AdvantageKind::Grpo,
        shape.max_seq,
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    // A row's tokens: its inputs up to the last that is not padding, and the last target.
    let lens_of = |tb: &super::trainer::TensorBatch| -> Vec<usize> {
        let m: Vec<Vec<u32>> = tb.inputs.to_vec2().unwrap();
        m.iter()
            .map(|r| r.iter().rposition(|&t| t != shape.pad).map_or(0, |p| p + 2))
            .collect()
    };
    let lens = lens_of(&whole);
    let longest = *lens.iter().max().unwrap();
    for (rows, budget) in [
        (usize::MAX, longest),
        (usize::MAX, 2 * longest),
        (2, usize::MAX),
        (3, longest / 2),
    ] {
        let chunks = super::trainer::micro_batches(
            &batch,
            AdvantageKind::Grpo,
            &shape,
            (rows, budget),
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        let mut seen = 0;
        for c in &chunks {
            let l = lens_of(c);
            assert!(l.len() <= rows, "{} rows over the cap {rows}", l.len());
            let total: usize = l.iter().sum();
            assert!(
                l.len() == 1 || total <= budget,
                "{l:?}: {total} tokens over {budget}"
            );
            seen += l.len();
        }
        assert_eq!(
            seen,
            lens.len(),
            "rows {rows}, budget {budget}: every row once"
        );
        if budget == longest {
            // No two of the longest rows fit together: at least one chunk per such row.
            assert!(chunks.len() >= lens.iter().filter(|&&l| 2 * l > longest).count());
        }
    }
}

#[test]
fn a_seeded_request_replays_exactly() {
    let cfg = ModelConfig {
        max_seq: 64,
        ..ModelConfig::default()
    };
    let w = Params::init(&cfg, 1, DType::F32, &Device::Cpu)
        .unwrap()
        .to_weights(0)
        .unwrap();
    let generate = |seed| {
        let mut e = BuiltinEngine::new(cfg, &w, 4).unwrap();
        run_to_completion(
            &mut e,
            vec![
                req(0, vec![BOS, 65, SEP], 20, seed, 1.0),
                req(1, vec![BOS, 66, 67, SEP], 7, seed + 1, 1.0),
            ],
        )
    };
    assert_eq!(generate(7), generate(7));
    assert_ne!(generate(7), generate(8));
}

#[test]
fn checkpoints_restore_parameters_and_optimiser_state() {
    let cfg = tiny();
    let init = Params::init(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
    let mut a = BuiltinTrainer::new(cfg, &init, TrainerConfig::default()).unwrap();
    a.step(&toy_batch()).unwrap();
    let dir = tempfile_dir();
    let path = dir.join("ckpt.safetensors");
    a.save(&path).unwrap();
    let mut b = BuiltinTrainer::new(cfg, &init, TrainerConfig::default()).unwrap();
    b.load(&path).unwrap();
    assert_eq!(b.version(), 1);
    // The next step is identical from the original and the restored trainer.
    let (_, wa) = a.step(&toy_batch()).unwrap();
    let (_, wb) = b.step(&toy_batch()).unwrap();
    assert_eq!(wa, wb);
    let _ = std::fs::remove_dir_all(dir);
}

fn tempfile_dir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("rollarc-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// "Answer with the digit shown": one token per answer; full reward for the right digit, a
/// little for any digit. Success is greedy accuracy over the ten digits.
#[test]
fn the_policy_learns_to_answer_with_the_digit_shown() {
    let cfg = ModelConfig {
        d_model: 32,
        n_layers: 1,
        n_heads: 2,
        d_ff: 64,
        max_seq: 8,
        ..ModelConfig::default()
    };
    let init = Params::init(&cfg, 21, DType::F32, &Device::Cpu).unwrap();
    let tcfg = TrainerConfig {
        lr: 3e-3,
        grad_clip: 1.0,
        ..TrainerConfig::default()
    };
    let mut trainer = BuiltinTrainer::new(cfg, &init, tcfg).unwrap();
    let mut engine = BuiltinEngine::new(cfg, &init.to_weights(0).unwrap(), 256).unwrap();
    let mut rng = SmallRng::seed_from_u64(5);
    let prompt = |d: u32| vec![BOS, 48 + d, SEP];
    let accuracy = |engine: &mut BuiltinEngine| {
        let outs = run_to_completion(
            engine,
            (0..10u32)
                .map(|d| req(d as u64, prompt(d), 1, 0, 0.0))
                .collect(),
        );
        outs.iter()
            .filter(|(id, o)| o.tokens[0] == 48 + *id as u32)
            .count() as f64
            / 10.0
    };
    let start = accuracy(&mut engine);
    let mut end = start;
    let mut next_id = 1000;
    for step in 0..300u64 {
        let mut groups = Vec::new();
        let mut reqs = Vec::new();
        let digits: Vec<u32> = (0..16).map(|_| rng.random_range(0..10)).collect();
        for (g, &d) in digits.iter().enumerate() {
            for _ in 0..8 {
                reqs.push((g, d, req(next_id, prompt(d), 1, rng.random(), 1.0)));
                next_id += 1;
            }
        }
        let outs = run_to_completion(&mut engine, reqs.iter().map(|r| r.2.clone()).collect());
        for (g, &d) in digits.iter().enumerate() {
            let trajs = reqs
                .iter()
                .zip(&outs)
                .filter(|(r, _)| r.0 == g)
                .map(|(_, (_, o))| {
                    let t = o.tokens[0];
                    let r = if t == 48 + d {
                        1.0
                    } else if (48..58).contains(&t) {
                        0.1
                    } else {
                        0.0
                    };
                    traj(
                        g as u64,
                        prompt(d),
                        o.tokens.to_vec(),
                        o.logprobs.to_vec(),
                        r,
                    )
                })
                .collect();
            groups.push(Group {
                id: g as u64,
                task: "digit".into(),
                seed: 0,
                start_version: step,
                masked: 0,
                trajectories: trajs,
            });
        }
        let (_, w) = trainer.step(&Batch { step, groups }).unwrap();
        engine
            .install(w.version, &w, crate::generation::InFlightPolicy::Abort)
            .unwrap();
        if step % 10 == 9 {
            end = accuracy(&mut engine);
            eprintln!("step {step}: accuracy {end}");
            if end >= 0.9 {
                break;
            }
        }
    }
    assert!(
        start <= 0.2,
        "a random policy should rarely be right, got {start}"
    );
    assert!(
        end >= 0.9,
        "greedy accuracy after training: {end} (from {start})"
    );
}

/// A step reports what it measured: near-uniform entropy at initialisation, importance
/// weights below 1 where the behaviour logprobs (−5.0…−5.4) exceed the model's (≈ −ln 260),
/// lower clips on negative advantages and none above, the KL to the (identical) reference ≈ 0,
/// the learning rate it used, a gradient norm, and the batch's response lengths.
#[test]
fn a_training_step_reports_its_diagnostics() {
    let cfg = tiny();
    let init = Params::init(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
    let tc = TrainerConfig {
        kl_beta: 0.1,
        recompute_old: false,
        ..TrainerConfig::default()
    };
    let lr = tc.lr_at(0);
    let mut t = BuiltinTrainer::new(cfg, &init, tc).unwrap();
    let (s, _) = t.step(&toy_batch()).unwrap();
    let n = &s.numbers;
    let uniform = (super::tokenizer::VOCAB as f64).ln();
    let ent = n.entropy.unwrap();
    assert!(
        (ent - uniform).abs() < 0.05,
        "entropy {ent} vs ln V {uniform}"
    );
    let (mean, max) = (n.is_weight_mean.unwrap(), n.is_weight_max.unwrap());
    assert!(
        mean > 0.5 && mean < 0.9 && max >= mean && max < 1.0,
        "{mean} {max}"
    );
    assert!(n.clip_frac_low.unwrap() > 0.0, "{n:?}");
    assert_eq!(n.clip_frac_high, Some(0.0));
    let kl = n.kl.unwrap();
    assert!((0.0..1e-6).contains(&kl), "kl {kl}");
    assert_eq!(n.lr, Some(lr));
    assert!(n.grad_norm.unwrap() > 0.0);
    assert!(
        (n.policy_loss.unwrap() + 0.1 * kl - s.loss).abs() < 1e-9,
        "{n:?} {}",
        s.loss
    );
    assert_eq!(n.response_len_mean, Some(3.0));
    assert_eq!(n.response_len_max, Some(3));
}
