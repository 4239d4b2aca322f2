//! Running a scenario: every run in virtual time, measured, then the checks evaluated.

use infra::clock::wall_now;

use super::checks::evaluate;
use super::error::{RunError, ScenarioError};
use super::metric::Metric;
use super::parse::Scenario;
use super::results::{RunResult, ScenarioResult};
use crate::job::{JobError, JobSummary};
use crate::spec::JobSpec;

/// Simulated events of a finished run (see [`RunResult::events`]).
pub fn events_of(s: &JobSummary) -> u64 {
    let Some(last) = s.steps.last() else { return 0 };
    let engine: u64 = last.pools.values().map(|p| p.engine_steps).sum();
    engine + last.env_calls + last.buffer.committed + s.steps_done
}

/// Runs one spec in virtual time and measures it.
pub fn run_one(name: &str, spec: JobSpec, warmup: u64) -> Result<RunResult, JobError> {
    let preset = spec.preset.map(|p| p.name().to_string());
    let t = wall_now();
    let s = crate::simrun::run_virtual(spec)?;
    let wall_s = t.elapsed().as_secs_f64();
    let metrics = Metric::ALL
        .iter()
        .map(|m| (m.name().to_string(), m.of(&s, warmup)))
        .collect();
    Ok(RunResult {
        name: name.to_string(),
        preset,
        metrics,
        steps: s.steps_done,
        simulated_s: s.elapsed_s,
        wall_s,
        events: events_of(&s),
        pools: s
            .pools
            .iter()
            .map(|(k, p)| (k.clone(), p.utilisation))
            .collect(),
        pool_groups: s.pools.iter().map(|(k, p)| (k.clone(), p.groups)).collect(),
        prefill_tokens: s.pools.values().map(|p| p.prefill_tokens).sum(),
        decode_tokens: s.pools.values().map(|p| p.decode_tokens).sum(),
        stale_aborted: s.steps.last().map_or(0, |m| m.scheduler.aborted_stale),
        stale_evicted: s.steps.last().map_or(0, |m| m.buffer.evicted_stale),
        rollout: crate::report::rollout_summary(&{
            let after: Vec<_> = s.steps.iter().filter(|m| m.step >= warmup).collect();
            if after.is_empty() {
                s.steps.iter().collect()
            } else {
                after
            }
        }),
    })
}

/// Peak resident memory of this process, MiB.
pub fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<f64>().ok())
        })
        .unwrap_or(0.0)
        / 1024.0
}

/// Peak resident memory of this process, KiB (whole).
pub fn peak_rss_kib() -> u64 {
    (peak_rss_mib() * 1024.0) as u64
}

/// Runs every run of the scenario (in order) and evaluates its checks.
pub fn run(
    sc: &Scenario,
    mut progress: impl FnMut(&RunResult),
) -> Result<ScenarioResult, ScenarioError> {
    let t = wall_now();
    let mut runs = Vec::new();
    for r in &sc.runs {
        let res =
            run_one(&r.name, r.spec.clone(), sc.warmup_steps).map_err(|e| ScenarioError::Run {
                file: sc.name.clone(),
                run: r.name.clone(),
                source: RunError::Simulation(Box::new(e)),
            })?;
        progress(&res);
        runs.push(res);
    }
    let checks = evaluate(&sc.checks, &runs);
    Ok(ScenarioResult {
        name: sc.name.clone(),
        title: sc.title.clone(),
        figure: sc.figure.clone(),
        notes: sc.notes.clone(),
        events: runs.iter().map(|r| r.events).sum(),
        wall_s: t.elapsed().as_secs_f64(),
        runs,
        checks,
        peak_rss_mib: peak_rss_mib(),
    })
}
