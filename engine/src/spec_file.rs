//! Job files on the command line: TOML, JSON or YAML, with `--set` overrides.

use anyhow::{Context, bail};
use job::spec::{self, Format, JobSpec};

/// Whether a job file is YAML (by its extension).
fn is_yaml(file: &std::path::Path) -> bool {
    file.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("yaml") || e.eq_ignore_ascii_case("yml"))
}

/// A job file's text and format (TOML, JSON, or YAML — sent on as JSON), with `--set`
/// overrides applied (then as JSON).
pub(crate) fn spec_text(
    file: &std::path::Path,
    sets: &[String],
) -> anyhow::Result<(String, Format)> {
    let body =
        std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
    if is_yaml(file) {
        let mut doc: serde_json::Value = yaml_serde::from_str(&body)
            .with_context(|| format!("{} is not valid YAML", file.display()))?;
        if !doc.is_object() {
            bail!(
                "{}: a job spec is a mapping (tasks, pools, …)",
                file.display()
            );
        }
        rebase_paths(&mut doc, file.parent().unwrap_or(std::path::Path::new(".")));
        spec::apply_overrides(&mut doc, sets).map_err(|e| anyhow::anyhow!(e))?;
        return Ok((serde_json::to_string(&doc)?, Format::Json));
    }
    let fmt = if file.extension().is_some_and(|e| e == "json") {
        Format::Json
    } else {
        Format::Toml
    };
    let parsed: Option<serde_json::Value> = match fmt {
        Format::Json => serde_json::from_str(&body).ok(),
        Format::Toml => toml::from_str::<toml::Table>(&body)
            .ok()
            .and_then(|t| serde_json::to_value(t).ok()),
    };
    // A file the service cannot parse goes as written: its answer names the problem, with
    // TOML line numbers.
    let Some(mut doc) = parsed else {
        if sets.is_empty() {
            return Ok((body, fmt));
        }
        bail!("{} is not valid {fmt:?}", file.display());
    };
    let dir = file.parent().unwrap_or(std::path::Path::new("."));
    let rebased = rebase_paths(&mut doc, dir);
    if sets.is_empty() && rebased == 0 {
        return Ok((body, fmt));
    }
    spec::apply_overrides(&mut doc, sets).map_err(|e| anyhow::anyhow!(e))?;
    Ok((serde_json::to_string(&doc)?, Format::Json))
}

/// Makes the relative paths of a job file that name files next to it absolute, so that a
/// job file means the same wherever it is submitted from (the service resolves a relative
/// path against its own working directory): datasets, checkpoints, a managed agent's
/// tokenizer, an environment's or agent's command-line arguments, `readable_paths` and
/// `python_path`. A relative path with nothing under the job file's directory stays as
/// written (a model name, which the service finds in its model cache). Returns how many
/// were rebased.
fn rebase_paths(doc: &mut serde_json::Value, dir: &std::path::Path) -> usize {
    let mut n = 0;
    let mut fix = |v: &mut serde_json::Value| {
        let Some(s) = v.as_str() else { return };
        let p = std::path::Path::new(s);
        if s.is_empty() || s.starts_with('-') || p.is_absolute() {
            return;
        }
        if let Ok(abs) = std::fs::canonicalize(dir.join(p))
            && dir.join(p).exists()
        {
            *v = serde_json::Value::String(abs.display().to_string());
            n += 1;
        }
    };
    let each = |v: &mut serde_json::Value, f: &mut dyn FnMut(&mut serde_json::Value)| {
        if let Some(a) = v.as_array_mut() {
            a.iter_mut().for_each(f);
        }
    };
    let task = |t: &mut serde_json::Value, fix: &mut dyn FnMut(&mut serde_json::Value)| {
        if let Some(p) = t.pointer_mut("/dataset/path") {
            fix(p);
        }
        let Some(env) = t.get_mut("env") else { return };
        if let Some(cmd) = env.get_mut("command").and_then(|c| c.as_array_mut()) {
            for (i, a) in cmd.iter_mut().enumerate() {
                // The program itself only when written as a path (`./run.sh`), not a name.
                if i > 0 || a.as_str().is_some_and(|s| s.contains('/')) {
                    fix(a);
                }
            }
        }
        for key in ["readable_paths", "python_path"] {
            if let Some(list) = env.get_mut(key) {
                each(list, fix);
            }
        }
        if let Some(tok) = env.get_mut("tokenizer") {
            fix(tok);
        }
    };
    for list in ["/tasks", "/eval/tasks"] {
        if let Some(tasks) = doc.pointer_mut(list).and_then(|t| t.as_array_mut()) {
            for t in tasks {
                task(t, &mut fix);
            }
        }
    }
    if let Some(functions) = doc
        .pointer_mut("/reward/functions")
        .and_then(|f| f.as_object_mut())
    {
        for f in functions.values_mut() {
            for at in ["/file", "/config/file"] {
                if let Some(file) = f.pointer_mut(at) {
                    fix(file);
                }
            }
        }
    }
    if let Some(pools) = doc.pointer_mut("/pools").and_then(|p| p.as_array_mut()) {
        for p in pools {
            if let Some(m) = p.pointer_mut("/backend/model/path") {
                fix(m);
            }
        }
    }
    n
}

/// A job file read and accepted as a spec (with `--set` overrides), or every problem it has.
pub(crate) fn read_spec(file: &std::path::Path, sets: &[String]) -> anyhow::Result<JobSpec> {
    let (body, fmt) = spec_text(file, sets)?;
    job::resolve::accept(&body, fmt).map_err(|e| {
        anyhow::anyhow!(
            "{} is not a valid job spec:\n{}",
            file.display(),
            problem_lines(&e.0)
        )
    })
}

/// A spec's problems, one indented `field: message` line each (the same in `run`,
/// `submit` and `validate`).
pub(crate) fn problem_lines(problems: &[job::spec::FieldError]) -> String {
    problems
        .iter()
        .map(|f| {
            format!(
                "  {}: {}",
                if f.field.is_empty() {
                    "(spec)"
                } else {
                    &f.field
                },
                f.message
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}
