//! Tool calls in the model's own text: the formats model families are trained on, parsed out
//! of a generated answer and checked against the declared tools; and the Hermes-style prompt
//! for checkpoints whose chat template has no tool syntax.
//!
//! A call that does not parse, names an unknown tool, or whose arguments break the tool's
//! schema makes the whole answer plain text, with the reason kept (`invalid_tool_call` on
//! the turn) so a reward function can penalise it.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::chat::{ToolCall, ToolChoice, ToolSpec};

/// How a model family writes tool calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolFormat {
    /// Hermes / Qwen: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, one block per
    /// call, text around them is content. Also the fallback for templates without tools.
    #[default]
    Hermes,
    /// Llama 3.x: the answer is a JSON object `{"name": …, "parameters": {…}}` (optionally
    /// after `<|python_tag|>`; several separated by `;`).
    Llama3Json,
    /// Mistral: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` objects, or
    /// `name[ARGS]{…}` per call (newer tokenizers).
    Mistral,
}

impl ToolFormat {
    /// The format named `hermes`, `llama3_json` or `mistral`.
    pub fn parse_name(name: &str) -> Option<Self> {
        match name {
            "hermes" => Some(Self::Hermes),
            "llama3_json" => Some(Self::Llama3Json),
            "mistral" => Some(Self::Mistral),
            _ => None,
        }
    }

    /// The format a chat template writes tool calls in, from its text: Mistral's and
    /// Llama 3's markers, otherwise Hermes (which is also the fallback).
    pub fn of_template(template: Option<&str>) -> Self {
        match template {
            Some(t) if t.contains("[TOOL_CALLS]") => Self::Mistral,
            Some(t) if t.contains("<|python_tag|>") || t.contains("<|eom_id|>") => Self::Llama3Json,
            _ => Self::Hermes,
        }
    }

    /// Tool calls written this way, as a model of the family would (for history the
    /// template cannot render itself).
    pub fn write(self, calls: &[ToolCall]) -> String {
        // Name first, as the families' own examples write it (serde_json sorts map keys).
        let obj = |c: &ToolCall, key: &str| {
            format!(
                "{{\"name\": {}, \"{key}\": {}}}",
                Value::String(c.name.clone()),
                c.arguments
            )
        };
        match self {
            Self::Hermes => calls
                .iter()
                .map(|c| format!("<tool_call>\n{}\n</tool_call>", obj(c, "arguments")))
                .collect::<Vec<_>>()
                .join("\n"),
            Self::Llama3Json => calls
                .iter()
                .map(|c| obj(c, "parameters"))
                .collect::<Vec<_>>()
                .join("; "),
            Self::Mistral => {
                let all: Vec<String> = calls.iter().map(|c| obj(c, "arguments")).collect();
                format!("[TOOL_CALLS][{}]", all.join(", "))
            }
        }
    }
}

/// A generated answer split into content and tool calls.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ParsedAnswer {
    /// The text for the client: without the call blocks, or the whole answer when a call
    /// was invalid.
    pub content: String,
    pub calls: Vec<ToolCall>,
    /// Why the answer's tool calls were refused (it is then plain text).
    pub invalid: Option<String>,
}

/// A call as written, before it is checked: name and arguments.
type RawCall = (String, Value);

/// Splits `text` into content and the calls of `format`, checked against `tools`; `id` names
/// the k-th call. Without declared tools an answer is plain text whatever it contains.
pub fn parse(
    format: ToolFormat,
    text: &str,
    tools: &[ToolSpec],
    mut id: impl FnMut(usize) -> String,
) -> ParsedAnswer {
    let plain = |invalid: Option<String>| ParsedAnswer {
        content: text.to_string(),
        calls: Vec::new(),
        invalid,
    };
    if tools.is_empty() {
        return plain(None);
    }
    let found = match format {
        ToolFormat::Hermes => hermes(text),
        ToolFormat::Llama3Json => llama3(text),
        ToolFormat::Mistral => mistral(text),
    };
    let (content, raw) = match found {
        Ok(Some(x)) => x,
        Ok(None) => return plain(None),
        Err(why) => return plain(Some(why)),
    };
    let mut calls = Vec::with_capacity(raw.len());
    for (k, (name, arguments)) in raw.into_iter().enumerate() {
        let Some(tool) = tools.iter().find(|t| t.name == name) else {
            return plain(Some(format!("call {k}: no tool is named {name:?}")));
        };
        if let Err(why) = check_schema(&arguments, &tool.parameters, "arguments") {
            return plain(Some(format!("call {k} ({name}): {why}")));
        }
        calls.push(ToolCall {
            id: id(k),
            name,
            arguments,
        });
    }
    ParsedAnswer {
        content,
        calls,
        invalid: None,
    }
}

