//! Agents on the policy side: conversations from programs written against the OpenAI and
//! Anthropic APIs (their messages in [`crate::chat`]) turned into exact token contexts, and the
//! answers turned back into their messages and tool calls.
//!
//! - [`render`]: a conversation as context ids through the checkpoint's chat template, every
//!   generated answer kept as the ids it was generated as (never re-tokenised).
//! - [`tools`]: tool calls parsed out of generated text by model family, checked against the
//!   declared tools; the Hermes-style prompt for templates without tool syntax.
//! - [`runner`]: agent episodes as the episode driver plays them ([`AgentRunner`]).
//! - [`session`]: one episode's context: appended to while the agent's history extends it, a
//!   new segment when it diverges; the policy version floor.

pub mod render;
pub mod runner;
pub mod session;
pub mod tools;

pub use crate::chat::{
    Conversation, ConversationError, Message, Role, ToolCall, ToolChoice, ToolSpec,
};
pub use render::{Generated, RenderError, Renderer};
pub use runner::{
    AgentEpisode, AgentOutcome, AgentReport, AgentRunner, AgentSlot, AgentSummary, SharedRunner,
};
pub use session::{Prepared, Session, VersionWentBack};
pub use tools::{ParsedAnswer, ToolFormat};

#[cfg(test)]
mod tests;
