//! SGLang's HTTP server as a generation backend.
//!
//! - generation: `POST /generate` with `input_ids`, `rid`, `return_logprob`
//!   (`logprob_start_len = -1`: the answer's tokens only) and `sampling_params`
//!   (`max_new_tokens`, `temperature`, `top_p`, `top_k`, `min_p = 0`, `stop`,
//!   `stop_token_ids`, `ignore_eos`, `no_stop_trim`, `skip_special_tokens = false`,
//!   `sampling_seed`); the answer is `output_ids` with `meta_info.output_token_logprobs`
//!   (`[logprob, id, text]`, of the tempered distribution, as the built-in engine's) and
//!   `meta_info.finish_reason.type` (`stop`, `length`, `abort`);
//! - abort: `POST /abort_request {rid}` (SGLang matches ids by prefix; rollarc's are fixed
//!   width); the aborted request answers with its partial tokens;
//! - suspend / resume: `POST /pause_generation {mode: "in_place"}` / `/continue_generation`;
//! - install: the version is written as a Hugging Face directory and announced with
//!   `POST /update_weights_from_disk {model_path, weight_version, flush_cache}`; every answer's
//!   `meta_info.weight_version` is checked against the installed version;
//! - health: `GET /health`; slots and context: `GET /server_info` (older servers:
//!   `/get_server_info`), `max_running_requests` and `max_req_input_len`/`context_length`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};

use super::http::{get, post, protocol};
use super::{
    BoxFut, Completion, ServerClient, ServerError, ServerInfo, ServerRequest, WeightsExporter,
};
use crate::generation::FinishReason;
use crate::types::PolicyVersion;
use crate::weights::Weights;

/// An SGLang server.
#[derive(Clone)]
pub struct Sglang {
    http: reqwest::Client,
    at: super::managed::Endpoint,
    export: Option<WeightsExporter>,
    /// The weight version the server was last told (checked on every answer).
    version: Arc<Mutex<Option<String>>>,
    /// Requests when the server does not say (`max_running_requests` unset).
    pub default_slots: usize,
    pub request_timeout: Duration,
}

impl Sglang {
    /// The server at `url`; `export` writes a version as a Hugging Face directory the server
    /// can read (none: it cannot install).
    pub fn new(http: reqwest::Client, url: &str, export: Option<WeightsExporter>) -> Self {
        Self {
            http,
            at: super::managed::Endpoint::Fixed(url.to_string()),
            export,
            version: Default::default(),
            default_slots: 64,
            request_timeout: Duration::from_secs(600),
        }
    }
}

/// The JSON body of a `/generate` request.
pub fn generate_body(req: &ServerRequest) -> Value {
    let p = &req.params;
    let mut sp = json!({
        "max_new_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "min_p": 0.0,
        "stop_token_ids": p.stop_tokens,
        "stop": p.stop_strings,
        "ignore_eos": p.ignore_eos,
        "no_stop_trim": true,
        "skip_special_tokens": false,
        "sampling_seed": p.seed,
    });
    if p.top_k > 0 {
        sp["top_k"] = json!(p.top_k);
    }
    json!({
        "input_ids": &*req.context,
        "rid": req.rid,
        "return_logprob": true,
        "logprob_start_len": -1,
        "stream": false,
        "sampling_params": sp,
    })
}

/// SGLang's `input_token_logprobs` (`[logprob, token id, text]` per input token, the first
/// without a log-probability) as the log-probabilities of `tokens[1..]`.
fn read_prompt_logprobs(
    server: &str,
    entries: &[Value],
    tokens: &[u32],
) -> Result<Vec<f32>, ServerError> {
    if entries.len() != tokens.len() {
        return Err(protocol(
            server,
            "/generate",
            format!(
                "{} input tokens but {} log-probabilities",
                tokens.len(),
                entries.len()
            ),
        ));
    }
    entries
        .iter()
        .zip(tokens)
        .skip(1)
        .map(|(e, &t)| {
            let id = e.get(1).and_then(Value::as_u64);
            match (e.get(0).and_then(Value::as_f64), id) {
                (Some(lp), Some(id)) if id == u64::from(t) => Ok(lp as f32),
                _ => Err(protocol(
                    server,
                    "/generate",
                    format!("input log-probability entry {e} does not belong to token {t}"),
                )),
            }
        })
        .collect()
}

