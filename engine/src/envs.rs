//! Builds environments from their spec: simulated, built-in games, or external programs over
//! the protocol.

use std::sync::Arc;
use std::time::Duration;

use actors::env::builtin::InvalidAction;
use actors::env::builtin::arithmetic::{Arithmetic, ArithmeticConfig};
use actors::env::builtin::frozenlake::{FrozenLake, FrozenLakeConfig};
use actors::env::builtin::sokoban::{Sokoban, SokobanConfig};
use actors::env::builtin::tictactoe::{TicTacToe, TicTacToeConfig};
use actors::env::external::{ExternalConfig, ExternalEnv};
use actors::env::sim::{SimEnv, SimEnvConfig};
use actors::env::{DynEnvironment, EnvFactory};

use crate::spec::{EnvSpec, SandboxMode};

/// Resource limits of sandboxed environment programs (applied with `prlimit`; the process
/// count is per uid, and every sandbox runs under its own uid, so it caps a fork bomb without
/// starving the other sandboxes).
pub const SANDBOX_LIMITS: [&str; 5] = ["--nproc=512", "--as=4294967296", "--cpu=600", "--fsize=104857600", "--nofile=256"];
/// Sandboxes run as unprivileged uids (and gids) `SANDBOX_UID_BASE + k`, k cycling through
/// `SANDBOX_UIDS` values: no account, no files on the host, one uid per live sandbox.
pub const SANDBOX_UID_BASE: u32 = 2_000_000;
pub const SANDBOX_UIDS: u32 = 65_536;
static NEXT_SANDBOX: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Wraps a command in bubblewrap and setpriv: new network, PID, IPC and UTS namespaces (no
/// network at all), the system read-only, a private writable `/tmp` as working directory, host
/// homes hidden except `readable` paths (bound read-only, e.g. an interpreter's install),
/// killed with its parent; then the uid drops to an unprivileged one with no new privileges;
/// rlimits on processes, address space, CPU time, file size and open files.
pub fn sandboxed(command: &[String], readable: &[String]) -> Vec<String> {
    let mut v: Vec<String> = vec!["prlimit".into()];
    v.extend(SANDBOX_LIMITS.iter().map(|s| s.to_string()));
    v.push("--".into());
    let s = |x: &str| x.to_string();
    v.extend(
        [
            "bwrap",
            "--unshare-net",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent",
            "--new-session",
            "--ro-bind",
            "/",
            "/",
            "--dev",
            "/dev",
            "--proc",
            "/proc",
            "--perms",
            "1777",
            "--tmpfs",
            "/tmp",
            "--tmpfs",
            "/root",
            "--tmpfs",
            "/home",
        ]
        .map(s),
    );
    for p in readable {
        v.extend([s("--ro-bind"), p.clone(), p.clone()]);
    }
    v.extend(["--chdir", "/tmp", "--setenv", "HOME", "/tmp", "--setenv", "OPENBLAS_NUM_THREADS", "1", "--"].map(s));
    let uid = SANDBOX_UID_BASE + NEXT_SANDBOX.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % SANDBOX_UIDS;
    v.extend(["setpriv", &format!("--reuid={uid}"), &format!("--regid={uid}"), "--clear-groups", "--no-new-privs", "--"].map(s));
    v.extend(command.iter().cloned());
    v
}

/// Whether the sandbox can be set up here: `bwrap` and `prlimit` are installed and bubblewrap
/// can create its namespaces.
pub fn check_sandbox() -> Result<(), String> {
    let probe = sandboxed(&["true".to_string()], &[]);
    let ok = std::process::Command::new(&probe[0]).args(&probe[1..]).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).status();
    match ok {
        Ok(s) if s.success() => {}
        Ok(s) => return Err(format!("bubblewrap cannot create its namespaces here ({s}); set env.sandbox = \"none\" to run without isolation")),
        Err(e) => return Err(format!("the sandbox needs prlimit, bubblewrap and setpriv ({e}); install them (make setup does) or set env.sandbox = \"none\"")),
    }
    Ok(())
}

/// Limits every environment call of a job obeys.
#[derive(Clone, Copy, Debug)]
pub struct EnvLimits {
    pub call_timeout: Duration,
}

/// A factory of environments for one task; `seed_base` makes simulated ones differ per index.
pub fn factory(spec: &EnvSpec, seed_base: u64, limits: &EnvLimits) -> EnvFactory {
    match spec {
        EnvSpec::Sim { reset_latency_s, step_latency_s, turns, observation_tokens, response_tokens, success_rate, failure_probability, hang_probability } => {
            let d = SimEnvConfig::default();
            let cfg = SimEnvConfig {
                reset_latency: reset_latency_s.clone().unwrap_or(d.reset_latency),
                step_latency: step_latency_s.clone().unwrap_or(d.step_latency),
                turns: turns.clone().unwrap_or(d.turns),
                observation_tokens: observation_tokens.clone().unwrap_or(d.observation_tokens),
                response_tokens: response_tokens.clone().unwrap_or(d.response_tokens),
                success_rate: *success_rate,
                failure_probability: *failure_probability,
                hang_probability: *hang_probability,
            };
            Arc::new(move |i| Box::new(SimEnv::new(cfg.clone(), seed_base ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15))))
        }
        EnvSpec::External { command, max_message_bytes, sandbox, readable_paths } => {
            let command = match sandbox {
                SandboxMode::None => command.clone(),
                SandboxMode::Bwrap => sandboxed(command, readable_paths),
            };
            let cfg = ExternalConfig { command, call_timeout: limits.call_timeout, max_message_bytes: *max_message_bytes, workdir: None };
            Arc::new(move |_| Box::new(ExternalEnv::new(cfg.clone())))
        }
        other => {
            let other = other.clone();
            Arc::new(move |_| builtin(&other).unwrap_or_else(|| Box::new(FrozenLake::new(FrozenLakeConfig::default()))))
        }
    }
}

/// A built-in game from its spec (`None` for simulated and external environments).
pub fn builtin(spec: &EnvSpec) -> Option<Box<dyn DynEnvironment>> {
    let inv = |penalty: f64, end_episode: bool| InvalidAction { penalty, end_episode };
    Some(match spec {
        EnvSpec::Frozenlake { size, slippery, random_map, invalid_penalty, end_on_invalid } => Box::new(FrozenLake::new(FrozenLakeConfig {
            size: *size,
            slippery: *slippery,
            random_map: *random_map,
            invalid: inv(*invalid_penalty, *end_on_invalid),
        })),
        EnvSpec::Sokoban { size, boxes, scramble, invalid_penalty, end_on_invalid } => {
            Box::new(Sokoban::new(SokobanConfig { size: *size, boxes: *boxes, scramble: *scramble, invalid: inv(*invalid_penalty, *end_on_invalid) }))
        }
        EnvSpec::Arithmetic { max_operand, ops } => Box::new(Arithmetic::new(ArithmeticConfig { max_operand: *max_operand, ops: ops.chars().collect() })),
        EnvSpec::Tictactoe { opponent_first, invalid_penalty, end_on_invalid } => {
            Box::new(TicTacToe::new(TicTacToeConfig { opponent_first: *opponent_first, invalid: inv(*invalid_penalty, *end_on_invalid) }))
        }
        EnvSpec::Sim { .. } | EnvSpec::External { .. } => return None,
    })
}
