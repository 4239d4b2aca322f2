//! `rollarc bench --what servers`: generation on llama.cpp servers (the `xllamacpp` wheel's)
//! serving SmolLM2, in one run:
//! - rollarc's orchestration overhead per generated turn: the same turns sent straight to
//!   the server (one HTTP request each) and through a shard's engine loop and the remote
//!   engine (streamed, slot-sticky), alternating, one at a time;
//! - end-to-end trajectories/s of a SmolLM2 job (FrozenLake, built-in LoRA trainer) on one
//!   and on two managed llama.cpp shards.

use std::path::PathBuf;
use std::sync::Arc;

use actors::generation::remote::llamacpp::{
    LlamaCpp, Target, XLLAMACPP_SERVE, completion_body, xllamacpp_command,
};
use actors::generation::remote::managed::{LaunchSpec, ManagedServer};
use actors::generation::remote::{RemoteConfig, RemoteEngine};
use actors::generation::{GenRequest, LoopPlacement, SamplingParams, spawn_engine};

use super::llm::smollm2;

#[derive(Debug, thiserror::Error)]
pub enum ServersBenchError {
    #[error("{0} is missing: run `make setup`")]
    Missing(PathBuf),
    #[error("runtime: {0}")]
    Runtime(#[from] std::io::Error),
    #[error("the llama.cpp server: {0}")]
    Server(String),
    #[error("the job failed: {0}")]
    Job(String),
}

const TURNS: usize = 24;
const NEW_TOKENS: u32 = 16;

fn prompt(i: usize) -> Vec<u32> {
    // Ordinary BPE ids, different per turn from the first on, so no prefix is shared.
    (0..48)
        .map(|k| 100 + ((7919 * i + 13 * k) % 20000) as u32)
        .collect()
}

fn params(i: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: NEW_TOKENS,
        seed: i as u64,
        ignore_eos: true,
        ..Default::default()
    }
}

fn wall() -> std::time::Instant {
    infra::clock::wall_now()
}

/// One turn sent straight to the server: the request rollarc's adapter sends, its stream
/// read to the end and its tokens counted (what a client without rollarc must do).
async fn direct(http: &reqwest::Client, url: &str, i: usize) -> Result<usize, String> {
    let req = actors::generation::remote::ServerRequest {
        rid: String::new(),
        context: Arc::new(prompt(i).into()),
        params: params(i),
        slot: Some(0),
        progress: Default::default(),
    };
    let body = completion_body(&req);
    let send = || http.post(format!("{url}/completion")).json(&body).send();
    // Like the adapter: one retry when a pooled connection was closed under the request.
    let resp = match send().await {
        Ok(r) => r,
        Err(_) => send().await.map_err(|e| infra::error_chain(&e))?,
    };
    let text = resp.text().await.map_err(|e| e.to_string())?;
    Ok(text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .map(|v| v["tokens"].as_array().map_or(0, Vec::len))
        .sum())
}

fn overhead(dir: &std::path::Path, python: &str) -> Result<(), ServersBenchError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let script = dir.join("xllamacpp_serve.py");
    std::fs::write(&script, XLLAMACPP_SERVE)?;
    let _g = rt.enter();
    let server = ManagedServer::start(
        LaunchSpec {
            command: xllamacpp_command(python, &script, 2),
            env: vec![],
            ports: None,
            gpus: None,
            slots: 1,
            context: 256,
            log: Some(dir.join("server.log")),
        },
        smollm2(),
    )
    .map_err(|e| ServersBenchError::Server(e.to_string()))?;
    let http = reqwest::Client::new();
    let client = LlamaCpp::new(reqwest::Client::new(), Target::Attached(server.url()));
    let engine = RemoteEngine::start(
        Arc::new(client),
        rt.handle().clone(),
        RemoteConfig::default(),
    );
    let (handle, _join) = spawn_engine(Box::new(engine), LoopPlacement::Thread);
    let url = server.url();
    let (mut t_direct, mut t_ours, mut tokens) = (0.0, 0.0, 0usize);
    rt.block_on(async {
        // Warm up both paths (and wait for the server).
        let r = handle
            .generate(GenRequest {
                id: 1_000_000,
                session: 1_000_000,
                context: Arc::new(prompt(999).into()),
                params: params(999),
                sim_response_len: None,
                prefilled: false,
                reusable: None,
                carried: 0,
            })
            .await
            .map_err(|e| ServersBenchError::Server(infra::error_chain(&e)))?;
        let _ = r;
        direct(&http, &url, 998)
            .await
            .map_err(ServersBenchError::Server)?;
        // Distinct prompts on the two paths (no prefix reuse between them), alternating
        // which goes first.
        for i in 0..TURNS {
            for path in [i % 2, 1 - i % 2] {
                let t = wall();
                if path == 0 {
                    tokens += direct(&http, &url, 2 * i)
                        .await
                        .map_err(ServersBenchError::Server)?;
                    t_direct += t.elapsed().as_secs_f64();
                } else {
                    let out = handle
                        .generate(GenRequest {
                            id: i as u64,
                            session: i as u64,
                            context: Arc::new(prompt(2 * i + 1).into()),
                            params: params(2 * i + 1),
                            sim_response_len: None,
                            prefilled: false,
                            reusable: None,
                            carried: 0,
                        })
                        .await
                        .map_err(|e| ServersBenchError::Server(infra::error_chain(&e)))?;
                    t_ours += t.elapsed().as_secs_f64();
                    tokens += out.tokens.len();
                }
            }
        }
        Ok::<(), ServersBenchError>(())
    })?;
    let (d, o) = (t_direct / TURNS as f64, t_ours / TURNS as f64);
    println!(
        "llama.cpp (SmolLM2 Q4_1, 2 threads, 1 slot): {TURNS} turns of {NEW_TOKENS} tokens after a 48-token prompt, alternating ({tokens} tokens in all)"
    );
    println!(
        "  straight to the server: {:.1} ms/turn; through rollarc (engine loop + remote engine, streamed): {:.1} ms/turn; overhead {:+.2} ms/turn ({:+.1} %)",
        d * 1e3,
        o * 1e3,
        (o - d) * 1e3,
        (o / d - 1.0) * 100.0
    );
    Ok(())
}

