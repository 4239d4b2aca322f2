//! The agent gateway: unmodified agents call an OpenAI- or Anthropic-compatible endpoint
//! scoped to one episode, and every call becomes a turn of the episode's trajectory with the
//! exact ids the engine prefilled and generated, their behaviour log-probabilities and the
//! policy versions that produced them.
//!
//! - [`wire`]: the call, answer and error every API shares; [`openai`] (Chat Completions),
//!   [`responses`] (Responses) and [`anthropic`] (Messages) parse and format them.
//! - [`episode`]: one episode's state and how a call is served (render → budget → generate →
//!   tool calls → turn); [`Gateway`] holds the open episodes by key.
//! - [`http`]: the routes under `/gateway/v1`; [`listen`]: the gateway on a unix socket or
//!   loopback port of its own.
//!
//! [`bench`]: `rollarc bench --what gateway`.
//!
//! Depends on `actors` (and the crates below it); `job` runs agent episodes through it and
//! `service` serves its routes.
//!
//! Keys: each episode has its own random key (`Authorization: Bearer` or `x-api-key`); an
//! unknown key is a 401, a finished episode's key a 410 (the last
//! [`FINISHED_KEYS_KEPT`] finished keys are remembered; older ones are unknown).

#![cfg_attr(
    test,
    allow(
        clippy::too_many_lines,
        reason = "the 100-line limit is on shipped code; a test reads top to bottom"
    )
)]

pub mod anthropic;
pub mod bench;
pub mod episode;
pub mod http;
pub mod listen;
pub mod openai;
pub mod responses;
pub mod wire;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use actors::generation::shard::ShardHandle;
use actors::generation::{EngineHandle, GenError, GenOutput, GenRequest};
use futures::future::BoxFuture;

pub use episode::{Episode, EpisodeLimits, EpisodeOptions, Finished, SamplingPolicy};
use wire::{ErrorKind, WireError};

/// Finished episodes' keys remembered to answer 410 rather than 401.
pub const FINISHED_KEYS_KEPT: usize = 10_000;

/// Where an episode's calls are generated: a shard of the job (or, in tests, an engine loop).
pub trait Generator: Send + Sync {
    fn generate(&self, req: GenRequest) -> BoxFuture<'_, Result<GenOutput, GenError>>;
    /// Forgets a session's prefix cache.
    fn release(&self, session: u64);
    /// Drops request `id` (its client went away): the shard stops generating it.
    fn abort(&self, id: u64);
}

impl Generator for ShardHandle {
    fn generate(&self, req: GenRequest) -> BoxFuture<'_, Result<GenOutput, GenError>> {
        Box::pin(ShardHandle::generate_boxed(self, Box::new(req)))
    }
    fn release(&self, session: u64) {
        ShardHandle::release(self, session);
    }
    fn abort(&self, id: u64) {
        ShardHandle::abort(self, id);
    }
}

impl Generator for EngineHandle {
    fn generate(&self, req: GenRequest) -> BoxFuture<'_, Result<GenOutput, GenError>> {
        Box::pin(EngineHandle::generate(self, req))
    }
    fn release(&self, session: u64) {
        EngineHandle::release(self, session);
    }
    fn abort(&self, id: u64) {
        EngineHandle::abort(self, id);
    }
}

/// What [`Gateway::open`] hands the agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Opened {
    pub id: u64,
    /// The episode's API key.
    pub key: String,
}

#[derive(Default)]
struct Keys {
    open: HashMap<String, Arc<Episode>>,
    finished: VecDeque<String>,
}

/// The open agent episodes, by key.
#[derive(Default)]
pub struct Gateway {
    keys: Mutex<Keys>,
    next_id: std::sync::atomic::AtomicU64,
}

impl Gateway {
    pub fn new() -> Self {
        Self::default()
    }

    /// Opens an episode served by `generator`; its key is random (256 bits, like the API's
    /// tokens).
    pub fn open(
        &self,
        opts: EpisodeOptions,
        generator: Arc<dyn Generator>,
    ) -> Result<Opened, infra::secret::RandomError> {
        let key = infra::secret::new_token("rke_")?;
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ep = Arc::new(Episode::new(id, opts, generator));
        self.lock().open.insert(key.clone(), ep);
        Ok(Opened { id, key })
    }

    /// The episode of `key`: 401 when unknown, 410 when finished.
    pub fn episode(&self, key: &str) -> Result<Arc<Episode>, WireError> {
        let keys = self.lock();
        if let Some(ep) = keys.open.get(key) {
            return Ok(ep.clone());
        }
        if keys.finished.iter().any(|k| k == key) {
            return Err(WireError::new(
                ErrorKind::Gone,
                "this episode is finished; its key is no longer valid",
            ));
        }
        Err(WireError::new(
            ErrorKind::Authentication,
            "the API key is not an open episode's key",
        ))
    }

    /// Finishes the episode of `key`: its key stops working (410) and its turns (and
    /// transcript) are returned once the call being served has ended. `None` when no open
    /// episode has the key.
    pub async fn finish(&self, key: &str) -> Option<Finished> {
        let ep = {
            let mut keys = self.lock();
            let ep = keys.open.remove(key)?;
            keys.finished.push_back(key.to_string());
            if keys.finished.len() > FINISHED_KEYS_KEPT {
                keys.finished.pop_front();
            }
            ep
        };
        // Closed if this future is dropped before the calls in flight end (the job gave the
        // episode up meanwhile): they end at once and the prefix cache is released.
        struct CloseOnDrop<'a>(Option<&'a Episode>);
        impl Drop for CloseOnDrop<'_> {
            fn drop(&mut self) {
                if let Some(ep) = self.0.take() {
                    ep.close();
                }
            }
        }
        let mut guard = CloseOnDrop(Some(&ep));
        let finished = ep.finish().await;
        guard.0 = None;
        Some(finished)
    }

    /// Closes the episode of `key` at once, without waiting for its calls: they end with
    /// 410, as later calls do. For an episode its job gave up (cancelled, or the job ended).
    pub fn close(&self, key: &str) {
        let mut keys = self.lock();
        if let Some(ep) = keys.open.remove(key) {
            ep.close();
            keys.finished.push_back(key.to_string());
            if keys.finished.len() > FINISHED_KEYS_KEPT {
                keys.finished.pop_front();
            }
        }
    }

    /// Open episodes.
    pub fn open_count(&self) -> usize {
        self.lock().open.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Keys> {
        self.keys
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
