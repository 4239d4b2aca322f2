//! OpenAI Chat Completions on the wire: the request parsed into a [`Call`], the answer as a
//! `chat.completion` object or as `chat.completion.chunk` SSE events ending in
//! `data: [DONE]`, errors as `{"error": {"message", "type", "param", "code"}}`.

use actors::agent::{Conversation, Message, Role, ToolCall};
use serde::Serialize;
use serde_json::{Value, json};
use utoipa::ToSchema;

use super::wire::{
    Answer, Call, ErrorKind, Fields, Sampling, ToolShape, WireError, openai_tool_choice,
    text_parts, tool_list,
};

/// Chat Completions tools: `{"type": "function", "function": {name, description, parameters}}`.
const TOOLS: ToolShape = ToolShape {
    kind: "function",
    kind_required: true,
    inner: Some("function"),
    schema: "parameters",
};

/// Parameters refused by name, with the reason.
const REFUSED: &[(&str, &str)] = &[
    ("audio", "audio output is not generated"),
    ("modalities", "only text is generated"),
    (
        "logit_bias",
        "the policy's distribution is what training needs",
    ),
    ("prediction", "predicted outputs are not used"),
    ("functions", "the deprecated functions field; declare tools"),
    (
        "function_call",
        "the deprecated function_call field; use tool_choice",
    ),
    ("web_search_options", "no web search"),
];

/// A Chat Completions request body.
pub fn parse(body: &Value) -> Result<Call, WireError> {
    let f = Fields::of(body)?;
    f.refuse(REFUSED)?;
    if let Some(n) = f.get("n")
        && n.as_u64() != Some(1)
    {
        return Err(WireError::unsupported("n", "one choice per call (n = 1)"));
    }
    if let Some(rf) = f.get("response_format")
        && rf.get("type").and_then(Value::as_str) != Some("text")
    {
        return Err(WireError::unsupported(
            "response_format",
            "only {\"type\": \"text\"} (no JSON mode)",
        ));
    }
    let logprobs = match (f.bool("logprobs")?, f.u32_min("top_logprobs", 0)?) {
        (Some(true), top) => Some(top.unwrap_or(0).min(20)),
        (_, Some(t)) if t > 0 => {
            return Err(WireError::invalid(
                "top_logprobs",
                "top_logprobs needs logprobs = true",
            ));
        }
        _ => None,
    };
    let messages = f
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| WireError::invalid("messages", "messages must be a list of messages"))?;
    let conv = Conversation {
        messages: messages
            .iter()
            .enumerate()
            .map(|(i, m)| message(i, m))
            .collect::<Result<_, _>>()?,
        tools: tool_list(f.get("tools"), &TOOLS)?,
        tool_choice: openai_tool_choice(f.get("tool_choice"), |o| {
            o.get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
        })?,
    };
    conv.check()
        .map_err(|e| WireError::invalid(e.param(), e.to_string()))?;
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = f
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(Call {
        model: f.str("model")?.unwrap_or_default().to_string(),
        conv,
        sampling: Sampling {
            temperature: f.f32_in("temperature", 0.0, 2.0)?,
            top_p: f.f32_in("top_p", 0.0, 1.0)?,
            max_tokens: f
                .u32_min("max_completion_tokens", 1)?
                .or(f.u32_min("max_tokens", 1)?),
            stop: f.stops("stop")?,
            seed: f.seed()?,
        },
        stream,
        include_usage: stream && include_usage,
        logprobs,
    })
}

fn message(i: usize, m: &Value) -> Result<Message, WireError> {
    let role = match m.get("role").and_then(Value::as_str) {
        Some("system" | "developer") => Role::System,
        Some("user") => Role::User,
        Some("assistant") => Role::Assistant,
        Some("tool") => Role::Tool,
        Some(other) => {
            return Err(WireError::invalid(
                format!("messages[{i}].role"),
                format!("unknown role {other:?} (system, developer, user, assistant, tool)"),
            ));
        }
        None => {
            return Err(WireError::invalid(
                format!("messages[{i}].role"),
                "a message needs a role",
            ));
        }
    };
    let content = text_parts(
        &format!("messages[{i}].content"),
        m.get("content"),
        &["text"],
    )?;
    let mut msg = Message::new(role, content);
    if role == Role::Tool {
        msg.tool_call_id = m
            .get("tool_call_id")
            .and_then(Value::as_str)
            .map(str::to_string);
    }
    if role == Role::Assistant
        && let Some(calls) = m.get("tool_calls").filter(|v| !v.is_null())
    {
        let calls = calls.as_array().ok_or_else(|| {
            WireError::invalid(
                format!("messages[{i}].tool_calls"),
                "tool_calls must be a list",
            )
        })?;
        for (k, c) in calls.iter().enumerate() {
            let at = format!("messages[{i}].tool_calls[{k}]");
            let id = c.get("id").and_then(Value::as_str);
            let func = c.get("function");
            let name = func.and_then(|f| f.get("name")).and_then(Value::as_str);
            let (Some(id), Some(name)) = (id, name) else {
                return Err(WireError::invalid(
                    at,
                    "a tool call needs an id and function.name",
                ));
            };
            let arguments = match func.and_then(|f| f.get("arguments")) {
                Some(Value::String(s)) if s.trim().is_empty() => json!({}),
                Some(Value::String(s)) => serde_json::from_str(s).map_err(|e| {
                    WireError::invalid(
                        format!("{at}.function.arguments"),
                        format!("arguments are not JSON: {e}"),
                    )
                })?,
                Some(v) => v.clone(),
                None => json!({}),
            };
            msg.tool_calls.push(ToolCall {
                id: id.into(),
                name: name.into(),
                arguments,
            });
        }
    }
    Ok(msg)
}

