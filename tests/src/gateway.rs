//! The agent gateway over a simulated shard (virtual time) with weight installs landing
//! every few milliseconds while agents stream: every stream is well formed, every answer's
//! versions are the ones that generated its tokens, and versions never go backwards within a
//! session — across installs (abort and recompute) and a restart of the shard's engine.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use actors::agent::Renderer;
use actors::call::call;
use actors::device::{DeviceProfile, ModelProfile};
use actors::generation::shard::{ShardActor, ShardArgs, ShardHandle, ShardMsg};
use actors::generation::sim::{SimEngine, SimEngineConfig};
use actors::generation::{InFlightPolicy, LoopPlacement};
use actors::model::llm::{Checkpoint, LlmTokenizer};
use actors::weights::Weights;
use axum::body::Body;
use axum::http::Request;
use gateway::episode::{EpisodeLimits, EpisodeOptions, SamplingPolicy};
use gateway::{Gateway, Generator};
use ractor::{Actor, ActorRef};
use serde_json::{Value, json};
use tower::ServiceExt;

fn tokenizer() -> Arc<LlmTokenizer> {
    let ck =
        Checkpoint::open_gguf(&actors::model::llm::smollm2_path()).expect("SmolLM2 (make setup)");
    Arc::new(LlmTokenizer::from_gguf(&ck).unwrap())
}

/// A simulated shard; its first engine freezes after `hang_after` steps (the watchdog then
/// restarts it), the engines after that do not.
async fn sim_shard(
    tok: &LlmTokenizer,
    hang_after: Option<u64>,
) -> (ActorRef<ShardMsg>, ShardHandle, Arc<AtomicU64>) {
    let device = DeviceProfile::builtin("H800").unwrap();
    let model = ModelProfile::builtin("qwen3-8b").unwrap();
    let vocab = tok.vocab_size() as u32;
    let built = AtomicU64::new(0);
    let factory: actors::generation::shard::EngineFactory = Arc::new(move || {
        let mut cfg = SimEngineConfig::new(device.clone(), model.clone());
        cfg.vocab = vocab;
        cfg.seed = 11;
        if built.fetch_add(1, Ordering::Relaxed) == 0 {
            cfg.hang_after_steps = hang_after;
        }
        Box::new(SimEngine::new(cfg))
    });
    let restarts = Arc::new(AtomicU64::new(0));
    let (tx, rx) = tokio::sync::oneshot::channel();
    let args = ShardArgs {
        pool: "sim".into(),
        index: 0,
        device: DeviceProfile::builtin("H800").unwrap(),
        factory,
        placement: LoopPlacement::Task,
        frozen_after: Duration::from_secs(30),
        restarts: restarts.clone(),
    };
    let (actor, _) = Actor::spawn(None, ShardActor, (args, tx)).await.unwrap();
    (actor, rx.await.unwrap(), restarts)
}

async fn install(shard: &ActorRef<ShardMsg>, v: u64, policy: InFlightPolicy) {
    call(shard, ShardMsg::Suspend, Duration::from_secs(60))
        .await
        .unwrap();
    let w = Arc::new(Weights::from_shared(v, Vec::new()));
    call(
        shard,
        |r| ShardMsg::Install(w, policy, r),
        Duration::from_secs(60),
    )
    .await
    .unwrap()
    .unwrap();
    shard.cast(ShardMsg::Resume).unwrap();
}

fn options(tok: &Arc<LlmTokenizer>) -> EpisodeOptions {
    EpisodeOptions {
        renderer: Arc::new(Renderer::new(tok.clone(), None)),
        model: "sim".into(),
        sampling: SamplingPolicy::default(),
        limits: EpisodeLimits {
            max_tokens_per_call: 96,
            ..EpisodeLimits::default()
        },
        seed: 3,
    }
}

async fn stream_call(app: &axum::Router, key: &str, messages: &[Value]) -> String {
    let req = Request::post("/gateway/v1/chat/completions")
        .header("authorization", format!("Bearer {key}"))
        .body(Body::from(
            json!({"messages": messages, "stream": true, "max_tokens": 96}).to_string(),
        ))
        .unwrap();
    let r = app.clone().oneshot(req).await.unwrap();
    let status = r.status();
    let body = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
    let body = String::from_utf8(body.to_vec()).unwrap();
    assert_eq!(status, 200, "{body}");
    let (text, finish, done) = read_stream(&body);
    assert!(done && finish.is_some(), "a whole stream");
    text
}

