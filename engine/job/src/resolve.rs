//! The resolve step: everything between a validated spec and its plan that looks outside the
//! spec. It reads dataset files and checkpoint headers, the process environment and the
//! working directory, writes the environment bridges' scripts and asks Python interpreters
//! where they live. [`crate::spec`]'s validation and [`crate::wiring::plan`] do none of that:
//! they are pure functions of the spec (and of the [`Resolved`] inputs this step hands on).
//!
//! Two entry points:
//! - [`check`]: the cheap look at submission (a dataset's first row, a checkpoint's header),
//!   reported as field errors beside validation's ([`accept`] runs both);
//! - [`resolve`]: the full look when a job starts (datasets loaded, programs resolved).

mod programs;
#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::sync::Arc;

use infra::env::EnvSource;

use crate::dataset::{Dataset, DatasetError};
use crate::spec::{EnvSandbox, FieldError, Format, JobSpec, ModelShape, SpecErrors, TaskSpec};

pub use programs::{absolute_args, absolute_args_in};

/// The program of one environment (external or bridged; `None` for the others) as a job's
/// resolve step makes it: what `rollarc env-worker` runs for a task registered on it.
pub fn env_program(
    env: &crate::spec::EnvSpec,
    host: &Host<'_>,
) -> std::io::Result<Option<EnvProgram>> {
    programs::program(env, host)
}

/// What the resolve step reads of the process it runs in; tests hand in their own.
pub struct Host<'a> {
    /// Environment variables (`ROLLARC_XLLAMACPP_PYTHON`, `HOME`).
    pub vars: &'a dyn EnvSource,
    /// The directory relative program arguments are looked up in (the service's working
    /// directory); `None`: they stay as given.
    pub cwd: Option<PathBuf>,
    /// Where the bridges' scripts are written (the system's temporary directory).
    pub scratch: PathBuf,
}

impl Host<'static> {
    /// This process: its environment, working directory and temporary directory.
    pub fn process() -> Self {
        Host {
            vars: &infra::env::ProcessEnv,
            cwd: std::env::current_dir().ok(),
            scratch: std::env::temp_dir(),
        }
    }
}

/// A spec's outside inputs, in the order of the spec's lists.
#[derive(Debug, Default)]
pub struct Resolved {
    /// Per task of `tasks`.
    pub tasks: Vec<TaskInputs>,
    /// Per task of `eval.tasks`.
    pub eval_tasks: Vec<TaskInputs>,
    /// Per pool of `pools`: the shape of its real model (`None`: a simulated pool).
    pub shapes: Vec<Option<ModelShape>>,
    /// The Python with the `xllamacpp` wheel, for managed llama.cpp pools that name none.
    pub xllamacpp_python: String,
}

/// One task's outside inputs.
#[derive(Debug, Default)]
pub struct TaskInputs {
    pub dataset: Option<Arc<Dataset>>,
    /// The environment's program: external and bridged environments.
    pub program: Option<EnvProgram>,
}

/// The command line of an environment program, with its sandbox and the host paths the
/// sandbox makes readable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvProgram {
    pub command: Vec<String>,
    pub sandbox: EnvSandbox,
    pub readable: Vec<String>,
}

/// Why a job's outside inputs could not be resolved; `field` is the spec's dotted path.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("{field}")]
    Dataset {
        field: String,
        #[source]
        source: DatasetError,
    },
    #[error("{field}: cannot read the checkpoint")]
    Checkpoint {
        field: String,
        #[source]
        source: Box<actors::model::llm::LoadError>,
    },
    #[error("{field}: cannot write the environment bridge")]
    Bridge {
        field: String,
        #[source]
        source: std::io::Error,
    },
}

/// Parses and validates a spec (pure), then checks its outside inputs ([`check`]): what the
/// HTTP API and the CLI accept.
pub fn accept(body: &str, format: Format) -> Result<JobSpec, SpecErrors> {
    let mut spec = crate::spec::parse(body, format)?;
    crate::inputs::find_models(&mut spec, &crate::inputs::model_dirs());
    let errs = check(&spec);
    if errs.is_empty() {
        Ok(spec)
    } else {
        Err(SpecErrors(errs))
    }
}

