//! OpenAI Responses on the wire (the default of Codex and the OpenAI Agents SDK): `input`
//! items (messages, `function_call`, `function_call_output`), `instructions`, function
//! tools, `previous_response_id`; the answer as a `response` object or as its event
//! sequence (`response.created` … `response.completed`, each with a `sequence_number`).

use actors::agent::{Conversation, Message, Role, ToolCall, ToolChoice};
use serde_json::{Value, json};

use super::wire::{
    Answer, Call, Fields, Finish, Sampling, ToolShape, WireError, openai_tool_choice, text_parts,
    tool_list,
};

/// Responses tools: `{"type": "function", name, description, parameters}`.
const TOOLS: ToolShape = ToolShape {
    kind: "function",
    kind_required: true,
    inner: None,
    schema: "parameters",
};

/// A Responses request body; the conversation holds `instructions` (as the system message)
/// and `input`, without what `previous_response_id` names (the gateway prepends it).
pub fn parse(body: &Value) -> Result<(Call, Option<String>), WireError> {
    let f = Fields::of(body)?;
    f.refuse(&[
        ("background", "calls are answered in the request"),
        ("conversation", "use previous_response_id"),
        ("prompt", "stored prompts are not kept"),
    ])?;
    if let Some(fmt) = f.get("text").and_then(|t| t.get("format"))
        && fmt.get("type").and_then(Value::as_str) != Some("text")
    {
        return Err(WireError::unsupported(
            "text.format",
            "only {\"type\": \"text\"}",
        ));
    }
    let mut messages = Vec::new();
    if let Some(s) = f.str("instructions")? {
        messages.push(Message::new(Role::System, s));
    }
    match f.get("input") {
        Some(Value::String(s)) => messages.push(Message::new(Role::User, s.clone())),
        Some(Value::Array(items)) => {
            for (i, it) in items.iter().enumerate() {
                item(i, it, &mut messages)?;
            }
        }
        _ => {
            return Err(WireError::invalid(
                "input",
                "input must be a string or a list of items",
            ));
        }
    }
    let conv = Conversation {
        messages,
        tools: tool_list(f.get("tools"), &TOOLS)?,
        tool_choice: openai_tool_choice(f.get("tool_choice"), |o| {
            o.get("name").and_then(Value::as_str)
        })?,
    };
    let previous = f.str("previous_response_id")?.map(str::to_string);
    Ok((
        Call {
            model: f.str("model")?.unwrap_or_default().to_string(),
            conv,
            sampling: Sampling {
                temperature: f.f32_in("temperature", 0.0, 2.0)?,
                top_p: f.f32_in("top_p", 0.0, 1.0)?,
                max_tokens: f.u32_min("max_output_tokens", 1)?,
                stop: Vec::new(),
                seed: None,
            },
            stream: f.bool("stream")?.unwrap_or(false),
            include_usage: false,
            logprobs: None,
        },
        previous,
    ))
}

/// A `message` item: its role and text (parts of type `input_text` / `output_text`).
fn message_item(at: &str, it: &Value, out: &mut Vec<Message>) -> Result<(), WireError> {
    let role = match it.get("role").and_then(Value::as_str) {
        Some("system" | "developer") => Role::System,
        Some("user") => Role::User,
        Some("assistant") => Role::Assistant,
        other => {
            return Err(WireError::invalid(
                format!("{at}.role"),
                format!(
                    "unknown role {:?} (system, developer, user, assistant)",
                    other.unwrap_or("")
                ),
            ));
        }
    };
    let text = text_parts(
        &format!("{at}.content"),
        it.get("content"),
        &["input_text", "output_text"],
    )?;
    // An assistant message right after its own calls' turn joins it (one answer).
    match out.last_mut() {
        Some(prev)
            if role == Role::Assistant
                && prev.role == Role::Assistant
                && prev.content.is_empty() =>
        {
            prev.content = text;
        }
        _ => out.push(Message::new(role, text)),
    }
    Ok(())
}

fn item(i: usize, it: &Value, out: &mut Vec<Message>) -> Result<(), WireError> {
    let at = format!("input[{i}]");
    let kind = it.get("type").and_then(Value::as_str).unwrap_or("message");
    match kind {
        "message" => message_item(&at, it, out)?,
        "function_call" => {
            let (Some(id), Some(name)) = (
                it.get("call_id").and_then(Value::as_str),
                it.get("name").and_then(Value::as_str),
            ) else {
                return Err(WireError::invalid(
                    at,
                    "a function_call needs a call_id and a name",
                ));
            };
            let arguments = match it.get("arguments").and_then(Value::as_str) {
                Some(s) if !s.trim().is_empty() => serde_json::from_str(s).map_err(|e| {
                    WireError::invalid(
                        format!("{at}.arguments"),
                        format!("arguments are not JSON: {e}"),
                    )
                })?,
                _ => json!({}),
            };
            let call = ToolCall {
                id: id.into(),
                name: name.into(),
                arguments,
            };
            // Calls of one answer are consecutive items: one assistant message holds them.
            match out.last_mut() {
                Some(prev) if prev.role == Role::Assistant => prev.tool_calls.push(call),
                _ => {
                    let mut m = Message::new(Role::Assistant, "");
                    m.tool_calls.push(call);
                    out.push(m);
                }
            }
        }
        "function_call_output" => {
            let id = it.get("call_id").and_then(Value::as_str).ok_or_else(|| {
                WireError::invalid(
                    format!("{at}.call_id"),
                    "a function_call_output needs a call_id",
                )
            })?;
            let output = match it.get("output") {
                Some(Value::String(s)) => s.clone(),
                Some(v) => v.to_string(),
                None => String::new(),
            };
            out.push(Message::tool(id, output));
        }
        other => {
            return Err(WireError::unsupported(
                &format!("{at}.type"),
                &format!("input items of type {other:?}"),
            ));
        }
    }
    Ok(())
}

