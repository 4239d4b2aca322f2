//! The routes in process, over a scripted generator that answers with given texts (SmolLM2's
//! real tokenizer and template): keys, errors in each provider's shape, budgets, streams and
//! the turns an episode records.

use std::sync::{Arc, Mutex, OnceLock};

use actors::agent::Renderer;
use actors::generation::{FinishReason, GenError, GenOutput, GenRequest};
use actors::model::llm::{Checkpoint, LlmTokenizer};
use actors::types::VersionSpan;
use axum::http::Request;
use futures::future::BoxFuture;
use tower::ServiceExt;

use super::*;
use crate::episode::{EpisodeLimits, EpisodeOptions, SamplingPolicy};
use crate::{Generator, Opened};

fn tokenizer() -> Arc<LlmTokenizer> {
    static TOK: OnceLock<Arc<LlmTokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        let ck = Checkpoint::open_gguf(&actors::model::llm::smollm2_path())
            .expect("make setup fetches SmolLM2");
        Arc::new(LlmTokenizer::from_gguf(&ck).expect("tokenizer"))
    })
    .clone()
}

/// Answers each request with the next scripted text (then `<|im_end|>`), under `version`.
struct Script {
    answers: Mutex<Vec<String>>,
    seen: Mutex<Vec<GenRequest>>,
    version: Mutex<u64>,
}

impl Generator for Script {
    fn generate(&self, req: GenRequest) -> BoxFuture<'_, Result<GenOutput, GenError>> {
        Box::pin(async move {
            let tok = tokenizer();
            let text = self.answers.lock().unwrap().remove(0);
            let mut ids = tok.encode(&text, false).unwrap();
            let cut = ids.len() > req.params.max_tokens as usize;
            ids.truncate(req.params.max_tokens as usize);
            if !cut {
                ids.push(tok.encode("<|im_end|>", true).unwrap()[0]);
            }
            self.seen.lock().unwrap().push(req);
            let v = *self.version.lock().unwrap();
            Ok(GenOutput {
                logprobs: vec![-0.1; ids.len()].into(),
                versions: vec![VersionSpan {
                    version: v,
                    tokens: ids.len() as u32,
                    precision: None,
                }],
                finish: if cut {
                    FinishReason::Length
                } else {
                    FinishReason::Stop
                },
                tokens: ids.into(),
                prefill_tokens: 0,
            })
        })
    }
    fn release(&self, _session: u64) {}
    fn abort(&self, _id: u64) {}
}

fn setup(answers: &[&str], limits: EpisodeLimits) -> (Arc<Gateway>, Arc<Script>, Opened, Router) {
    let gw = Arc::new(Gateway::new());
    let script = Arc::new(Script {
        answers: Mutex::new(answers.iter().map(|s| s.to_string()).collect()),
        seen: Mutex::new(Vec::new()),
        version: Mutex::new(0),
    });
    let opts = EpisodeOptions {
        renderer: Arc::new(Renderer::new(tokenizer(), None)),
        model: "smollm2".into(),
        sampling: SamplingPolicy {
            temperature: 0.8,
            ..SamplingPolicy::default()
        },
        limits,
        seed: 1,
    };
    let opened = gw.open(opts, script.clone()).unwrap();
    let app = router(gw.clone(), 4096);
    (gw, script, opened, app)
}

async fn post(app: &Router, path: &str, key: &str, body: Value) -> (StatusCode, String) {
    let req = Request::post(path)
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let r = app.clone().oneshot(req).await.unwrap();
    let status = r.status();
    let bytes = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

fn weather_tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
}

