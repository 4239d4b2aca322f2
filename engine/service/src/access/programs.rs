//! The program policy applied to a job spec: the programs it would start, the host paths it
//! would make readable, and whether it would run outside the sandbox or call out over the
//! network.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use job::spec::{EnvSandbox, EnvSpec, FieldError, FunctionSpec, JobSpec, TaskSpec};

use super::ProgramPolicy;

/// One check of a spec against the policy: what the policy allows, and the refusals so far.
pub(super) struct ProgramCheck {
    /// The service has tokens: an absent policy entry denies instead of allowing.
    strict: bool,
    allow_unsandboxed: bool,
    allow_network: bool,
    allowed: Allowlist,
    readable: ReadableList,
    denied: Vec<FieldError>,
}

/// The program an environment starts, under which field, its sandbox and the host paths it
/// reads (`readable_paths`, and a gymnasium environment's `python_path`).
struct EnvProgram<'a> {
    program: &'a str,
    /// The whole command line (the program alone for the bridged environments).
    command: &'a [String],
    field: &'static str,
    sandbox: EnvSandbox,
    readable_paths: &'a [String],
    python_path: &'a [String],
}

impl ProgramCheck {
    /// The policy as it applies to a service with tokens (`strict`) or without.
    pub(super) fn new(policy: &ProgramPolicy, strict: bool) -> Self {
        Self {
            strict,
            allow_unsandboxed: policy.allow_unsandboxed.unwrap_or(!strict),
            allow_network: policy.allow_network_functions.unwrap_or(!strict),
            allowed: Allowlist::new(policy.executables.as_deref(), strict),
            readable: ReadableList::new(policy.readable_paths.as_deref(), strict),
            denied: Vec::new(),
        }
    }

    /// Every refusal for `spec`: its tasks' environments and datasets in task order, then its
    /// reward functions.
    pub(super) fn run(mut self, spec: &JobSpec) -> Vec<FieldError> {
        for (i, t) in spec.tasks.iter().enumerate() {
            self.task(i, t);
        }
        // A checkpoint is a host file (or directory) the job reads.
        for (i, p) in spec.pools.iter().enumerate() {
            if let Some(path) = p.backend.real_model().and_then(|m| m.path.as_deref())
                && !self.readable.permits(path)
            {
                self.deny(
                    format!("pools[{i}].backend.model.path"),
                    format!("the service does not allow reading {path:?}"),
                );
            }
        }
        for (name, f) in &spec.reward.functions {
            self.function(&format!("reward.functions.{name}"), f);
        }
        self.denied
    }

    /// Records one refusal.
    fn deny(&mut self, field: String, message: String) {
        self.denied.push(FieldError { field, message });
    }

    /// Refuses each of `paths` (field `at[j]`) that the policy does not let a spec make
    /// readable.
    fn readable_paths(&mut self, at: &str, paths: &[String]) {
        for (j, p) in paths.iter().enumerate() {
            if !self.readable.permits(p) {
                self.deny(
                    format!("{at}[{j}]"),
                    format!("the service does not allow making {p:?} readable in the sandbox"),
                );
            }
        }
    }

