//! The gateway's routes, under `/gateway/v1` (an OpenAI client's `base_url`; an Anthropic
//! client's is `/gateway`): `POST chat/completions`, `POST responses`, `POST messages`,
//! `GET models`. The key is `Authorization: Bearer KEY` or `x-api-key: KEY`. Every error is
//! in the provider's own shape (Anthropic's on `messages`, OpenAI's elsewhere), bodies over
//! the cap are refused with 413 before they are parsed, and a streamed answer is the
//! provider's SSE event sequence.

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

use super::anthropic::AnthropicError;
use super::episode::{Api, Episode};
use super::openai::OpenAiError;
use super::wire::{ErrorKind, WireError};
use super::{Gateway, anthropic, openai, responses};

/// Default cap on a call's body (a long agent history with tool results).
pub const DEFAULT_BODY_CAP: usize = 4 << 20;

/// A call's body must arrive within this (a client trickling its body is cut off with 408
/// rather than holding its connection).
pub const BODY_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

#[derive(Clone)]
pub struct GatewayState {
    gateway: Arc<Gateway>,
    body_cap: usize,
}

/// The gateway's routes, to be merged at the service's root (or served alone).
pub fn router<S: Clone + Send + Sync + 'static>(
    gateway: Arc<Gateway>,
    body_cap: usize,
) -> Router<S> {
    Router::new()
        .route("/gateway/v1/chat/completions", post(chat))
        .route("/gateway/v1/responses", post(responses_route))
        .route("/gateway/v1/messages", post(messages))
        .route("/gateway/v1/models", get(models))
        .with_state(GatewayState { gateway, body_cap })
}

/// Serves the gateway's routes alone on `listener` (a job's own loopback port, or the unix
/// socket its sandboxed agents reach it through) until the task is aborted.
pub fn serve<L>(listener: L, gateway: Arc<Gateway>) -> tokio::task::JoinHandle<()>
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    let app: Router = router(gateway, DEFAULT_BODY_CAP);
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "the gateway listener stopped");
        }
    })
}

/// The caller's key: a bearer token or Anthropic's `x-api-key`.
fn key(headers: &HeaderMap) -> Option<&str> {
    if let Some(k) = headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
        return Some(k.trim());
    }
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

fn provider_error(api: Api, e: &WireError) -> Response {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    match api {
        Api::Messages => (status, axum::Json(anthropic::error(e))).into_response(),
        Api::ChatCompletions | Api::Responses => {
            (status, axum::Json(openai::error(e))).into_response()
        }
    }
}

/// The episode and the parsed JSON body of a call, or the error to answer.
async fn accept(
    st: &GatewayState,
    headers: &HeaderMap,
    body: Body,
) -> Result<(Arc<Episode>, Value), WireError> {
    let key = key(headers).ok_or_else(|| {
        WireError::new(
            ErrorKind::Authentication,
            "no API key (Authorization: Bearer KEY, or x-api-key)",
        )
    })?;
    let ep = st.gateway.episode(key)?;
    let read = tokio::time::timeout(BODY_READ_TIMEOUT, axum::body::to_bytes(body, st.body_cap))
        .await
        .map_err(|_| {
            WireError::new(
                ErrorKind::Timeout,
                format!(
                    "the request body did not arrive within {} s",
                    BODY_READ_TIMEOUT.as_secs()
                ),
            )
        })?;
    let bytes: Bytes = read.map_err(|_| {
        WireError::new(
            ErrorKind::TooLarge,
            format!(
                "the request body is over the gateway's cap of {} bytes",
                st.body_cap
            ),
        )
    })?;
    let v = serde_json::from_slice(&bytes)
        .map_err(|e| WireError::invalid("body", format!("the body is not JSON: {e}")))?;
    Ok((ep, v))
}

fn sse(events: Vec<String>) -> Response {
    let stream = futures::stream::iter(events.into_iter().map(Ok::<_, std::convert::Infallible>));
    let mut r = Response::new(Body::from_stream(stream));
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// OpenAI Chat Completions, for one agent episode (its key as the bearer token).
#[utoipa::path(post, path = "/gateway/v1/chat/completions", tag = "gateway", security(("episode_key" = [])),
    request_body(content = Object, description = "a Chat Completions request: messages, tools, tool_choice, sampling, stream"),
    responses((status = 200, description = "a chat.completion object, or with stream: true its chunks as server-sent events ending in data: [DONE]", body = Object),
        (status = 400, description = "a malformed or unsupported request, or past the episode's budget (code context_length_exceeded)", body = OpenAiError),
        (status = 401, description = "no key, or not an open episode's key", body = OpenAiError),
        (status = 410, description = "the episode is finished", body = OpenAiError),
        (status = 408, description = "the body did not arrive in time", body = OpenAiError),
        (status = 413, description = "the body is over the cap", body = OpenAiError),
        (status = 429, description = "too many calls of this episode waiting", body = OpenAiError),
        (status = 503, description = "no shard could generate the answer", body = OpenAiError)))]