/// One call object: `name` and the arguments under `key` (a JSON object; a string holding
/// one is accepted, as some models write it).
fn raw_call(v: &Value, keys: &[&str]) -> Result<RawCall, String> {
    let name = v
        .get("name")
        .and_then(Value::as_str)
        .ok_or("a call without a \"name\" string")?;
    let args = keys
        .iter()
        .find_map(|k| v.get(*k))
        .cloned()
        .unwrap_or(Value::Object(serde_json::Map::new()));
    let args = match args {
        Value::String(s) => serde_json::from_str(&s)
            .map_err(|e| format!("the arguments of {name:?} are a string that is not JSON: {e}"))?,
        a => a,
    };
    Ok((name.to_string(), args))
}

/// Result of a family's parser: `None` when the answer holds no call.
type Found = Result<Option<(String, Vec<RawCall>)>, String>;

fn hermes(text: &str) -> Found {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    if !text.contains(OPEN) {
        return Ok(None);
    }
    let (mut content, mut calls, mut rest) = (String::new(), Vec::new(), text);
    while let Some(at) = rest.find(OPEN) {
        content.push_str(&rest[..at]);
        let body = &rest[at + OPEN.len()..];
        // A last block the model left open (it stopped after the JSON) counts when its JSON
        // is whole, as vLLM's Hermes parser reads it; one cut mid-JSON is refused.
        let Some(end) = body.find(CLOSE) else {
            let v: Value = serde_json::from_str(body.trim())
                .map_err(|e| format!("a <tool_call> block is not closed and not JSON: {e}"))?;
            calls.push(raw_call(&v, &["arguments", "parameters"])?);
            rest = "";
            break;
        };
        let v: Value = serde_json::from_str(body[..end].trim())
            .map_err(|e| format!("a <tool_call> block is not JSON: {e}"))?;
        calls.push(raw_call(&v, &["arguments", "parameters"])?);
        rest = &body[end + CLOSE.len()..];
    }
    content.push_str(rest);
    Ok(Some((content.trim().to_string(), calls)))
}

fn llama3(text: &str) -> Found {
    let t = text.trim();
    let t = t.strip_prefix("<|python_tag|>").unwrap_or(t).trim();
    if !t.starts_with('{') {
        return Ok(None);
    }
    let (mut calls, mut rest) = (Vec::new(), t);
    loop {
        rest = rest.trim_start().trim_start_matches(';').trim_start();
        if rest.is_empty() {
            break;
        }
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let v = match values.next() {
            Some(Ok(v)) => v,
            Some(Err(e)) => return Err(format!("the answer is not a JSON tool call: {e}")),
            None => break,
        };
        calls.push(raw_call(&v, &["parameters", "arguments"])?);
        rest = &rest[values.byte_offset()..];
    }
    Ok(Some((String::new(), calls)))
}

