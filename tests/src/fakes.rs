//! Fakes of SGLang's and vLLM's HTTP servers, built from their request and response shapes
//! (SGLang 0.5: `/generate`, `/abort_request`, `/pause_generation`, `/continue_generation`,
//! `/update_weights_from_disk`, `/server_info`, `/health`; vLLM ≥ 0.10 with dev mode:
//! `/v1/completions`, `/v1/models`, `/abort_requests`, `/pause`, `/resume`, `/is_paused`,
//! `/collective_rpc`, `/update_weight_version`, `/health`), with their failure modes:
//! aborted answers carrying partial tokens, SGLang holding requests while paused and vLLM
//! answering 503, a weight version that does not follow installs, and a slow health check.
//!
//! The "model" answers token `(sum of the context + 7·step + 31·version) mod 1000` at each
//! step, one per `token_ms`, with log-probability −0.25 − (step mod 4)/10; it stops early
//! on a stop token id.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// How a fake behaves.
#[derive(Clone, Debug)]
pub struct FakeConfig {
    pub token_ms: u64,
    pub slots: usize,
    pub context: usize,
    /// Every answer reports this weight version instead of the installed one.
    pub stuck_version: Option<String>,
    /// `/health` answers after this long.
    pub health_delay: Duration,
    /// Requests other clients keep running on the server (its load reports count them).
    pub background: usize,
}

impl Default for FakeConfig {
    fn default() -> Self {
        Self {
            token_ms: 2,
            slots: 4,
            context: 512,
            stuck_version: None,
            health_delay: Duration::ZERO,
            background: 0,
        }
    }
}

#[derive(Default)]
struct Inner {
    version: String,
    version_number: u64,
    paused: bool,
    running: HashMap<String, CancellationToken>,
    /// Every request body, in order.
    pub requests: Vec<Value>,
    installs: Vec<String>,
    aborts: Vec<String>,
}

/// A running fake and what it saw.
#[derive(Clone)]
pub struct Fake {
    pub url: String,
    cfg: FakeConfig,
    inner: Arc<Mutex<Inner>>,
    resumed: Arc<tokio::sync::Notify>,
    _server: Arc<tokio_util::task::AbortOnDropHandle<()>>,
}

impl Fake {
    pub fn installs(&self) -> Vec<String> {
        self.inner.lock().unwrap().installs.clone()
    }
    pub fn aborts(&self) -> Vec<String> {
        self.inner.lock().unwrap().aborts.clone()
    }
    pub fn requests(&self) -> Vec<Value> {
        self.inner.lock().unwrap().requests.clone()
    }
    pub fn paused(&self) -> bool {
        self.inner.lock().unwrap().paused
    }
}

/// The shared generation loop: tokens until `max` or a stop id, or cancelled (partial).
async fn run(
    fake: &Fake,
    rid: &str,
    context: &[u64],
    max: u64,
    stops: &[u64],
) -> (Vec<u64>, Vec<f64>, &'static str) {
    let token = CancellationToken::new();
    let version = {
        let mut g = fake.inner.lock().unwrap();
        g.running.insert(rid.to_string(), token.clone());
        g.version_number
    };
    // A request whose client went away is dropped mid-run: it leaves the running set too.
    struct Leave<'a>(&'a Fake, &'a str);
    impl Drop for Leave<'_> {
        fn drop(&mut self) {
            if let Ok(mut g) = self.0.inner.lock() {
                g.running.remove(self.1);
            }
        }
    }
    let _leave = Leave(fake, rid);
    let base: u64 = context.iter().sum();
    let (mut ids, mut lps) = (Vec::new(), Vec::new());
    let mut reason = "length";
    for step in 0..max {
        tokio::select! {
            () = token.cancelled() => { reason = "abort"; break; }
            () = tokio::time::sleep(Duration::from_millis(fake.cfg.token_ms)) => {}
        }
        let t = (base + 7 * step + 31 * version) % 1000;
        ids.push(t);
        lps.push(-0.25 - (step % 4) as f64 / 10.0);
        if stops.contains(&t) {
            reason = "stop";
            break;
        }
    }
    (ids, lps, reason)
}

