//! Running Python: the interpreter's command line (sandboxed as configured, with a scrubbed
//! environment), the start-up probe, and one capped, time-limited run of a harness.

use std::time::Duration;

use infra::process::{CapturedOutput, ProcessError};

use super::config::{CodeConfig, SandboxMode};
use crate::text::tail_chars;

/// The longest the start-up probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(60);
/// Output of the probe kept for its error message.
const PROBE_OUTPUT_BYTES: usize = 64 * 1024;

/// Why the interpreter does not run where candidates will run.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("python {python:?} does not start")]
    Start {
        python: String,
        #[source]
        source: ProcessError,
    },
    #[error("python {python:?} does not run{hint} ({status}): {stderr}")]
    Fails {
        python: String,
        hint: &'static str,
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error("python {python:?} did not finish a no-op within {timeout:?}")]
    Hung { python: String, timeout: Duration },
}

/// The interpreter's command line, wrapped in the sandbox as configured, with a scrubbed
/// environment (the function's own variables, API keys included, stay out of reach).
pub(super) fn python_command(cfg: &CodeConfig, args: &[&str]) -> std::process::Command {
    let mut python = vec![cfg.python.clone(), "-I".into(), "-B".into()];
    python.extend(args.iter().map(|a| a.to_string()));
    let argv = match cfg.sandbox {
        SandboxMode::Bwrap => infra::sandbox::sandboxed(&python, &cfg.readable_paths),
        SandboxMode::None => python,
    };
    let mut cmd = std::process::Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .env_clear()
        .env(
            "PATH",
            std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into()),
        )
        .env("LC_ALL", "C.UTF-8");
    if cfg.sandbox == SandboxMode::None {
        // No private /tmp here: the system temporary directory, and HOME for version managers'
        // interpreter shims.
        cmd.current_dir(std::env::temp_dir());
        if let Some(home) = std::env::var_os("HOME") {
            cmd.env("HOME", home);
        }
    }
    cmd
}

/// Checks once, at start, that the interpreter runs where candidates will run.
pub(super) fn probe_python(cfg: &CodeConfig) -> Result<(), ProbeError> {
    let out = infra::process::run_capped_blocking(
        python_command(cfg, &["-c", "pass"]),
        None,
        PROBE_OUTPUT_BYTES,
        PROBE_TIMEOUT,
    )
    .map_err(|source| ProbeError::Start {
        python: cfg.python.clone(),
        source,
    })?;
    if out.timed_out {
        return Err(ProbeError::Hung {
            python: cfg.python.clone(),
            timeout: PROBE_TIMEOUT,
        });
    }
    if out.status.success() {
        return Ok(());
    }
    let hint = match cfg.sandbox {
        SandboxMode::Bwrap => {
            " in the sandbox (/root and /home are hidden there: put the interpreter's install in readable_paths)"
        }
        SandboxMode::None => "",
    };
    Err(ProbeError::Fails {
        python: cfg.python.clone(),
        hint,
        status: out.status,
        stderr: tail_chars(String::from_utf8_lossy(&out.stderr.data).trim(), 500),
    })
}

/// Runs one harness (fed through stdin) under the sandbox (or not), with the timeout and the
/// output caps; the whole process group is killed at the end.
pub(super) async fn run_harness(
    cfg: &CodeConfig,
    timeout: Duration,
    harness: String,
) -> Result<CapturedOutput, ProcessError> {
    let cmd = tokio::process::Command::from(python_command(cfg, &["-"]));
    infra::process::run_capped(
        cmd,
        Some(harness.into_bytes()),
        cfg.max_output_bytes,
        timeout,
    )
    .await
}

/// How a run ended, for the details.
pub(super) fn status_text(cfg: &CodeConfig, out: &CapturedOutput) -> String {
    if out.timed_out {
        format!("timed out after {} s, killed", cfg.timeout_s)
    } else {
        infra::process::describe_status(&out.status)
    }
}
