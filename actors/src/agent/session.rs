//! One agent episode's context on the policy side: the ids the engine prefilled and
//! generated so far, the answers it generated (to recognise them when the agent sends its
//! history back), the segments, and the newest policy version that served it.
//!
//! A request whose rendered ids extend the session's context appends only the new ids (the
//! tool results, the next user message, the generation prompt). A request that does not —
//! the agent edited, truncated or summarised its history, or changed its system prompt or
//! tools — starts a new segment: its whole context is the new turn's observation, and it
//! trains under that context only (`Turn::restart`).

use std::sync::Arc;

use super::render::{Generated, RenderError, Renderer};
use crate::chat::{Conversation, Message};
use crate::generation::GenOutput;
use crate::types::PolicyVersion;

/// The context of one request, ready for the engine.
#[derive(Clone, Debug)]
pub struct Prepared {
    /// The whole context to generate from.
    pub context: Arc<crate::tokens::Tokens>,
    /// Ids this request adds to the session (the turn's observation): the new ids after the
    /// session's context, or the whole context for a new segment.
    pub observation: Vec<u32>,
    /// The request diverged from the session's context: a new segment starts.
    pub restart: bool,
}

/// A generation that would move the session's policy version backwards.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the answer was generated under policy version {got}, older than version {floor} this session already used"
)]
pub struct VersionWentBack {
    pub got: PolicyVersion,
    pub floor: PolicyVersion,
}

/// The policy side of one agent episode.
pub struct Session {
    renderer: Arc<Renderer>,
    generated: Vec<Generated>,
    /// The current segment's ids: prefilled context and generated answer of the last call.
    context: Vec<u32>,
    segments: u32,
    /// Newest policy version that generated a token of this session.
    floor: PolicyVersion,
}

impl Session {
    pub fn new(renderer: Arc<Renderer>) -> Self {
        Self {
            renderer,
            generated: Vec::new(),
            context: Vec::new(),
            segments: 0,
            floor: 0,
        }
    }

    pub fn renderer(&self) -> &Arc<Renderer> {
        &self.renderer
    }

    /// Segments so far (0 before the first call); divergences are `segments − 1`.
    pub fn segments(&self) -> u32 {
        self.segments
    }

    /// The newest policy version that served this session (0 before the first answer).
    pub fn version_floor(&self) -> PolicyVersion {
        self.floor
    }

    /// The current segment's ids.
    pub fn context(&self) -> &[u32] {
        &self.context
    }

    /// Renders `conv` against the session: what to prefill, and whether it continues the
    /// session's context or starts a new segment. The session is unchanged until
    /// [`Session::commit`].
    pub fn prepare(&self, conv: &Conversation) -> Result<Prepared, RenderError> {
        let ids = self.renderer.ids(conv, &self.generated)?;
        let extends = !self.context.is_empty() && ids.starts_with(&self.context);
        let restart = self.segments > 0 && !extends;
        let observation = if extends {
            ids[self.context.len()..].to_vec()
        } else {
            ids.clone()
        };
        Ok(Prepared {
            context: Arc::new(ids.into()),
            observation,
            restart,
        })
    }

    /// Checks that `out` was generated under versions no older than the session's newest
    /// (versions never go backwards within a session, whichever shard served it).
    pub fn check_versions(&self, out: &GenOutput) -> Result<(), VersionWentBack> {
        match out.versions.iter().map(|s| s.version).min() {
            Some(got) if got < self.floor => Err(VersionWentBack {
                got,
                floor: self.floor,
            }),
            _ => Ok(()),
        }
    }

    /// Records the answer to `prepared`: its ids join the context, and `message` (what the
    /// client was sent) is how the agent will send it back.
    pub fn commit(&mut self, prepared: &Prepared, out: &GenOutput, message: Message) {
        if self.segments == 0 || prepared.restart {
            self.segments += 1;
        }
        self.context.clear();
        self.context.extend_from_slice(&prepared.context);
        self.context.extend_from_slice(&out.tokens);
        if let Some(v) = out.versions.iter().map(|s| s.version).max() {
            self.floor = self.floor.max(v);
        }
        self.generated.push(Generated {
            message,
            ids: out.tokens[..].into(),
        });
    }
}
