//! llama.cpp's HTTP server (`llama-server`, or the one the `xllamacpp` wheel embeds) as a
//! generation backend.
//!
//! Generation is `POST /completion` with the context as token ids, streamed (`stream`,
//! `return_tokens`, `n_probs = 1` for the sampled token's log-probability), on the slot that
//! holds the session's prefix (`id_slot`, `cache_prompt`), with llama.cpp's sampler chain
//! narrowed to temperature → top-k → top-p (its defaults, which a GGUF may change, add min-p
//! 0.05, which would change the distribution the trainer assumes). llama.cpp reports the
//! log-probability of the untempered distribution: equal to the built-in engine's at
//! temperature 1 (what episodes sample at). It omits the entry of a token that ends inside a
//! multi-byte UTF-8 character; such a token gets the log-probability 0 and is counted. Stop ids and stop strings are checked here,
//! on the streamed tokens and their text pieces, so the tokens that completed a stop are kept
//! exactly as the built-in engine keeps them. Closing the request cancels it on the server.
//!
//! llama.cpp has no weight-update endpoint: a managed server installs new weights by
//! restarting on the exported GGUF of the new version; an attached one cannot install.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};

use super::managed::ManagedServer;
use super::{BoxFut, Completion, ServerClient, ServerError, ServerInfo, ServerRequest};
use crate::generation::FinishReason;
use crate::types::PolicyVersion;
use crate::weights::Weights;

/// Writes the weights of a version as a GGUF file the server can load; returns its path.
pub type GgufExporter = super::WeightsExporter;

/// Where the server is.
#[derive(Clone)]
pub enum Target {
    /// A server someone else runs.
    Attached(String),
    /// A child process this client owns, and how to make a GGUF of new weights for it.
    Managed {
        server: Arc<ManagedServer>,
        export: GgufExporter,
    },
}

/// A llama.cpp server.
#[derive(Clone)]
pub struct LlamaCpp {
    http: reqwest::Client,
    target: Target,
    /// Per-request limit (a whole answer on a slow CPU server).
    pub request_timeout: Duration,
    /// The token of "a", once asked (teacher forcing reads through it).
    plain: Arc<std::sync::Mutex<Option<u32>>>,
}

impl LlamaCpp {
    pub fn new(http: reqwest::Client, target: Target) -> Self {
        Self {
            http,
            target,
            request_timeout: Duration::from_secs(600),
            plain: Arc::default(),
        }
    }

    /// The managed server, if this client owns one.
    pub fn managed(&self) -> Option<&Arc<ManagedServer>> {
        match &self.target {
            Target::Managed { server, .. } => Some(server),
            Target::Attached(_) => None,
        }
    }

    fn url(&self) -> String {
        match &self.target {
            Target::Attached(u) => u.trim_end_matches('/').to_string(),
            Target::Managed { server, .. } => server.url(),
        }
    }

    fn describe_url(url: &str) -> String {
        format!("llama.cpp at {url}")
    }

