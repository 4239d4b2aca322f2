//! Agent episodes as the episode driver sees them: an [`AgentRunner`] plays one episode (a
//! managed program in a sandbox, or a claim of an external harness) through the gateway on
//! the episode's shard and reports the turns it recorded. The driver scores the report like
//! any trajectory; the runner lives above this crate (it needs the gateway).

use std::sync::Arc;

use crate::env::{EnvError, Environment, Observation, Record, StepOutcome};
use crate::generation::shard::ShardHandle;
pub use crate::types::AgentSummary;
use crate::types::{PolicyVersion, Turn};
use futures::future::BoxFuture;

/// One agent episode to play.
#[derive(Clone)]
pub struct AgentEpisode {
    /// The episode's id within its job.
    pub id: u64,
    pub group: u64,
    /// The group's seed (its problem, for tasks without a dataset).
    pub seed: u64,
    /// This episode's own sampling seed: the episodes of a group sample differently.
    pub sample_seed: u64,
    /// The group's dataset row (tasks with a dataset).
    pub record: Option<Record>,
    /// Where its model calls are generated.
    pub shard: ShardHandle,
    pub start_version: PolicyVersion,
    /// What the policy samples at (the evaluation's temperature for held-out episodes).
    pub temperature: f32,
    /// Answer tokens of one model call at most.
    pub max_tokens_per_call: u32,
}

/// What an agent episode produced.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AgentReport {
    /// One turn per model call, as the gateway recorded them.
    pub turns: Vec<Turn>,
    pub summary: AgentSummary,
    /// The reward decided without the reward functions: the agent's own (where the spec
    /// trusts it) or the spec's reward for a policy failure.
    pub reward: Option<f64>,
}

/// How an agent episode ended.
#[derive(Clone, Debug, PartialEq)]
pub enum AgentOutcome {
    /// The agent ran; the report may carry a policy failure.
    Done(Box<AgentReport>),
    /// The infrastructure failed (the sandbox did not start, the agent died before its first
    /// model call or was killed from outside, a claim expired): masked, never rewarded.
    Infra(String),
    /// The agent failed after the gateway could not generate one of its calls (the shard
    /// stopped or failed past the retries): masked like a generation failure.
    GenerationFailed(String),
}

/// Plays agent episodes.
pub trait AgentRunner: Send + Sync + 'static {
    fn run(&self, episode: AgentEpisode) -> BoxFuture<'static, AgentOutcome>;
}

pub type SharedRunner = Arc<dyn AgentRunner>;

/// The environment slot an agent episode holds while it runs: the task's `envs` bound how
/// many agents run at once (sandbox starts included), and the slot's held time is measured
/// as for any environment. It is never reset or stepped.
pub struct AgentSlot;

impl Environment for AgentSlot {
    async fn reset(&mut self, _seed: u64) -> Result<Observation, EnvError> {
        Err(EnvError::Reported(
            "an agent task's slot is not an environment".into(),
        ))
    }

    async fn step(
        &mut self,
        _action: &str,
        _tokens: &crate::tokens::Tokens,
    ) -> Result<StepOutcome, EnvError> {
        Err(EnvError::Reported(
            "an agent task's slot is not an environment".into(),
        ))
    }

    async fn close(&mut self) {}
}