/// The fake model's log-probability of the prompt token `t` (teacher forcing).
pub fn prompt_logprob(t: u64) -> f64 {
    -0.5 - (t % 7) as f64 / 10.0
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

fn error(status: StatusCode, body: Value) -> Response {
    (status, Json(body)).into_response()
}

async fn health(State(f): State<Fake>) -> StatusCode {
    tokio::time::sleep(f.cfg.health_delay).await;
    StatusCode::OK
}

// ---- SGLang ----

async fn sg_generate(State(f): State<Fake>, Json(b): Json<Value>) -> Response {
    f.inner.lock().unwrap().requests.push(b.clone());
    let Some(ids) = b.get("input_ids").map(u64s) else {
        return error(
            StatusCode::BAD_REQUEST,
            json!({"error": {"message": "input_ids or text required"}}),
        );
    };
    // Unknown sampling fields are refused, as SGLang's schema check does.
    let known = [
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "no_stop_trim",
        "skip_special_tokens",
        "sampling_seed",
    ];
    if let Some(sp) = b.get("sampling_params").and_then(Value::as_object)
        && let Some(k) = sp.keys().find(|k| !known.contains(&k.as_str()))
    {
        return error(
            StatusCode::BAD_REQUEST,
            json!({"error": format!("unknown field `{k}`")}),
        );
    }
    if ids.len() >= f.cfg.context {
        return error(
            StatusCode::BAD_REQUEST,
            json!({"error": {"message": "input is longer than the context"}}),
        );
    }
    // While paused, requests wait (SGLang holds them in its tokenizer manager).
    while f.paused() {
        f.resumed.notified().await;
    }
    let rid = b
        .get("rid")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let sp = b.get("sampling_params").cloned().unwrap_or(Value::Null);
    let max = sp
        .get("max_new_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(128);
    let stops = sp.get("stop_token_ids").map(u64s).unwrap_or_default();
    let (out, lps, reason) = run(&f, &rid, &ids, max, &stops).await;
    let version = f
        .cfg
        .stuck_version
        .clone()
        .unwrap_or_else(|| f.inner.lock().unwrap().version.clone());
    let finish = match reason {
        "abort" => {
            json!({"type": "abort", "message": "Aborted", "status_code": null, "err_type": null})
        }
        "stop" => json!({"type": "stop", "matched": out.last()}),
        _ => json!({"type": "length", "length": out.len()}),
    };
    let logprobs: Vec<Value> = out
        .iter()
        .zip(&lps)
        .map(|(t, l)| json!([l, t, null]))
        .collect();
    let mut answer = json!({
        "output_ids": out,
        "meta_info": {
            "id": rid, "finish_reason": finish, "prompt_tokens": ids.len(),
            "completion_tokens": out.len(), "cached_tokens": 0, "weight_version": version,
            "output_token_logprobs": logprobs,
        },
    });
    // The input's log-probabilities from `logprob_start_len` on (-1: none), the first token
    // of the sequence without one.
    let start = b
        .get("logprob_start_len")
        .and_then(Value::as_i64)
        .unwrap_or(-1);
    if b.get("return_logprob").and_then(Value::as_bool) == Some(true) && start >= 0 {
        let input: Vec<Value> = ids
            .iter()
            .enumerate()
            .skip(start as usize)
            .map(|(i, &t)| json!([(i > 0).then(|| prompt_logprob(t)), t, null]))
            .collect();
        answer["meta_info"]["input_token_logprobs"] = json!(input);
    }
    Json(answer).into_response()
}

async fn sg_abort(State(f): State<Fake>, Json(b): Json<Value>) -> StatusCode {
    let rid = b.get("rid").and_then(Value::as_str).unwrap_or("");
    let all = b.get("abort_all").and_then(Value::as_bool).unwrap_or(false);
    let mut g = f.inner.lock().unwrap();
    g.aborts.push(rid.to_string());
    for (r, t) in &g.running {
        // SGLang matches request ids by prefix.
        if all || (!rid.is_empty() && r.starts_with(rid)) {
            t.cancel();
        }
    }
    StatusCode::OK
}

async fn sg_pause(State(f): State<Fake>, Json(_b): Json<Value>) -> Json<Value> {
    f.inner.lock().unwrap().paused = true;
    Json(json!({"message": "Generation paused successfully.", "status": "ok"}))
}

async fn sg_continue(State(f): State<Fake>, Json(_b): Json<Value>) -> Json<Value> {
    f.inner.lock().unwrap().paused = false;
    f.resumed.notify_waiters();
    Json(json!({"message": "Generation continued successfully.", "status": "ok"}))
}

async fn sg_update(State(f): State<Fake>, Json(b): Json<Value>) -> Response {
    let Some(path) = b.get("model_path").and_then(Value::as_str) else {
        return error(
            StatusCode::BAD_REQUEST,
            json!({"success": false, "message": "model_path is required"}),
        );
    };
    let mut g = f.inner.lock().unwrap();
    g.version = b
        .get("weight_version")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    g.version_number = g.version.parse().unwrap_or(g.version_number + 1);
    g.installs.push(path.to_string());
    Json(json!({"success": true, "message": "Succeeded to update model weights.", "num_paused_requests": 0})).into_response()
}

async fn sg_loads(State(f): State<Fake>) -> Json<Value> {
    let n = f.inner.lock().unwrap().running.len() + f.cfg.background;
    Json(json!({"timestamp": 0, "version": "fake", "loads": [
        {"dp_rank": 0, "num_running_reqs": n, "num_waiting_reqs": 0, "num_used_tokens": 0}
    ]}))
}

async fn vl_metrics(State(f): State<Fake>) -> String {
    let n = f.inner.lock().unwrap().running.len() + f.cfg.background;
    format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"fake-model\"}} {n}.0\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"fake-model\"}} 0.0\n"
    )
}

async fn sg_info(State(f): State<Fake>) -> Json<Value> {
    Json(json!({
        "max_running_requests": f.cfg.slots, "context_length": f.cfg.context,
        "internal_states": [{"max_req_input_len": f.cfg.context}], "version": "0.5.23-fake",
    }))
}

// ---- vLLM ----

async fn vl_completions(State(f): State<Fake>, Json(b): Json<Value>) -> Response {
    f.inner.lock().unwrap().requests.push(b.clone());
    if f.paused() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            json!({"error": {"message": "Generation is paused. Please retry after it resumes.", "type": "ServiceUnavailableError", "param": null, "code": 503}}),
        );
    }
    if b.get("model").and_then(Value::as_str) != Some("fake-model") {
        return error(
            StatusCode::NOT_FOUND,
            json!({"error": {"message": "The model does not exist.", "type": "NotFoundError", "param": "model", "code": 404}}),
        );
    }
    let ids = b.get("prompt").map(u64s).unwrap_or_default();
    if ids.is_empty() || ids.len() >= f.cfg.context {
        return error(
            StatusCode::BAD_REQUEST,
            json!({"error": {"message": "prompt must be 1..max_model_len token ids", "type": "BadRequestError", "param": null, "code": 400}}),
        );
    }
    let rid = format!(
        "cmpl-{}-0",
        b.get("request_id").and_then(Value::as_str).unwrap_or("x")
    );
    let max = b.get("max_tokens").and_then(Value::as_u64).unwrap_or(16);
    let stops = b.get("stop_token_ids").map(u64s).unwrap_or_default();
    let (out, lps, reason) = run(&f, &rid, &ids, max, &stops).await;
    let tokens: Vec<String> = out.iter().map(|t| format!("token_id:{t}")).collect();
    // `prompt_logprobs: k`: per prompt token (the first: null) its own log-probability and
    // the k most likely alternatives, keyed by token id.
    let prompt_logprobs = b.get("prompt_logprobs").and_then(Value::as_u64).map(|_| {
        ids.iter()
            .enumerate()
            .map(|(i, &t)| {
                (i > 0).then(|| {
                    json!({ t.to_string(): {"logprob": prompt_logprob(t), "rank": 1 + t % 3, "decoded_token": format!("t{t}")} })
                })
            })
            .collect::<Vec<_>>()
    });
    Json(json!({
        "id": rid, "object": "text_completion", "model": "fake-model",
        "choices": [{
            "index": 0, "text": "", "finish_reason": reason, "stop_reason": null,
            "token_ids": out, "prompt_token_ids": ids, "prompt_logprobs": prompt_logprobs,
            "logprobs": {"tokens": tokens, "token_logprobs": lps, "top_logprobs": [], "text_offset": []},
        }],
        "usage": {"prompt_tokens": ids.len(), "completion_tokens": out.len(), "total_tokens": ids.len() + out.len()},
    }))
    .into_response()
}