    /// The log-probability of `next` after `prefix`. llama.cpp reports, for the token it
    /// generates, its log-probability and the `n_probs` most likely alternatives, all from the
    /// raw distribution (before its samplers, so before `logit_bias`). `next` is forced with a
    /// bias and read from its own entry (one token generated; the prefix stays cached for the
    /// next position). llama.cpp omits the entry of a token that ends inside a UTF-8
    /// character: then a whole-character token is forced instead and `next` looked up among
    /// the alternatives (the top 20, else the whole vocabulary).
    async fn next_logprob(&self, prefix: &[u32], next: u32) -> Result<f32, ServerError> {
        let whole = |n_probs: u64| async move {
            Ok::<_, ServerError>((self.plain_token().await?, n_probs))
        };
        for attempt in 0..3 {
            let (forced, n_probs) = match attempt {
                0 => (next, 1),
                1 => whole(20).await?,
                _ => whole(1 << 20).await?,
            };
            let body = json!({
                "prompt": prefix, "n_predict": 1, "temperature": 0.0, "n_probs": n_probs,
                "post_sampling_probs": false, "cache_prompt": true, "return_tokens": true,
                "logit_bias": [[forced, 100.0]],
            });
            let v = super::http::post(
                &self.http,
                &self.describe(),
                &self.url(),
                "/completion",
                &body,
                self.request_timeout,
            )
            .await?;
            let Some(entry) = v.pointer("/completion_probabilities/0") else {
                continue;
            };
            let is_next = |e: &Value| e.get("id").and_then(Value::as_u64) == Some(u64::from(next));
            let found = if is_next(entry) {
                Some(entry)
            } else {
                entry
                    .get("top_logprobs")
                    .and_then(Value::as_array)
                    .and_then(|top| top.iter().find(|e| is_next(e)))
            };
            if let Some(lp) = found.and_then(|e| e.get("logprob")).and_then(Value::as_f64) {
                return Ok(lp as f32);
            }
        }
        Err(ServerError::Protocol {
            server: self.describe(),
            path: "/completion".into(),
            detail: format!("no log-probability for token {next} among the vocabulary's"),
        })
    }

    /// A token that is a whole character (the server's token for "a"), asked once.
    async fn plain_token(&self) -> Result<u32, ServerError> {
        if let Some(t) = self.plain.lock().ok().and_then(|g| *g) {
            return Ok(t);
        }
        let (server, path) = (self.describe(), "/tokenize");
        let body = json!({ "content": "a" });
        let v = super::http::post(
            &self.http,
            &server,
            &self.url(),
            path,
            &body,
            self.request_timeout,
        )
        .await?;
        let t = v
            .pointer("/tokens/0")
            .and_then(Value::as_u64)
            .ok_or_else(|| ServerError::Protocol {
                server,
                path: path.into(),
                detail: "no tokens".into(),
            })? as u32;
        if let Ok(mut g) = self.plain.lock() {
            *g = Some(t);
        }
        Ok(t)
    }
}

/// The JSON body of a `/completion` request.
pub fn completion_body(req: &ServerRequest) -> Value {
    let p = &req.params;
    let mut body = json!({
        "prompt": &*req.context,
        "n_predict": p.max_tokens,
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": 0.0,
        // Temperature first, as the built-in engine samples (top-k/top-p on the tempered
        // distribution); penalties, DRY, min-p and the rest are left out of the chain.
        "samplers": ["temperature", "top_k", "top_p"],
        "seed": p.seed as u32,
        "ignore_eos": p.ignore_eos,
        "cache_prompt": true,
        "n_probs": 1,
        "return_tokens": true,
        "stream": true,
    });
    if let Some(s) = req.slot {
        body["id_slot"] = json!(s);
    }
    body
}

/// Reads one streamed chunk into `out`; returns whether generation ended (and why).
fn take_chunk(
    v: &Value,
    req: &ServerRequest,
    text: &mut String,
    out: &mut Completion,
) -> Option<FinishReason> {
    let probs = v
        .get("completion_probabilities")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut probs = probs.into_iter().peekable();
    let tokens: Vec<u32> = match v.get("tokens").and_then(Value::as_array) {
        Some(t) => t
            .iter()
            .filter_map(|x| x.as_u64())
            .map(|x| x as u32)
            .collect(),
        None => probs
            .clone()
            .filter_map(|p| p.get("id").and_then(Value::as_u64))
            .map(|x| x as u32)
            .collect(),
    };
    for tok in tokens {
        // The entries follow the tokens, except for tokens that end mid-character.
        let pr = probs.next_if(|p| p.get("id").and_then(Value::as_u64) == Some(u64::from(tok)));
        let lp = match pr
            .as_ref()
            .and_then(|p| p.get("logprob"))
            .and_then(Value::as_f64)
        {
            Some(lp) => lp as f32,
            None => {
                out.missing_logprobs += 1;
                0.0
            }
        };
        if let Some(piece) = pr
            .as_ref()
            .and_then(|p| p.get("token"))
            .and_then(Value::as_str)
        {
            text.push_str(piece);
        }
        out.tokens.push(tok);
        out.logprobs.push(lp);
        if let Ok(mut g) = req.progress.lock() {
            g.tokens.push(tok);
            g.logprobs.push(lp);
        }
        if req.params.stop_tokens.contains(&tok) {
            return Some(FinishReason::Stop);
        }
        if req
            .params
            .stop_strings
            .iter()
            .any(|s| !s.is_empty() && text.contains(s.as_str()))
        {
            return Some(FinishReason::Stop);
        }
        if out.tokens.len() >= req.params.max_tokens as usize {
            return Some(FinishReason::Length);
        }
    }
    if let Some(n) = v
        .get("timings")
        .and_then(|t| t.get("prompt_n"))
        .and_then(Value::as_u64)
    {
        out.prefill_tokens = n as u32;
    }
    if v.get("stop").and_then(Value::as_bool) == Some(true) {
        return Some(match v.get("stop_type").and_then(Value::as_str) {
            Some("limit") => FinishReason::Length,
            _ => FinishReason::Stop,
        });
    }
    None
}