pub async fn chat(State(st): State<GatewayState>, headers: HeaderMap, body: Body) -> Response {
    let api = Api::ChatCompletions;
    let served = async {
        let (ep, v) = accept(&st, &headers, body).await?;
        let call = openai::parse(&v)?;
        let answer = ep.call(api, call.clone(), None).await?;
        Ok::<_, WireError>(if call.stream {
            sse(openai::chunks(
                &answer,
                call.logprobs.is_some(),
                call.include_usage,
            ))
        } else {
            axum::Json(openai::completion(&answer, call.logprobs.is_some())).into_response()
        })
    };
    served.await.unwrap_or_else(|e| provider_error(api, &e))
}

/// OpenAI Responses, for one agent episode.
#[utoipa::path(post, path = "/gateway/v1/responses", tag = "gateway", security(("episode_key" = [])),
    request_body(content = Object, description = "a Responses request: input items, instructions, tools, previous_response_id, stream"),
    responses((status = 200, description = "a response object, or with stream: true its events as server-sent events", body = Object),
        (status = 400, body = OpenAiError), (status = 401, body = OpenAiError), (status = 410, body = OpenAiError),
        (status = 408, body = OpenAiError), (status = 413, body = OpenAiError),
        (status = 429, body = OpenAiError), (status = 503, body = OpenAiError)))]
pub async fn responses_route(
    State(st): State<GatewayState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let api = Api::Responses;
    let served = async {
        let (ep, v) = accept(&st, &headers, body).await?;
        let (call, previous) = responses::parse(&v)?;
        let answer = ep.call(api, call.clone(), previous.as_deref()).await?;
        Ok::<_, WireError>(if call.stream {
            sse(responses::events(&answer, &call, previous.as_deref()))
        } else {
            axum::Json(responses::response(&answer, &call, previous.as_deref())).into_response()
        })
    };
    served.await.unwrap_or_else(|e| provider_error(api, &e))
}

/// Anthropic Messages, for one agent episode (its key as `x-api-key` or the bearer token).
#[utoipa::path(post, path = "/gateway/v1/messages", tag = "gateway", security(("episode_key" = [])),
    request_body(content = Object, description = "a Messages request: system, messages with content blocks, tools, max_tokens, stream"),
    responses((status = 200, description = "a message object, or with stream: true its events as server-sent events", body = Object),
        (status = 400, body = AnthropicError), (status = 401, body = AnthropicError), (status = 410, body = AnthropicError),
        (status = 408, body = AnthropicError), (status = 413, body = AnthropicError),
        (status = 429, body = AnthropicError), (status = 503, body = AnthropicError)))]
pub async fn messages(State(st): State<GatewayState>, headers: HeaderMap, body: Body) -> Response {
    let api = Api::Messages;
    let served = async {
        let (ep, v) = accept(&st, &headers, body).await?;
        let call = anthropic::parse(&v)?;
        let answer = ep.call(api, call.clone(), None).await?;
        Ok::<_, WireError>(if call.stream {
            sse(anthropic::events(&answer))
        } else {
            axum::Json(anthropic::message(&answer)).into_response()
        })
    };
    served.await.unwrap_or_else(|e| provider_error(api, &e))
}

/// The model an episode's calls are answered by.
#[utoipa::path(get, path = "/gateway/v1/models", tag = "gateway", security(("episode_key" = [])),
    responses((status = 200, description = "a list with the episode's model", body = Object),
        (status = 401, body = OpenAiError), (status = 410, body = OpenAiError)))]
pub async fn models(State(st): State<GatewayState>, headers: HeaderMap) -> Response {
    let found = key(&headers)
        .ok_or_else(|| WireError::new(ErrorKind::Authentication, "no API key"))
        .and_then(|k| st.gateway.episode(k));
    match found {
        Ok(ep) => axum::Json(json!({"object": "list", "data": [
            {"id": ep.model(), "object": "model", "created": 0, "owned_by": "rollarc"}]}))
        .into_response(),
        Err(e) => provider_error(Api::ChatCompletions, &e),
    }
}

#[cfg(test)]
mod tests;