async fn vl_models(State(f): State<Fake>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": "fake-model", "object": "model", "max_model_len": f.cfg.context}]}),
    )
}

async fn vl_abort(State(f): State<Fake>, Json(b): Json<Value>) -> Json<Value> {
    let ids: Vec<String> = b
        .get("request_ids")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let mut g = f.inner.lock().unwrap();
    let mut n = 0;
    for (r, t) in &g.running {
        if ids.is_empty() || ids.contains(r) {
            t.cancel();
            n += 1;
        }
    }
    g.aborts.extend(ids);
    Json(json!({"status": "aborted", "aborted": n}))
}

async fn vl_pause(State(f): State<Fake>, Query(q): Query<HashMap<String, String>>) -> Response {
    let mode = q.get("mode").map_or("abort", String::as_str);
    if !["abort", "wait", "keep"].contains(&mode) {
        return error(
            StatusCode::BAD_REQUEST,
            json!({"error": format!("invalid mode {mode}")}),
        );
    }
    f.inner.lock().unwrap().paused = true;
    Json(json!({"status": "paused"})).into_response()
}

async fn vl_resume(State(f): State<Fake>) -> Json<Value> {
    f.inner.lock().unwrap().paused = false;
    Json(json!({"status": "resumed"}))
}

async fn vl_is_paused(State(f): State<Fake>) -> Json<Value> {
    Json(json!({"is_paused": f.paused()}))
}

