//! `rollarc bench --what gateway`: what the agent gateway costs per call, on a zero-latency
//! simulated shard (an ideal device: all time is orchestration) and SmolLM2's real tokenizer
//! and chat template.
//!
//! - **Overhead**: agent episodes of 8 Chat Completions calls with tools over real HTTP
//!   (reqwest → axum: parse, render with the template, tokenise, generate, parse tool calls,
//!   record, answer), each followed by a direct call of the engine with the very context the
//!   gateway prefilled; Δp50 and Δp99 per call, measured in one run.
//! - **Concurrency**: 1,000 sessions of 4 calls each at once; calls/s, and the process's CPU
//!   seconds per call (the orchestration cost, whichever core paid it).

use std::sync::{Arc, Mutex};

use actors::agent::Renderer;
use actors::device::{DeviceProfile, ModelProfile};
use actors::generation::sim::{SimEngine, SimEngineConfig};
use actors::generation::{
    EngineHandle, GenError, GenOutput, GenRequest, LoopPlacement, SamplingParams, spawn_engine,
};
use actors::model::llm::{Checkpoint, LlmTokenizer};
use futures::future::BoxFuture;
use infra::clock::wall_now;
use serde_json::{Value, json};

use crate::episode::{EpisodeLimits, EpisodeOptions, SamplingPolicy};
use crate::{Gateway, Generator};

#[derive(Debug, thiserror::Error)]
pub enum GatewayBenchError {
    #[error("bench I/O")]
    Io(#[from] std::io::Error),
    #[error("SmolLM2's tokenizer (run `make setup`): {0}")]
    Tokenizer(String),
    #[error("HTTP")]
    Http(#[from] reqwest::Error),
    #[error("a call failed: {0}")]
    Call(String),
}

const CALLS_PER_EPISODE: usize = 8;
const EPISODES: usize = 40;
const SESSIONS: usize = 1000;
const SESSION_CALLS: usize = 4;

/// Keeps the context of each call, to call the engine directly with it.
struct Recorder {
    engine: EngineHandle,
    last: Mutex<Vec<u32>>,
}

impl Generator for Recorder {
    fn generate(&self, req: GenRequest) -> BoxFuture<'_, Result<GenOutput, GenError>> {
        Box::pin(async move {
            *self.last.lock().unwrap_or_else(|p| p.into_inner()) = req.context.to_vec();
            self.engine.generate(req).await
        })
    }
    fn release(&self, session: u64) {
        self.engine.release(session);
    }
    fn abort(&self, id: u64) {
        self.engine.abort(id);
    }
}

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "search", "description": "Search the docs.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}])
}

pub fn bench_gateway() -> Result<(), GatewayBenchError> {
    let ck = Checkpoint::open_gguf(&actors::model::llm::smollm2_path())
        .map_err(|e| GatewayBenchError::Tokenizer(e.to_string()))?;
    let tok = Arc::new(
        LlmTokenizer::from_gguf(&ck).map_err(|e| GatewayBenchError::Tokenizer(e.to_string()))?,
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(run(tok))
}

fn ideal_engine(vocab: u32) -> Option<EngineHandle> {
    let mut cfg = SimEngineConfig::new(
        DeviceProfile::builtin("IDEAL")?,
        ModelProfile::builtin("tiny")?,
    );
    cfg.vocab = vocab;
    cfg.max_batch = 100_000;
    // The loop's task runs on (detached) until its handles are gone.
    let (h, _join) = spawn_engine(Box::new(SimEngine::new(cfg)), LoopPlacement::Task);
    Some(h)
}

async fn run(tok: Arc<LlmTokenizer>) -> Result<(), GatewayBenchError> {
    let engine = ideal_engine(tok.vocab_size() as u32).ok_or_else(|| {
        GatewayBenchError::Call("the ideal device or tiny model is missing".into())
    })?;
    let gw = Arc::new(Gateway::new());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}/gateway/v1", listener.local_addr()?);
    let app = crate::http::router::<()>(gw.clone(), 4 << 20);
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = reqwest::Client::new();
    let opts = EpisodeOptions {
        renderer: Arc::new(Renderer::new(tok.clone(), None)),
        model: "sim".into(),
        sampling: SamplingPolicy::default(),
        limits: EpisodeLimits {
            max_tokens_per_call: 24,
            ..EpisodeLimits::default()
        },
        seed: 1,
    };
    overhead(&gw, &client, &base, &engine, &opts).await?;
    concurrency(&gw, &client, &base, &engine, &opts).await
}

/// One Chat Completions call; the answer's message.
async fn chat(
    client: &reqwest::Client,
    base: &str,
    key: &str,
    messages: &[Value],
) -> Result<Value, GatewayBenchError> {
    let r = client
        .post(format!("{base}/chat/completions"))
        .bearer_auth(key)
        .json(&json!({"messages": messages, "tools": tools(), "max_tokens": 24}))
        .send()
        .await?;
    let status = r.status();
    let v: Value = r.json().await?;
    if !status.is_success() {
        return Err(GatewayBenchError::Call(v.to_string()));
    }
    Ok(v["choices"][0]["message"].clone())
}

