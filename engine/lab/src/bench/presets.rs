//! `rollarc bench --what presets`: the quickstart job under `sync`, `sync_plus`, `one_off` and
//! `rollarc` for the same number of steps, with the built-in environments as they are and with
//! environment latency injected.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use actors::dist::Dist;

use job::runtime::{JobError, JobSummary};
use job::spec::{InjectLatency, JobSpec, Preset, SpecErrors};

/// Why the preset benchmark stopped.
#[derive(Debug, thiserror::Error)]
pub enum PresetsBenchError {
    #[error("{}", file.display())]
    Read {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}", file.display())]
    Spec {
        file: PathBuf,
        #[source]
        source: SpecErrors,
    },
    #[error("{preset}")]
    Run {
        preset: &'static str,
        #[source]
        source: JobError,
    },
}

const PRESETS: [Preset; 4] = [
    Preset::Sync,
    Preset::SyncPlus,
    Preset::OneOff,
    Preset::Rollarc,
];

/// The job spec in TOML `file`. With `model`, a built-in pool whose checkpoint file does not
/// exist (the examples name it relative to where `make setup` puts it) serves `model` instead.
pub(super) fn read_spec(file: &Path, model: Option<&Path>) -> Result<JobSpec, PresetsBenchError> {
    let body = std::fs::read_to_string(file).map_err(|source| PresetsBenchError::Read {
        file: file.to_path_buf(),
        source,
    })?;
    let mut spec = job::spec::parse(&body, job::spec::Format::Toml).map_err(|source| {
        PresetsBenchError::Spec {
            file: file.to_path_buf(),
            source,
        }
    })?;
    if let Some(m) = model {
        for pool in &mut spec.pools {
            if let job::spec::BackendSpec::Builtin { model: b, .. } = &mut pool.backend
                && let Some(path) = &mut b.path
                && !Path::new(path.as_str()).exists()
            {
                *path = m.display().to_string();
            }
        }
    }
    Ok(spec)
}

/// The environment latency both preset benchmarks inject: per step Normal(0.3 s, σ 0.15 s),
/// resets LogNormal(μ −2, σ 1) (heavy-tailed).
pub(super) fn injected_latency() -> InjectLatency {
    InjectLatency {
        reset_s: Some(Dist::Lognormal {
            mu: -2.0,
            sigma: 1.0,
        }),
        step_s: Some(Dist::Normal {
            mean: 0.3,
            std: 0.15,
        }),
    }
}

/// Runs `base` under preset `p` for `steps` steps, with environment latency injected if asked.
fn run_preset(
    base: &JobSpec,
    p: Preset,
    steps: u64,
    injected: bool,
) -> Result<JobSummary, PresetsBenchError> {
    let mut spec = base.with_preset(p);
    spec.rollout.steps = Some(steps);
    if injected {
        for t in &mut spec.tasks {
            t.inject_latency = Some(injected_latency());
        }
    }
    job::simrun::run_blocking(
        spec,
        0,
        0,
        Arc::new(actors::buffer::CountingSink::default()),
        Arc::new(job::runtime::NoObserver),
        None,
    )
    .map_err(|source| PresetsBenchError::Run {
        preset: p.name(),
        source,
    })
}

/// Success per task over the last three steps, weighted by trajectories: `task 0.42`.
fn final_success(s: &JobSummary) -> Vec<String> {
    let tail = &s.steps[s.steps.len().saturating_sub(3)..];
    let mut per_task: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    for m in tail {
        for (k, t) in &m.tasks {
            let e = per_task.entry(k.clone()).or_default();
            e.0 += t.success_rate * t.trajectories as f64;
            e.1 += t.trajectories;
        }
    }
    per_task
        .iter()
        .map(|(k, (s, n))| format!("{k} {:.2}", s / (*n).max(1) as f64))
        .collect()
}

/// `rollarc bench --what presets`: the quickstart job under `sync`, `sync_plus`, `one_off` and
/// `rollarc` for the same number of steps, with the built-in environments as they are and with
/// environment latency injected (per-turn Normal(μ, σ), heavy-tailed resets; scaled down so
/// the runs stay short); wall time, steps/min, final success per task, bubble ratio, and the
/// ratio of `rollarc` against each baseline measured in the same run.
pub fn bench_presets(file: &Path, steps: u64) -> Result<(), PresetsBenchError> {
    let base = read_spec(file, None)?;
    println!(
        "preset benchmark: {} × {steps} steps per run (release, 2 cores)",
        file.display()
    );
    for injected in [false, true] {
        let label = if injected {
            "injected env latency: step Normal(0.3 s, σ 0.15 s), reset LogNormal(μ −2, σ 1)"
        } else {
            "built-in environments as they are"
        };
        println!("  {label}");
        println!(
            "    {:<10} {:>9} {:>10} {:>8}  final success per task",
            "preset", "wall s", "steps/min", "bubble"
        );
        let mut walls = BTreeMap::new();
        for p in PRESETS {
            let s = run_preset(&base, p, steps, injected)?;
            println!(
                "    {:<10} {:>9.1} {:>10.2} {:>8.3}  {}",
                p.name(),
                s.elapsed_s,
                s.steps_done as f64 / (s.elapsed_s / 60.0).max(1e-9),
                s.bubble_ratio,
                final_success(&s).join(", ")
            );
            walls.insert(p.name(), s.elapsed_s);
        }
        let r = walls.get("rollarc").copied().unwrap_or(f64::NAN);
        let ratios: Vec<String> = ["sync", "sync_plus", "one_off"]
            .iter()
            .map(|b| format!("{:.2}× {b}", walls.get(b).copied().unwrap_or(f64::NAN) / r))
            .collect();
        println!("    rollarc is {}", ratios.join(", "));
    }
    Ok(())
}