/// The assistant message's tool calls, as OpenAI writes them (arguments as a JSON string).
fn calls_json(calls: &[ToolCall]) -> Vec<Value> {
    calls
        .iter()
        .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments.to_string()}}))
        .collect()
}

fn logprobs_json(a: &Answer) -> Value {
    let content: Vec<Value> = a
        .tokens
        .iter()
        .map(|t| json!({"token": t.text, "logprob": t.logprob, "bytes": t.text.as_bytes(), "top_logprobs": []}))
        .collect();
    json!({"content": content, "refusal": null})
}

fn usage(a: &Answer) -> Value {
    json!({"prompt_tokens": a.prompt_tokens, "completion_tokens": a.completion_tokens,
        "total_tokens": a.prompt_tokens + a.completion_tokens})
}

/// The `chat.completion` object.
pub fn completion(a: &Answer, logprobs: bool) -> Value {
    let mut message = json!({"role": "assistant", "content": a.content, "refusal": null});
    if !a.tool_calls.is_empty() {
        message["tool_calls"] = Value::Array(calls_json(&a.tool_calls));
        if a.content.is_empty() {
            message["content"] = Value::Null;
        }
    }
    json!({
        "id": a.id, "object": "chat.completion", "created": a.created, "model": a.model,
        "choices": [{"index": 0, "message": message,
            "logprobs": if logprobs { logprobs_json(a) } else { Value::Null },
            "finish_reason": a.finish.openai()}],
        "usage": usage(a),
    })
}

/// The SSE events of a streamed answer: the role, the content, each tool call (id and name
/// first, then its arguments), the finish reason, the usage chunk when asked, `[DONE]`.
pub fn chunks(a: &Answer, logprobs: bool, include_usage: bool) -> Vec<String> {
    let chunk = |delta: Value, finish: Value, lp: Value| {
        let mut c = json!({"id": a.id, "object": "chat.completion.chunk", "created": a.created,
            "model": a.model, "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]});
        if include_usage {
            c["usage"] = Value::Null;
        }
        c.to_string()
    };
    let mut out = vec![chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
        Value::Null,
    )];
    if !a.content.is_empty() {
        let lp = if logprobs {
            logprobs_json(a)
        } else {
            Value::Null
        };
        out.push(chunk(json!({"content": a.content}), Value::Null, lp));
    }
    for (i, c) in a.tool_calls.iter().enumerate() {
        out.push(chunk(
            json!({"tool_calls": [{"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}]}),
            Value::Null,
            Value::Null,
        ));
        out.push(chunk(
            json!({"tool_calls": [{"index": i, "function": {"arguments": c.arguments.to_string()}}]}),
            Value::Null,
            Value::Null,
        ));
    }
    out.push(chunk(json!({}), json!(a.finish.openai()), Value::Null));
    if include_usage {
        out.push(
            json!({"id": a.id, "object": "chat.completion.chunk", "created": a.created, "model": a.model,
                "choices": [], "usage": usage(a)})
            .to_string(),
        );
    }
    let mut events: Vec<String> = out.into_iter().map(|d| format!("data: {d}\n\n")).collect();
    events.push("data: [DONE]\n\n".into());
    events
}

/// OpenAI's error body: the SDKs raise their exception class from the status and read
/// `message`, `type`, `param` and `code` from it.
#[derive(Debug, Serialize, ToSchema)]
pub struct OpenAiError {
    pub error: OpenAiErrorDetail,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct OpenAiErrorDetail {
    /// What went wrong, led by the field it is about.
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `rate_limit_error` or `server_error`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The request field the error is about.
    pub param: Option<String>,
    /// `context_length_exceeded`, `invalid_api_key`, `episode_finished`,
    /// `request_too_large`, `request_timeout`, `rate_limit_exceeded`, `unavailable`, or null.
    pub code: Option<&'static str>,
}

/// OpenAI's error body for `e`.
pub fn error(e: &WireError) -> OpenAiError {
    let (kind, code) = match e.kind {
        ErrorKind::InvalidRequest => ("invalid_request_error", None),
        ErrorKind::ContextLength => ("invalid_request_error", Some("context_length_exceeded")),
        ErrorKind::Authentication => ("authentication_error", Some("invalid_api_key")),
        ErrorKind::NotFound => ("not_found_error", None),
        ErrorKind::Gone => ("invalid_request_error", Some("episode_finished")),
        ErrorKind::TooLarge => ("invalid_request_error", Some("request_too_large")),
        ErrorKind::Timeout => ("invalid_request_error", Some("request_timeout")),
        ErrorKind::RateLimited => ("rate_limit_error", Some("rate_limit_exceeded")),
        ErrorKind::Unavailable => ("server_error", Some("unavailable")),
        ErrorKind::Internal => ("server_error", None),
    };
    OpenAiError {
        error: OpenAiErrorDetail {
            message: e.named_message(),
            kind,
            param: e.param.clone(),
            code,
        },
    }
}

#[cfg(test)]
mod tests;
