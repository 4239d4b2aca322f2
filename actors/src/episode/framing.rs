//! How observations become context tokens and answers become actions, per policy:
//! the tiny byte-level model frames an observation as `[BOS] text [SEP]` and answers until
//! EOT; a real checkpoint frames it as a user message of its own chat template and answers
//! as the assistant until the template's end of turn.
//!
//! Token-in/token-out: each observation's tokens are appended to the context as it is; the
//! history (previous observations, generated ids) is never re-tokenised. The observation
//! text itself is encoded with special tokens *not* recognised, so an environment cannot
//! inject a role marker.

use std::sync::Arc;

use crate::model::llm::{ChatMessage, LlmTokenizer, TokenizerError};
use crate::model::tokenizer::{BOS, ByteTokenizer, EOT, SEP};

#[derive(Debug, thiserror::Error)]
pub enum FramingError {
    #[error("the chat template cannot frame observations")]
    Template(#[source] TokenizerError),
    #[error("the chat template is not append-only: {0}")]
    NotAppendOnly(&'static str),
}

/// A policy's framing of observations and answers.
pub trait Framing: Send + Sync {
    /// Tokens an observation adds to the context; `first`: the episode's first turn;
    /// `previous`: the answer generated just before (empty on the first turn).
    fn observation(
        &self,
        text: &str,
        first: bool,
        previous: &[u32],
    ) -> Result<Vec<u32>, FramingError>;
    /// Tokens of a chat-format prompt (a dataset row's messages) on the first turn. Without
    /// a chat template the contents are joined by newlines and framed as an observation.
    fn prompt(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, FramingError> {
        let text: Vec<&str> = messages.iter().map(|m| m.content.as_str()).collect();
        self.observation(&text.join("\n"), true, &[])
    }
    /// The action text of an answer (its end-of-turn token dropped, specials skipped).
    fn action(&self, answer: &[u32]) -> String;
    /// Ids that end an answer.
    fn stop_ids(&self) -> Vec<u32>;
}

/// The tiny byte-level policy's framing.
pub struct ByteFraming;

impl Framing for ByteFraming {
    fn observation(
        &self,
        text: &str,
        first: bool,
        _previous: &[u32],
    ) -> Result<Vec<u32>, FramingError> {
        let mut v = if first { vec![BOS] } else { Vec::new() };
        v.extend(ByteTokenizer.encode(text));
        v.push(SEP);
        Ok(v)
    }
    fn action(&self, answer: &[u32]) -> String {
        ByteTokenizer.decode(answer)
    }
    fn stop_ids(&self) -> Vec<u32> {
        vec![EOT]
    }
}

/// A chat model's framing, cut from its own template once: the text before and after a
/// user message on the first turn, and between an assistant answer and the next user
/// message on later turns.
pub struct ChatFraming {
    tok: Arc<LlmTokenizer>,
    /// First turn: (system and) user header, then the generation prompt after the text.
    first: (Vec<u32>, Vec<u32>),
    /// Later turns: what closes the assistant's answer (as text: the end-of-turn token
    /// the answer may already hold is matched against it), the next user header, and the
    /// generation prompt after the text.
    close: String,
    next: (String, Vec<u32>),
    /// The job's system message, put before a dataset prompt that has none of its own.
    system: Option<String>,
}

const SENTINEL_USER: &str = "\u{1}rollarc-observation\u{1}";
const SENTINEL_ANSWER: &str = "\u{1}rollarc-answer\u{1}";

impl ChatFraming {
    /// Cuts `tok`'s chat template; `system`: a system message before the first observation.
    pub fn new(tok: Arc<LlmTokenizer>, system: Option<&str>) -> Result<Self, FramingError> {
        let mut msgs: Vec<ChatMessage> = system
            .map(|s| ChatMessage::new("system", s))
            .into_iter()
            .collect();
        let render = |m: &[ChatMessage], prompt: bool| {
            tok.render_chat(m, prompt).map_err(FramingError::Template)
        };
        msgs.push(ChatMessage::new("user", SENTINEL_USER));
        let one = render(&msgs, true)?;
        let (head, tail) = one
            .split_once(SENTINEL_USER)
            .ok_or(FramingError::NotAppendOnly(
                "the user message is not rendered",
            ))?;
        let enc = |t: &str| tok.encode(t, true).map_err(FramingError::Template);
        let first = (enc(head)?, enc(tail)?);
        // The same chat with an answer, without and with a following user message.
        msgs.pop();
        msgs.push(ChatMessage::new("user", "x"));
        msgs.push(ChatMessage::new("assistant", SENTINEL_ANSWER));
        let base = render(&msgs, false)?;
        msgs.push(ChatMessage::new("user", SENTINEL_USER));
        let full = render(&msgs, true)?;
        let delta = full
            .strip_prefix(base.as_str())
            .ok_or(FramingError::NotAppendOnly(
                "a new message changes the text before it",
            ))?;
        let close = base
            .split_once(SENTINEL_ANSWER)
            .map(|(_, after)| after.to_string())
            .ok_or(FramingError::NotAppendOnly("the answer is not rendered"))?;
        let (mid, tail) = delta
            .split_once(SENTINEL_USER)
            .ok_or(FramingError::NotAppendOnly(
                "the next user message is not rendered",
            ))?;
        Ok(Self {
            first,
            close,
            next: (mid.to_string(), enc(tail)?),
            tok,
            system: system.map(str::to_string),
        })
    }
}

impl Framing for ChatFraming {
    fn observation(
        &self,
        text: &str,
        first: bool,
        previous: &[u32],
    ) -> Result<Vec<u32>, FramingError> {
        let body = self
            .tok
            .encode(text, false)
            .map_err(FramingError::Template)?;
        let mut v = if first {
            self.first.0.clone()
        } else {
            // Close the answer: what the template writes after it, less the end-of-turn
            // token the answer already ends with.
            let mut close = self.close.as_str();
            if let Some(&last) = previous.last()
                && self.tok.stop_ids.contains(&last)
                && let Ok(piece) = self.tok.decode(&[last])
                && let Some(rest) = close.strip_prefix(piece.as_str())
            {
                close = rest;
            }
            let head = format!("{close}{}", self.next.0);
            self.tok
                .encode(&head, true)
                .map_err(FramingError::Template)?
        };
        v.extend(body);
        v.extend_from_slice(if first { &self.first.1 } else { &self.next.1 });
        Ok(v)
    }

    /// The messages rendered by the template with each content replaced by a marker; the
    /// template's text between markers is encoded with special tokens, the contents without
    /// (so a row cannot inject a role marker either).
    fn prompt(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, FramingError> {
        let mut msgs: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
        if let Some(s) = &self.system
            && !messages.iter().any(|m| m.role == "system")
        {
            msgs.push(ChatMessage::new("system", s));
        }
        msgs.extend(messages.iter().cloned());
        let marker = |i: usize| format!("\u{1}rollarc-message-{i}\u{1}");
        let marked: Vec<ChatMessage> = msgs
            .iter()
            .enumerate()
            .map(|(i, m)| ChatMessage::new(&m.role, &marker(i)))
            .collect();
        let mut rest = self
            .tok
            .render_chat(&marked, true)
            .map_err(FramingError::Template)?;
        let mut v = Vec::new();
        for (i, m) in msgs.iter().enumerate() {
            let (head, tail) = rest
                .split_once(&marker(i))
                .ok_or(FramingError::NotAppendOnly(
                    "a prompt message is not rendered",
                ))?;
            v.extend(
                self.tok
                    .encode(head, true)
                    .map_err(FramingError::Template)?,
            );
            v.extend(
                self.tok
                    .encode(&m.content, false)
                    .map_err(FramingError::Template)?,
            );
            rest = tail.to_string();
        }
        v.extend(
            self.tok
                .encode(&rest, true)
                .map_err(FramingError::Template)?,
        );
        Ok(v)
    }

    fn action(&self, answer: &[u32]) -> String {
        let end = answer
            .iter()
            .rposition(|t| !self.tok.stop_ids.contains(t))
            .map_or(0, |i| i + 1);
        let kept: Vec<u32> = answer[..end].to_vec();
        self.tok.decode(&kept).unwrap_or_default()
    }

    fn stop_ids(&self) -> Vec<u32> {
        self.tok.stop_ids.clone()
    }
}
