//! Running a scenario: every run in virtual time, measured, then the checks evaluated.

use std::collections::BTreeMap;
use std::sync::Arc;

use actors::buffer::{CountingSink, TrajectorySink};
use actors::reward::FunctionUsage;
use infra::clock::wall_now;
use tokio_util::sync::CancellationToken;

use super::checks::evaluate;
use super::error::{RunError, ScenarioError};
use super::metric::Metric;
use super::parse::Scenario;
use super::results::{RunResult, ScenarioResult};
use job::runtime::{JobError, JobRun, JobSummary, NoObserver, SharedSimFunctions};
use job::spec::JobSpec;

/// Simulated events of a finished run (see [`RunResult::events`]).
pub fn events_of(s: &JobSummary) -> u64 {
    let Some(last) = s.steps.last() else { return 0 };
    let engine: u64 = last.pools.values().map(|p| p.engine_steps).sum();
    engine + last.env_calls + last.buffer.committed + s.steps_done
}

/// Runs one spec in virtual time and measures it.
pub fn run_one(name: &str, spec: JobSpec, warmup: u64) -> Result<RunResult, JobError> {
    run_jobs(name, spec, warmup, 1, false)
}

/// Runs `jobs` copies of a spec together on one virtual clock (copy `i` seeded `seed + i`),
/// each with its own simulated function deployments, or all sharing them (`shared`: one
/// deployment and autoscaler per function name), and measures them.
pub fn run_jobs(
    name: &str,
    spec: JobSpec,
    warmup: u64,
    jobs: u32,
    shared: bool,
) -> Result<RunResult, JobError> {
    let preset = spec.preset.map(|p| p.name().to_string());
    let t = wall_now();
    let (all, shared_usage) = simulate(spec, jobs, shared, Arc::new(CountingSink::default()))?;
    let wall_s = t.elapsed().as_secs_f64();
    let functions = shared_usage.unwrap_or_else(|| {
        let mut sum: BTreeMap<String, FunctionUsage> = BTreeMap::new();
        for s in &all {
            for (k, u) in &s.functions {
                sum.entry(k.clone()).or_default().add(u);
            }
        }
        sum
    });
    let n = all.len() as f64;
    let mean = |f: &dyn Fn(&JobSummary) -> f64| all.iter().map(f).sum::<f64>() / n;
    let metrics = Metric::ALL
        .iter()
        .map(|m| {
            let v = match m {
                _ if m.of_deployments() => m.of_functions(&functions),
                Metric::ElapsedS => all.iter().map(|s| s.elapsed_s).fold(0.0, f64::max),
                _ => mean(&|s| m.of(s, warmup)),
            };
            (m.name().to_string(), v)
        })
        .collect();
    let first = &all[0];
    let mut pools: BTreeMap<String, f64> = BTreeMap::new();
    let mut pool_groups: BTreeMap<String, u64> = BTreeMap::new();
    for s in &all {
        for (k, p) in &s.pools {
            *pools.entry(k.clone()).or_default() += p.utilisation / n;
            *pool_groups.entry(k.clone()).or_default() += p.groups;
        }
    }
    let sum = |f: &dyn Fn(&JobSummary) -> u64| all.iter().map(f).sum::<u64>();
    Ok(RunResult {
        name: name.to_string(),
        preset,
        metrics,
        steps: sum(&|s| s.steps_done),
        simulated_s: all.iter().map(|s| s.elapsed_s).fold(0.0, f64::max),
        wall_s,
        events: sum(&events_of),
        pools,
        pool_groups,
        prefill_tokens: sum(&|s| s.pools.values().map(|p| p.prefill_tokens).sum()),
        decode_tokens: sum(&|s| s.pools.values().map(|p| p.decode_tokens).sum()),
        stale_aborted: sum(&|s| s.steps.last().map_or(0, |m| m.scheduler.aborted_stale)),
        stale_evicted: sum(&|s| s.steps.last().map_or(0, |m| m.buffer.evicted_stale)),
        rollout: crate::report::rollout_summary(&{
            let after: Vec<_> = first.steps.iter().filter(|m| m.step > warmup).collect();
            if after.is_empty() {
                first.steps.iter().collect()
            } else {
                after
            }
        }),
        jobs,
        functions,
    })
}

/// Simulated function deployments' usage, by function name.
type Usage = BTreeMap<String, FunctionUsage>;

/// Runs `jobs` copies of a spec together on one virtual clock (copy `i` seeded `seed + i`),
/// every trajectory committed to `sink`, each job with its own simulated function
/// deployments or all sharing them (`shared`). Returns each job's summary and, when shared,
/// the deployments' usage.
pub(crate) fn simulate(
    spec: JobSpec,
    jobs: u32,
    shared: bool,
    sink: Arc<dyn TrajectorySink>,
) -> Result<(Vec<JobSummary>, Option<Usage>), JobError> {
    let rt = job::simrun::virtual_runtime().map_err(JobError::Runtime)?;
    let registry = shared.then(|| Arc::new(SharedSimFunctions::default()));
    let jobs = jobs.max(1);
    let (done, shared_usage) = rt.block_on(async {
        let runs = (0..jobs).map(|i| {
            let mut spec = spec.clone();
            spec.seed = spec.seed.wrapping_add(u64::from(i));
            job::runtime::run(JobRun {
                id: if jobs == 1 {
                    "sim".into()
                } else {
                    format!("sim-{i}")
                },
                spec,
                start_step: 0,
                epoch: 0,
                resume: None,
                sink: sink.clone(),
                observer: Arc::new(NoObserver),
                cancel: CancellationToken::new(),
                checkpoint_dir: None,
                functions: None,
                timeline: false,
                batches: None,
                shared_sim_functions: registry.clone(),
                agents: None,
            })
        });
        let done = futures::future::join_all(runs).await;
        (done, registry.as_ref().map(|r| r.usage()))
    });
    Ok((done.into_iter().collect::<Result<_, _>>()?, shared_usage))
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
        let res = run_jobs(
            &r.name,
            r.spec.clone(),
            sc.warmup_steps,
            r.jobs,
            r.shared_functions,
        )
        .map_err(|e| ScenarioError::Run {
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
