//! Agent tasks (`env = { kind = "agent" }`): their episodes are played by agent programs
//! through the gateway.
//!
//! - [`managed`]: rollarc starts the program per episode, in the sandbox, whose only way out
//!   is a forwarder to the gateway's unix socket.
//! - [`claims`]: external harnesses claim episodes and finish them (the service's
//!   `episodes:claim` and `finish` routes); a claim not finished by its deadline is failed.
//!
//! [`AgentHost`] is a job's side of the gateway: the gateway its episodes open on (the
//! service's, so external harnesses reach it on the service's port, or the job's own) and
//! the listeners its managed agents call (served by the gateway crate: this crate has no
//! HTTP server of its own).

pub mod claims;
pub mod managed;
pub mod remote;

use std::sync::Arc;
use std::time::Duration;

use actors::agent::{AgentEpisode, Renderer, SharedRunner, ToolFormat};
use actors::model::llm::LlmTokenizer;
use gateway::{EpisodeLimits, EpisodeOptions, Gateway, SamplingPolicy};

use crate::resolve::EnvProgram;
use crate::spec::{AgentEnv, AgentMode, EnvSandbox};
pub use claims::{Claim, ClaimBoard, FinishReport, FinishStatus};

/// The model name agent episodes' answers carry (and `GET /gateway/v1/models` lists).
pub const MODEL_NAME: &str = "rollarc-policy";

/// The loopback port a sandboxed agent reaches the gateway on (inside its own network
/// namespace, so every sandbox has its own).
pub const SANDBOX_GATEWAY_PORT: u16 = 8742;

/// What the service lends its jobs' agent tasks: its gateway and the board external
/// harnesses claim episodes from (the claim route builds the base URL from the address the
/// harness reached the service at).
pub struct AgentAccess {
    pub gateway: Arc<Gateway>,
    pub claims: Arc<ClaimBoard>,
}

impl AgentAccess {
    pub fn new(gateway: Arc<Gateway>) -> Self {
        Self {
            gateway,
            claims: Arc::new(ClaimBoard::default()),
        }
    }
}

/// An agent task as planned from the spec (its runner is built when the job's actors are).
#[derive(Clone, Debug)]
pub struct AgentPlan {
    pub spec: AgentEnv,
    /// Managed: the resolved program.
    pub program: Option<EnvProgram>,
    /// Managed on an env pool: the task on its workers and where they reach the gateway.
    pub remote: Option<RemoteAgents>,
}

/// A managed agent task whose programs run on an env pool's workers.
#[derive(Clone)]
pub struct RemoteAgents {
    pub task: Arc<actors::env::remote::RemoteTask>,
    /// The pool's `gateway_url` (default: the job's loopback gateway, for workers on this
    /// machine).
    pub gateway_url: Option<String>,
}

impl std::fmt::Debug for RemoteAgents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteAgents")
            .field("gateway_url", &self.gateway_url)
            .finish_non_exhaustive()
    }
}

/// A job's side of the gateway: the listeners its managed agents call (the gateway crate's,
/// stopped when this is dropped).
pub struct AgentHost {
    pub access: Arc<AgentAccess>,
    pub listeners: gateway::listen::Listeners,
}

impl AgentHost {
    /// The host for `plans`: a unix socket if a managed agent runs in the sandbox here, a
    /// loopback port if one runs outside it or on env workers.
    pub async fn start(
        access: Arc<AgentAccess>,
        plans: &[&AgentPlan],
    ) -> Result<Self, std::io::Error> {
        let managed = |sb: EnvSandbox| {
            plans.iter().any(|p| {
                p.spec.mode == AgentMode::Managed && p.remote.is_none() && p.spec.sandbox == sb
            })
        };
        let remote = plans.iter().any(|p| p.remote.is_some());
        let listeners = gateway::listen::Listeners::start(
            &access.gateway,
            managed(EnvSandbox::Bwrap),
            managed(EnvSandbox::None) || remote,
        )
        .await?;
        Ok(Self { access, listeners })
    }
}