fn job(shards: usize, python: &str) -> Result<(f64, u64), ServersBenchError> {
    let text = format!(
        r#"
seed = 3
[[tasks]]
domain = "lake"
group_size = 2
max_turns = 2
max_tokens_per_turn = 10
env = {{ kind = "frozenlake", size = 4 }}
[rollout]
batch_size = 4
steps = 3
[[pools]]
name = "llama"
device = "CPU"
count = {shards}
backend = {{ kind = "llamacpp", slots = 4, model = {{ path = {path:?}, max_seq = 1024 }}, launch = {{ python = {python:?} }} }}
[trainer]
kind = "builtin"
lr = 0.001
lora = {{ rank = 4, alpha = 8, targets = ["attn_q", "attn_v"] }}
"#,
        path = smollm2().display().to_string(),
    );
    let spec = job::spec::parse(&text, job::spec::Format::Toml)
        .map_err(|e| ServersBenchError::Job(format!("{e:?}")))?;
    let dir = scratch(&format!("job{shards}"))?;
    let t = wall();
    let s = job::simrun::run_blocking(
        spec,
        0,
        0,
        Arc::new(actors::buffer::MemorySink::default()),
        Arc::new(job::runtime::NoObserver),
        Some(dir.clone()),
    )
    .map_err(|e| ServersBenchError::Job(infra::error_chain(&e)));
    let secs = t.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&dir);
    Ok((secs, s?.trajectories_committed))
}

/// A fresh folder for this run's files.
fn scratch(name: &str) -> std::io::Result<PathBuf> {
    let d = std::env::temp_dir().join(format!(
        "rollarc-bench-servers-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

pub fn bench_servers() -> Result<(), ServersBenchError> {
    let path = smollm2();
    if !path.is_file() {
        return Err(ServersBenchError::Missing(path));
    }
    let python = job::resolve::xllamacpp_python(&infra::env::ProcessEnv);
    if !std::path::Path::new(&python).is_file() {
        return Err(ServersBenchError::Missing(python.into()));
    }
    let dir = scratch("overhead")?;
    let r = overhead(&dir, &python);
    if r.is_err() {
        let log = std::fs::read_to_string(dir.join("server.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(15).collect();
        eprintln!(
            "server log (last lines, newest first):\n{}",
            tail.join("\n")
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    r?;
    let mut rates = Vec::new();
    for shards in [1, 2] {
        let (secs, trajectories) = job(shards, &python)?;
        let rate = trajectories as f64 / secs;
        println!(
            "SmolLM2 job (FrozenLake, 3 steps of 4 trajectories, LoRA trainer) on {shards} managed llama.cpp shard(s): {trajectories} trajectories in {secs:.1} s = {rate:.3} trajectories/s"
        );
        rates.push(rate);
    }
    println!(
        "  2 shards / 1 shard: {:.2}× (2 cores: the servers, the trainer and the exports share them)",
        rates[1] / rates[0]
    );
    Ok(())
}
