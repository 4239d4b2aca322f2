//! The agent gateway on SmolLM2 served by the built-in engine: the official OpenAI and
//! Anthropic SDKs drive it (`tests/agents/sdk_clients.py`, sync and async, streaming and not,
//! tools, Chat Completions, Responses and Messages), and every episode's turns are checked
//! against what the engine prefilled and generated (zero drift); a history edit makes two
//! segments, each of which re-scores, teacher-forced, to the recorded behaviour
//! log-probabilities.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use actors::agent::Renderer;
use actors::generation::{
    EngineHandle, EngineLoopJoin, GenError, GenOutput, GenRequest, LoopPlacement, spawn_engine,
};
use actors::model::engine::BuiltinEngine;
use actors::model::llm::{LlmDecoder, LlmTokenizer, LlmWeights};
use actors::types::{Trajectory, Turn};
use futures::future::BoxFuture;
use gateway::episode::{EpisodeLimits, EpisodeOptions, SamplingPolicy};
use gateway::{Gateway, Generator, Opened};
use serde_json::{Value, json};

/// The Python with the pinned SDKs: `ROLLARC_AGENT_PYTHON`, else where `make setup` puts it.
fn sdk_python() -> PathBuf {
    std::env::var_os("ROLLARC_AGENT_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/rollarc/agent-sdks-venv/bin/python")
        })
}

/// Every generation the engine served: the session, the context it prefilled, its answer.
type Log = Mutex<Vec<(u64, Vec<u32>, GenOutput)>>;

struct Recorder {
    engine: EngineHandle,
    log: Arc<Log>,
}

impl Generator for Recorder {
    fn generate(&self, req: GenRequest) -> BoxFuture<'_, Result<GenOutput, GenError>> {
        Box::pin(async move {
            let (session, context) = (req.session, req.context.to_vec());
            let out = self.engine.generate(req).await?;
            self.log
                .lock()
                .unwrap()
                .push((session, context, out.clone()));
            Ok(out)
        })
    }
    fn release(&self, session: u64) {
        self.engine.release(session);
    }
    fn abort(&self, id: u64) {
        self.engine.abort(id);
    }
}

struct Smollm2 {
    engine: EngineHandle,
    _join: EngineLoopJoin,
    tok: Arc<LlmTokenizer>,
    /// A copy of the weights for teacher-forced re-scoring.
    weights: LlmWeights,
}

fn smollm2() -> Smollm2 {
    let (w, tok) = actors::model::llm::load(&actors::model::llm::smollm2_path())
        .expect("SmolLM2 loads (make setup fetches it)");
    let tok = Arc::new(tok);
    let copy = w
        .with_tensors(w.named().into_iter().map(|(n, t)| (n, t.clone())))
        .unwrap();
    let engine = BuiltinEngine::with_decoder(LlmDecoder::new(w, tok.clone(), 2048), 0, 4);
    let (engine, join) = spawn_engine(Box::new(engine), LoopPlacement::Thread);
    Smollm2 {
        engine,
        _join: join,
        tok,
        weights: copy,
    }
}

fn options(tok: &Arc<LlmTokenizer>) -> EpisodeOptions {
    EpisodeOptions {
        renderer: Arc::new(Renderer::new(tok.clone(), None)),
        model: "smollm2-135m".into(),
        // Temperature 1: the behaviour log-probabilities are the model's own.
        sampling: SamplingPolicy::default(),
        limits: EpisodeLimits {
            max_tokens_per_call: 16,
            ..EpisodeLimits::default()
        },
        seed: 7,
    }
}

/// The turns' tokens of each segment equal what the engine prefilled and generated: every
/// answer is the engine's ids, and each segment's observations and answers concatenate to
/// the context of its last call followed by that call's answer.
fn assert_zero_drift(name: &str, turns: &[Turn], calls: &[&(u64, Vec<u32>, GenOutput)]) {
    assert_eq!(turns.len(), calls.len(), "{name}: one turn per call");
    let mut segment: Vec<u32> = Vec::new();
    for (i, (t, (_, context, out))) in turns.iter().zip(calls).enumerate() {
        assert_eq!(
            t.response_tokens, out.tokens,
            "{name} turn {i}: the generated ids"
        );
        assert_eq!(
            t.logprobs, out.logprobs,
            "{name} turn {i}: behaviour logprobs"
        );
        if t.restart {
            segment.clear();
        }
        segment.extend_from_slice(&t.observation_tokens);
        assert_eq!(&segment, context, "{name} turn {i}: the prefilled context");
        segment.extend_from_slice(&t.response_tokens);
    }
}

