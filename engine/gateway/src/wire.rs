//! What every provider's wire format parses into and formats from: the call (conversation,
//! sampling, streaming), the answer, and the error, whatever API carried them.

use actors::agent::{Conversation, ToolCall, ToolChoice, ToolSpec};
use serde_json::Value;

/// Sampling the agent asked for; the job's policy clamps it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub max_tokens: Option<u32>,
    pub stop: Vec<String>,
    pub seed: Option<u64>,
}

/// One model call, parsed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Call {
    pub model: String,
    pub conv: Conversation,
    pub sampling: Sampling,
    pub stream: bool,
    /// Streams: end with a usage chunk (OpenAI's `stream_options.include_usage`).
    pub include_usage: bool,
    /// Log-probabilities of the answer's tokens, with this many alternatives each.
    pub logprobs: Option<u32>,
}

/// Why the answer ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
    ToolCalls,
}

impl Finish {
    /// OpenAI's `finish_reason`.
    pub fn openai(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::ToolCalls => "tool_calls",
        }
    }

    /// Anthropic's `stop_reason`.
    pub fn anthropic(self, stopped_on_sequence: bool) -> &'static str {
        match self {
            Self::Stop if stopped_on_sequence => "stop_sequence",
            Self::Stop => "end_turn",
            Self::Length => "max_tokens",
            Self::ToolCalls => "tool_use",
        }
    }
}

/// One generated token as the client sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenInfo {
    pub text: String,
    pub logprob: f32,
}

/// The answer to a call.
#[derive(Clone, Debug, PartialEq)]
pub struct Answer {
    pub id: String,
    pub model: String,
    /// Unix seconds.
    pub created: u64,
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
    pub finish: Finish,
    /// The stop sequence that ended it, if one did.
    pub stop_sequence: Option<String>,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Per generated token (when the call asked for log-probabilities).
    pub tokens: Vec<TokenInfo>,
}

/// What went wrong with a call, shaped by each provider's error body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// 400: the request is malformed or asks for something not supported.
    InvalidRequest,
    /// 400 with OpenAI's `context_length_exceeded` code.
    ContextLength,
    /// 401: no key, or not a key of any episode.
    Authentication,
    /// 404: no such route or resource.
    NotFound,
    /// 410: the episode is finished.
    Gone,
    /// 413: the body is over the cap.
    TooLarge,
    /// 408: the body did not arrive in time.
    Timeout,
    /// 429: the episode's budget of calls is spent, or too many calls at once.
    RateLimited,
    /// 503: no shard can serve the call now.
    Unavailable,
    /// 500.
    Internal,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WireError {
    pub kind: ErrorKind,
    pub message: String,
    /// The request field the error is about.
    pub param: Option<String>,
}

impl WireError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            param: None,
        }
    }

    /// A 400 about `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.into()),
            ..Self::new(ErrorKind::InvalidRequest, message)
        }
    }

    /// A parameter the gateway does not support, refused by name (never ignored).
    pub fn unsupported(param: &str, why: &str) -> Self {
        Self::invalid(
            param,
            format!("{param} is not supported by this gateway: {why}"),
        )
    }

    /// The message, led by the field it is about where it does not name it already.
    pub fn named_message(&self) -> String {
        match &self.param {
            Some(p) if !self.message.contains(p.as_str()) => format!("{p}: {}", self.message),
            _ => self.message.clone(),
        }
    }

    pub fn status(&self) -> u16 {
        match self.kind {
            ErrorKind::InvalidRequest | ErrorKind::ContextLength => 400,
            ErrorKind::Authentication => 401,
            ErrorKind::NotFound => 404,
            ErrorKind::Gone => 410,
            ErrorKind::TooLarge => 413,
            ErrorKind::Timeout => 408,
            ErrorKind::RateLimited => 429,
            ErrorKind::Unavailable => 503,
            ErrorKind::Internal => 500,
        }
    }
}

/// Reading JSON request fields with errors that name them.
pub(crate) struct Fields<'a> {
    pub(crate) obj: &'a serde_json::Map<String, Value>,
}

impl<'a> Fields<'a> {
    pub(crate) fn of(body: &'a Value) -> Result<Self, WireError> {
        body.as_object()
            .map(|obj| Self { obj })
            .ok_or_else(|| WireError::invalid("body", "the request body must be a JSON object"))
    }

