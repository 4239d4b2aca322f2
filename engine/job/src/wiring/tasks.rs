//! Tasks: the scheduler's view (weights, groups, seeds, cost-model priors, declared pool),
//! the environment factory and pool size, and the reward functions episodes call.

use std::sync::Arc;
use std::time::Duration;

use actors::env::EnvFactory;

use crate::cost::Tokens;
use crate::resolve::TaskInputs;

use super::TaskView;
use super::envs::{EnvLimits, factory, remote_factory, remote_task};
use crate::spec::{EnvSandbox, EnvSpec, JobSpec, Knobs, TaskSpec, TruncationPolicy};

/// One task of a job.
pub struct TaskPlan {
    pub view: TaskView,
    pub env: EnvFactory,
    /// Environments kept for this task (a lease waits when all are held).
    pub envs: usize,
    pub env_call_timeout: Duration,
    /// The environment runs inside the bubblewrap sandbox (checked before the job starts).
    pub sandboxed: bool,
    /// Reward functions in the order the task names them.
    pub scorers: Vec<ScorerPlan>,
    pub max_turns: u32,
    pub max_tokens_per_turn: u32,
    /// Constrained decoding: the tokens the policy may sample.
    pub allowed_tokens: Option<Arc<[u32]>>,
    /// The share of a turn's context the next turn keeps as its prefix (1: append, 0: rewrite).
    pub context_keep: f64,
    /// The trajectory's context budget, and whether truncated trajectories train.
    pub max_context: Option<usize>,
    pub train_truncated: bool,
    /// What a turn that would not fit the context does.
    pub truncation: actors::episode::Truncation,
    /// Agent tasks: how their episodes are played.
    pub agent: Option<crate::agents::AgentPlan>,
}

/// A reward function a task names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ScorerPlan {
    /// The environment's own reward, passed through.
    Env,
    /// A function of `reward.functions`.
    Function(String),
}

pub(super) fn plan(
    spec: &JobSpec,
    knobs: &Knobs,
    inputs: &[TaskInputs],
) -> Result<Vec<TaskPlan>, super::WiringError> {
    // The local pool's start control, shared by every local task.
    let local = spec.env_pools.iter().find(|p| p.is_local());
    let limits = EnvLimits {
        call_timeout: Duration::from_secs_f64(knobs.env_call_timeout_s),
        starts: actors::env::starts::StartCaps::new(
            local
                .and_then(|p| p.max_concurrent_starts)
                .map(|n| n as usize),
        ),
        warm: local.map_or(0, |p| p.warm as usize),
    };
    let remote = remote_pools(spec)?;
    // Task keys on env workers: unique to this run of these tasks.
    let run_key = infra::secret::new_token("")
        .map(|t| t[..16].to_string())
        .map_err(|_| super::WiringError::EnvPool {
            name: String::new(),
            why: "no system randomness for the task keys".into(),
        })?;
    spec.tasks
        .iter()
        .enumerate()
        .map(|(ti, t)| {
            let estimate = prior_tokens(t);
            let input = inputs
                .get(ti)
                .ok_or(super::WiringError::Unresolved { task: ti })?;
            let dataset = input.dataset.clone();
            if t.dataset.is_some() && dataset.is_none() {
                return Err(super::WiringError::Unresolved { task: ti });
            }
            let view = TaskView {
                dataset,
                domain: t.domain.clone(),
                weight: t.weight,
                group_size: t.group_size,
                redundancy: t.redundancy,
                seeds: t.seeds.map(|s| (s.start, s.count)),
                estimate,
                declared_pool: spec
                    .mapping
                    .declared
                    .get(&t.domain)
                    .or(spec.mapping.fallback.as_ref())
                    .and_then(|name| spec.pools.iter().position(|p| &p.name == name)),
            };
            let envs = t.envs.unwrap_or(knobs.max_concurrent_episodes).max(1);
            let env = task_env(
                t,
                (ti, envs),
                input,
                spec.seed ^ ((ti as u64) << 32),
                &limits,
                (&remote, &run_key, &spec.env_pools),
            )?;
            Ok(TaskPlan {
                view,
                env,
                envs,
                env_call_timeout: limits.call_timeout,
                sandboxed: sandboxed(t),
                agent: match &t.env {
                    EnvSpec::Agent(a) => Some(crate::agents::AgentPlan {
                        spec: a.clone(),
                        program: input.program.clone(),
                        remote: remote_agents(
                            t,
                            (ti, envs),
                            &limits,
                            (&remote, &run_key, &spec.env_pools),
                        ),
                    }),
                    _ => None,
                },
                scorers: t
                    .reward
                    .iter()
                    .map(|r| match r.as_str() {
                        "env" => ScorerPlan::Env,
                        name => ScorerPlan::Function(name.to_string()),
                    })
                    .collect(),
                max_turns: t.max_turns,
                max_tokens_per_turn: t.max_tokens_per_turn,
                allowed_tokens: t.allowed_tokens().map(Arc::from),
                context_keep: t.context.keep(),
                max_context: t.max_context_tokens.map(|m| m as usize),
                train_truncated: t.train_truncated,
                truncation: match t.truncation {
                    TruncationPolicy::End => actors::episode::Truncation::End,
                    TruncationPolicy::DropOldestTurns => {
                        actors::episode::Truncation::DropOldestTurns
                    }
                },
            })
        })
        .collect()
}

