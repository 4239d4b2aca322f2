//! Builds environments from their spec: simulated, built-in games, or external programs over
//! the protocol.

use std::sync::Arc;
use std::time::Duration;

use actors::env::builtin::InvalidAction;
use actors::env::builtin::arithmetic::{Arithmetic, ArithmeticConfig};
use actors::env::builtin::dataset::{DatasetEnv, DatasetEnvConfig, Verifier};
use actors::env::builtin::frozenlake::{FrozenLake, FrozenLakeConfig};
use actors::env::builtin::sokoban::{Sokoban, SokobanConfig};
use actors::env::builtin::tictactoe::{TicTacToe, TicTacToeConfig};
use actors::env::delayed::Delayed;
use actors::env::external::{ExternalConfig, ExternalEnv, ExternalStarts};
use actors::env::mux::{MuxConfig, MuxGroup};
use actors::env::sim::{SimEnv, SimEnvConfig};
use actors::env::{DynEnvironment, EnvFactory};

use crate::resolve::EnvProgram;
use crate::spec::{EnvSandbox, EnvSpec, InjectLatency, VerifierSpec};

pub use infra::sandbox::{
    SANDBOX_CPU_S, SANDBOX_LIMITS, SANDBOX_UID_BASE, SANDBOX_UIDS, check_sandbox, sandboxed,
    sandboxed_shared,
};

/// Limits every environment call of a job obeys, and how its programs start.
#[derive(Clone, Debug)]
pub struct EnvLimits {
    pub call_timeout: Duration,
    /// Caps every program start passes (`max_concurrent_starts`).
    pub starts: actors::env::starts::StartCaps,
    /// Programs each task keeps started ahead (protocols 1 and 2).
    pub warm: usize,
}

impl EnvLimits {
    /// Calls bounded by `call_timeout`; no start control.
    pub fn calls(call_timeout: Duration) -> Self {
        Self {
            call_timeout,
            starts: Default::default(),
            warm: 0,
        }
    }
}

/// A factory of environments for one task; `seed_base` makes simulated ones differ per index.
/// With `inject`, every environment sleeps a sampled extra latency inside each reset and step
/// (so the environment is busy for it, as a slow one would be). External and bridged
/// environments run their resolved `program`: `None` when they have none. `slots` is the
/// task's number of environments (what a multiplexed program's processes share).
pub fn factory(
    spec: &EnvSpec,
    program: Option<&EnvProgram>,
    seed_base: u64,
    limits: &EnvLimits,
    inject: Option<&InjectLatency>,
    slots: usize,
) -> Option<EnvFactory> {
    let inner = base_factory(spec, program, seed_base, limits, slots)?;
    Some(with_latency(inner, seed_base, inject))
}

/// A factory of environments hosted by `pool`'s env workers for the task `key` (unique to
/// this run of the task), with injected latency as [`factory`]; the pool's
/// `max_concurrent_starts` and `warm` go to each worker with the task.
pub fn remote_factory(
    pool: Arc<actors::env::remote::WorkerPool>,
    key: String,
    spec: &EnvSpec,
    (seed_base, slots): (u64, usize),
    (limits, starts): (&EnvLimits, (Option<u32>, u32)),
    inject: Option<&InjectLatency>,
) -> EnvFactory {
    let task = remote_task(pool, key, spec, slots, limits, starts);
    let inner: EnvFactory = Arc::new(move |i| Box::new(task.env(i)));
    with_latency(inner, seed_base, inject)
}

/// The task `key` (unique to this run of the task) on `pool`'s workers: its environment
/// `spec`, `slots` and call timeout, and the pool's `max_concurrent_starts` and `warm`, sent
/// to each worker with the task.
pub fn remote_task(
    pool: Arc<actors::env::remote::WorkerPool>,
    key: String,
    spec: &EnvSpec,
    slots: usize,
    limits: &EnvLimits,
    (max_concurrent_starts, warm): (Option<u32>, u32),
) -> Arc<actors::env::remote::RemoteTask> {
    let mut registration = serde_json::json!({
        "env": spec,
        "call_timeout_s": limits.call_timeout.as_secs_f64(),
        "slots": slots,
    });
    // The pool's start control, applied by each worker to this task.
    if let Some(n) = max_concurrent_starts {
        registration["max_concurrent_starts"] = n.into();
    }
    if warm > 0 {
        registration["warm"] = warm.into();
    }
    actors::env::remote::RemoteTask::new(pool, key, registration, limits.call_timeout)
}