    /// Task `i`: the program its environment starts (with its sandbox and the paths it
    /// reads), and its dataset.
    fn task(&mut self, i: usize, t: &TaskSpec) {
        if let Some(env) = env_program(&t.env) {
            self.readable_paths(
                &format!("tasks[{i}].env.readable_paths"),
                env.readable_paths,
            );
            self.readable_paths(&format!("tasks[{i}].env.python_path"), env.python_path);
            if !self.allowed.permits(env.program) {
                self.deny(
                    format!("tasks[{i}].env.{}", env.field),
                    format!("the service does not allow running `{}`", env.program),
                );
            }
            // Every argument that names a host path binds its directory in the sandbox: the
            // same rule as `readable_paths` (the program itself is the allowlist's business).
            if env.sandbox == EnvSandbox::Bwrap {
                let cwd = std::env::current_dir().ok();
                let args = job::resolve::absolute_args(env.command, cwd.as_deref());
                for (j, a) in args.iter().enumerate().skip(1) {
                    if let Some(dir) = infra::sandbox::bound_by_argument(a)
                        && !self.readable.permits(&dir)
                    {
                        self.deny(
                            format!("tasks[{i}].env.{}[{j}]", env.field),
                            format!(
                                "the argument {:?} would make {dir:?} readable in the sandbox, \
                                 which the service does not allow",
                                env.command[j]
                            ),
                        );
                    }
                }
            }
            if env.sandbox == EnvSandbox::None && !self.allow_unsandboxed {
                self.deny(
                    format!("tasks[{i}].env.sandbox"),
                    "the service does not allow environments outside the sandbox".into(),
                );
            }
        }
        // An agent task's tokenizer is a host file the job reads.
        if let EnvSpec::Agent(a) = &t.env
            && let Some(tok) = &a.tokenizer
            && !self.readable.permits(tok)
        {
            self.deny(
                format!("tasks[{i}].env.tokenizer"),
                format!("the service does not allow reading {tok:?}"),
            );
        }
        // A dataset is a host file the job reads (and its rows reach the trajectories).
        if let Some(d) = &t.dataset
            && !self.readable.permits(&d.path)
        {
            self.deny(
                format!("tasks[{i}].dataset.path"),
                format!("the service does not allow reading {:?}", d.path),
            );
        }
    }

    /// The reward function at field `p`.
    fn function(&mut self, p: &str, f: &FunctionSpec) {
        match f {
            FunctionSpec::Command { command, env, .. } => self.command_function(p, command, env),
            FunctionSpec::Http { .. } if !self.allow_network => self.deny(
                format!("{p}.url"),
                "the service does not allow calling functions at arbitrary URLs".into(),
            ),
            FunctionSpec::Builtin {
                function, config, ..
            } if function == "judge" && !self.allow_network => {
                for key in ["endpoint", "api_key_env"] {
                    if config.as_ref().and_then(|c| c.get(key)).is_some() {
                        self.deny(
                            format!("{p}.config.{key}"),
                            "the service does not allow the judge to call out over the \
                             network"
                                .into(),
                        );
                    }
                }
            }
            FunctionSpec::Builtin {
                function, config, ..
            } if function == "code" => self.code_function(p, config.as_ref()),
            FunctionSpec::Builtin {
                function, config, ..
            } if function == "python" => {
                self.code_function(p, config.as_ref());
                if let Some(file) = config
                    .as_ref()
                    .and_then(|c| c.get("file"))
                    .and_then(|f| f.as_str())
                    && !self.readable.permits(file)
                {
                    self.deny(
                        format!("{p}.config.file"),
                        format!("the service does not allow reading {file:?}"),
                    );
                }
            }
            _ => {}
        }
    }

    /// A `command` function: its program, that it runs outside the sandbox, and the
    /// variables of its environment.
    fn command_function(&mut self, p: &str, command: &str, env: &BTreeMap<String, String>) {
        if !self.allowed.permits(command) {
            self.deny(
                format!("{p}.command"),
                format!("the service does not allow running `{command}`"),
            );
        }
        if !self.allow_unsandboxed {
            self.deny(
                format!("{p}.kind"),
                "`command` functions run outside the sandbox; the service does \
                 not allow that"
                    .into(),
            );
        }
        // Variables that choose which code runs: a listed program could load another.
        for k in env.keys() {
            if self.strict && (k == "PATH" || k.starts_with("LD_") || k.starts_with("PYTHON")) {
                self.deny(
                    format!("{p}.env.{k}"),
                    format!("the service does not allow setting {k}"),
                );
            }
        }
    }

