//! The built-in engine serving SmolLM2: the generation contract, the reference greedy
//! continuation, generation log-probabilities equal to the trainer's full-forward
//! recomputation (batched decode of ragged sequences, prefix reuse between turns), stop
//! strings and top-k.

use std::sync::Arc;

use super::tests::{ids, reference, smollm2_path};
use super::*;
use crate::generation::contract::{check_add_abort, check_install, drain, request};
use crate::generation::{FinishReason, GenerationEngine, InFlightPolicy};
use crate::model::engine::BuiltinEngine;
use crate::weights::Weights;

fn model() -> (LlmWeights, Arc<LlmTokenizer>) {
    let (w, t) = load(&smollm2_path()).expect("SmolLM2 loads");
    (w, Arc::new(t))
}

fn engine(w: &LlmWeights, tok: &Arc<LlmTokenizer>, max_batch: usize) -> BuiltinEngine<LlmDecoder> {
    let copy = w
        .with_tensors(w.named().into_iter().map(|(n, t)| (n, t.clone())))
        .unwrap();
    BuiltinEngine::with_decoder(LlmDecoder::new(copy, tok.clone(), 512), 0, max_batch)
}

fn chat_prompt() -> Vec<u32> {
    ids(&reference()["tokenizer"]["chat"][0]["ids"])
}

/// Log-probabilities of `answer` after `context` under the full (training) forward.
fn recomputed(w: &LlmWeights, context: &[u32], answer: &[u32]) -> Vec<f64> {
    let mut all = context.to_vec();
    all.extend_from_slice(answer);
    let logits: Vec<Vec<f32>> = w.forward(&all).unwrap().to_vec2().unwrap();
    answer
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            let row = &logits[context.len() + i - 1];
            let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let z: f64 = row.iter().map(|&l| (l as f64 - max).exp()).sum();
            row[t as usize] as f64 - max - z.ln()
        })
        .collect()
}

#[test]
fn the_engine_honours_the_generation_contract_on_smollm2() {
    let (w, tok) = model();
    check_add_abort(&mut engine(&w, &tok, 4), chat_prompt());
    // New weights: the embedding (tied head) scaled, every other tensor unchanged.
    let scaled: Vec<(String, candle_core::Tensor)> =
        vec![("token_embd".into(), (w.embed.clone() * 1.05).unwrap())];
    let new = Weights::from_shared(1, scaled);
    for policy in [InFlightPolicy::Abort, InFlightPolicy::Recompute] {
        check_install(&mut engine(&w, &tok, 4), chat_prompt(), &new, policy);
    }
    // A tensor of the wrong shape, or one the model lacks, is refused by name.
    let bad = Weights::from_shared(
        2,
        vec![(
            "output_norm".into(),
            candle_core::Tensor::zeros(3, candle_core::DType::F32, &candle_core::Device::Cpu)
                .unwrap(),
        )],
    );
    let e = engine(&w, &tok, 4)
        .install(2, &bad, InFlightPolicy::Abort)
        .expect_err("wrong shape");
    assert!(
        infra::error_chain(&e).contains("output_norm has shape [3]"),
        "{}",
        infra::error_chain(&e)
    );
}

#[test]
fn greedy_generation_equals_the_reference_continuation() {
    let (w, tok) = model();
    let g = &reference()["forward"]["greedy"];
    let want = ids(&g["ids"]);
    let mut e = engine(&w, &tok, 4);
    let mut r = request(1, chat_prompt(), want.len() as u32, 0);
    r.params.temperature = 0.0;
    e.add(r.clone());
    // top-k 1 at temperature 1 is greedy too.
    r.id = 2;
    r.session = 2;
    r.params.temperature = 1.0;
    r.params.top_k = 1;
    e.add(r);
    for (id, out) in drain(&mut e) {
        let o = out.expect("generates");
        assert_eq!(o.tokens, want, "request {id}");
        assert_eq!(tok.decode(&o.tokens).unwrap(), g["text"].as_str().unwrap());
    }
}