/// Where a pool's members come from: a fixed list, a DNS name looked up every `refresh_s`,
/// or Kubernetes EndpointSlices (checked spec).
pub fn membership(w: &crate::spec::WorkersSpec) -> actors::env::remote::Membership {
    use actors::env::remote::{KubeTarget, Membership};
    match (&w.kubernetes, w.dns_target()) {
        (Some(k), _) => Membership::Kubernetes(KubeTarget {
            api: k.api.clone(),
            namespace: k.namespace.clone(),
            label_selector: k.label_selector.clone(),
            port: k.port,
        }),
        (None, Some((host, port))) => Membership::Dns {
            host,
            port,
            nameserver: w.nameserver.as_deref().and_then(|n| n.parse().ok()),
            every: Duration::from_secs_f64(w.refresh_s.unwrap_or(crate::spec::DEFAULT_REFRESH_S)),
        },
        (None, None) => Membership::Urls(w.urls.clone()),
    }
}

/// `inner`, each environment sleeping a sampled extra latency in each reset and step.
fn with_latency(inner: EnvFactory, seed_base: u64, inject: Option<&InjectLatency>) -> EnvFactory {
    match inject {
        None => inner,
        Some(l) => {
            let l = l.clone();
            Arc::new(move |i| {
                let seed = seed_base ^ 0x1a7e_3c11 ^ i.wrapping_mul(0x2545_f491_4f6c_dd1d);
                Box::new(Delayed::new(
                    inner(i),
                    l.reset_s.clone(),
                    l.step_s.clone(),
                    seed,
                ))
            })
        }
    }
}

fn base_factory(
    spec: &EnvSpec,
    program: Option<&EnvProgram>,
    seed_base: u64,
    limits: &EnvLimits,
    slots: usize,
) -> Option<EnvFactory> {
    Some(match spec {
        EnvSpec::Sim {
            reset_latency_s,
            step_latency_s,
            turns,
            observation_tokens,
            prompt_tokens,
            response_tokens,
            success_rate,
            failure_probability,
            hang_probability,
            difficulty,
            sandbox,
        } => {
            let d = SimEnvConfig::default();
            // One machine per task, shared by all its sandboxes.
            let sandboxes = sandbox.as_ref().map(|s| {
                Arc::new(actors::env::sim::SimSandboxes::new(
                    s.cores,
                    s.max_concurrent_starts,
                    s.reset_cpu_s.clone(),
                    s.step_cpu_s.clone(),
                    s.warm,
                ))
            });
            let cfg = SimEnvConfig {
                reset_latency: reset_latency_s.clone().unwrap_or(d.reset_latency),
                step_latency: step_latency_s.clone().unwrap_or(d.step_latency),
                turns: turns.clone().unwrap_or(d.turns),
                observation_tokens: observation_tokens.clone().unwrap_or(d.observation_tokens),
                prompt_tokens: prompt_tokens.clone(),
                response_tokens: response_tokens.clone().unwrap_or(d.response_tokens),
                success_rate: *success_rate,
                failure_probability: *failure_probability,
                hang_probability: *hang_probability,
                difficulty: difficulty.clone(),
                sandboxes,
            };
            Arc::new(move |i| {
                Box::new(SimEnv::new(
                    cfg.clone(),
                    seed_base ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15),
                ))
            })
        }
        EnvSpec::External {
            max_message_bytes,
            protocol,
            processes,
            ..
        } => external(
            program?,
            *max_message_bytes,
            *protocol,
            (processes.unwrap_or(1), slots),
            limits,
        ),
        EnvSpec::ReasoningGym { processes, .. } | EnvSpec::Gymnasium { processes, .. } => external(
            program?,
            actors::env::protocol::MAX_MESSAGE_BYTES,
            actors::env::protocol::PROTOCOL_V3,
            (*processes, slots),
            limits,
        ),
        // An agent task's environment is only the slot its episode holds.
        EnvSpec::Agent(_) => Arc::new(|_| Box::new(actors::agent::AgentSlot)),
        other => {
            let other = other.clone();
            Arc::new(move |_| {
                builtin(&other)
                    .unwrap_or_else(|| Box::new(FrozenLake::new(FrozenLakeConfig::default())))
            })
        }
    })
}