    /// The field, treating `null` as absent.
    pub(crate) fn get(&self, k: &str) -> Option<&'a Value> {
        self.obj.get(k).filter(|v| !v.is_null())
    }

    pub(crate) fn str(&self, k: &str) -> Result<Option<&'a str>, WireError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(WireError::invalid(k, format!("{k} must be a string"))),
        }
    }

    pub(crate) fn bool(&self, k: &str) -> Result<Option<bool>, WireError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(WireError::invalid(k, format!("{k} must be a boolean"))),
        }
    }

    pub(crate) fn f32_in(&self, k: &str, lo: f32, hi: f32) -> Result<Option<f32>, WireError> {
        match self.get(k).map(Value::as_f64) {
            None => Ok(None),
            Some(Some(x)) if (lo as f64..=hi as f64).contains(&x) => Ok(Some(x as f32)),
            Some(_) => Err(WireError::invalid(
                k,
                format!("{k} must be a number from {lo} to {hi}"),
            )),
        }
    }

    pub(crate) fn u32_min(&self, k: &str, min: u32) -> Result<Option<u32>, WireError> {
        match self.get(k).map(Value::as_u64) {
            None => Ok(None),
            Some(Some(x)) if x >= u64::from(min) => Ok(Some(u32::try_from(x).unwrap_or(u32::MAX))),
            Some(_) => Err(WireError::invalid(
                k,
                format!("{k} must be an integer of at least {min}"),
            )),
        }
    }

    pub(crate) fn seed(&self) -> Result<Option<u64>, WireError> {
        match self.get("seed") {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .or_else(|| v.as_i64().map(|i| i as u64))
                .map(Some)
                .ok_or_else(|| WireError::invalid("seed", "seed must be an integer")),
        }
    }

    /// `stop` / `stop_sequences`: a string or a list of at most 16 non-empty strings.
    pub(crate) fn stops(&self, k: &str) -> Result<Vec<String>, WireError> {
        let v: Vec<String> = match self.get(k) {
            None => return Ok(Vec::new()),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| x.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| WireError::invalid(k, format!("{k} must hold strings")))?,
            Some(_) => {
                return Err(WireError::invalid(
                    k,
                    format!("{k} must be a string or a list of strings"),
                ));
            }
        };
        if v.len() > 16 || v.iter().any(String::is_empty) {
            return Err(WireError::invalid(
                k,
                format!("{k} takes at most 16 non-empty strings"),
            ));
        }
        Ok(v)
    }

    /// Refuses each of `params` that is present (and not its neutral value `ok`).
    pub(crate) fn refuse(&self, params: &[(&str, &str)]) -> Result<(), WireError> {
        for (p, why) in params {
            if self.get(p).is_some() {
                return Err(WireError::unsupported(p, why));
            }
        }
        Ok(())
    }
}

/// Text given as a string or a list of parts: parts of the types `kinds` (each with a `text`)
/// are joined; any other part is refused by name (`at[k]`). `null` is empty text.
pub(crate) fn text_parts(at: &str, v: Option<&Value>, kinds: &[&str]) -> Result<String, WireError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut s = String::new();
            for (k, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str);
                match (kind, p.get("text").and_then(Value::as_str)) {
                    (Some(kd), Some(t)) if kinds.contains(&kd) => s.push_str(t),
                    _ => {
                        return Err(WireError::unsupported(
                            &format!("{at}[{k}]"),
                            &format!(
                                "a part of type {:?}; only {} parts",
                                kind.unwrap_or("?"),
                                kinds.join(" / ")
                            ),
                        ));
                    }
                }
            }
            Ok(s)
        }
        Some(_) => Err(WireError::invalid(
            at,
            format!("{at} must be a string or a list of parts"),
        )),
    }
}

/// How one API declares a tool.
pub(crate) struct ToolShape {
    /// The `type` a tool must have (`None`: absent or this one).
    pub(crate) kind: &'static str,
    pub(crate) kind_required: bool,
    /// The object holding `name` and `description` (`function` in Chat Completions), if not
    /// the tool itself.
    pub(crate) inner: Option<&'static str>,
    /// The key of the arguments' JSON Schema.
    pub(crate) schema: &'static str,
}

/// The declared tools: a list of `shape` declarations, each with a non-empty name.
pub(crate) fn tool_list(v: Option<&Value>, shape: &ToolShape) -> Result<Vec<ToolSpec>, WireError> {
    let Some(v) = v else { return Ok(Vec::new()) };
    let list = v
        .as_array()
        .ok_or_else(|| WireError::invalid("tools", "tools must be a list"))?;
    list.iter()
        .enumerate()
        .map(|(i, t)| {
            match t.get("type").and_then(Value::as_str) {
                Some(k) if k == shape.kind => {}
                None if !shape.kind_required => {}
                _ => {
                    return Err(WireError::unsupported(
                        &format!("tools[{i}].type"),
                        &format!("only {} tools", shape.kind),
                    ));
                }
            }
            let (decl, at) = match shape.inner {
                Some(k) => (t.get(k).unwrap_or(&Value::Null), format!("tools[{i}].{k}")),
                None => (t, format!("tools[{i}]")),
            };
            let name = decl
                .get("name")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty());
            let name = name
                .ok_or_else(|| WireError::invalid(format!("{at}.name"), "a tool needs a name"))?;
            Ok(ToolSpec {
                name: name.into(),
                description: decl
                    .get("description")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .into(),
                parameters: decl
                    .get(shape.schema)
                    .cloned()
                    .unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}})),
            })
        })
        .collect()
}

/// OpenAI's `tool_choice` (Chat Completions and Responses): `auto`, `none`, `required`, or
/// an object naming a function (`name_of` finds the name in it).
pub(crate) fn openai_tool_choice(
    v: Option<&Value>,
    name_of: impl Fn(&Value) -> Option<&str>,
) -> Result<ToolChoice, WireError> {
    Ok(match v {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(WireError::invalid(
                    "tool_choice",
                    format!("tool_choice {other:?} is not auto, none or required"),
                ));
            }
        },
        Some(o) => match name_of(o) {
            Some(name) => ToolChoice::Function(name.into()),
            None => {
                return Err(WireError::invalid(
                    "tool_choice",
                    "tool_choice names no function",
                ));
            }
        },
    })
}
