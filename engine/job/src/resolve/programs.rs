//! Environment programs: an external environment's command line with its relative paths
//! made absolute, and the bridged environments' (reasoning-gym, gymnasium) embedded scripts
//! written out and run by an interpreter that was asked where it lives.

use std::path::{Path, PathBuf};

use crate::spec::{EnvSandbox, EnvSpec};

use super::{EnvProgram, Host};

/// The program of an external or bridged environment (`None` for the others).
pub(super) fn program(env: &EnvSpec, host: &Host<'_>) -> std::io::Result<Option<EnvProgram>> {
    match env {
        EnvSpec::External {
            command,
            sandbox,
            readable_paths,
            ..
        } => Ok(Some(user_program(command, *sandbox, readable_paths, host))),
        EnvSpec::ReasoningGym { .. } | EnvSpec::Gymnasium { .. } => {
            bridge_command(env, host).map(Some)
        }
        EnvSpec::Agent(a) if a.mode == crate::spec::AgentMode::Managed => {
            Ok(Some(agent_command(a, host)))
        }
        _ => Ok(None),
    }
}

/// A managed agent's command line, as [`user_program`].
fn agent_command(a: &crate::spec::AgentEnv, host: &Host<'_>) -> EnvProgram {
    user_program(&a.command, a.sandbox, &a.readable_paths, host)
}

/// A user's program (an external environment, a managed agent) as the sandbox runs it: its
/// relative paths made absolute, and a Python interpreter (`python…` as the program) asked
/// where it lives, so the sandbox can bind its installation (a virtual environment's
/// packages, gymnasium in a pyenv under a hidden home, the agent's SDK) as it does for the
/// bridges.
fn user_program(
    command: &[String],
    sandbox: EnvSandbox,
    readable_paths: &[String],
    host: &Host<'_>,
) -> EnvProgram {
    let mut command = absolute_args(command, host.cwd.as_deref());
    let mut readable = readable_paths.to_vec();
    let is_python = Path::new(&command[0])
        .file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with("python"));
    if sandbox == EnvSandbox::Bwrap && is_python {
        let (exe, dirs) = interpreter(&command[0]);
        command[0] = exe;
        readable.extend(dirs);
    }
    EnvProgram {
        command,
        sandbox,
        readable,
    }
}

/// Arguments that name an existing file or directory relative to `base` (the service's
/// working directory), made absolute: the sandbox runs the program elsewhere (in a private
/// `/tmp`) and binds only the directories of absolute paths. Arguments after the program
/// that name an existing path have their directories' links resolved (the sandbox binds
/// the real directory, so `envs/` linked elsewhere or a script under `/tmp` is found
/// there); a file keeps its own name (a virtual environment's `bin/python` is a link whose
/// target would leave the environment). As given without a base.
pub fn absolute_args(command: &[String], base: Option<&Path>) -> Vec<String> {
    match base {
        Some(d) => absolute_args_in(command, d),
        None => command
            .iter()
            .enumerate()
            .map(|(i, a)| resolved_arg(i, a, None))
            .collect(),
    }
}

/// [`absolute_args`] relative to `base`.
pub fn absolute_args_in(command: &[String], base: &Path) -> Vec<String> {
    command
        .iter()
        .enumerate()
        .map(|(i, a)| resolved_arg(i, a, Some(base)))
        .collect()
}

/// One argument of [`absolute_args`].
fn resolved_arg(i: usize, a: &str, base: Option<&Path>) -> String {
    let p = Path::new(a);
    let pathlike = i > 0 || a.contains('/');
    if !pathlike || a.is_empty() || a.starts_with('-') {
        return a.to_string();
    }
    let abs = match base {
        Some(b) if p.is_relative() => b.join(p),
        _ => p.to_path_buf(),
    };
    if !abs.is_absolute() || !abs.exists() {
        return a.to_string();
    }
    if i > 0
        && let Some(real) = real_dirs(&abs)
    {
        return real.to_string_lossy().into_owned();
    }
    abs.to_string_lossy().into_owned()
}

/// `path` with the links of its directories resolved: a directory whole, a file through its
/// parent, keeping its own name (a virtual environment's `bin/python` or a cache's
/// `snapshots/…/model.gguf` is itself a link whose target would lose its meaning).
fn real_dirs(path: &Path) -> Option<PathBuf> {
    if path.is_dir() {
        return std::fs::canonicalize(path).ok();
    }
    let parent = std::fs::canonicalize(path.parent()?).ok()?;
    Some(parent.join(path.file_name()?))
}

const REASONING_GYM_BRIDGE: &str = include_str!("../../../../envs/reasoning_gym_bridge.py");
const GYMNASIUM_BRIDGE: &str = include_str!("../../../../envs/gymnasium_bridge.py");

/// Writes an embedded bridge script (once per content) under `scratch` and returns its path.
fn bridge_script(scratch: &Path, name: &str, text: &str) -> std::io::Result<PathBuf> {
    let digest = ring::digest::digest(&ring::digest::SHA256, text.as_bytes());
    let tag: String = digest.as_ref()[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let dir = scratch.join(format!("rollarc-envs-{tag}"));
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
    host: &Host<'_>,
    (name, text): (&str, &str),
    python: &str,
    sandbox: EnvSandbox,
    readable_paths: &[String],
) -> std::io::Result<(Vec<String>, Vec<String>)> {
    let script = bridge_script(&host.scratch, name, text)?;
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
fn bridge_command(spec: &EnvSpec, host: &Host<'_>) -> std::io::Result<EnvProgram> {
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
            processes: _,
        } => {
            let (mut cmd, readable) = script_command(
                host,
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
            Ok(EnvProgram {
                command: cmd,
                sandbox: *sandbox,
                readable,
            })
        }
        EnvSpec::Gymnasium {
            id,
            kwargs,
            python_path,
            python,
            sandbox,
            readable_paths,
            processes: _,
        } => {
            let (mut cmd, mut readable) = script_command(
                host,
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
                let abs = absolute_args(&["-".into(), d.clone()], host.cwd.as_deref())
                    .pop()
                    .unwrap_or_default();
                cmd.extend(["--path".into(), abs.clone()]);
                readable.push(abs);
            }
            Ok(EnvProgram {
                command: cmd,
                sandbox: *sandbox,
                readable,
            })
        }
        _ => Err(std::io::Error::other("not a bridged environment")),
    }
}