/// Runs `tests/agents/sdk_clients.py` against a gateway over `engine` (one episode per
/// scenario, one finished before it starts), then checks the report and every episode's
/// turns against what the engine prefilled and generated.
async fn drive_with_sdks(engine: EngineHandle, opts: EpisodeOptions, short: bool) {
    let python = sdk_python();
    assert!(
        python.is_file(),
        "{} is missing: run `make setup`",
        python.display()
    );
    {
        let log: Arc<Log> = Arc::default();
        let generator: Arc<dyn Generator> = Arc::new(Recorder {
            engine,
            log: log.clone(),
        });
        let gw = Arc::new(Gateway::new());
        let scenarios = [
            "chat_sync_tools",
            "chat_async_stream",
            "responses_chain",
            "messages_sync_tools",
            "messages_async_stream",
            "errors",
            "finished",
        ];
        let mut keys = serde_json::Map::new();
        let mut opened: Vec<(&str, Opened)> = Vec::new();
        for s in scenarios {
            let o = gw.open(opts.clone(), generator.clone()).unwrap();
            keys.insert(s.into(), json!(o.key));
            opened.push((s, o));
        }
        assert!(gw.finish(&opened[6].1.key).await.is_some());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = gateway::http::router(gw.clone(), 1 << 20);
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("config.json");
        let base = format!("http://{addr}/gateway");
        std::fs::write(
            &cfg,
            json!({"base": base, "keys": keys, "short": short}).to_string(),
        )
        .unwrap();
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/agents/sdk_clients.py");
        let out = tokio::process::Command::new(&python)
            .arg(script)
            .arg(&cfg)
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "the SDK script failed:\n{stderr}");
        let report: Value = serde_json::from_slice(&out.stdout).expect("a JSON report");
        server.abort();

        let errors = &report["errors"]["errors"];
        for (name, status) in [
            ("n_2", 400),
            ("unknown_role", 400),
            ("unknown_tool_call_id", 400),
            ("wrong_key", 401),
            ("finished_episode", 410),
            ("anthropic_wrong_key", 401),
            ("anthropic_bad_block", 400),
        ] {
            assert_eq!(errors[name]["status"], status, "{name}: {}", errors[name]);
        }
        assert_eq!(errors["n_2"]["param"], "n", "{}", errors["n_2"]);
        assert_eq!(errors["unknown_role"]["param"], "messages[0].role");
        assert_eq!(
            errors["unknown_tool_call_id"]["param"],
            "messages[1].tool_call_id"
        );
        assert_eq!(report["errors"]["models"], json!([opts.model]));
        assert_eq!(report["chat_sync_tools"]["calls"], 5);

        let log = log.lock().unwrap().clone();
        for (name, o) in &opened[..5] {
            let turns = gw.finish(&o.key).await.unwrap().turns;
            let session = o.id | (1 << 62);
            let calls: Vec<_> = log.iter().filter(|(s, _, _)| *s == session).collect();
            assert_zero_drift(name, &turns, &calls);
            // The SDKs send the history back as the gateway answered it: one segment.
            assert!(
                turns.iter().all(|t| !t.restart),
                "{name}: a history sent back unchanged never diverges"
            );
            let apis: Vec<&str> = turns
                .iter()
                .map(|t| t.call.as_ref().unwrap().api.as_str())
                .collect();
            assert!(!apis.is_empty(), "{name}");
        }
        assert_eq!(
            report["chat_sync_tools"]["finishes"]
                .as_array()
                .unwrap()
                .len(),
            5
        );
    }
}