    /// The `code` function: its interpreter, the paths it makes readable, its sandbox.
    fn code_function(&mut self, p: &str, cfg: Option<&serde_json::Value>) {
        let python = cfg
            .and_then(|c| c.get("python"))
            .and_then(|v| v.as_str())
            .unwrap_or("python3");
        if !self.allowed.permits(python) {
            self.deny(
                format!("{p}.config.python"),
                format!("the service does not allow running `{python}`"),
            );
        }
        let paths: Vec<String> = cfg
            .and_then(|c| c.get("readable_paths"))
            .and_then(|v| serde_json::from_value(v.clone()).ok())
            .unwrap_or_default();
        self.readable_paths(&format!("{p}.config.readable_paths"), &paths);
        let unsandboxed = cfg
            .and_then(|c| c.get("sandbox"))
            .is_some_and(|v| v == "none");
        if unsandboxed && !self.allow_unsandboxed {
            self.deny(
                format!("{p}.config.sandbox"),
                "the service does not allow code outside the sandbox".into(),
            );
        }
    }
}

/// The program an environment starts, if it starts one.
fn env_program(env: &EnvSpec) -> Option<EnvProgram<'_>> {
    match env {
        EnvSpec::External {
            command,
            sandbox,
            readable_paths,
            ..
        } => command.first().map(|program| EnvProgram {
            program,
            command,
            field: "command",
            sandbox: *sandbox,
            readable_paths,
            python_path: &[],
        }),
        EnvSpec::ReasoningGym {
            python,
            sandbox,
            readable_paths,
            ..
        } => Some(EnvProgram {
            program: python,
            command: std::slice::from_ref(python),
            field: "python",
            sandbox: *sandbox,
            readable_paths,
            python_path: &[],
        }),
        EnvSpec::Gymnasium {
            python,
            sandbox,
            readable_paths,
            python_path,
            ..
        } => Some(EnvProgram {
            program: python,
            command: std::slice::from_ref(python),
            field: "python",
            sandbox: *sandbox,
            readable_paths,
            python_path,
        }),
        EnvSpec::Agent(a) => a.command.first().map(|program| EnvProgram {
            program,
            command: &a.command,
            field: "command",
            sandbox: a.sandbox,
            readable_paths: &a.readable_paths,
            python_path: &[],
        }),
        _ => None,
    }
}

/// The executables of the policy, as written and as resolved files.
struct Allowlist {
    /// None: every program.
    names: Option<Vec<String>>,
    files: Vec<PathBuf>,
}

impl Allowlist {
    fn new(configured: Option<&[String]>, strict: bool) -> Self {
        let names = match configured {
            Some(list) => Some(list.to_vec()),
            None if strict => Some(Vec::new()),
            None => None,
        };
        let files = names
            .iter()
            .flatten()
            .filter_map(|n| resolve_program(n))
            .collect();
        Self { names, files }
    }

    fn permits(&self, program: &str) -> bool {
        let Some(names) = &self.names else {
            return true;
        };
        names.iter().any(|n| n == program)
            || resolve_program(program).is_some_and(|f| self.files.contains(&f))
    }
}

/// The directories of the policy a spec may make readable in the sandbox.
pub(super) struct ReadableList {
    /// None: any.
    dirs: Option<Vec<PathBuf>>,
}

impl ReadableList {
    pub(super) fn new(configured: Option<&[String]>, strict: bool) -> Self {
        let dirs = match configured {
            Some(list) => Some(
                list.iter()
                    .filter_map(|d| std::fs::canonicalize(d).ok())
                    .collect(),
            ),
            None if strict => Some(Vec::new()),
            None => None,
        };
        Self { dirs }
    }

    /// A path (resolved: `..` and symlinks cannot leave a listed directory) inside a listed
    /// directory. A path that does not exist is refused when a list applies.
    pub(super) fn permits(&self, path: &str) -> bool {
        let Some(dirs) = &self.dirs else {
            return true;
        };
        std::fs::canonicalize(path).is_ok_and(|p| dirs.iter().any(|d| p.starts_with(d)))
    }
}

/// The file a program name runs: a path as written (relative to the working directory), a
/// bare name through `PATH`; symlinks resolved.
fn resolve_program(program: &str) -> Option<PathBuf> {
    if program.contains('/') {
        return std::fs::canonicalize(program).ok();
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| is_executable(p))
        .and_then(|p| std::fs::canonicalize(p).ok())
}

/// A regular file with an execute bit.
fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
