//! Anthropic Messages on the wire: `system`, content blocks (`text`, `tool_use`,
//! `tool_result`), `tools` with `input_schema`; the answer as a `message` object or as the
//! event sequence `message_start`, `content_block_start/delta/stop`, `message_delta`,
//! `message_stop`; errors as `{"type": "error", "error": {"type", "message"}}`.

use actors::agent::{Conversation, Message, Role, ToolCall, ToolChoice};
use serde::Serialize;
use serde_json::{Value, json};
use utoipa::ToSchema;

use super::wire::{
    Answer, Call, ErrorKind, Fields, Sampling, ToolShape, WireError, text_parts, tool_list,
};

/// Messages tools: `{name, description, input_schema}`, `type` absent or `custom` (client
/// tools; server tools such as web search are refused).
const TOOLS: ToolShape = ToolShape {
    kind: "custom",
    kind_required: false,
    inner: None,
    schema: "input_schema",
};

/// A Messages request body.
pub fn parse(body: &Value) -> Result<Call, WireError> {
    let f = Fields::of(body)?;
    if f.get("thinking")
        .and_then(|t| t.get("type"))
        .and_then(Value::as_str)
        == Some("enabled")
    {
        return Err(WireError::unsupported(
            "thinking",
            "extended thinking budgets",
        ));
    }
    let max_tokens = f
        .u32_min("max_tokens", 1)?
        .ok_or_else(|| WireError::invalid("max_tokens", "max_tokens is required"))?;
    let mut messages = Vec::new();
    if let Some(s) = f.get("system") {
        messages.push(Message::new(
            Role::System,
            text_parts("system", Some(s), &["text"])?,
        ));
    }
    let list = f
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| WireError::invalid("messages", "messages must be a list of messages"))?;
    for (i, m) in list.iter().enumerate() {
        turn(i, m, &mut messages)?;
    }
    let conv = Conversation {
        messages,
        tools: tool_list(f.get("tools"), &TOOLS)?,
        tool_choice: tool_choice(f.get("tool_choice"))?,
    };
    conv.check().map_err(|e| {
        // Positions count the system message the wire format keeps apart.
        WireError::invalid("messages", e.to_string())
    })?;
    Ok(Call {
        model: f.str("model")?.unwrap_or_default().to_string(),
        conv,
        sampling: Sampling {
            temperature: f.f32_in("temperature", 0.0, 1.0)?,
            top_p: f.f32_in("top_p", 0.0, 1.0)?,
            max_tokens: Some(max_tokens),
            stop: f.stops("stop_sequences")?,
            seed: None,
        },
        stream: f.bool("stream")?.unwrap_or(false),
        include_usage: false,
        logprobs: None,
    })
}

/// One wire message: a user turn may hold tool results (each a tool message) and text; an
/// assistant turn text and tool uses.
fn turn(i: usize, m: &Value, out: &mut Vec<Message>) -> Result<(), WireError> {
    let at = format!("messages[{i}]");
    let role = match m.get("role").and_then(Value::as_str) {
        Some("user") => Role::User,
        Some("assistant") => Role::Assistant,
        other => {
            return Err(WireError::invalid(
                format!("{at}.role"),
                format!("unknown role {:?} (user, assistant)", other.unwrap_or("")),
            ));
        }
    };
    let content = m.get("content").unwrap_or(&Value::Null);
    let blocks = match content {
        Value::String(s) => {
            out.push(Message::new(role, s.clone()));
            return Ok(());
        }
        Value::Array(b) => b,
        _ => {
            return Err(WireError::invalid(
                format!("{at}.content"),
                "content must be a string or a list of blocks",
            ));
        }
    };
    let mut current = Message::new(role, "");
    for (k, b) in blocks.iter().enumerate() {
        let bat = format!("{at}.content[{k}]");
        match b.get("type").and_then(Value::as_str) {
            Some("text") => current
                .content
                .push_str(b.get("text").and_then(Value::as_str).unwrap_or_default()),
            Some("tool_use") if role == Role::Assistant => {
                let (Some(id), Some(name)) = (
                    b.get("id").and_then(Value::as_str),
                    b.get("name").and_then(Value::as_str),
                ) else {
                    return Err(WireError::invalid(
                        bat,
                        "a tool_use block needs an id and a name",
                    ));
                };
                current.tool_calls.push(ToolCall {
                    id: id.into(),
                    name: name.into(),
                    arguments: b.get("input").cloned().unwrap_or_else(|| json!({})),
                });
            }
            Some("tool_result") if role == Role::User => {
                let id = b
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        WireError::invalid(
                            format!("{bat}.tool_use_id"),
                            "a tool_result needs a tool_use_id",
                        )
                    })?;
                let text = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(c) => text_parts(&format!("{bat}.content"), Some(c), &["text"])?,
                };
                let text = if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                    format!("Error: {text}")
                } else {
                    text
                };
                out.push(Message::tool(id, text));
            }
            kind => {
                return Err(WireError::unsupported(
                    &bat,
                    &format!(
                        "a {:?} block in a {} message",
                        kind.unwrap_or("?"),
                        role.as_str()
                    ),
                ));
            }
        }
    }
    if !current.content.is_empty() || !current.tool_calls.is_empty() || role == Role::Assistant {
        out.push(current);
    }
    Ok(())
}

