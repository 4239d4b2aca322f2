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

/// `rollarc plan`: the fastest trainer and rollout hardware under a cost budget.
pub(crate) fn plan(
    scenario: &Path,
    budget: f64,
    json_out: Option<PathBuf>,
) -> anyhow::Result<ExitCode> {
    if !(budget.is_finite() && budget > 0.0) {
        bail!("--budget must be a positive cost (H20 = 1), got {budget}");
    }
    let sc = lab::scenario::Scenario::load(scenario)?;
    println!("planning {} under a budget of {budget:.0}", sc.name);
    let p = lab::plan::plan(&sc, budget, |c| {
        let roll: Vec<String> = c
            .rollout_gpus
            .iter()
            .map(|(d, g)| format!("{g} {d}"))
            .collect();
        println!(
            "  trainer {:>5} + {:<24} cost {:>7.0}: step {:>8.1} s",
            c.trainer_gpus,
            roll.join(" + "),
            c.cost,
            c.step_s
        );
    })?;
    print!("{}", lab::plan::render(&p));
    if let Some(out) = json_out {
        std::fs::write(&out, serde_json::to_string_pretty(&p)?)
            .with_context(|| format!("cannot write {}", out.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `rollarc bench`: the benchmarks named by `what`.
pub(crate) fn bench(episodes: usize, what: &str, preset_steps: u64) -> anyhow::Result<ExitCode> {
    let opts = lab::bench::BenchOptions {
        episodes,
        preset_file: Path::new("examples/quickstart.toml"),
        preset_steps,
    };
    lab::bench::run(what, &opts, |b| match b {
        lab::bench::Benchmark::Gateway => gateway::bench::bench_gateway().map_err(Into::into),
        _ => service::bench_batches::bench_batches().map_err(Into::into),
    })?;
    Ok(ExitCode::SUCCESS)
}