/// On the built-in engine (one load of SmolLM2 for both parts): the SDKs' episodes without
/// drift, then a history edit whose two segments re-score to their behaviour log-probabilities.
#[test]
fn on_the_builtin_engine_sdks_see_no_drift_and_edited_histories_rescore_exactly() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let m = smollm2();
        drive_with_sdks(m.engine.clone(), options(&m.tok), true).await;
        a_history_edit_gives_two_segments_that_rescore_to_the_behaviour_logprobs(&m).await;
    });
}

#[test]
fn the_official_sdks_drive_the_gateway_on_a_managed_llamacpp_shard_without_drift() {
    use actors::generation::remote::llamacpp::{
        LlamaCpp, Target, XLLAMACPP_SERVE, xllamacpp_command,
    };
    use actors::generation::remote::managed::{LaunchSpec, ManagedServer};
    use actors::generation::remote::{RemoteConfig, RemoteEngine};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let _g = rt.enter();
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("xllamacpp_serve.py");
    std::fs::write(&script, XLLAMACPP_SERVE).unwrap();
    let python = job::resolve::xllamacpp_python(&infra::env::ProcessEnv);
    let path = actors::model::llm::smollm2_path();
    let launch = LaunchSpec {
        command: xllamacpp_command(&python, &script, 1),
        env: vec![],
        ports: None,
        gpus: None,
        slots: 2,
        context: 4096,
        log: None,
    };
    let server = ManagedServer::start(launch, path.clone()).expect("llama.cpp starts");
    let spec = actors::model::runtime::CheckpointSpec {
        path,
        max_seq: 2048,
        lora: None,
        micro_batch_rows: 1,
    };
    let (_, policy) =
        actors::model::runtime::BuiltinParts::checkpoint(&spec, Default::default(), 0, None)
            .unwrap();
    let export = policy.gguf_exporter(dir.path().join("export"), actors::model::llm::GgufType::F32);
    let client = LlamaCpp::new(
        reqwest::Client::new(),
        Target::Managed {
            server: server.clone(),
            export,
        },
    );
    let engine = RemoteEngine::start(
        Arc::new(client),
        rt.handle().clone(),
        RemoteConfig::default(),
    );
    let (handle, _join) = spawn_engine(Box::new(engine), LoopPlacement::Task);
    let mut opts = options(&policy.tokenizer);
    opts.model = "smollm2-135m-llamacpp".into();
    // The server's context per slot (4096 over 2 slots).
    opts.limits.max_context = 2048;
    rt.block_on(drive_with_sdks(handle.clone(), opts.clone(), false));
    rt.block_on(a_killed_server_mid_stream(handle, opts, server));
}

/// SIGKILL of the llama.cpp server while a streamed call is being generated: the server is
/// restarted and the call retried, the client gets one well-formed stream, and the session
/// goes on with versions that never went back.
async fn a_killed_server_mid_stream(
    engine: EngineHandle,
    opts: EpisodeOptions,
    server: Arc<actors::generation::remote::managed::ManagedServer>,
) {
    let gw = Arc::new(Gateway::new());
    // A long answer, so the kill lands while it is generated.
    let mut opts = opts;
    opts.limits.max_tokens_per_call = 96;
    let o = gw.open(opts, Arc::new(engine)).unwrap();
    let ep = gw.episode(&o.key).unwrap();
    let api = gateway::episode::Api::ChatCompletions;
    let mut messages =
        vec![json!({"role": "user", "content": "Tell me a long story about a lighthouse keeper."})];
    let body = json!({"messages": messages, "stream": true, "max_tokens": 96});
    let call = gateway::openai::parse(&body).unwrap();
    let pid = server.pid().await.expect("the server runs");
    let first = tokio::spawn({
        let ep = ep.clone();
        async move { ep.call(api, call, None).await }
    });
    // Kill the server 100 ms in: the request is on the server (rendering took about a
    // millisecond), and no 96-token answer of SmolLM2 on one llama.cpp thread is done by then.
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert!(
        !first.is_finished(),
        "the answer ended before the kill: make it longer"
    );
    assert!(infra::process::kill_group(pid));
    let answer = first
        .await
        .unwrap()
        .expect("the call is retried on the restarted server");
    let events = gateway::openai::chunks(&answer, false, false);
    assert_eq!(events.last().map(String::as_str), Some("data: [DONE]\n\n"));
    assert!(server.restarts() >= 1);
    assert_ne!(server.pid().await, Some(pid));
    messages.push(json!({"role": "assistant", "content": answer.content}));
    messages.push(json!({"role": "user", "content": "Go on."}));
    let call = gateway::openai::parse(&json!({"messages": messages, "max_tokens": 16})).unwrap();
    ep.call(api, call, None).await.expect("the session goes on");
    let turns = gw.finish(&o.key).await.unwrap().turns;
    assert_eq!(turns.len(), 2);
    assert!(
        !turns[1].restart,
        "the retried answer's ids are the session's context"
    );
    let versions: Vec<u64> = turns
        .iter()
        .flat_map(|t| t.versions.iter().map(|v| v.version))
        .collect();
    assert!(versions.windows(2).all(|w| w[0] <= w[1]), "{versions:?}");
}