/// Parses an SSE body of Chat Completions chunks: the text, the finish reason, and whether it
/// ended with `[DONE]`.
fn read_stream(body: &str) -> (String, Option<String>, bool) {
    let (mut text, mut finish, mut done) = (String::new(), None, false);
    for line in body.lines().filter(|l| !l.is_empty()) {
        let data = line.strip_prefix("data: ").expect("every line is data");
        if data == "[DONE]" {
            done = true;
            continue;
        }
        assert!(!done, "nothing after [DONE]");
        let v: Value = serde_json::from_str(data).expect("each chunk is JSON");
        let c = &v["choices"][0];
        text.push_str(c["delta"]["content"].as_str().unwrap_or_default());
        if let Some(f) = c["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    (text, finish, done)
}

#[tokio::test(start_paused = true)]
async fn installs_mid_stream_keep_streams_whole_and_versions_monotone_per_session() {
    let tok = tokenizer();
    let (shard, handle, _) = sim_shard(&tok, None).await;
    let gw = Arc::new(Gateway::new());
    let generator: Arc<dyn Generator> = Arc::new(handle);
    let app = gateway::http::router::<()>(gw.clone(), 1 << 20);
    let keys: Vec<String> = (0..6)
        .map(|_| gw.open(options(&tok), generator.clone()).unwrap().key)
        .collect();
    // Installs every 20 ms of virtual time, alternating abort and recompute, until stopped.
    let stop = tokio_util::sync::CancellationToken::new();
    let installer = {
        let (shard, stop) = (shard.clone(), stop.clone());
        tokio::spawn(async move {
            let mut v = 0;
            while !stop.is_cancelled() {
                tokio::time::sleep(Duration::from_millis(20)).await;
                v += 1;
                let policy = if v % 2 == 0 {
                    InFlightPolicy::Recompute
                } else {
                    InFlightPolicy::Abort
                };
                install(&shard, v, policy).await;
            }
            v
        })
    };
    let agents = keys.iter().map(|key| {
        let (app, key) = (app.clone(), key.clone());
        async move {
            let mut messages = vec![json!({"role": "user", "content": "Count."})];
            for i in 0..6 {
                let text = stream_call(&app, &key, &messages).await;
                messages.push(json!({"role": "assistant", "content": text}));
                messages.push(json!({"role": "user", "content": format!("More ({i}).")}));
            }
        }
    });
    futures::future::join_all(agents).await;
    stop.cancel();
    let installed = installer.await.unwrap();
    assert!(installed >= 5, "{installed} installs");
    let mut spanning = 0;
    for key in &keys {
        let turns = gw.finish(key).await.unwrap().turns;
        assert_eq!(turns.len(), 6);
        let versions: Vec<u64> = turns
            .iter()
            .flat_map(|t| t.versions.iter().map(|s| s.version))
            .collect();
        assert!(
            versions.windows(2).all(|w| w[0] <= w[1]),
            "versions go backwards: {versions:?}"
        );
        for t in &turns {
            let n: u32 = t.versions.iter().map(|s| s.tokens).sum();
            assert_eq!(
                n as usize,
                t.response_tokens.len(),
                "spans cover the answer"
            );
            spanning += usize::from(t.versions.len() > 1);
        }
        assert!(turns.iter().all(|t| !t.restart), "one segment per agent");
    }
    assert!(spanning > 0, "some answer spans an install (recompute)");
}

#[tokio::test(start_paused = true)]
async fn a_shard_restart_mid_answer_is_retried_and_versions_never_go_back() {
    let tok = tokenizer();
    // The first engine freezes 40 steps in: mid-answer of the second call.
    let (shard, handle, restarts) = sim_shard(&tok, Some(40)).await;
    let gw = Arc::new(Gateway::new());
    let o = gw.open(options(&tok), Arc::new(handle)).unwrap();
    let app = gateway::http::router::<()>(gw.clone(), 1 << 20);
    let mut messages = vec![json!({"role": "user", "content": "Count."})];
    for i in 0..3 {
        if i == 1 {
            install(&shard, 4, InFlightPolicy::Recompute).await;
        }
        let text = stream_call(&app, &o.key, &messages).await;
        messages.push(json!({"role": "assistant", "content": text}));
        messages.push(json!({"role": "user", "content": "More."}));
    }
    assert_eq!(
        restarts.load(Ordering::Relaxed),
        1,
        "the frozen engine was restarted"
    );
    let turns = gw.finish(&o.key).await.unwrap().turns;
    let versions: Vec<Vec<u64>> = turns
        .iter()
        .map(|t| t.versions.iter().map(|s| s.version).collect())
        .collect();
    // The restarted engine came back with version 4 installed: the retried answer is v4.
    assert_eq!(versions, [vec![0], vec![4], vec![4]]);
}