fn tool_choice(v: Option<&Value>) -> Result<ToolChoice, WireError> {
    let Some(v) = v else {
        return Ok(ToolChoice::Auto);
    };
    Ok(match v.get("type").and_then(Value::as_str) {
        Some("auto") => ToolChoice::Auto,
        Some("any") => ToolChoice::Required,
        Some("none") => ToolChoice::None,
        Some("tool") => match v.get("name").and_then(Value::as_str) {
            Some(n) => ToolChoice::Function(n.into()),
            None => {
                return Err(WireError::invalid(
                    "tool_choice.name",
                    "tool_choice of type tool needs a name",
                ));
            }
        },
        _ => {
            return Err(WireError::invalid(
                "tool_choice.type",
                "tool_choice.type is auto, any, tool or none",
            ));
        }
    })
}

fn content_blocks(a: &Answer) -> Vec<Value> {
    let mut blocks = Vec::new();
    if !a.content.is_empty() || a.tool_calls.is_empty() {
        blocks.push(json!({"type": "text", "text": a.content}));
    }
    for c in &a.tool_calls {
        blocks.push(json!({"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments}));
    }
    blocks
}

/// The `message` object.
pub fn message(a: &Answer) -> Value {
    json!({
        "id": a.id, "type": "message", "role": "assistant", "model": a.model,
        "content": content_blocks(a),
        "stop_reason": a.finish.anthropic(a.stop_sequence.is_some()),
        "stop_sequence": a.stop_sequence,
        "usage": {"input_tokens": a.prompt_tokens, "output_tokens": a.completion_tokens},
    })
}

/// The SSE events of a streamed answer, in Anthropic's order.
pub fn events(a: &Answer) -> Vec<String> {
    let ev = |name: &str, data: Value| format!("event: {name}\ndata: {data}\n\n");
    let mut start = message(a);
    start["content"] = json!([]);
    start["stop_reason"] = Value::Null;
    start["stop_sequence"] = Value::Null;
    start["usage"]["output_tokens"] = json!(0);
    let mut out = vec![ev(
        "message_start",
        json!({"type": "message_start", "message": start}),
    )];
    for (index, b) in content_blocks(a).into_iter().enumerate() {
        let (empty, delta) = if b["type"] == "text" {
            (
                json!({"type": "text", "text": ""}),
                json!({"type": "text_delta", "text": b["text"]}),
            )
        } else {
            (
                json!({"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}),
                json!({"type": "input_json_delta", "partial_json": b["input"].to_string()}),
            )
        };
        out.push(ev(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": empty}),
        ));
        out.push(ev(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index, "delta": delta}),
        ));
        out.push(ev(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ));
    }
    out.push(ev(
        "message_delta",
        json!({"type": "message_delta",
            "delta": {"stop_reason": a.finish.anthropic(a.stop_sequence.is_some()), "stop_sequence": a.stop_sequence},
            "usage": {"output_tokens": a.completion_tokens}}),
    ));
    out.push(ev("message_stop", json!({"type": "message_stop"})));
    out
}

/// Anthropic's error body: `{"type": "error", "error": {"type", "message"}}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct AnthropicError {
    /// Always `error`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub error: AnthropicErrorDetail,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AnthropicErrorDetail {
    /// `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `request_too_large`, `rate_limit_error`, `overloaded_error` or `api_error`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// What went wrong, led by the field it is about.
    pub message: String,
}

/// Anthropic's error body for `e`.
pub fn error(e: &WireError) -> AnthropicError {
    let kind = match e.kind {
        ErrorKind::InvalidRequest
        | ErrorKind::ContextLength
        | ErrorKind::Gone
        | ErrorKind::Timeout => "invalid_request_error",
        ErrorKind::Authentication => "authentication_error",
        ErrorKind::NotFound => "not_found_error",
        ErrorKind::TooLarge => "request_too_large",
        ErrorKind::RateLimited => "rate_limit_error",
        ErrorKind::Unavailable => "overloaded_error",
        ErrorKind::Internal => "api_error",
    };
    AnthropicError {
        kind: "error",
        error: AnthropicErrorDetail {
            kind,
            message: e.named_message(),
        },
    }
}

#[cfg(test)]
mod tests;
