//! A conversation turned into context ids with the checkpoint's own chat template, every
//! assistant message the session generated kept as the ids it was generated as.
//!
//! The template renders the conversation with a marker in place of each generated answer's
//! text; the text between markers is tokenised (special tokens recognised: the template
//! writes them as text) and each marker is replaced by the answer's generated ids. An answer
//! that ended on a stop id (`<|im_end|>`) already holds what the template writes right after
//! it, so that text is not added twice. Nothing the policy generated is ever re-tokenised.
//!
//! Templates without tool syntax (SmolLM2's) get the Hermes-style fallback: the tools are
//! declared in the system prompt ([`super::tools::hermes_prompt`]), calls the template cannot
//! write are written into the assistant's text in the model's format, and tool results are
//! user messages inside `<tool_response></tool_response>`.

use std::sync::Arc;

use serde_json::{Value, json};

use super::tools::{ToolFormat, hermes_prompt};
use crate::chat::{Conversation, Message, Role, ToolCall};
use crate::model::llm::{LlmTokenizer, TokenizerError};

/// Marks the place of generated answer `k` in the rendered text (private-use characters no
/// tokenizer merges across; a message holding the same text is refused).
fn marker(k: usize) -> String {
    format!("\u{F8FF}rollarc-generated-{k}\u{F8FF}")
}
const MARK_CHAR: char = '\u{F8FF}';

/// An answer the session generated: the message the client was sent, and its ids.
#[derive(Clone, Debug)]
pub struct Generated {
    pub message: Message,
    pub ids: Arc<[u32]>,
}

impl Generated {
    /// Whether the client's assistant message `m` is this answer sent back: the same text
    /// (surrounding whitespace aside: some harnesses trim) and the same calls (names and
    /// arguments; ids may be rewritten).
    fn is(&self, m: &Message) -> bool {
        let same_calls = |a: &[ToolCall], b: &[ToolCall]| {
            a.len() == b.len()
                && a.iter()
                    .zip(b)
                    .all(|(x, y)| x.name == y.name && x.arguments == y.arguments)
        };
        m.role == Role::Assistant
            && m.content.trim() == self.message.content.trim()
            && same_calls(&m.tool_calls, &self.message.tool_calls)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    #[error(transparent)]
    Template(#[from] TokenizerError),
    #[error("messages[{0}]: the content holds the reserved character U+F8FF")]
    Reserved(usize),
    #[error("the chat template dropped or reordered a generated answer")]
    Marker,
}

/// Renders conversations for one checkpoint.
pub struct Renderer {
    tok: Arc<LlmTokenizer>,
    pub format: ToolFormat,
    /// The template writes `tools` and tool calls itself.
    native_tools: bool,
}

impl Renderer {
    /// `format`: the model family's tool-call format, or the one the template names.
    pub fn new(tok: Arc<LlmTokenizer>, format: Option<ToolFormat>) -> Self {
        let template = tok.chat_template();
        let native_tools = template.is_some_and(|t| t.contains("tools"));
        Self {
            format: format.unwrap_or_else(|| ToolFormat::of_template(template)),
            native_tools,
            tok,
        }
    }

    pub fn tokenizer(&self) -> &Arc<LlmTokenizer> {
        &self.tok
    }

    /// Whether the template declares tools itself (otherwise the Hermes-style fallback).
    pub fn native_tools(&self) -> bool {
        self.native_tools
    }

    /// The context ids of `conv`, ready to generate the next assistant answer. Assistant
    /// messages that are answers of `generated` (matched in order) are their ids.
    pub fn ids(
        &self,
        conv: &Conversation,
        generated: &[Generated],
    ) -> Result<Vec<u32>, RenderError> {
        let mut cursor = 0;
        let mut spliced: Vec<&Generated> = Vec::new();
        let mut messages = Vec::with_capacity(conv.messages.len() + 1);
        for (i, m) in conv.messages.iter().enumerate() {
            if m.content.contains(MARK_CHAR) {
                return Err(RenderError::Reserved(i));
            }
            let found = (m.role == Role::Assistant)
                .then(|| generated[cursor..].iter().position(|g| g.is(m)))
                .flatten();
            if let Some(j) = found {
                spliced.push(&generated[cursor + j]);
                cursor += j + 1;
                messages.push(json!({"role": "assistant", "content": marker(spliced.len() - 1)}));
            } else {
                messages.push(self.template_message(m));
            }
        }
        let tools = conv.offered_tools();
        let tools_json: Vec<Value> = tools
            .iter()
            .map(|t| json!({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}))
            .collect();
        if !self.native_tools && !tools.is_empty() {
            let prompt = hermes_prompt(tools, &conv.tool_choice);
            match messages.first_mut() {
                Some(first) if first["role"] == "system" => {
                    let text = first["content"].as_str().unwrap_or_default();
                    first["content"] = Value::String(format!("{text}\n\n{prompt}"));
                }
                _ => messages.insert(0, json!({"role": "system", "content": prompt})),
            }
        }
        let tools_arg = (self.native_tools && !tools_json.is_empty()).then_some(&tools_json[..]);
        let text = self.tok.render_chat_json(&messages, tools_arg, true)?;
        self.splice(&text, &spliced)
    }

    /// A message as the template sees it: OpenAI's shape where the template writes tools;
    /// otherwise tool calls written into the text and tool results as user messages.
    fn template_message(&self, m: &Message) -> Value {
        if self.native_tools {
            let calls: Vec<Value> = m
                .tool_calls
                .iter()
                .map(|c| {
                    json!({"id": c.id, "type": "function", "name": c.name, "arguments": c.arguments,
                    "function": {"name": c.name, "arguments": c.arguments}})
                })
                .collect();
            let mut v = json!({"role": m.role.as_str(), "content": m.content});
            if !calls.is_empty() {
                v["tool_calls"] = Value::Array(calls);
            }
            if let Some(id) = &m.tool_call_id {
                v["tool_call_id"] = Value::String(id.clone());
            }
            return v;
        }
        match m.role {
            Role::Tool => {
                json!({"role": "user", "content": format!("<tool_response>\n{}\n</tool_response>", m.content)})
            }
            Role::Assistant if !m.tool_calls.is_empty() => {
                let calls = self.format.write(&m.tool_calls);
                let text = if m.content.is_empty() {
                    calls
                } else {
                    format!("{}\n{calls}", m.content)
                };
                json!({"role": "assistant", "content": text})
            }
            r => json!({"role": r.as_str(), "content": m.content}),
        }
    }

    /// The rendered text's ids, each marker replaced by its answer's ids.
    fn splice(&self, text: &str, spliced: &[&Generated]) -> Result<Vec<u32>, RenderError> {
        let mut ids = Vec::new();
        let mut rest = text;
        for (k, g) in spliced.iter().enumerate() {
            let m = marker(k);
            let at = rest.find(&m).ok_or(RenderError::Marker)?;
            ids.extend(self.tok.encode(&rest[..at], true)?);
            ids.extend_from_slice(&g.ids);
            rest = &rest[at + m.len()..];
            // What the template writes after the answer, when the answer already ended on it.
            if let Some(&last) = g.ids.last()
                && self.tok.stop_ids.contains(&last)
            {
                let end = self.tok.decode(&[last])?;
                if let Some(after) = rest.strip_prefix(end.as_str()) {
                    rest = after;
                }
            }
        }
        if rest.contains(MARK_CHAR) {
            return Err(RenderError::Marker);
        }
        ids.extend(self.tok.encode(rest, true)?);
        Ok(ids)
    }
}
