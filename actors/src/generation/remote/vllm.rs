//! vLLM's OpenAI-compatible server (≥ 0.8, with `VLLM_SERVER_DEV_MODE=1` for its RL
//! endpoints) as a generation backend.
//!
//! - generation: `POST /v1/completions` with the context as token ids (`prompt`),
//!   `request_id`, `return_token_ids`, `logprobs = 1`, `max_tokens`, `temperature`, `top_p`,
//!   `top_k`, `seed`, `stop`, `stop_token_ids`, `ignore_eos`, `include_stop_str_in_output`,
//!   `skip_special_tokens = false`; the answer is `choices[0].token_ids` with
//!   `logprobs.token_logprobs` (by default of the untempered distribution: equal to the
//!   built-in engine's at temperature 1) and `finish_reason` (`stop`, `length`, `abort`);
//! - abort: `POST /abort_requests {request_ids: ["cmpl-{id}-0"]}`; the aborted request answers
//!   with its partial tokens;
//! - suspend / resume: `POST /pause?mode=keep` / `POST /resume` (while paused in the other
//!   modes vLLM answers 503, which the engine retries once the server is back);
//! - install: the version is written as a Hugging Face directory and loaded with
//!   `POST /collective_rpc {method: "reload_weights", kwargs: {weights_path}}`, then named
//!   with `POST /update_weight_version {new_version}`;
//! - health: `GET /health`; context: `GET /v1/models` (`max_model_len`); slots: configured
//!   (vLLM's `max_num_seqs` is not served).

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

use super::http::{get, post, protocol};
use super::{
    BoxFut, Completion, ServerClient, ServerError, ServerInfo, ServerRequest, WeightsExporter,
};
use crate::generation::FinishReason;
use crate::types::PolicyVersion;
use crate::weights::Weights;

/// A vLLM server.
#[derive(Clone)]
pub struct Vllm {
    http: reqwest::Client,
    at: super::managed::Endpoint,
    export: Option<WeightsExporter>,
    /// The served model's name (asked from `/v1/models` when unset).
    model: Arc<std::sync::Mutex<Option<String>>>,
    pub slots: usize,
    pub request_timeout: Duration,
}

impl Vllm {
    /// The server at `url`, generating `slots` requests at once; `export` writes a version as
    /// a Hugging Face directory the server can read.
    pub fn new(
        http: reqwest::Client,
        url: &str,
        slots: usize,
        export: Option<WeightsExporter>,
    ) -> Self {
        Self {
            http,
            at: super::managed::Endpoint::Fixed(url.to_string()),
            export,
            model: Default::default(),
            slots,
            request_timeout: Duration::from_secs(600),
        }
    }

    fn model(&self) -> Option<String> {
        self.model.lock().ok().and_then(|m| m.clone())
    }
}

/// The JSON body of a `/v1/completions` request.
pub fn completion_body(req: &ServerRequest, model: Option<&str>) -> Value {
    let p = &req.params;
    let mut b = json!({
        "prompt": &*req.context,
        "request_id": req.rid,
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": if p.top_k > 0 { i64::from(p.top_k) } else { -1 },
        "seed": p.seed as i64 & i64::MAX,
        "stop": p.stop_strings,
        "stop_token_ids": p.stop_tokens,
        "ignore_eos": p.ignore_eos,
        "include_stop_str_in_output": true,
        "skip_special_tokens": false,
        "logprobs": 1,
        "return_token_ids": true,
        "stream": false,
    });
    if let Some(m) = model {
        b["model"] = json!(m);
    }
    b
}