async fn generate(
    http: reqwest::Client,
    url: String,
    req: ServerRequest,
    timeout: Duration,
) -> Result<Completion, ServerError> {
    let server = LlamaCpp::describe_url(&url);
    let path = "/completion";
    if req.params.allowed_tokens.is_some() {
        return Err(ServerError::Other(format!(
            "{server}: constrained decoding (allowed tokens) is not supported"
        )));
    }
    let unreachable = |e: reqwest::Error| ServerError::Unreachable {
        server: server.clone(),
        source: crate::error::SharedError::new(e),
    };
    let body = completion_body(&req);
    let send = || {
        http.post(format!("{url}{path}"))
            .timeout(timeout)
            .json(&body)
            .send()
    };
    // A pooled connection the server has just closed fails before the request reaches it:
    // one immediate retry on a fresh connection.
    let resp = match send().await {
        Ok(r) => r,
        Err(e) if e.is_request() || e.is_connect() => send().await.map_err(unreachable)?,
        Err(e) => return Err(unreachable(e)),
    };
    let status = resp.status();
    if !status.is_success() {
        let body = resp.text().await.unwrap_or_default();
        return Err(ServerError::Status {
            server,
            path: path.into(),
            status: status.as_u16(),
            body: super::http::error_message(&body),
        });
    }
    let mut out = Completion::default();
    let mut text = String::new();
    let mut buf: Vec<u8> = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        buf.extend_from_slice(&chunk.map_err(unreachable)?);
        // Server-sent events: "data: {json}" lines, separated by blank lines.
        while let Some(end) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(data) = line.trim().strip_prefix("data:") else {
                continue;
            };
            let v: Value =
                serde_json::from_str(data.trim()).map_err(|e| ServerError::Protocol {
                    server: server.clone(),
                    path: path.into(),
                    detail: format!("{e} in {}", data.trim()),
                })?;
            if let Some(err) = v.get("error") {
                return Err(ServerError::Status {
                    server,
                    path: path.into(),
                    status: err.get("code").and_then(Value::as_u64).unwrap_or(500) as u16,
                    body: super::http::error_message(&err.to_string()),
                });
            }
            if let Some(f) = take_chunk(&v, &req, &mut text, &mut out) {
                out.finish = Some(f);
                if v.get("stop").and_then(Value::as_bool) == Some(true) {
                    // The server's last event: read the stream's end so the connection goes
                    // back to the pool whole.
                    let _ = tokio::time::timeout(Duration::from_secs(1), async {
                        while stream.next().await.is_some() {}
                    })
                    .await;
                }
                return Ok(out);
            }
        }
    }
    Err(ServerError::Protocol {
        server,
        path: path.into(),
        detail: "the stream ended before the answer did".into(),
    })
}

impl ServerClient for LlamaCpp {
    fn describe(&self) -> String {
        Self::describe_url(&self.url())
    }

