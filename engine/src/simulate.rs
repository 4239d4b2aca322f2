//! The simulator's commands: `sim` (one spec in virtual time), `scenario`, `bench-sim`,
//! `plan`, and `bench` (the benchmarks).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, bail};

use crate::spec_file::read_spec;

/// `rollarc sim`: runs a spec (under its preset, another, or several to compare) in virtual
/// time.
pub(crate) fn sim(
    file: &Path,
    sets: &[String],
    preset: Option<&str>,
    compare: &[String],
) -> anyhow::Result<ExitCode> {
    let spec = read_spec(file, sets)?;
    crate::cli::sim(spec, preset, compare)?;
    Ok(ExitCode::SUCCESS)
}

/// `rollarc scenario`: runs a scenario file and prints its table against the paper.
pub(crate) fn scenario(
    file: &Path,
    json_out: Option<PathBuf>,
    quiet: bool,
) -> anyhow::Result<ExitCode> {
    let sc = lab::scenario::Scenario::load(file)?;
    println!(
        "{} — {} ({}): {} runs",
        sc.name,
        sc.title,
        sc.figure,
        sc.runs.len()
    );
    let res = lab::scenario::run(&sc, |r| {
        if !quiet {
            crate::cli::print_run(r);
        }
    })?;
    print!("{}", lab::scenario::table(std::slice::from_ref(&res)));
    if let Some(p) = json_out {
        std::fs::write(&p, serde_json::to_string_pretty(&res)?)
            .with_context(|| format!("cannot write {}", p.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `rollarc bench-sim`: runs every scenario (each in its own process) and writes the results.
pub(crate) fn bench_sim(
    files: Vec<PathBuf>,
    out: &Path,
    parallel: usize,
) -> anyhow::Result<ExitCode> {
    let files = if files.is_empty() {
        let mut v: Vec<PathBuf> = std::fs::read_dir("examples/sim")
            .context("examples/sim")?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "toml"))
            .collect();
        v.sort();
        v
    } else {
        files
    };
    let exe = std::env::current_exe().context("cannot find this executable")?;
    // Checks outside the paper's band are reported (and explained in the scenario's notes),
    // not a failure of the benchmark.
    lab::simbench::run_all(&exe, &files, out, parallel)?;
    Ok(ExitCode::SUCCESS)
}

/// `rollarc plan`: the cheapest configuration per step: trainer and rollout hardware under a
/// GPU budget (or the spec's own), then the other resources the `[plan]` table lists.
pub(crate) fn plan(
    file: &Path,
    budget: Option<f64>,
    search: Option<&Path>,
    json_out: Option<PathBuf>,
    spec_out: Option<PathBuf>,
) -> anyhow::Result<ExitCode> {
    if let Some(b) = budget
        && !(b.is_finite() && b > 0.0)
    {
        bail!("--budget must be a positive cost (H20 = 1), got {b}");
    }
    let text =
        std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
    let is_scenario = toml::from_str::<toml::Table>(&text)
        .map(|t| t.contains_key("scenario"))
        .unwrap_or(false);
    let sc = if is_scenario {
        if search.is_some() {
            bail!("--search is for a job spec; a scenario has its own [plan] table");
        }
        lab::scenario::Scenario::load(file)?
    } else {
        let spec = read_spec(file, &[])?;
        let table = match search {
            Some(p) => {
                let t: toml::Table = toml::from_str(
                    &std::fs::read_to_string(p)
                        .with_context(|| format!("cannot read {}", p.display()))?,
                )
                .with_context(|| format!("{} is not TOML", p.display()))?;
                let plan = t
                    .get("plan")
                    .cloned()
                    .ok_or_else(|| anyhow::anyhow!("{} has no [plan] table", p.display()))?;
                Some(serde_json::to_value(plan)?)
            }
            None => None,
        };
        let name = file
            .file_stem()
            .map_or("spec".into(), |s| s.to_string_lossy().to_string());
        lab::scenario::Scenario::of_spec(&name, spec, table)?
    };
    match budget {
        Some(b) => println!("planning {} under a GPU budget of {b:.0}", sc.name),
        None => println!("planning {} on its own GPUs", sc.name),
    }
    let p = lab::plan::plan(&sc, budget, |c| {
        let roll: Vec<String> = c
            .rollout_gpus
            .iter()
            .map(|(d, g)| format!("{g} {d}"))
            .collect();
        println!(
            "  trainer {:>5} + {:<24} {:<28} step {:>8.2} s, {:.4} per step ({})",
            c.trainer_gpus,
            roll.join(" + "),
            c.resources.label(),
            c.step_s,
            c.cost_per_step,
            c.bottleneck
        );
    })?;
    print!("{}", lab::plan::render(&p));
    if let Some(out) = json_out {
        std::fs::write(&out, serde_json::to_string_pretty(&p)?)
            .with_context(|| format!("cannot write {}", out.display()))?;
    }
    if let Some(out) = spec_out {
        std::fs::write(
            &out,
            serde_json::to_string_pretty(&lab::plan::recommended_spec(&sc, &p))?,
        )
        .with_context(|| format!("cannot write {}", out.display()))?;
        println!("wrote the recommended spec to {}", out.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// `rollarc bench`: the benchmarks named by `what`.
pub(crate) fn bench(
    episodes: usize,
    what: &str,
    preset_steps: u64,
    llm: &lab::bench::PresetsLlmOptions,
) -> anyhow::Result<ExitCode> {
    let opts = lab::bench::BenchOptions {
        episodes,
        preset_file: Path::new("examples/quickstart.toml"),
        preset_steps,
        llm_file: Path::new("examples/smollm2-reasoning.toml"),
        llm,
    };
    lab::bench::run(what, &opts, |b| match b {
        lab::bench::Benchmark::Gateway => gateway::bench::bench_gateway().map_err(Into::into),
        _ => service::bench_batches::bench_batches().map_err(Into::into),
    })?;
    Ok(ExitCode::SUCCESS)
}