/// Reads a `/generate` answer.
pub fn read_answer(
    server: &str,
    v: &Value,
) -> Result<(Completion, bool, Option<String>), ServerError> {
    let path = "/generate";
    let ids: Vec<u32> = v
        .get("output_ids")
        .and_then(Value::as_array)
        .ok_or_else(|| protocol(server, path, "no output_ids"))?
        .iter()
        .filter_map(Value::as_u64)
        .map(|x| x as u32)
        .collect();
    let meta = v.get("meta_info").cloned().unwrap_or(Value::Null);
    let lps: Vec<f32> = meta
        .get("output_token_logprobs")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|e| e.get(0).and_then(Value::as_f64).unwrap_or(0.0) as f32)
                .collect()
        })
        .unwrap_or_default();
    if lps.len() != ids.len() {
        return Err(protocol(
            server,
            path,
            format!("{} tokens but {} log-probabilities", ids.len(), lps.len()),
        ));
    }
    let kind = meta
        .pointer("/finish_reason/type")
        .and_then(Value::as_str)
        .unwrap_or("stop");
    let prompt = meta
        .get("prompt_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let cached = meta
        .get("cached_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let c = Completion {
        tokens: ids,
        logprobs: lps,
        finish: Some(match kind {
            "length" => FinishReason::Length,
            _ => FinishReason::Stop,
        }),
        prefill_tokens: prompt.saturating_sub(cached) as u32,
        missing_logprobs: 0,
    };
    let version = meta.get("weight_version").map(|w| match w {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    });
    Ok((c, kind == "abort", version))
}

impl Sglang {
    /// Talks to (and keeps alive) the managed server `s`.
    pub fn managed(mut self, s: Arc<super::managed::ManagedServer>) -> Self {
        self.at = super::managed::Endpoint::Managed(s);
        self
    }

    fn base(&self) -> String {
        self.at.url()
    }
}

impl ServerClient for Sglang {
    fn describe(&self) -> String {
        format!("SGLang at {}", self.base())
    }

    fn info(&self) -> BoxFut<Result<ServerInfo, ServerError>> {
        let me = self.clone();
        Box::pin(async move {
            let server = me.describe();
            let v = match get(&me.http, &server, &me.base(), "/server_info").await {
                Ok(v) => v,
                Err(ServerError::Status { status: 404, .. }) => {
                    get(&me.http, &server, &me.base(), "/get_server_info").await?
                }
                Err(e) => return Err(e),
            };
            let num = |k: &str| {
                v.get(k).and_then(Value::as_u64).or_else(|| {
                    v.pointer(&format!("/internal_states/0/{k}"))
                        .and_then(Value::as_u64)
                })
            };
            let slots = num("max_running_requests").unwrap_or(me.default_slots as u64);
            let context = num("max_req_input_len")
                .or_else(|| num("context_length"))
                .ok_or_else(|| {
                    protocol(
                        &server,
                        "/server_info",
                        "no max_req_input_len or context_length",
                    )
                })?;
            Ok(ServerInfo {
                slots: slots.max(1) as usize,
                context: context as usize,
            })
        })
    }

    fn generate(&self, req: ServerRequest) -> BoxFut<Result<Completion, ServerError>> {
        let me = self.clone();
        Box::pin(async move {
            let server = me.describe();
            let v = post(
                &me.http,
                &server,
                &me.base(),
                "/generate",
                &generate_body(&req),
                me.request_timeout,
            )
            .await?;
            let (c, aborted, version) = read_answer(&server, &v)?;
            if let Ok(mut p) = req.progress.lock() {
                p.tokens.clone_from(&c.tokens);
                p.logprobs.clone_from(&c.logprobs);
            }
            if aborted {
                return Err(ServerError::Aborted { server, partial: c });
            }
            let want = me.version.lock().map(|g| g.clone()).unwrap_or(None);
            if let (Some(want), Some(got)) = (want, version)
                && want != got
            {
                return Err(protocol(
                    &server,
                    "/generate",
                    format!("answered with weight version {got}, but {want} is installed"),
                ));
            }
            Ok(c)
        })
    }