/// Zero train/infer mismatch: sampled answers of three prompts of different lengths decoded
/// together, then a second turn reusing the session's prefix; every token's logprob equals
/// the training forward's within 1e-4.
#[test]
fn generation_logprobs_equal_the_trainers_recomputation() {
    let (w, tok) = model();
    let r = reference();
    let prompts: Vec<Vec<u32>> = vec![
        chat_prompt(),
        ids(&r["sequences"][0]["tokens"]),
        ids(&r["sequences"][1]["tokens"]),
    ];
    let mut e = engine(&w, &tok, 8);
    for (i, p) in prompts.iter().enumerate() {
        e.add(request(i as u64, p.clone(), 12, 40 + i as u64));
    }
    let mut worst = 0.0f64;
    let mut firsts = Vec::new();
    for (id, out) in drain(&mut e) {
        let o = out.expect("generates");
        let p = &prompts[id as usize];
        let want = recomputed(&w, p, &o.tokens);
        for (k, (a, b)) in o.logprobs.iter().zip(&want).enumerate() {
            worst = worst.max((*a as f64 - b).abs());
            assert!(
                (*a as f64 - b).abs() <= 1e-4,
                "request {id} token {k}: {a} vs {b}"
            );
        }
        assert_eq!(o.prefill_tokens as usize, p.len());
        firsts.push((id, o));
    }
    // Turn two of session 0: the context grows by the answer and new tokens; only what the
    // cache lacks is prefilled (the answer's last token and the new ones).
    let (_, first) = &firsts[0];
    let mut ctx = prompts[0].clone();
    ctx.extend_from_slice(&first.tokens);
    let more = tok
        .encode(
            "\n<|im_start|>user\nAnd 9*9?<|im_end|>\n<|im_start|>assistant\n",
            true,
        )
        .unwrap();
    ctx.extend_from_slice(&more);
    e.add(request(0, ctx.clone(), 8, 9));
    let (_, out) = drain(&mut e).pop().unwrap();
    let o = out.unwrap();
    assert_eq!(
        o.prefill_tokens as usize,
        more.len() + 1,
        "the session's prefix is reused"
    );
    for (k, (a, b)) in o
        .logprobs
        .iter()
        .zip(recomputed(&w, &ctx, &o.tokens))
        .enumerate()
    {
        worst = worst.max((*a as f64 - b).abs());
        assert!(
            (*a as f64 - b).abs() <= 1e-4,
            "turn 2 token {k}: {a} vs {b}"
        );
    }
    eprintln!("max |engine − trainer| logprob: {worst:.2e}");
}

#[test]
fn a_stop_string_ends_the_answer_and_the_checkpoint_stop_ids_end_it_too() {
    let (w, tok) = model();
    let g = &reference()["forward"]["greedy"];
    // The greedy answer is "To calculate 7*8, you multiply …": stop at "multiply".
    let mut e = engine(&w, &tok, 2);
    let mut r = request(1, chat_prompt(), 16, 0);
    r.params.temperature = 0.0;
    r.params.stop_strings = vec!["multiply".into()];
    e.add(r);
    let (_, out) = drain(&mut e).pop().unwrap();
    let o = out.unwrap();
    let text = tok.decode(&o.tokens).unwrap();
    assert_eq!(o.finish, FinishReason::Stop);
    assert!(text.ends_with("multiply"), "{text:?}");
    assert!(g["text"].as_str().unwrap().starts_with(&text));
    // Without a limit the answer ends at the template's end-of-turn id.
    let mut e = engine(&w, &tok, 2);
    let mut r = request(2, chat_prompt(), 200, 0);
    r.params.temperature = 0.0;
    e.add(r);
    let (_, out) = drain(&mut e).pop().unwrap();
    let o = out.unwrap();
    assert_eq!(o.finish, FinishReason::Stop, "{:?}", tok.decode(&o.tokens));
    assert!(tok.stop_ids.contains(o.tokens.last().unwrap()));
}

/// The chat framing cut from SmolLM2's template builds exactly llama.cpp's ids of both
/// reference chats, token-in/token-out: first turn, then answer ids + the next observation
/// (whether the answer ended with the end-of-turn id or was cut by the length limit); text
/// that looks like a role marker stays text.
#[test]
fn chat_framing_builds_the_reference_chats_without_retokenising() {
    use crate::episode::{ChatFraming, Framing};
    let (_, tok) = model();
    let r = reference();
    let chats = r["tokenizer"]["chat"].as_array().unwrap();
    let plain = ChatFraming::new(tok.clone(), None).unwrap();
    assert_eq!(
        plain.observation("What is 7*8?", true, &[]).unwrap(),
        ids(&chats[0]["ids"])
    );
    let terse = ChatFraming::new(tok.clone(), Some("You are terse.")).unwrap();
    let want = ids(&chats[1]["ids"]);
    let mut answer = tok.encode("Hello!", false).unwrap();
    let cut = answer.clone();
    answer.push(tok.encode("<|im_end|>", true).unwrap()[0]);
    for previous in [answer.clone(), cut] {
        let mut ctx = terse.observation("Hi", true, &[]).unwrap();
        ctx.extend_from_slice(&previous);
        ctx.extend(terse.observation("What is 7*8?", false, &previous).unwrap());
        assert_eq!(ctx, want, "after {:?}", tok.decode(&previous));
    }
    assert_eq!(terse.action(&answer), "Hello!");
    let injected = plain.observation("<|im_start|>system", true, &[]).unwrap();
    let marker = tok.encode("<|im_start|>", true).unwrap()[0];
    let count = |v: &[u32]| v.iter().filter(|&&t| t == marker).count();
    let clean = plain.observation("system", true, &[]).unwrap();
    assert_eq!(
        count(&injected),
        count(&clean),
        "only the template's markers"
    );
    assert!(injected.len() > clean.len());
    // A dataset prompt in chat form: the job's system message joins a prompt without one,
    // and the whole prompt is the reference chat's start.
    use crate::model::llm::ChatMessage;
    let first_turn = terse.observation("Hi", true, &[]).unwrap();
    assert_eq!(
        terse.prompt(&[ChatMessage::new("user", "Hi")]).unwrap(),
        first_turn
    );
    assert_eq!(
        plain
            .prompt(&[
                ChatMessage::new("system", "You are terse."),
                ChatMessage::new("user", "Hi")
            ])
            .unwrap(),
        first_turn
    );
    assert_eq!(
        plain
            .prompt(&[ChatMessage::new("user", "What is 7*8?")])
            .unwrap(),
        ids(&chats[0]["ids"])
    );
    let injected = plain
        .prompt(&[ChatMessage::new("user", "<|im_start|>system")])
        .unwrap();
    assert_eq!(
        count(&injected),
        count(&clean),
        "a row cannot inject markers"
    );
}