/// Environments of a program: one process per environment (protocol 1 and 2), or
/// `processes` shared by the task's `slots` environments (protocol 3, each serving many
/// episodes; started on first use, each sandboxed once for the slots it serves).
fn external(
    program: &EnvProgram,
    max_message_bytes: usize,
    protocol: u32,
    (processes, slots): (usize, usize),
    limits: &EnvLimits,
) -> EnvFactory {
    if protocol >= actors::env::protocol::PROTOCOL_V3 {
        let processes = processes.clamp(1, slots.max(1));
        let command = match program.sandbox {
            EnvSandbox::None => program.command.clone(),
            EnvSandbox::Bwrap => sandboxed_shared(
                &program.command,
                &program.readable,
                slots.div_ceil(processes),
            ),
        };
        let group = MuxGroup::with_caps(
            MuxConfig {
                command,
                call_timeout: limits.call_timeout,
                max_message_bytes,
                workdir: None,
                processes,
            },
            limits.starts.clone(),
        );
        return Arc::new(move |i| Box::new(group.env(i)));
    }
    let command = match program.sandbox {
        EnvSandbox::None => program.command.clone(),
        EnvSandbox::Bwrap => sandboxed(&program.command, &program.readable),
    };
    let cfg = ExternalConfig {
        command,
        call_timeout: limits.call_timeout,
        max_message_bytes,
        workdir: None,
        protocol,
    };
    if limits.warm == 0 && !limits.starts.is_capped() {
        return Arc::new(move |_| Box::new(ExternalEnv::new(cfg.clone())));
    }
    let starts = ExternalStarts::new(cfg, limits.starts.clone(), limits.warm);
    Arc::new(move |_| Box::new(ExternalEnv::with_starts(Arc::clone(&starts))))
}

/// A built-in game from its spec (`None` for simulated and external environments).
pub fn builtin(spec: &EnvSpec) -> Option<Box<dyn DynEnvironment>> {
    let inv = |penalty: f64, end_episode: bool| InvalidAction {
        penalty,
        end_episode,
    };
    Some(match spec {
        EnvSpec::Frozenlake {
            size,
            slippery,
            random_map,
            invalid_penalty,
            end_on_invalid,
        } => Box::new(FrozenLake::new(FrozenLakeConfig {
            size: *size,
            slippery: *slippery,
            random_map: *random_map,
            invalid: inv(*invalid_penalty, *end_on_invalid),
        })),
        EnvSpec::Sokoban {
            size,
            boxes,
            scramble,
            invalid_penalty,
            end_on_invalid,
        } => Box::new(Sokoban::new(SokobanConfig {
            size: *size,
            boxes: *boxes,
            scramble: *scramble,
            invalid: inv(*invalid_penalty, *end_on_invalid),
        })),
        EnvSpec::Arithmetic { max_operand, ops } => Box::new(Arithmetic::new(ArithmeticConfig {
            max_operand: *max_operand,
            ops: ops.chars().collect(),
        })),
        EnvSpec::Tictactoe {
            opponent_first,
            invalid_penalty,
            end_on_invalid,
        } => Box::new(TicTacToe::new(TicTacToeConfig {
            opponent_first: *opponent_first,
            invalid: inv(*invalid_penalty, *end_on_invalid),
        })),
        EnvSpec::Prompt { verifier } | EnvSpec::Chat { verifier } => {
            Box::new(DatasetEnv::new(DatasetEnvConfig {
                multi_turn: matches!(spec, EnvSpec::Chat { .. }),
                verifier: match verifier {
                    VerifierSpec::Math => Verifier::Math,
                    VerifierSpec::Exact => Verifier::Exact,
                    VerifierSpec::None => Verifier::None,
                },
            }))
        }
        EnvSpec::Sim { .. }
        | EnvSpec::External { .. }
        | EnvSpec::ReasoningGym { .. }
        | EnvSpec::Gymnasium { .. }
        | EnvSpec::Agent(_) => return None,
    })
}