/// Prior per-trajectory token estimates for the cost model, from the task's environment;
/// observations replace them as trajectories finish.
pub fn prior_tokens(t: &TaskSpec) -> Tokens {
    // Built-in games: byte-level observations of the board each turn, short answers.
    let game = |turns: f64, obs: f64, resp: f64| {
        let turns = turns.min(t.max_turns as f64);
        Tokens::new(turns * obs, turns * resp.min(t.max_tokens_per_turn as f64))
    };
    match &t.env {
        EnvSpec::Frozenlake { size, .. } => {
            game(2.0 * *size as f64, (*size * *size * 2) as f64, 6.0)
        }
        EnvSpec::Sokoban { size, .. } => game(10.0, (*size * (*size + 1)) as f64, 6.0),
        EnvSpec::Arithmetic { .. } => game(1.0, 8.0, 4.0),
        EnvSpec::Tictactoe { .. } => game(4.0, 20.0, 2.0),
        EnvSpec::External { .. } | EnvSpec::Gymnasium { .. } => game(8.0, 64.0, 8.0),
        // A prompt of a few hundred tokens, a reasoning answer up to the turn's cap.
        EnvSpec::Prompt { .. } | EnvSpec::ReasoningGym { .. } => game(1.0, 200.0, 256.0),
        EnvSpec::Chat { .. } => game(3.0, 100.0, 256.0),
        // A few tool calls over a system prompt with the tools, each answer short.
        EnvSpec::Agent(_) => game(4.0, 150.0, 64.0),
        EnvSpec::Sim {
            turns,
            observation_tokens,
            prompt_tokens,
            response_tokens,
            difficulty,
            ..
        } => {
            // A prompt's difficulty scales its turns and answers (mean factor).
            let f = difficulty.as_ref().map_or(1.0, |d| d.mean().max(0.0));
            let turns = (turns.as_ref().map_or(1.0, |d| d.mean()) * f)
                .min(t.max_turns as f64)
                .max(1.0);
            let obs = observation_tokens.as_ref().map_or(64.0, |d| d.mean());
            let prompt = prompt_tokens.as_ref().map_or(obs, |d| d.mean());
            let resp = (response_tokens.as_ref().map_or(64.0, |d| d.mean()) * f)
                .min(t.max_tokens_per_turn as f64);
            // Turn k's answer attends to the prompt, k turns of history, and itself so far,
            // whichever way the context was prefilled.
            let context = prompt + (turns - 1.0) / 2.0 * (obs + resp) + resp / 2.0;
            // `append`: the prompt, then each later turn's observation (the history is
            // cached). `rewrite`: the whole context every turn (the prompt, then the grown
            // history). A kept share `f` re-prefills the rest, (1 − f) of the history.
            let rewrite = turns * prompt + (obs + resp) * turns * (turns - 1.0) / 2.0;
            let append = prompt + (turns - 1.0) * obs;
            let f = t.context.keep();
            let prefill = f * append + (1.0 - f) * rewrite;
            Tokens {
                prefill,
                decode: turns * resp,
                context,
            }
        }
    }
}