/// The outside inputs a submission can be refused for, read cheaply: each dataset's first
/// row and each checkpoint's header. Every problem, with its field path.
pub fn check(spec: &JobSpec) -> Vec<FieldError> {
    let mut out = Vec::new();
    for (prefix, tasks) in spec.task_lists() {
        for (i, t) in tasks.iter().enumerate() {
            if let Some(d) = t.dataset.as_ref().filter(|d| !d.path.trim().is_empty())
                && let Err(e) = crate::dataset::check_first_row(d)
            {
                out.push(FieldError {
                    field: format!("{prefix}[{i}].dataset.{}", dataset_field(&e)),
                    message: infra::error_chain(&e),
                });
            }
        }
    }
    for (i, p) in spec.pools.iter().enumerate() {
        let Some(m) = p.backend.real_model() else {
            continue;
        };
        let Some(path) = &m.path else {
            continue;
        };
        let at = format!("pools[{i}].backend.model");
        match actors::model::llm::inspect(std::path::Path::new(path)) {
            Ok(cfg) => {
                if let Some(max) = m.max_seq
                    && max > cfg.context_length
                {
                    out.push(FieldError {
                        field: format!("{at}.max_seq"),
                        message: format!(
                            "the checkpoint was trained for {} tokens of context, got {max}",
                            cfg.context_length
                        ),
                    });
                }
                let precision = m.precision.unwrap_or_default();
                let rows = [cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.d_ff];
                if precision != actors::types::Precision::F32
                    && let Some(bad) = rows
                        .into_iter()
                        .find(|k| k % actors::model::llm::forward::QUANT_BLOCK != 0)
                {
                    out.push(FieldError {
                        field: format!("{at}.precision"),
                        message: format!(
                            "{precision} quantises rows in blocks of {} values; this checkpoint has matrices with rows of {bad}: use f32",
                            actors::model::llm::forward::QUANT_BLOCK
                        ),
                    });
                }
            }
            Err(e) => out.push(FieldError {
                field: format!("{at}.path"),
                message: infra::error_chain(&e),
            }),
        }
    }
    out
}

/// The dataset field a first-row error is about.
fn dataset_field(e: &DatasetError) -> &'static str {
    match e {
        DatasetError::UnknownFormat { .. } => "format",
        DatasetError::Row { message, .. }
            if message.contains("prompt_key") || message.contains("no prompt") =>
        {
            "prompt_key"
        }
        DatasetError::Row { message, .. } if message.contains("answer_key") => "answer_key",
        _ => "path",
    }
}

/// Loads and looks up everything the plan of `spec` needs from outside it.
pub fn resolve(spec: &JobSpec, host: &Host<'_>) -> Result<Resolved, ResolveError> {
    let eval = spec
        .eval
        .as_ref()
        .map(|e| e.tasks.as_slice())
        .unwrap_or(&[]);
    Ok(Resolved {
        tasks: tasks(spec, "tasks", &spec.tasks, host)?,
        eval_tasks: tasks(spec, "eval.tasks", eval, host)?,
        shapes: shapes(spec)?,
        xllamacpp_python: xllamacpp_python(host.vars),
    })
}

/// The models' part of [`resolve`] alone (no dataset, no program): what
/// [`crate::wiring::plan_trainer`] needs.
pub fn resolve_models(spec: &JobSpec, host: &Host<'_>) -> Result<Resolved, ResolveError> {
    Ok(Resolved {
        shapes: shapes(spec)?,
        xllamacpp_python: xllamacpp_python(host.vars),
        ..Resolved::default()
    })
}

fn shapes(spec: &JobSpec) -> Result<Vec<Option<ModelShape>>, ResolveError> {
    spec.pools
        .iter()
        .enumerate()
        .map(|(i, p)| {
            p.backend
                .real_model()
                .map(|m| {
                    m.choice()
                        .read_shape()
                        .map_err(|source| ResolveError::Checkpoint {
                            field: format!("pools[{i}].backend.model.path"),
                            source: Box::new(source),
                        })
                })
                .transpose()
        })
        .collect()
}

fn tasks(
    spec: &JobSpec,
    prefix: &str,
    tasks: &[TaskSpec],
    host: &Host<'_>,
) -> Result<Vec<TaskInputs>, ResolveError> {
    tasks
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let dataset = t
                .dataset
                .as_ref()
                .map(|d| Dataset::load(d, spec.seed).map(Arc::new))
                .transpose()
                .map_err(|source| ResolveError::Dataset {
                    field: format!("{prefix}[{i}].dataset"),
                    source,
                })?;
            let program =
                programs::program(&t.env, host).map_err(|source| ResolveError::Bridge {
                    field: format!("{prefix}[{i}].env"),
                    source,
                })?;
            Ok(TaskInputs { dataset, program })
        })
        .collect()
}

/// The default Python with the `xllamacpp` wheel: `ROLLARC_XLLAMACPP_PYTHON`, else where
/// `make setup` installs it.
pub fn xllamacpp_python(vars: &dyn EnvSource) -> String {
    vars.var("ROLLARC_XLLAMACPP_PYTHON").unwrap_or_else(|| {
        format!(
            "{}/.cache/rollarc/xllamacpp-venv/bin/python",
            vars.var("HOME").unwrap_or_default()
        )
    })
}