/// The agent's next messages after `answer`: its tool calls answered, or a user turn.
fn follow_up(messages: &mut Vec<Value>, answer: Value, i: usize) {
    let calls: Vec<String> = answer["tool_calls"]
        .as_array()
        .map(|c| {
            c.iter()
                .filter_map(|x| x["id"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    messages.push(answer);
    if calls.is_empty() {
        messages.push(json!({"role": "user", "content": format!("Next question, number {i}: what does the scheduler do?")}));
    }
    for id in calls {
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": "The scheduler admits groups under the staleness bound."}));
    }
}

fn quantile(xs: &mut [f64], q: f64) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[((xs.len() - 1) as f64 * q).round() as usize]
}

async fn overhead(
    gw: &Arc<Gateway>,
    client: &reqwest::Client,
    base: &str,
    engine: &EngineHandle,
    opts: &EpisodeOptions,
) -> Result<(), GatewayBenchError> {
    let (mut via, mut direct) = (Vec::new(), Vec::new());
    for e in 0..EPISODES {
        let rec = Arc::new(Recorder {
            engine: engine.clone(),
            last: Mutex::default(),
        });
        let key = gw
            .open(opts.clone(), rec.clone())
            .map_err(|_| GatewayBenchError::Call("no key".into()))?
            .key;
        let mut messages = vec![
            json!({"role": "system", "content": "You answer questions about rollarc, using the search tool."}),
            json!({"role": "user", "content": "How does rollarc keep trajectories within the staleness bound?"}),
        ];
        for i in 0..CALLS_PER_EPISODE {
            let t = wall_now();
            let answer = chat(client, base, &key, &messages).await?;
            via.push(t.elapsed().as_secs_f64());
            let context = rec.last.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let t = wall_now();
            engine
                .generate(GenRequest {
                    id: (1 << 40) | (e * CALLS_PER_EPISODE + i) as u64,
                    session: (1 << 40) | e as u64,
                    context: Arc::new(context.into()),
                    params: SamplingParams {
                        max_tokens: 24,
                        stop_tokens: tok_stops(opts),
                        ..SamplingParams::default()
                    },
                    sim_response_len: None,
                    prefilled: false,
                    reusable: None,
                    carried: 0,
                })
                .await
                .map_err(|e| GatewayBenchError::Call(e.to_string()))?;
            direct.push(t.elapsed().as_secs_f64());
            follow_up(&mut messages, answer, i);
        }
        gw.finish(&key).await;
    }
    let ms = |x: f64| x * 1e3;
    let (v50, v99) = (quantile(&mut via, 0.5), quantile(&mut via, 0.99));
    let (d50, d99) = (quantile(&mut direct, 0.5), quantile(&mut direct, 0.99));
    println!(
        "gateway overhead per call ({} calls, {EPISODES} episodes of {CALLS_PER_EPISODE}, Chat Completions with a tool, SmolLM2's template, ideal shard):",
        via.len()
    );
    println!(
        "  through the gateway (HTTP)  p50 {:.3} ms  p99 {:.3} ms",
        ms(v50),
        ms(v99)
    );
    println!(
        "  the engine directly         p50 {:.3} ms  p99 {:.3} ms",
        ms(d50),
        ms(d99)
    );
    println!(
        "  Δp50 {:.3} ms  Δp99 {:.3} ms",
        ms(v50 - d50),
        ms(v99 - d99)
    );
    Ok(())
}

fn tok_stops(opts: &EpisodeOptions) -> Vec<u32> {
    opts.renderer.tokenizer().stop_ids.clone()
}

/// The process's CPU seconds so far (user + system), from `/proc/self/stat`.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<f64> = rest
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    // utime and stime are fields 14 and 15 of the line: 11 and 12 after the name.
    let ticks = f.get(11).copied().unwrap_or(0.0) + f.get(12).copied().unwrap_or(0.0);
    ticks / 100.0
}

async fn concurrency(
    gw: &Arc<Gateway>,
    client: &reqwest::Client,
    base: &str,
    engine: &EngineHandle,
    opts: &EpisodeOptions,
) -> Result<(), GatewayBenchError> {
    let generator: Arc<dyn Generator> = Arc::new(engine.clone());
    let keys: Vec<String> = (0..SESSIONS)
        .filter_map(|_| gw.open(opts.clone(), generator.clone()).ok().map(|o| o.key))
        .collect();
    let (t, cpu) = (wall_now(), cpu_seconds());
    let sessions = keys.iter().map(|key| async move {
        let mut messages =
            vec![json!({"role": "user", "content": "What is trajectory-level asynchrony?"})];
        for i in 0..SESSION_CALLS {
            let answer = chat(client, base, key, &messages).await?;
            follow_up(&mut messages, answer, i);
        }
        Ok::<_, GatewayBenchError>(())
    });
    for r in futures::future::join_all(sessions).await {
        r?;
    }
    let (wall, cpu) = (t.elapsed().as_secs_f64(), cpu_seconds() - cpu);
    let calls = (keys.len() * SESSION_CALLS) as f64;
    for k in &keys {
        gw.finish(k).await;
    }
    println!(
        "{} concurrent sessions × {SESSION_CALLS} calls (ideal shard):",
        keys.len()
    );
    println!(
        "  {calls:.0} calls in {wall:.2} s: {:.0} calls/s; orchestration {:.3} ms of CPU per call (client and server in one process)",
        calls / wall,
        cpu / calls * 1e3
    );
    Ok(())
}
