//! `rollarc sim`: a spec in virtual time, under one preset or several compared.

use std::time::Duration;

use infra::clock::wall_now;

use job::runtime::{JobError, JobSummary};
use job::spec::{JobSpec, Preset};

use super::print::{print_functions, print_metrics};

/// Why `rollarc sim` failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SimError {
    #[error("unknown preset {0:?}, expected one of sync, sync_plus, one_off, areal, rollarc")]
    UnknownPreset(String),
    #[error(transparent)]
    Run(#[from] JobError),
    #[error(transparent)]
    Metrics(#[from] serde_json::Error),
}

/// One run's figures in a line (virtual time, steps/min, throughput, bubble, wall time),
/// then its functions.
fn summary_line(label: &str, s: &JobSummary, wall: Duration) {
    let steps = s.steps_done.max(1) as f64;
    println!(
        "{label:10} virtual {:9.1} s  steps/min {:7.3}  traj/s {:7.2}  bubble {:.3}  wall {:.2} s",
        s.elapsed_s,
        steps / (s.elapsed_s / 60.0).max(1e-9),
        s.trajectories_committed as f64 / s.elapsed_s.max(1e-9),
        s.bubble_ratio,
        wall.as_secs_f64()
    );
    print_functions(&s.functions);
}

/// `rollarc sim`: runs the spec (optionally under several presets) in virtual time.
pub(crate) fn sim(spec: JobSpec, preset: Option<&str>, compare: &[String]) -> Result<(), SimError> {
    let parse = |p: &str| Preset::parse(p).ok_or_else(|| SimError::UnknownPreset(p.to_string()));
    let base = match preset {
        Some(p) => spec.with_preset(parse(p)?),
        None => spec,
    };
    if compare.is_empty() {
        let t = wall_now();
        let s = job::simrun::run_virtual(base)?;
        summary_line(s.steps.last().map_or("run", |_| "run"), &s, t.elapsed());
        if let Some(last) = s.steps.last() {
            print_metrics(&serde_json::to_value(last)?);
        }
        return Ok(());
    }
    let mut results = Vec::new();
    for name in compare {
        let p = parse(name)?;
        let t = wall_now();
        let s = job::simrun::run_virtual(base.with_preset(p))?;
        summary_line(p.name(), &s, t.elapsed());
        results.push((p, s));
    }
    if let Some((first, fs)) = results.first() {
        for (p, s) in &results[1..] {
            println!(
                "{} is {:.2}× faster than {} (virtual time for the same {} steps)",
                first.name(),
                s.elapsed_s / fs.elapsed_s.max(1e-9),
                p.name(),
                fs.steps_done
            );
        }
    }
    Ok(())
}
