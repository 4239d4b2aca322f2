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
use actors::env::external::{ExternalConfig, ExternalEnv};
use actors::env::sim::{SimEnv, SimEnvConfig};
use actors::env::{DynEnvironment, EnvFactory};

use crate::spec::{EnvSandbox, EnvSpec, InjectLatency, VerifierSpec};

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
            difficulty,
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
                difficulty: difficulty.clone(),
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
            protocol,
            ..
        } => external(
            &absolute_args(command),
            *sandbox,
            readable_paths,
            *max_message_bytes,
            *protocol,
            limits,
        ),
        EnvSpec::ReasoningGym { .. } | EnvSpec::Gymnasium { .. } => {
            match bridge_command(spec) {
                Ok((command, sandbox, readable)) => external(
                    &command,
                    sandbox,
                    &readable,
                    actors::env::protocol::MAX_MESSAGE_BYTES,
                    actors::env::protocol::PROTOCOL_V2,
                    limits,
                ),
                Err(e) => {
                    // Every environment reports why it cannot start (the job fails with it).
                    let why = format!("cannot write the environment bridge: {e}");
                    let cfg = ExternalConfig {
                        command: vec![
                            "sh".into(),
                            "-c".into(),
                            format!("echo {why:?} >&2; exit 1"),
                        ],
                        call_timeout: limits.call_timeout,
                        max_message_bytes: actors::env::protocol::MAX_MESSAGE_BYTES,
                        workdir: None,
                        protocol: 1,
                    };
                    Arc::new(move |_| Box::new(ExternalEnv::new(cfg.clone())))
                }
            }
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

fn external(
    command: &[String],
    sandbox: EnvSandbox,
    readable: &[String],
    max_message_bytes: usize,
    protocol: u32,
    limits: &EnvLimits,
) -> EnvFactory {
    let command = match sandbox {
        EnvSandbox::None => command.to_vec(),
        EnvSandbox::Bwrap => sandboxed(command, readable),
    };
    let cfg = ExternalConfig {
        command,
        call_timeout: limits.call_timeout,
        max_message_bytes,
        workdir: None,
        protocol,
    };
    Arc::new(move |_| Box::new(ExternalEnv::new(cfg.clone())))
}

/// Arguments that name an existing file or directory relative to the service's working
/// directory, made absolute: the sandbox runs the program elsewhere (in a private `/tmp`) and
/// binds only the directories of absolute paths.
pub fn absolute_args(command: &[String]) -> Vec<String> {
    match std::env::current_dir() {
        Ok(d) => absolute_args_in(command, &d),
        Err(_) => command.to_vec(),
    }
}

/// [`absolute_args`] relative to `base`.
pub fn absolute_args_in(command: &[String], base: &std::path::Path) -> Vec<String> {
    command
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let p = std::path::Path::new(a);
            let pathlike = i > 0 || a.contains('/');
            let abs = base.join(p);
            if pathlike && !a.is_empty() && !a.starts_with('-') && p.is_relative() && abs.exists() {
                abs.to_string_lossy().into_owned()
            } else {
                a.clone()
            }
        })
        .collect()
}

const REASONING_GYM_BRIDGE: &str = include_str!("../../../../envs/reasoning_gym_bridge.py");
const GYMNASIUM_BRIDGE: &str = include_str!("../../../../envs/gymnasium_bridge.py");

/// Writes an embedded bridge script (once per content) under the temporary directory and
/// returns its path.
fn bridge_script(name: &str, text: &str) -> std::io::Result<std::path::PathBuf> {
    let digest = ring::digest::digest(&ring::digest::SHA256, text.as_bytes());
    let tag: String = digest.as_ref()[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let dir = std::env::temp_dir().join(format!("rollarc-envs-{tag}"));
    let path = dir.join(name);
    if std::fs::read_to_string(&path).is_ok_and(|t| t == text) {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir)?;
    // Written aside and renamed: another job may be reading the script right now.
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, &path)?;
    Ok(path)
}

/// A Python interpreter as a sandbox needs it: its real executable (not a shim or a symlink
/// into a hidden home) and the directories of its installation (a virtual environment's and
/// its base's), read-only. Asked of the interpreter itself; as given if it cannot answer.
fn interpreter(python: &str) -> (String, Vec<String>) {
    let probe = std::process::Command::new(python)
        .args([
            "-c",
            "import sys, json; print(json.dumps([sys.executable, sys.prefix, sys.base_prefix]))",
        ])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output();
    let parsed = probe
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| serde_json::from_slice::<Vec<String>>(&o.stdout).ok());
    match parsed.as_deref() {
        Some([exe, prefix, base]) if !exe.is_empty() => {
            let mut dirs = vec![prefix.clone()];
            if base != prefix {
                dirs.push(base.clone());
            }
            (exe.clone(), dirs)
        }
        _ => (python.to_string(), Vec::new()),
    }
}

/// `python SCRIPT` for an embedded bridge script (written out), and the host paths the
/// sandbox must make readable: the interpreter's installation (sandboxed) and the spec's.
fn script_command(
    (name, text): (&str, &str),
    python: &str,
    sandbox: EnvSandbox,
    readable_paths: &[String],
) -> std::io::Result<(Vec<String>, Vec<String>)> {
    let script = bridge_script(name, text)?;
    let (python, mut readable) = match sandbox {
        EnvSandbox::Bwrap => interpreter(python),
        EnvSandbox::None => (python.to_string(), Vec::new()),
    };
    readable.extend(readable_paths.iter().cloned());
    Ok((
        vec![python, script.to_string_lossy().into_owned()],
        readable,
    ))
}

/// The command line of a bridged environment (reasoning-gym, gymnasium): the embedded
/// script, written out, run by the spec's interpreter; with its sandbox and readable paths.
pub fn bridge_command(spec: &EnvSpec) -> std::io::Result<(Vec<String>, EnvSandbox, Vec<String>)> {
    match spec {
        EnvSpec::ReasoningGym {
            dataset,
            config,
            size,
            seed,
            answer,
            instruction,
            python,
            sandbox,
            readable_paths,
        } => {
            let (mut cmd, readable) = script_command(
                ("reasoning_gym_bridge.py", REASONING_GYM_BRIDGE),
                python,
                *sandbox,
                readable_paths,
            )?;
            cmd.extend([
                dataset.clone(),
                "--config".into(),
                serde_json::Value::Object(config.clone()).to_string(),
                "--size".into(),
                size.to_string(),
                "--seed".into(),
                seed.to_string(),
                "--answer".into(),
                answer.as_str().into(),
            ]);
            if let Some(i) = instruction {
                cmd.extend(["--instruction".into(), i.clone()]);
            }
            Ok((cmd, *sandbox, readable))
        }
        EnvSpec::Gymnasium {
            id,
            kwargs,
            python_path,
            python,
            sandbox,
            readable_paths,
        } => {
            let (mut cmd, mut readable) = script_command(
                ("gymnasium_bridge.py", GYMNASIUM_BRIDGE),
                python,
                *sandbox,
                readable_paths,
            )?;
            cmd.extend([
                id.clone(),
                "--kwargs".into(),
                serde_json::Value::Object(kwargs.clone()).to_string(),
            ]);
            for d in python_path {
                let abs = absolute_args(&["-".into(), d.clone()])
                    .pop()
                    .unwrap_or_default();
                cmd.extend(["--path".into(), abs.clone()]);
                readable.push(abs);
            }
            Ok((cmd, *sandbox, readable))
        }
        _ => Err(std::io::Error::other("not a bridged environment")),
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
        | EnvSpec::Gymnasium { .. } => return None,
    })
}
