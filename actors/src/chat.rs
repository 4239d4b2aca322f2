//! The conversation an agent sends, in one shape whichever API it spoke (the record types
//! trajectories keep, so they depend on nothing else of the crate): messages with roles,
//! tool calls and tool results, and the tools it declared. The wire formats (OpenAI Chat
//! Completions and Responses, Anthropic Messages) are parsed into it at the HTTP edge.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Who wrote a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::System => "system",
            Self::User => "user",
            Self::Assistant => "assistant",
            Self::Tool => "tool",
        }
    }
}

/// A call of a declared tool, as the assistant made it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as a JSON value (an object for a valid call).
    pub arguments: Value,
}

/// One message of the conversation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    /// The text (for a tool message: the tool's result).
    pub content: String,
    /// Assistant messages: the tools it called.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// Tool messages: the call they answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    /// A tool's result for call `id`.
    pub fn tool(id: &str, content: impl Into<String>) -> Self {
        Self {
            tool_call_id: Some(id.to_string()),
            ..Self::new(Role::Tool, content)
        }
    }
}

/// A function the agent declared as a tool.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// JSON Schema of the arguments (an object schema).
    #[serde(default = "empty_object_schema")]
    pub parameters: Value,
}

fn empty_object_schema() -> Value {
    serde_json::json!({"type": "object", "properties": {}})
}

/// Whether and which tool the model must call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (the default when tools are declared).
    #[default]
    Auto,
    /// No tool calls: tools are left out of the prompt.
    None,
    /// At least one call (the prompt says so; the answer is checked like any other).
    Required,
    /// This function (the prompt says so).
    Function(String),
}

/// A whole request's conversation: what the model is asked to continue.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Conversation {
    pub messages: Vec<Message>,
    pub tools: Vec<ToolSpec>,
    pub tool_choice: ToolChoice,
}

/// A conversation that cannot be rendered, naming where.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConversationError {
    #[error("messages is empty")]
    Empty,
    #[error(
        "messages[{index}]: a tool result for call id {id:?}, which no earlier assistant message made"
    )]
    UnknownToolCall { index: usize, id: String },
    #[error("messages[{index}]: a tool message needs a tool_call_id")]
    MissingToolCallId { index: usize },
    #[error("messages[{index}]: the system message must come first")]
    LateSystem { index: usize },
    #[error("tools[{index}]: the tool name {name:?} is declared twice")]
    DuplicateTool { index: usize, name: String },
    #[error("tool_choice names {0:?}, which is not a declared tool")]
    UnknownToolChoice(String),
}

impl ConversationError {
    /// The request field the error is about (for the providers' `param`).
    pub fn param(&self) -> String {
        match self {
            Self::Empty => "messages".into(),
            Self::UnknownToolCall { index, .. } | Self::MissingToolCallId { index } => {
                format!("messages[{index}].tool_call_id")
            }
            Self::LateSystem { index } => format!("messages[{index}].role"),
            Self::DuplicateTool { index, .. } => format!("tools[{index}].name"),
            Self::UnknownToolChoice(_) => "tool_choice".into(),
        }
    }
}

impl Conversation {
    /// Checks what every wire format must hold: a message to continue, the system message
    /// first, every tool result answering a call an earlier assistant message made, tool
    /// names unique, and `tool_choice` naming a declared tool.
    pub fn check(&self) -> Result<(), ConversationError> {
        if self.messages.is_empty() {
            return Err(ConversationError::Empty);
        }
        let mut calls: Vec<&str> = Vec::new();
        for (index, m) in self.messages.iter().enumerate() {
            match m.role {
                Role::System if index > 0 => return Err(ConversationError::LateSystem { index }),
                Role::Assistant => calls.extend(m.tool_calls.iter().map(|c| c.id.as_str())),
                Role::Tool => {
                    let id = m
                        .tool_call_id
                        .as_deref()
                        .ok_or(ConversationError::MissingToolCallId { index })?;
                    if !calls.contains(&id) {
                        return Err(ConversationError::UnknownToolCall {
                            index,
                            id: id.to_string(),
                        });
                    }
                }
                _ => {}
            }
        }
        for (index, t) in self.tools.iter().enumerate() {
            if self.tools[..index].iter().any(|u| u.name == t.name) {
                return Err(ConversationError::DuplicateTool {
                    index,
                    name: t.name.clone(),
                });
            }
        }
        if let ToolChoice::Function(name) = &self.tool_choice
            && !self.tools.iter().any(|t| &t.name == name)
        {
            return Err(ConversationError::UnknownToolChoice(name.clone()));
        }
        Ok(())
    }

    /// The tools the prompt offers (none under `tool_choice = none`).
    pub fn offered_tools(&self) -> &[ToolSpec] {
        if self.tool_choice == ToolChoice::None {
            &[]
        } else {
            &self.tools
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(id: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            name: "f".into(),
            arguments: serde_json::json!({}),
        }
    }

    #[test]
    fn tool_results_must_answer_an_earlier_call() {
        let mut asked = Message::new(Role::Assistant, "");
        asked.tool_calls.push(call("c1"));
        let ok = Conversation {
            messages: vec![
                Message::new(Role::User, "hi"),
                asked.clone(),
                Message::tool("c1", "42"),
            ],
            ..Conversation::default()
        };
        assert_eq!(ok.check(), Ok(()));
        let mut bad = ok.clone();
        bad.messages.push(Message::tool("c9", "?"));
        let e = bad.check().unwrap_err();
        assert_eq!(e.param(), "messages[3].tool_call_id");
        assert!(e.to_string().contains("\"c9\""), "{e}");
        // A result before its call does not count.
        let early = Conversation {
            messages: vec![Message::tool("c1", "42"), asked],
            ..Conversation::default()
        };
        assert!(matches!(
            early.check(),
            Err(ConversationError::UnknownToolCall { index: 0, .. })
        ));
    }

    #[test]
    fn empty_late_system_duplicate_tools_and_unknown_choice_are_refused() {
        assert_eq!(
            Conversation::default().check(),
            Err(ConversationError::Empty)
        );
        let late = Conversation {
            messages: vec![
                Message::new(Role::User, "a"),
                Message::new(Role::System, "b"),
            ],
            ..Conversation::default()
        };
        assert_eq!(late.check().unwrap_err().param(), "messages[1].role");
        let tool = |n: &str| ToolSpec {
            name: n.into(),
            description: String::new(),
            parameters: empty_object_schema(),
        };
        let mut c = Conversation {
            messages: vec![Message::new(Role::User, "a")],
            tools: vec![tool("x"), tool("x")],
            ..Conversation::default()
        };
        assert_eq!(c.check().unwrap_err().param(), "tools[1].name");
        c.tools.pop();
        c.tool_choice = ToolChoice::Function("y".into());
        assert_eq!(c.check().unwrap_err().param(), "tool_choice");
        c.tool_choice = ToolChoice::None;
        assert!(c.check().is_ok() && c.offered_tools().is_empty());
    }
}
