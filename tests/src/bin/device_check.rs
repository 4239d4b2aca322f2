//! `make device-check`: the generation contract against a real SGLang or vLLM server on a
//! GPU machine, serving SmolLM2 exported as a Hugging Face directory.
//!
//! Usage: `device_check export DIR` writes the model for the server to load;
//! `device_check run sglang|vllm URL DIR` runs the checks against the server at URL (which
//! must read DIR's siblings for installs) and exits non-zero on the first failure: the
//! add/abort contract, teacher-forced logprobs against the built-in forward, installs under
//! abort and recompute.

#![allow(
    clippy::too_many_lines,
    reason = "test code: the 100-line limit is on shipped code; a test reads top to bottom"
)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use actors::generation::contract;
use actors::generation::remote::sglang::Sglang;
use actors::generation::remote::vllm::Vllm;
use actors::generation::remote::{RemoteConfig, RemoteEngine, ServerClient};
use actors::generation::{GenerationEngine, InFlightPolicy};
use actors::model::runtime::{BuiltinParts, CheckpointSpec};

fn smollm2() -> PathBuf {
    actors::model::llm::smollm2_path()
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let spec = CheckpointSpec {
        path: smollm2(),
        max_seq: 1024,
        lora: None,
        micro_batch_rows: 1,
    };
    let (parts, policy) =
        BuiltinParts::checkpoint(&spec, Default::default(), 0, None).expect("SmolLM2 loads");
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["export", dir] => {
            policy
                .save(&parts.initial, std::path::Path::new(dir), None)
                .expect("export");
            println!("SmolLM2 written to {dir}");
            ExitCode::SUCCESS
        }
        ["run", kind, url, dir] => {
            let export = policy.exporter(PathBuf::from(dir).with_file_name("installs"), None);
            let http = reqwest::Client::new();
            let client: Arc<dyn ServerClient> = match kind {
                "sglang" => Arc::new(Sglang::new(http, url, Some(export))),
                "vllm" => Arc::new(Vllm::new(http, url, 8, Some(export))),
                other => {
                    eprintln!("unknown server kind {other:?}: sglang or vllm");
                    return ExitCode::FAILURE;
                }
            };
            let start = || {
                let mut e = RemoteEngine::start(
                    client.clone(),
                    rt.handle().clone(),
                    RemoteConfig::default(),
                );
                let deadline = infra::clock::wall_now() + Duration::from_secs(600);
                while e.info().is_none() && infra::clock::wall_now() < deadline {
                    if e.has_work() {
                        e.step();
                    }
                    contract::pause_briefly();
                }
                e
            };
            let prompt: Vec<u32> = vec![
                1, 9690, 198, 2683, 359, 253, 5356, 5646, 2, 198, 1, 4093, 198, 1780, 314, 216, 39,
                26, 40, 47, 2, 198, 1, 520, 9531, 198,
            ];
            contract::check_add_abort(&mut start(), prompt.clone());
            println!("{kind}: add/abort contract holds");
            // Teacher forcing: the server's log-probabilities of the prompt against the
            // built-in f32 forward over the same weights (a GPU server computes in bf16/f16).
            let tokens: Arc<[u32]> = prompt.clone().into();
            let got = match rt.block_on(client.prompt_logprobs(tokens.clone())) {
                Ok(v) => v,
                Err(e) => {
                    eprintln!("{kind}: prompt logprobs failed: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let (w, _) = actors::model::llm::load(&smollm2()).expect("SmolLM2 loads");
            let logits: Vec<Vec<f32>> = w.forward(&prompt).unwrap().to_vec2().unwrap();
            let worst = got
                .iter()
                .enumerate()
                .map(|(i, lp)| {
                    let row = &logits[i];
                    let max = row.iter().copied().fold(f32::MIN, f32::max);
                    let lse = max + row.iter().map(|&x| (x - max).exp()).sum::<f32>().ln();
                    (lp - (row[prompt[i + 1] as usize] - lse)).abs()
                })
                .fold(0f32, f32::max);
            println!(
                "{kind}: teacher-forced logprobs at {} positions, max |Δ| {worst:.3} to the built-in f32 forward",
                got.len()
            );
            if got.len() + 1 != prompt.len() || worst > 0.25 {
                eprintln!("{kind}: prompt logprobs disagree with the built-in model");
                return ExitCode::FAILURE;
            }
            for policy in [InFlightPolicy::Abort, InFlightPolicy::Recompute] {
                let mut e = start();
                contract::check_install_after(
                    &mut e,
                    prompt.clone(),
                    &actors::weights::Weights::from_shared(1, Vec::new()),
                    policy,
                    Duration::from_millis(50),
                );
                println!("{kind}: install under {policy:?} holds");
            }
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("usage: device_check export DIR | device_check run sglang|vllm URL DIR");
            ExitCode::FAILURE
        }
    }
}