    fn prompt_logprobs(&self, tokens: Arc<[u32]>) -> BoxFut<Result<Vec<f32>, ServerError>> {
        let me = self.clone();
        Box::pin(async move {
            let server = me.describe();
            // One token generated; the input's log-probabilities from its first position.
            let body = json!({
                "input_ids": &*tokens, "return_logprob": true, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            });
            let v = post(
                &me.http,
                &server,
                &me.base(),
                "/generate",
                &body,
                me.request_timeout,
            )
            .await?;
            let entries = v
                .pointer("/meta_info/input_token_logprobs")
                .and_then(Value::as_array)
                .ok_or_else(|| {
                    protocol(&server, "/generate", "no meta_info.input_token_logprobs")
                })?;
            read_prompt_logprobs(&server, entries, &tokens)
        })
    }

    fn cancel(&self, rid: &str) -> BoxFut<()> {
        let (me, rid) = (self.clone(), rid.to_string());
        Box::pin(async move {
            let body = json!({ "rid": rid });
            let r = post(
                &me.http,
                &me.describe(),
                &me.base(),
                "/abort_request",
                &body,
                Duration::from_secs(10),
            )
            .await;
            if let Err(e) = r {
                tracing::debug!(error = %e, "abort_request failed");
            }
        })
    }

    fn partial_on_cancel(&self) -> bool {
        true
    }

    fn pause(&self) -> BoxFut<Result<(), ServerError>> {
        let me = self.clone();
        Box::pin(async move {
            let server = me.describe();
            super::http::post_unit(
                &me.http,
                &server,
                &me.base(),
                "/pause_generation",
                json!({ "mode": "in_place" }),
            )
            .await
        })
    }

    fn resume(&self) -> BoxFut<Result<(), ServerError>> {
        let me = self.clone();
        Box::pin(async move {
            let server = me.describe();
            super::http::post_unit(
                &me.http,
                &server,
                &me.base(),
                "/continue_generation",
                json!({}),
            )
            .await
        })
    }

    fn install(
        &self,
        version: PolicyVersion,
        weights: Arc<Weights>,
    ) -> BoxFut<Result<(), ServerError>> {
        let me = self.clone();
        Box::pin(async move {
            let server = me.describe();
            let path =
                super::http::export_for(me.export.as_ref(), &server, version, weights).await?;
            let tag = version.to_string();
            let body = json!({
                "model_path": path.to_string_lossy(),
                "weight_version": tag,
                "flush_cache": true,
                "abort_all_requests": true,
            });
            let v = post(
                &me.http,
                &server,
                &me.base(),
                "/update_weights_from_disk",
                &body,
                Duration::from_secs(600),
            )
            .await?;
            if v.get("success").and_then(Value::as_bool) != Some(true) {
                return Err(ServerError::CannotInstall {
                    server,
                    reason: v
                        .get("message")
                        .and_then(Value::as_str)
                        .unwrap_or("update_weights_from_disk did not succeed")
                        .to_string(),
                });
            }
            if let Ok(mut g) = me.version.lock() {
                *g = Some(tag);
            }
            Ok(())
        })
    }

    fn server_load(&self) -> BoxFut<Option<super::ServerLoad>> {
        let me = self.clone();
        Box::pin(async move {
            let v = get(&me.http, &me.describe(), &me.base(), "/v1/loads")
                .await
                .ok()?;
            let loads = v.get("loads")?.as_array()?;
            let sum = |k: &str| {
                loads
                    .iter()
                    .filter_map(|l| l.get(k).and_then(Value::as_u64))
                    .sum::<u64>() as usize
            };
            Some(super::ServerLoad {
                running: sum("num_running_reqs"),
                waiting: sum("num_waiting_reqs"),
            })
        })
    }

    fn health(&self) -> BoxFut<Result<(), ServerError>> {
        let me = self.clone();
        Box::pin(async move {
            let server = me.describe();
            super::http::health(&me.http, &server, me.at.managed(), &me.base(), "/health").await
        })
    }
}