    fn info(&self) -> BoxFut<Result<ServerInfo, ServerError>> {
        let (http, url) = (self.http.clone(), self.url());
        Box::pin(async move {
            let v = super::http::get(&http, &Self::describe_url(&url), &url, "/props").await?;
            let slots = v.get("total_slots").and_then(Value::as_u64);
            let context = v
                .get("default_generation_settings")
                .and_then(|g| g.get("n_ctx"))
                .and_then(Value::as_u64);
            match (slots, context) {
                (Some(s), Some(c)) if s > 0 && c > 0 => Ok(ServerInfo {
                    slots: s as usize,
                    context: c as usize,
                }),
                _ => Err(ServerError::Protocol {
                    server: Self::describe_url(&url),
                    path: "/props".into(),
                    detail: "no total_slots or default_generation_settings.n_ctx".into(),
                }),
            }
        })
    }

    fn generate(&self, req: ServerRequest) -> BoxFut<Result<Completion, ServerError>> {
        Box::pin(generate(
            self.http.clone(),
            self.url(),
            req,
            self.request_timeout,
        ))
    }

    fn prompt_logprobs(&self, tokens: Arc<[u32]>) -> BoxFut<Result<Vec<f32>, ServerError>> {
        let me = self.clone();
        Box::pin(async move {
            let mut out = Vec::with_capacity(tokens.len().saturating_sub(1));
            for i in 1..tokens.len() {
                out.push(me.next_logprob(&tokens[..i], tokens[i]).await?);
            }
            Ok(out)
        })
    }

    fn install(
        &self,
        version: PolicyVersion,
        weights: Arc<Weights>,
    ) -> BoxFut<Result<(), ServerError>> {
        let me = self.clone();
        Box::pin(async move {
            let Target::Managed { server, export } = &me.target else {
                return Err(ServerError::CannotInstall {
                    server: me.describe(),
                    reason: "llama.cpp has no weight-update endpoint; run it managed \
                             (launch = {…}) so rollarc can restart it on the new weights"
                        .into(),
                });
            };
            let path = export(version, weights).await?;
            server.restart_on(path).await?;
            // Healthy again on the new file.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
            loop {
                if me.health().await.is_ok() {
                    return Ok(());
                }
                if tokio::time::Instant::now() >= deadline {
                    return Err(ServerError::NotHealthy {
                        server: me.describe(),
                        seconds: 300.0,
                    });
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    }

    fn server_load(&self) -> BoxFut<Option<super::ServerLoad>> {
        let (http, url) = (self.http.clone(), self.url());
        Box::pin(async move {
            let v = super::http::get(&http, &Self::describe_url(&url), &url, "/slots")
                .await
                .ok()?;
            let busy = v
                .as_array()?
                .iter()
                .filter(|s| s.get("is_processing").and_then(Value::as_bool) == Some(true))
                .count();
            Some(super::ServerLoad {
                running: busy,
                waiting: 0,
            })
        })
    }

    fn health(&self) -> BoxFut<Result<(), ServerError>> {
        let me = self.clone();
        Box::pin(async move {
            let (server, url) = (me.describe(), me.url());
            super::http::health(&me.http, &server, me.managed(), &url, "/health").await
        })
    }
}

/// A launcher for llama.cpp's server from the `xllamacpp` wheel, with llama-server's flags
/// (written next to the job's files and run by the wheel's Python).
pub const XLLAMACPP_SERVE: &str = include_str!("xllamacpp_serve.py");

/// The command line of a managed llama.cpp server run through [`XLLAMACPP_SERVE`] by
/// `python`, with `threads` CPU threads (placeholders filled at each start).
pub fn xllamacpp_command(python: &str, script: &std::path::Path, threads: usize) -> Vec<String> {
    let mut v: Vec<String> = vec![python.into(), script.to_string_lossy().into_owned()];
    v.extend(
        [
            "-m",
            "{model}",
            "--host",
            "{host}",
            "--port",
            "{port}",
            "-np",
            "{slots}",
            "-c",
            "{total_context}",
            "-t",
        ]
        .map(String::from),
    );
    v.push(threads.to_string());
    v
}