/// The job's env pools by name, each reaching its workers with the token in the service's
/// environment variable the pool names (none when it is unset).
fn remote_pools(
    spec: &JobSpec,
) -> Result<
    std::collections::BTreeMap<String, Arc<actors::env::remote::WorkerPool>>,
    super::WiringError,
> {
    spec.env_pools
        .iter()
        .filter(|p| !p.is_local())
        .map(|p| {
            let token = std::env::var(&p.token_env).ok().filter(|t| !t.is_empty());
            let membership = super::envs::membership(&p.workers);
            let pool =
                actors::env::remote::WorkerPool::new(actors::env::remote::WorkerPoolConfig {
                    name: p.name.clone(),
                    membership,
                    token,
                })
                .map_err(|e| super::WiringError::EnvPool {
                    name: p.name.clone(),
                    why: e.to_string(),
                })?;
            Ok((p.name.clone(), pool))
        })
        .collect()
}

/// The environment factory of task `ti`: its env pool's workers, or this machine.
fn task_env(
    t: &TaskSpec,
    (ti, envs): (usize, usize),
    input: &TaskInputs,
    seed_base: u64,
    limits: &EnvLimits,
    (remote, run_key, pools): (
        &std::collections::BTreeMap<String, Arc<actors::env::remote::WorkerPool>>,
        &str,
        &[crate::spec::EnvPoolSpec],
    ),
) -> Result<EnvFactory, super::WiringError> {
    let pool_starts = t
        .remote_pool()
        .and_then(|n| pools.iter().find(|p| p.name == n))
        .map_or((None, 0), |p| (p.max_concurrent_starts, p.warm));
    // An agent task's environments are slots here, wherever its programs run.
    let agent = matches!(t.env, EnvSpec::Agent(_));
    Ok(match t.remote_pool().and_then(|n| remote.get(n)) {
        Some(pool) if !agent => remote_factory(
            Arc::clone(pool),
            format!("{run_key}-{ti}"),
            &t.env,
            (seed_base, envs),
            (limits, pool_starts),
            t.inject_latency.as_ref(),
        ),
        _ => factory(
            &t.env,
            input.program.as_ref(),
            seed_base,
            limits,
            t.inject_latency.as_ref(),
            envs,
        )
        .ok_or(super::WiringError::Unresolved { task: ti })?,
    })
}

/// A managed agent task on an env pool: its task on the pool's workers (registered with
/// its agent spec) and where they reach the gateway.
fn remote_agents(
    t: &TaskSpec,
    (ti, envs): (usize, usize),
    limits: &EnvLimits,
    (remote, run_key, pools): (
        &std::collections::BTreeMap<String, Arc<actors::env::remote::WorkerPool>>,
        &str,
        &[crate::spec::EnvPoolSpec],
    ),
) -> Option<crate::agents::RemoteAgents> {
    let name = t.remote_pool()?;
    let pool = remote.get(name)?;
    let spec = pools.iter().find(|p| p.name == name)?;
    Some(crate::agents::RemoteAgents {
        task: remote_task(
            Arc::clone(pool),
            format!("{run_key}-{ti}"),
            &t.env,
            envs,
            limits,
            (spec.max_concurrent_starts, spec.warm),
        ),
        gateway_url: spec.gateway_url.clone(),
    })
}

/// Whether the task's environment runs in this machine's sandbox (checked before the job
/// starts); a worker checks its own.
fn sandboxed(t: &TaskSpec) -> bool {
    if t.remote_pool().is_some() {
        return false;
    }
    matches!(
        t.env,
        EnvSpec::External {
            sandbox: EnvSandbox::Bwrap,
            ..
        } | EnvSpec::ReasoningGym {
            sandbox: EnvSandbox::Bwrap,
            ..
        } | EnvSpec::Gymnasium {
            sandbox: EnvSandbox::Bwrap,
            ..
        }
    ) || matches!(&t.env, EnvSpec::Agent(a)
            if a.mode == crate::spec::AgentMode::Managed && a.sandbox == EnvSandbox::Bwrap)
}