/// Reads a `/v1/completions` answer; whether it was aborted.
pub fn read_answer(server: &str, v: &Value) -> Result<(Completion, bool), ServerError> {
    let path = "/v1/completions";
    let c = v
        .pointer("/choices/0")
        .ok_or_else(|| protocol(server, path, "no choices"))?;
    let ids: Vec<u32> = c
        .get("token_ids")
        .and_then(Value::as_array)
        .ok_or_else(|| {
            protocol(
                server,
                path,
                "no token_ids (return_token_ids needs vLLM ≥ 0.10)",
            )
        })?
        .iter()
        .filter_map(Value::as_u64)
        .map(|x| x as u32)
        .collect();
    let lps: Vec<f32> = c
        .pointer("/logprobs/token_logprobs")
        .and_then(Value::as_array)
        .map(|a| a.iter().map(|x| x.as_f64().unwrap_or(0.0) as f32).collect())
        .unwrap_or_default();
    if lps.len() != ids.len() {
        return Err(protocol(
            server,
            path,
            format!("{} tokens but {} log-probabilities", ids.len(), lps.len()),
        ));
    }
    let reason = c
        .get("finish_reason")
        .and_then(Value::as_str)
        .unwrap_or("stop");
    let prompt = v
        .pointer("/usage/prompt_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let cached = v
        .pointer("/usage/prompt_tokens_details/cached_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    Ok((
        Completion {
            tokens: ids,
            logprobs: lps,
            finish: Some(if reason == "length" {
                FinishReason::Length
            } else {
                FinishReason::Stop
            }),
            prefill_tokens: prompt.saturating_sub(cached) as u32,
            missing_logprobs: 0,
        },
        reason == "abort",
    ))
}

impl Vllm {
    /// Talks to (and keeps alive) the managed server `s`.
    pub fn managed(mut self, s: Arc<super::managed::ManagedServer>) -> Self {
        self.at = super::managed::Endpoint::Managed(s);
        self
    }

    fn base(&self) -> String {
        self.at.url()
    }
}

impl ServerClient for Vllm {
    fn describe(&self) -> String {
        format!("vLLM at {}", self.base())
    }

    fn info(&self) -> BoxFut<Result<ServerInfo, ServerError>> {
        let me = self.clone();
        Box::pin(async move {
            let server = me.describe();
            let v = get(&me.http, &server, &me.base(), "/v1/models").await?;
            let m = v
                .pointer("/data/0")
                .ok_or_else(|| protocol(&server, "/v1/models", "no model is served"))?;
            if let (Some(id), Ok(mut g)) = (m.get("id").and_then(Value::as_str), me.model.lock()) {
                *g = Some(id.to_string());
            }
            let context = m
                .get("max_model_len")
                .and_then(Value::as_u64)
                .ok_or_else(|| protocol(&server, "/v1/models", "no max_model_len"))?;
            Ok(ServerInfo {
                slots: me.slots.max(1),
                context: context as usize,
            })
        })
    }

    fn generate(&self, req: ServerRequest) -> BoxFut<Result<Completion, ServerError>> {
        let me = self.clone();
        Box::pin(async move {
            let server = me.describe();
            let body = completion_body(&req, me.model().as_deref());
            let v = post(
                &me.http,
                &server,
                &me.base(),
                "/v1/completions",
                &body,
                me.request_timeout,
            )
            .await?;
            let (c, aborted) = read_answer(&server, &v)?;
            if let Ok(mut p) = req.progress.lock() {
                p.tokens.clone_from(&c.tokens);
                p.logprobs.clone_from(&c.logprobs);
            }
            if aborted {
                return Err(ServerError::Aborted { server, partial: c });
            }
            Ok(c)
        })
    }