/// How a task's episodes are served by the gateway.
pub(crate) fn episode_options(
    spec: &AgentEnv,
    renderer: &Arc<Renderer>,
    ep: &AgentEpisode,
) -> EpisodeOptions {
    EpisodeOptions {
        renderer: renderer.clone(),
        model: MODEL_NAME.into(),
        sampling: SamplingPolicy {
            temperature: ep.temperature,
            ..SamplingPolicy::default()
        },
        limits: EpisodeLimits {
            max_calls: spec.max_calls,
            max_generated_tokens: spec.max_generated_tokens,
            max_context: spec.max_context,
            max_tokens_per_call: ep.max_tokens_per_call,
        },
        // The episode's own seed: the agent's `seed` (if it sends one) is ignored for
        // sampling, so a group's episodes differ.
        seed: ep.sample_seed,
    }
}

/// The renderer of an agent task: the job policy's tokenizer, else the spec's `tokenizer`
/// checkpoint (simulated pools).
pub fn renderer(
    spec: &AgentEnv,
    policy: Option<&Arc<LlmTokenizer>>,
) -> Result<Arc<Renderer>, String> {
    let format = spec.tool_format.as_deref().and_then(ToolFormat::parse_name);
    let tok = match (policy, &spec.tokenizer) {
        (Some(t), _) => t.clone(),
        (None, Some(path)) => {
            let ck = actors::model::llm::Checkpoint::open_gguf(std::path::Path::new(path))
                .map_err(|e| format!("env.tokenizer: {}", infra::error_chain(&e)))?;
            Arc::new(
                LlmTokenizer::from_gguf(&ck)
                    .map_err(|e| format!("env.tokenizer: {}", infra::error_chain(&e)))?,
            )
        }
        (None, None) => {
            return Err(
                "an agent task on simulated pools needs env.tokenizer (a GGUF \
                        checkpoint whose chat template renders the calls)"
                    .into(),
            );
        }
    };
    Ok(Arc::new(Renderer::new(tok, format)))
}

/// The runner of an agent task.
pub fn runner(
    plan: &AgentPlan,
    renderer: Arc<Renderer>,
    host: &AgentHost,
    (job, task): (&str, &str),
) -> Result<SharedRunner, String> {
    Ok(match plan.spec.mode {
        AgentMode::Managed if plan.remote.is_some() => {
            let remote = plan.remote.as_ref().ok_or("no remote task")?;
            let base = match (&remote.gateway_url, &host.listeners.loopback) {
                (Some(u), _) | (None, Some(u)) => u.clone(),
                (None, None) => return Err("the gateway's loopback port is not open".into()),
            };
            Arc::new(remote::RemoteRunner::new(
                plan.spec.clone(),
                renderer,
                host.access.gateway.clone(),
                remote.task.clone(),
                base,
            ))
        }
        AgentMode::Managed => {
            let program = plan
                .program
                .clone()
                .ok_or("the agent's program was not resolved")?;
            Arc::new(managed::ManagedRunner::new(
                plan.spec.clone(),
                program,
                renderer,
                host,
            )?)
        }
        AgentMode::External => Arc::new(claims::ExternalRunner {
            spec: plan.spec.clone(),
            renderer,
            access: host.access.clone(),
            job: job.to_string(),
            task: task.to_string(),
        }),
    })
}

/// Closes an episode's key if still open when dropped (the episode was cancelled, or its
/// job ended): its calls in flight end with 410 at once.
pub(crate) struct FinishOnDrop(pub(crate) Arc<gateway::Gateway>, pub(crate) Option<String>);

impl Drop for FinishOnDrop {
    fn drop(&mut self) {
        if let Some(key) = self.1.take() {
            self.0.close(&key);
        }
    }
}

/// Seconds as a duration (specs are checked: finite, positive, bounded).
fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.0))
}