fn mistral(text: &str) -> Found {
    const MARK: &str = "[TOOL_CALLS]";
    let Some(at) = text.find(MARK) else {
        return Ok(None);
    };
    let content = text[..at].trim().to_string();
    let body = text[at + MARK.len()..].trim();
    let mut calls = Vec::new();
    if body.starts_with('[') {
        let v: Value = serde_json::from_str(body)
            .map_err(|e| format!("the [TOOL_CALLS] list is not JSON: {e}"))?;
        for c in v.as_array().into_iter().flatten() {
            calls.push(raw_call(c, &["arguments", "parameters"])?);
        }
    } else {
        for part in body.split(MARK) {
            let (name, args) = part
                .split_once("[ARGS]")
                .ok_or("a [TOOL_CALLS] call without [ARGS]")?;
            let args: Value = serde_json::from_str(args.trim())
                .map_err(|e| format!("the [ARGS] of {:?} are not JSON: {e}", name.trim()))?;
            calls.push((name.trim().to_string(), args));
        }
    }
    if calls.is_empty() {
        return Err("[TOOL_CALLS] without a call".into());
    }
    Ok(Some((content, calls)))
}

/// Checks `v` against the subset of JSON Schema tool declarations use: `type` (one or a
/// list), `properties`, `required`, `additionalProperties: false`, `items` and `enum`.
/// Other keywords are not checked. `at` names the value in the error.
pub fn check_schema(v: &Value, schema: &Value, at: &str) -> Result<(), String> {
    let Some(s) = schema.as_object() else {
        return Ok(());
    };
    if let Some(t) = s.get("type") {
        let types: Vec<&str> = match t {
            Value::String(x) => vec![x.as_str()],
            Value::Array(xs) => xs.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        if !types.is_empty() && !types.iter().any(|t| is_type(v, t)) {
            return Err(format!("{at} should be {}, got {v}", types.join(" or ")));
        }
    }
    if let Some(Value::Array(options)) = s.get("enum")
        && !options.contains(v)
    {
        return Err(format!(
            "{at} = {v} is not one of {}",
            Value::Array(options.clone())
        ));
    }
    if let Value::Object(obj) = v {
        let props = s.get("properties").and_then(Value::as_object);
        for r in s
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(r) = r.as_str()
                && !obj.contains_key(r)
            {
                return Err(format!("{at}.{r} is required"));
            }
        }
        for (k, x) in obj {
            match props.and_then(|p| p.get(k)) {
                Some(sub) => check_schema(x, sub, &format!("{at}.{k}"))?,
                None if s.get("additionalProperties") == Some(&Value::Bool(false)) => {
                    return Err(format!("{at}.{k} is not a declared property"));
                }
                None => {}
            }
        }
    }
    if let (Value::Array(items), Some(sub)) = (v, s.get("items")) {
        for (i, x) in items.iter().enumerate() {
            check_schema(x, sub, &format!("{at}[{i}]"))?;
        }
    }
    Ok(())
}

fn is_type(v: &Value, t: &str) -> bool {
    match t {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "number" => v.is_number(),
        "integer" => v.is_i64() || v.is_u64() || v.as_f64().is_some_and(|f| f.fract() == 0.0),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        _ => true,
    }
}

/// The system-prompt section that offers tools to a model whose chat template has none
/// (Hermes style): each tool's declaration as JSON inside `<tools>`, and how to call one.
pub fn hermes_prompt(tools: &[ToolSpec], choice: &ToolChoice) -> String {
    let mut s = String::from(
        "# Tools\n\nYou can call functions to help with the request. Their signatures are \
         inside <tools></tools>:\n<tools>\n",
    );
    for t in tools {
        s.push_str(&format!(
            "{{\"type\": \"function\", \"function\": {{\"name\": {}, \"description\": {}, \"parameters\": {}}}}}\n",
            Value::String(t.name.clone()),
            Value::String(t.description.clone()),
            t.parameters
        ));
    }
    s.push_str(
        "</tools>\n\nTo call a function, answer with a JSON object holding its name and \
         arguments inside <tool_call></tool_call>:\n<tool_call>\n{\"name\": <function name>, \
         \"arguments\": <arguments as a JSON object>}\n</tool_call>",
    );
    match choice {
        ToolChoice::Required => s.push_str("\n\nCall at least one function."),
        ToolChoice::Function(name) => {
            s.push_str(&format!("\n\nCall the function {name}."));
        }
        ToolChoice::Auto | ToolChoice::None => {}
    }
    s
}

#[cfg(test)]
mod tests;