#[tokio::test]
async fn a_tool_conversation_records_exact_turns_and_one_segment() {
    let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let (gw, script, opened, app) =
        setup(&[call, "It is 18 C in Paris."], EpisodeLimits::default());
    let mut messages = vec![json!({"role": "user", "content": "Weather in Paris?"})];
    let (s, body) = post(
        &app,
        "/gateway/v1/chat/completions",
        &opened.key,
        json!({"model": "x", "messages": messages, "tools": weather_tools(), "temperature": 0.1}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let msg = &v["choices"][0]["message"];
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(msg["tool_calls"][0]["function"]["name"], "get_weather");
    let id = msg["tool_calls"][0]["id"].as_str().unwrap().to_string();
    // The job's sampling, not the agent's.
    assert_eq!(script.seen.lock().unwrap()[0].params.temperature, 0.8);
    messages.push(msg.clone());
    messages.push(json!({"role": "tool", "tool_call_id": id, "content": "18 C"}));
    *script.version.lock().unwrap() = 1;
    let (s, body) = post(&app, "/gateway/v1/chat/completions", &opened.key,
        json!({"messages": messages, "tools": weather_tools(), "stream": true, "stream_options": {"include_usage": true}})).await;
    assert_eq!(s, StatusCode::OK);
    assert!(
        body.contains("It is 18 C in Paris.") && body.ends_with("data: [DONE]\n\n"),
        "{body}"
    );
    let turns = gw.finish(&opened.key).await.unwrap().turns;
    assert_eq!(turns.len(), 2);
    assert!(!turns[1].restart, "the second call extends the first");
    // The second request's context is the first's context, the first answer's ids, then new ids.
    let seen = script.seen.lock().unwrap().clone();
    let first: Vec<u32> = seen[0]
        .context
        .iter()
        .copied()
        .chain(turns[0].response_tokens.iter().copied())
        .collect();
    assert_eq!(&seen[1].context[..first.len()], &first[..]);
    assert_eq!(turns[1].observation_tokens, seen[1].context[first.len()..]);
    let rec = turns[0].call.as_ref().unwrap();
    assert_eq!(
        (
            rec.api.as_str(),
            rec.finish_reason.as_str(),
            rec.tool_calls.len()
        ),
        ("chat.completions", "tool_calls", 1)
    );
    assert_eq!(
        turns[1].call.as_ref().unwrap().tool_results[0].content,
        "18 C"
    );
    assert_eq!(turns[1].versions[0].version, 1);
    // The key is spent: 410 in OpenAI's shape.
    let (s, body) = post(
        &app,
        "/gateway/v1/chat/completions",
        &opened.key,
        json!({"messages": messages}),
    )
    .await;
    assert_eq!(s, StatusCode::GONE);
    assert!(
        body.contains("\"type\":\"invalid_request_error\""),
        "{body}"
    );
}

#[tokio::test]
async fn bad_input_keys_and_budgets_get_the_providers_4xx() {
    let limits = EpisodeLimits {
        max_calls: 2,
        max_context: 200,
        ..EpisodeLimits::default()
    };
    let (_gw, _script, opened, app) = setup(&["a", "b", "c"], limits);
    let user = json!([{"role": "user", "content": "hi"}]);
    for (path, key, body, status, needle) in [
        (
            "/gateway/v1/chat/completions",
            "wrong",
            json!({"messages": user}),
            401,
            "authentication_error",
        ),
        (
            "/gateway/v1/chat/completions",
            opened.key.as_str(),
            json!({"messages": user, "n": 2}),
            400,
            "\"param\":\"n\"",
        ),
        (
            "/gateway/v1/chat/completions",
            opened.key.as_str(),
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            400,
            "messages[0].role",
        ),
        (
            "/gateway/v1/chat/completions",
            opened.key.as_str(),
            json!({"messages": user, "pad": "x".repeat(5000)}),
            413,
            "over the gateway's cap",
        ),
        (
            "/gateway/v1/messages",
            opened.key.as_str(),
            json!({"messages": user}),
            400,
            "\"type\":\"error\"",
        ),
        (
            "/gateway/v1/chat/completions",
            opened.key.as_str(),
            json!({"messages": [{"role": "user", "content": "word ".repeat(300)}]}),
            400,
            "context_length_exceeded",
        ),
    ] {
        let (s, b) = post(&app, path, key, body).await;
        assert_eq!(s.as_u16(), status, "{path} {b}");
        assert!(b.contains(needle), "{needle}: {b}");
    }
    // Two calls, then the budget says so (a 4xx, never a 5xx).
    for _ in 0..2 {
        let (s, b) = post(
            &app,
            "/gateway/v1/chat/completions",
            &opened.key,
            json!({"messages": user}),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{b}");
    }
    let (s, b) = post(
        &app,
        "/gateway/v1/chat/completions",
        &opened.key,
        json!({"messages": user}),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(b.contains("budget of 2 model calls"), "{b}");
}

#[tokio::test]
async fn responses_chain_by_previous_response_id_and_messages_stream_in_anthropics_order() {
    let (gw, _script, opened, app) =
        setup(&["First.", "Second.", "Third."], EpisodeLimits::default());
    let (s, body) = post(
        &app,
        "/gateway/v1/responses",
        &opened.key,
        json!({"input": "one", "instructions": "Be short."}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["output"][0]["content"][0]["text"], "First.");
    let (s, body) = post(
        &app,
        "/gateway/v1/responses",
        &opened.key,
        json!({"input": "two", "previous_response_id": v["id"], "instructions": "Be short."}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{body}");
    let (s, body) = post(
        &app,
        "/gateway/v1/responses",
        &opened.key,
        json!({"input": "x", "previous_response_id": "resp_none"}),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(body.contains("previous_response_id"), "{body}");
    let (s, body) = post(&app, "/gateway/v1/messages", &opened.key,
        json!({"max_tokens": 16, "stream": true, "messages": [{"role": "user", "content": "three"}]})).await;
    assert_eq!(s, StatusCode::OK);
    assert!(
        body.starts_with("event: message_start")
            && body.contains("Third.")
            && body.ends_with("data: {\"type\":\"message_stop\"}\n\n"),
        "{body}"
    );
    let turns = gw.finish(&opened.key).await.unwrap().turns;
    // The chained response extends the first; the Messages call (a new conversation) restarts.
    assert_eq!(
        turns.iter().map(|t| t.restart).collect::<Vec<_>>(),
        [false, false, true]
    );
}

/// Never answers: calls pile up behind the first. Records the requests aborted.
#[derive(Default)]
struct Stuck {
    aborted: Mutex<Vec<u64>>,
}

impl Generator for Stuck {
    fn generate(&self, _req: GenRequest) -> BoxFuture<'_, Result<GenOutput, GenError>> {
        Box::pin(futures::future::pending())
    }
    fn release(&self, _session: u64) {}
    fn abort(&self, id: u64) {
        self.aborted.lock().unwrap().push(id);
    }
}

/// An episode on a shard that never answers.
fn open_stuck(gw: &Gateway) -> (Arc<Stuck>, Opened) {
    let shard = Arc::new(Stuck::default());
    let opts = EpisodeOptions {
        renderer: Arc::new(Renderer::new(tokenizer(), None)),
        model: "m".into(),
        sampling: SamplingPolicy::default(),
        limits: EpisodeLimits::default(),
        seed: 0,
    };
    let opened = gw.open(opts, shard.clone()).unwrap();
    (shard, opened)
}

#[tokio::test(start_paused = true)]
async fn a_body_that_never_arrives_gets_408_and_a_crowd_of_calls_gets_429() {
    let (gw, _script, opened, app) = setup(&[], EpisodeLimits::default());
    let req = Request::post("/gateway/v1/chat/completions")
        .header("authorization", format!("Bearer {}", opened.key))
        .body(Body::from_stream(futures::stream::pending::<
            Result<Bytes, std::io::Error>,
        >()))
        .unwrap();
    let r = app.clone().oneshot(req).await.unwrap();
    assert_eq!(r.status(), StatusCode::REQUEST_TIMEOUT);
    // An episode whose shard never answers: the first call is served, 16 wait, the next is
    // refused at once.
    let (stuck_shard, stuck) = open_stuck(&gw);
    let user = json!({"messages": [{"role": "user", "content": "hi"}]});
    let mut waiting = Vec::new();
    for _ in 0..=crate::episode::MAX_WAITING_CALLS {
        let (app, key, body) = (app.clone(), stuck.key.clone(), user.clone());
        waiting.push(tokio::spawn(async move {
            post(&app, "/gateway/v1/chat/completions", &key, body).await
        }));
    }
    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    let (s, body) = post(&app, "/gateway/v1/chat/completions", &stuck.key, user).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert!(body.contains("calls in flight"), "{body}");
    assert!(waiting.iter().all(|w| !w.is_finished()));
    // The clients go away: the one request on the shard is aborted there (the waiting calls
    // never reached it).
    for w in &waiting {
        w.abort();
    }
    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    assert_eq!(stuck_shard.aborted.lock().unwrap().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn closing_an_episode_ends_its_calls_in_flight_with_410() {
    let (gw, _script, _opened, app) = setup(&[], EpisodeLimits::default());
    let (stuck_shard, stuck) = open_stuck(&gw);
    let user = json!({"messages": [{"role": "user", "content": "hi"}]});
    let calls: Vec<_> = (0..3)
        .map(|_| {
            let (app, key, body) = (app.clone(), stuck.key.clone(), user.clone());
            tokio::spawn(
                async move { post(&app, "/gateway/v1/chat/completions", &key, body).await },
            )
        })
        .collect();
    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    assert!(
        calls.iter().all(|c| !c.is_finished()),
        "the shard never answers"
    );
    // The job gives the episode up: the call on the shard and those waiting end at once.
    gw.close(&stuck.key);
    for c in calls {
        let (s, body) = c.await.unwrap();
        assert_eq!(s, StatusCode::GONE, "{body}");
        assert!(body.contains("ended by its job"), "{body}");
    }
    assert_eq!(
        stuck_shard.aborted.lock().unwrap().len(),
        1,
        "its request was aborted"
    );
    let (s, _) = post(&app, "/gateway/v1/chat/completions", &stuck.key, user).await;
    assert_eq!(s, StatusCode::GONE, "a closed episode's key is gone");
    assert_eq!(gw.open_count(), 1, "only the other episode is open");
}