    fn prompt_logprobs(&self, tokens: Arc<[u32]>) -> BoxFut<Result<Vec<f32>, ServerError>> {
        let me = self.clone();
        Box::pin(async move {
            let server = me.describe();
            let path = "/v1/completions";
            // `prompt_logprobs: 0`: each prompt token's own log-probability, no alternatives.
            let mut body = json!({
                "prompt": &*tokens, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0,
            });
            if let Some(m) = me.model() {
                body["model"] = json!(m);
            }
            let v = post(
                &me.http,
                &server,
                &me.base(),
                path,
                &body,
                me.request_timeout,
            )
            .await?;
            let entries = v
                .pointer("/choices/0/prompt_logprobs")
                .and_then(Value::as_array)
                .ok_or_else(|| protocol(&server, path, "no choices[0].prompt_logprobs"))?;
            if entries.len() != tokens.len() {
                return Err(protocol(
                    &server,
                    path,
                    format!(
                        "{} prompt tokens but {} entries",
                        tokens.len(),
                        entries.len()
                    ),
                ));
            }
            // Entry i maps token ids (as strings) to {logprob, rank, decoded_token}.
            entries
                .iter()
                .zip(tokens.iter())
                .skip(1)
                .map(|(e, t)| {
                    e.get(t.to_string())
                        .and_then(|x| x.get("logprob"))
                        .and_then(Value::as_f64)
                        .map(|lp| lp as f32)
                        .ok_or_else(|| {
                            protocol(
                                &server,
                                path,
                                format!("prompt token {t} has no logprob in {e}"),
                            )
                        })
                })
                .collect()
        })
    }

    fn cancel(&self, rid: &str) -> BoxFut<()> {
        let (me, rid) = (self.clone(), rid.to_string());
        Box::pin(async move {
            // vLLM names a completion's engine request `cmpl-{request_id}-{prompt index}`.
            let body = json!({ "request_ids": [format!("cmpl-{rid}-0")] });
            let r = post(
                &me.http,
                &me.describe(),
                &me.base(),
                "/abort_requests",
                &body,
                Duration::from_secs(10),
            )
            .await;
            if let Err(e) = r {
                tracing::debug!(error = %e, "abort_requests failed");
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
            super::http::post_unit(&me.http, &server, &me.base(), "/pause?mode=keep", json!({}))
                .await
        })
    }

    fn resume(&self) -> BoxFut<Result<(), ServerError>> {
        let me = self.clone();
        Box::pin(async move {
            let server = me.describe();
            super::http::post_unit(&me.http, &server, &me.base(), "/resume", json!({})).await
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
            let body = json!({
                "method": "reload_weights",
                "kwargs": { "weights_path": path.to_string_lossy() },
            });
            post(
                &me.http,
                &server,
                &me.base(),
                "/collective_rpc",
                &body,
                Duration::from_secs(600),
            )
            .await?;
            let body = json!({ "new_version": version.to_string() });
            post(
                &me.http,
                &server,
                &me.base(),
                "/update_weight_version",
                &body,
                Duration::from_secs(60),
            )
            .await?;
            Ok(())
        })
    }

    fn server_load(&self) -> BoxFut<Option<super::ServerLoad>> {
        let (http, url) = (self.http.clone(), self.base());
        Box::pin(async move {
            let text = http
                .get(format!("{url}/metrics"))
                .timeout(Duration::from_secs(5))
                .send()
                .await
                .ok()?
                .text()
                .await
                .ok()?;
            Some(super::ServerLoad {
                running: prometheus_sum(&text, "vllm:num_requests_running")? as usize,
                waiting: prometheus_sum(&text, "vllm:num_requests_waiting")? as usize,
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

/// The sum over label sets of a Prometheus gauge in a text exposition (`None`: absent).
pub fn prometheus_sum(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        // The name must end here (`name{…} v` or `name v`), not continue (`name_total`).
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        let v: f64 = rest.rsplit(' ').next()?.parse().ok()?;
        *found.get_or_insert(0.0) += v;
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_gauges_are_summed_over_their_labels() {
        let text = "# HELP vllm:num_requests_running Number of requests\n\
                    vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
                    vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 2.0\n\
                    vllm:num_requests_running_total 99\n\
                    vllm:num_requests_waiting 4\n";
        assert_eq!(prometheus_sum(text, "vllm:num_requests_running"), Some(5.0));
        assert_eq!(prometheus_sum(text, "vllm:num_requests_waiting"), Some(4.0));
        assert_eq!(prometheus_sum(text, "vllm:kv_cache_usage_perc"), None);
    }
}
