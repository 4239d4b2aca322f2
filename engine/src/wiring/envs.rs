//! Builds environments from their spec: simulated, built-in games, or external programs over
//! the protocol.

use std::sync::Arc;
use std::time::Duration;

use actors::env::builtin::InvalidAction;
use actors::env::builtin::arithmetic::{Arithmetic, ArithmeticConfig};
use actors::env::builtin::frozenlake::{FrozenLake, FrozenLakeConfig};
use actors::env::builtin::sokoban::{Sokoban, SokobanConfig};
use actors::env::builtin::tictactoe::{TicTacToe, TicTacToeConfig};
use actors::env::delayed::Delayed;
use actors::env::external::{ExternalConfig, ExternalEnv};
use actors::env::sim::{SimEnv, SimEnvConfig};
use actors::env::{DynEnvironment, EnvFactory};

use crate::spec::{EnvSandbox, EnvSpec, InjectLatency};

pub use infra::sandbox::{
    SANDBOX_LIMITS, SANDBOX_UID_BASE, SANDBOX_UIDS, check_sandbox, sandboxed,
};

/// Limits every environment call of a job obeys.
#[derive(Clone, Copy, Debug)]
pub struct EnvLimits {
    pub call_timeout: Duration,
}

/// A factory of environments for one task; `seed_base` makes simulated ones differ per index.
/// With `inject`, every environment sleeps a sampled extra latency inside each reset and step
/// (so the environment is busy for it, as a slow one would be).
pub fn factory(
    spec: &EnvSpec,
    seed_base: u64,
    limits: &EnvLimits,
    inject: Option<&InjectLatency>,
) -> EnvFactory {
    let inner = base_factory(spec, seed_base, limits);
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

fn base_factory(spec: &EnvSpec, seed_base: u64, limits: &EnvLimits) -> EnvFactory {
    match spec {
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
        } => {
            let d = SimEnvConfig::default();
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
            };
            Arc::new(move |i| {
                Box::new(SimEnv::new(
                    cfg.clone(),
                    seed_base ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15),
                ))
            })
        }
        EnvSpec::External {
            command,
            max_message_bytes,
            sandbox,
            readable_paths,
        } => {
            let command = match sandbox {
                EnvSandbox::None => command.clone(),
                EnvSandbox::Bwrap => sandboxed(command, readable_paths),
            };
            let cfg = ExternalConfig {
                command,
                call_timeout: limits.call_timeout,
                max_message_bytes: *max_message_bytes,
                workdir: None,
            };
            Arc::new(move |_| Box::new(ExternalEnv::new(cfg.clone())))
        }
        other => {
            let other = other.clone();
            Arc::new(move |_| {
                builtin(&other)
                    .unwrap_or_else(|| Box::new(FrozenLake::new(FrozenLakeConfig::default())))
            })
        }
    }
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
        EnvSpec::Sim { .. } | EnvSpec::External { .. } => return None,
    })
}