/// Log-probabilities of the trained positions of `seg` under the full (training) forward.
fn rescored(w: &LlmWeights, tokens: &[u32], train: &[bool]) -> Vec<f64> {
    let logits: Vec<Vec<f32>> = w.forward(tokens).unwrap().to_vec2().unwrap();
    (1..tokens.len())
        .filter(|&i| train[i])
        .map(|i| {
            let row = &logits[i - 1];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let z: f64 = row.iter().map(|&l| (l as f64 - max).exp()).sum();
            row[tokens[i] as usize] as f64 - max - z.ln()
        })
        .collect()
}

async fn a_history_edit_gives_two_segments_that_rescore_to_the_behaviour_logprobs(m: &Smollm2) {
    {
        let generator: Arc<dyn Generator> = Arc::new(m.engine.clone());
        let gw = Arc::new(Gateway::new());
        let o = gw.open(options(&m.tok), generator).unwrap();
        let ep = gw.episode(&o.key).unwrap();
        let tools = json!([{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]);
        let mut messages = vec![json!({"role": "user", "content": "Count to three."})];
        let api = gateway::episode::Api::ChatCompletions;
        for i in 0..3 {
            let call =
                gateway::openai::parse(&json!({"messages": messages, "tools": tools})).unwrap();
            let a = ep.call(api, call, None).await.unwrap();
            messages.push(json!({"role": "assistant", "content": a.content}));
            messages.push(json!({"role": "user", "content": format!("Next ({i}).")}));
        }
        // The agent summarises its history: the first message changes.
        messages[0] = json!({"role": "user", "content": "Count to three, briefly."});
        for _ in 0..2 {
            let call =
                gateway::openai::parse(&json!({"messages": messages, "tools": tools})).unwrap();
            let a = ep.call(api, call, None).await.unwrap();
            messages.push(json!({"role": "assistant", "content": a.content}));
            messages.push(json!({"role": "user", "content": "Go on."}));
        }
        assert_eq!(ep.segments().await, 2);
        let turns = gw.finish(&o.key).await.unwrap().turns;
        assert_eq!(
            turns.iter().map(|t| t.restart).collect::<Vec<_>>(),
            [false, false, false, true, false]
        );
        let traj = Trajectory {
            id: "agent".into(),
            group_id: 0,
            task: "agent".into(),
            seed: 0,
            start_version: 0,
            pool: "builtin".into(),
            shard: 0,
            turns,
            reward: Some(1.0),
            success: true,
            invalid_actions: 0,
            failure: None,
            timings: Default::default(),
            reference: None,
            final_text: String::new(),
            allowed_tokens: None,
            truncated: false,
            agent: None,
            verdict: None,
        };
        let segments = traj.segments();
        assert_eq!(segments.len(), 2);
        for (k, (tokens, train, behaviour)) in segments.iter().enumerate() {
            let want: Vec<f64> = (0..tokens.len())
                .filter(|&i| train[i])
                .map(|i| f64::from(behaviour[i]))
                .collect();
            assert!(!want.is_empty());
            let got = rescored(&m.weights, tokens, train);
            let worst = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert!(
                worst < 1e-4,
                "segment {k}: teacher-forced logprobs differ by {worst}"
            );
        }
    }
}
