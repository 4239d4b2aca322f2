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
        spec::apply_overrides(&mut doc, sets).map_err(|e| anyhow::anyhow!(e))?;
        return Ok((serde_json::to_string(&doc)?, Format::Json));
    }
    let fmt = if file.extension().is_some_and(|e| e == "json") {
        Format::Json
    } else {
        Format::Toml
    };
    if sets.is_empty() {
        return Ok((body, fmt));
    }
    let mut doc: serde_json::Value = match fmt {
        Format::Json => serde_json::from_str(&body)
            .with_context(|| format!("{} is not JSON", file.display()))?,
        Format::Toml => serde_json::to_value(
            toml::from_str::<toml::Table>(&body)
                .with_context(|| format!("{} is not TOML", file.display()))?,
        )?,
    };
    spec::apply_overrides(&mut doc, sets).map_err(|e| anyhow::anyhow!(e))?;
    Ok((serde_json::to_string(&doc)?, Format::Json))
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