/// The answer's output items: the message (when it has text or no call), then each call.
fn output(a: &Answer) -> Vec<Value> {
    let mut items = Vec::new();
    if !a.content.is_empty() || a.tool_calls.is_empty() {
        items.push(json!({"type": "message", "id": format!("msg_{}", a.id), "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": a.content, "annotations": []}]}));
    }
    for c in &a.tool_calls {
        items.push(json!({"type": "function_call", "id": format!("fc_{}", c.id), "call_id": c.id, "name": c.name,
            "arguments": c.arguments.to_string(), "status": "completed"}));
    }
    items
}

/// The `response` object (`status` `completed`, or `incomplete` at the token budget).
pub fn response(a: &Answer, call: &Call, previous: Option<&str>) -> Value {
    let incomplete = a.finish == Finish::Length;
    let tools: Vec<Value> = call
        .conv
        .tools
        .iter()
        .map(|t| json!({"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters, "strict": false}))
        .collect();
    let tool_choice = match &call.conv.tool_choice {
        ToolChoice::Auto => json!("auto"),
        ToolChoice::None => json!("none"),
        ToolChoice::Required => json!("required"),
        ToolChoice::Function(n) => json!({"type": "function", "name": n}),
    };
    let instructions = call
        .conv
        .messages
        .first()
        .filter(|m| m.role == Role::System)
        .map(|m| m.content.clone());
    json!({
        "id": a.id, "object": "response", "created_at": a.created, "model": a.model,
        "status": if incomplete { "incomplete" } else { "completed" },
        "incomplete_details": if incomplete { json!({"reason": "max_output_tokens"}) } else { Value::Null },
        "error": null, "instructions": instructions, "metadata": {},
        "output": output(a), "parallel_tool_calls": true,
        "previous_response_id": previous, "temperature": call.sampling.temperature, "top_p": call.sampling.top_p,
        "max_output_tokens": call.sampling.max_tokens, "tool_choice": tool_choice, "tools": tools,
        "text": {"format": {"type": "text"}}, "truncation": "disabled",
        "usage": {"input_tokens": a.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": a.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": a.prompt_tokens + a.completion_tokens},
    })
}

/// The SSE events of a streamed answer, in the Responses API's order.
pub fn events(a: &Answer, call: &Call, previous: Option<&str>) -> Vec<String> {
    let full = response(a, call, previous);
    let mut seq = 0u64;
    let mut out = Vec::new();
    let mut ev = |name: &str, mut data: Value| {
        data["type"] = json!(name);
        data["sequence_number"] = json!(seq);
        seq += 1;
        out.push(format!("event: {name}\ndata: {data}\n\n"));
    };
    let mut start = full.clone();
    start["status"] = json!("in_progress");
    start["output"] = json!([]);
    start["usage"] = Value::Null;
    start["incomplete_details"] = Value::Null;
    ev("response.created", json!({"response": start}));
    ev("response.in_progress", json!({"response": start}));
    for (index, item) in output(a).into_iter().enumerate() {
        let id = item["id"].clone();
        let mut added = item.clone();
        added["status"] = json!("in_progress");
        if item["type"] == "message" {
            added["content"] = json!([]);
            ev(
                "response.output_item.added",
                json!({"output_index": index, "item": added}),
            );
            let empty = json!({"type": "output_text", "text": "", "annotations": []});
            let text = item["content"][0]["text"].clone();
            ev(
                "response.content_part.added",
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": empty}),
            );
            ev(
                "response.output_text.delta",
                json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text, "logprobs": []}),
            );
            ev(
                "response.output_text.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
            );
            ev(
                "response.content_part.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": item["content"][0]}),
            );
        } else {
            added["arguments"] = json!("");
            ev(
                "response.output_item.added",
                json!({"output_index": index, "item": added}),
            );
            ev(
                "response.function_call_arguments.delta",
                json!({"item_id": id, "output_index": index, "delta": item["arguments"]}),
            );
            ev(
                "response.function_call_arguments.done",
                json!({"item_id": id, "output_index": index, "arguments": item["arguments"], "name": item["name"]}),
            );
        }
        ev(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
    }
    let done = if a.finish == Finish::Length {
        "response.incomplete"
    } else {
        "response.completed"
    };
    ev(done, json!({"response": full}));
    out
}

/// The messages the answer adds to the conversation (what `previous_response_id` carries).
pub fn answer_message(a: &Answer) -> Message {
    let mut m = Message::new(Role::Assistant, a.content.clone());
    m.tool_calls = a.tool_calls.clone();
    m
}

#[cfg(test)]
mod tests;