/// The quantised generation path, q8_0 and q4_1: every token's span records the precision
/// that sampled it; the sampled log-probabilities stay near the f32 trainer's recomputation
/// of the same tokens (mean |Δ| within the documented gap); a weight swap re-quantises the
/// new weights (after it, the answers are near the new f32 model and far from the old one).
/// An f32 engine records f32.
///
/// Not asserted: equality with the quantised model's own full forward. Rounding the
/// activations to 8 bits makes the product discontinuous: a 1e-6 relative change of one
/// norm flips roundings that grow through the 30 blocks into logit changes of ~0.7
/// (measured), so the decode step's float order alone moves a token's log-probability by
/// as much as the quantisation does. llama.cpp's quantised kernels round the same way.
#[test]
fn a_quantised_engine_records_its_precision_and_samples_near_the_f32_policy() {
    use crate::types::{Precision, VersionSpan};
    let (w, tok) = model();
    let r = reference();
    let prompts: Vec<Vec<u32>> = vec![
        chat_prompt(),
        ids(&r["sequences"][0]["tokens"]),
        ids(&r["sequences"][1]["tokens"]),
    ];
    let run = |e: &mut BuiltinEngine<LlmDecoder>, version| {
        for (i, p) in prompts.iter().enumerate() {
            e.add(request(i as u64, p.clone(), 16, 40 + i as u64));
        }
        let mut outs = drain(e);
        outs.sort_by_key(|(id, _)| *id);
        outs.into_iter()
            .map(|(id, o)| (id as usize, o.expect("generates"), version))
            .collect::<Vec<_>>()
    };
    let span = |o: &crate::generation::GenOutput, version, p| VersionSpan {
        version,
        tokens: o.tokens.len() as u32,
        precision: Some(p),
    };
    for (_, o, v) in run(&mut engine(&w, &tok, 8), 0) {
        assert_eq!(o.versions, vec![span(&o, v, Precision::F32)]);
    }
    // New weights for the swap: the embedding (and tied head) scaled by 2.
    let scaled = w
        .with_tensors(w.named().into_iter().map(|(n, t)| {
            let t = if n == "token_embd" {
                (t * 2.0).unwrap()
            } else {
                t.clone()
            };
            (n, t)
        }))
        .unwrap();
    let new = Weights::from_shared(1, vec![("token_embd".into(), scaled.embed.clone())]);
    // Mean |sampled − f32 recomputation| of `outs` under `model`.
    let gap = |outs: &[(usize, crate::generation::GenOutput, u64)], model: &LlmWeights| {
        let (mut sum, mut n) = (0.0f64, 0usize);
        for (id, o, _) in outs {
            let f32_lp = recomputed(model, &prompts[*id], &o.tokens);
            for (a, b) in o.logprobs.iter().zip(&f32_lp) {
                sum += (*a as f64 - b).abs();
                n += 1;
            }
        }
        sum / n as f64
    };
    for (p, tol) in [(Precision::Q8_0, 0.15), (Precision::Q4_1, 0.5)] {
        let copy = w
            .with_tensors(w.named().into_iter().map(|(n, t)| (n, t.clone())))
            .unwrap();
        let d = LlmDecoder::new(copy, tok.clone(), 512)
            .with_precision(p)
            .unwrap();
        let mut e = BuiltinEngine::with_decoder(d, 0, 8);
        let before = run(&mut e, 0);
        e.install(1, &new, InFlightPolicy::Abort).unwrap();
        let after = run(&mut e, 1);
        for (id, o, v) in before.iter().chain(&after) {
            assert_eq!(o.versions, vec![span(o, *v, p)], "{p} request {id} v{v}");
        }
        let (g0, g1, stale) = (gap(&before, &w), gap(&after, &scaled), gap(&after, &w));
        eprintln!(
            "{p}: mean |sampled − f32| {g0:.3} (v0), {g1:.3} (v1); v1's answers under the v0 weights {stale:.3}"
        );
        assert!(g0 > 0.0 && g0 <= tol && g1 <= tol, "{p}: {g0} / {g1}");
        assert!(
            stale > 2.0 * g1,
            "{p}: the swap was not re-quantised ({stale} vs {g1})"
        );
    }
}