async fn vl_rpc(State(f): State<Fake>, Json(b): Json<Value>) -> Response {
    if b.get("method").and_then(Value::as_str) != Some("reload_weights") {
        return error(
            StatusCode::BAD_REQUEST,
            json!({"error": {"message": "unknown method", "type": "BadRequestError", "param": null, "code": 400}}),
        );
    }
    let path = b
        .pointer("/kwargs/weights_path")
        .and_then(Value::as_str)
        .unwrap_or("");
    f.inner.lock().unwrap().installs.push(path.to_string());
    Json(json!({"results": [null]})).into_response()
}

async fn vl_version(State(f): State<Fake>, Json(b): Json<Value>) -> Json<Value> {
    let v = b
        .get("new_version")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let mut g = f.inner.lock().unwrap();
    g.version_number = v.parse().unwrap_or(g.version_number + 1);
    g.version.clone_from(&v);
    Json(json!({"success": true, "new_version": v}))
}

/// Which server a fake imitates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Sglang,
    Vllm,
}

/// Starts a fake on a free port of 127.0.0.1 (on the current runtime).
pub async fn start(kind: Kind, cfg: FakeConfig) -> Fake {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let inner = Arc::new(Mutex::new(Inner {
        version: "0".into(),
        ..Default::default()
    }));
    let mut fake = Fake {
        url,
        cfg,
        inner,
        resumed: Default::default(),
        _server: Arc::new(tokio_util::task::AbortOnDropHandle::new(tokio::spawn(
            async {},
        ))),
    };
    let app = match kind {
        Kind::Sglang => axum::Router::new()
            .route("/generate", post(sg_generate))
            .route("/abort_request", post(sg_abort))
            .route("/pause_generation", post(sg_pause))
            .route("/continue_generation", post(sg_continue))
            .route("/update_weights_from_disk", post(sg_update))
            .route("/server_info", get(sg_info))
            .route("/v1/loads", get(sg_loads))
            .route("/health", get(health)),
        Kind::Vllm => axum::Router::new()
            .route("/v1/completions", post(vl_completions))
            .route("/v1/models", get(vl_models))
            .route("/abort_requests", post(vl_abort))
            .route("/pause", post(vl_pause))
            .route("/resume", post(vl_resume))
            .route("/is_paused", get(vl_is_paused))
            .route("/collective_rpc", post(vl_rpc))
            .route("/update_weight_version", post(vl_version))
            .route("/metrics", get(vl_metrics))
            .route("/health", get(health)),
    }
    .with_state(fake.clone());
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    fake._server = Arc::new(tokio_util::task::AbortOnDropHandle::new(server));
    fake
}
