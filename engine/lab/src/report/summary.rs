//! `summary.json`: per task, success at the start and at the end of training, from the step
//! metrics the store kept, and the success of a random policy on the same game.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use job::runtime::StepMetrics;

/// Steps averaged for "at the start" and "at the end": a tenth of the run, at least 5; and
/// the trailing window "success reached 0.9" is judged on (one lucky step does not count).
pub const WINDOW: usize = 5;

fn window(n: usize) -> usize {
    (n / 10).max(WINDOW)
}

#[derive(Debug, Serialize)]
pub struct TaskSummary {
    /// Success over the first tenth (at least `WINDOW`) of the steps that had trajectories of
    /// this task, weighted by trajectories.
    pub success_start: f64,
    /// The same over the last tenth.
    pub success_end: f64,
    /// Success of a uniformly random policy over the task's action alphabet, measured on the
    /// environment itself (built-in games with one-token actions).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub success_random: Option<f64>,
    /// Seconds since the start when success first reached 0.9, as a mean over the trailing
    /// `WINDOW` steps (weighted by trajectories).
    pub wall_s_at_90: Option<f64>,
    pub reward_start: f64,
    pub reward_end: f64,
    /// First step at which the trailing `WINDOW`-step success reached 0.9 (none: never).
    pub first_step_at_90: Option<u64>,
    pub steps: usize,
    pub trajectories: usize,
    /// Share of the trained trajectories that ended at their context budget (`truncated`).
    pub truncation_rate: f64,
}

#[derive(Debug, Serialize)]
pub struct Summary {
    pub job: String,
    pub state: String,
    pub steps: u64,
    pub wall_s: f64,
    pub trajectories: usize,
    pub bubble_ratio_mean: f64,
    pub staleness_max: u64,
    /// Trajectories that ended at their context budget, trained or masked.
    pub truncated: u64,
    /// Where the steps' time went: rollout span, trainer waits, stages, weight syncs.
    pub rollout: RolloutSummary,
    pub tasks: BTreeMap<String, TaskSummary>,
    /// Every held-out evaluation, in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub eval: Vec<job::runtime::eval::EvalRecord>,
    /// Per held-out task: the first and the last evaluation.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub eval_change: BTreeMap<String, EvalChange>,
    /// The rollarc version and commit that wrote the summary.
    pub rollarc_version: String,
    pub commit: String,
    /// The job's seed and spec (as stored, every default filled in), when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec: Option<serde_json::Value>,
}

/// Where a run's step time went (over the steps given: a scenario leaves out its warm-up).
#[derive(Clone, Debug, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct RolloutSummary {
    pub step_s_mean: f64,
    /// Span of a step's batch: its first trajectory's start to its last one's end.
    pub rollout_s_mean: f64,
    pub train_s_mean: f64,
    /// The trainer waiting for its batch (`get_batch`): mean and longest, and its share of
    /// the steps' time.
    pub wait_batch_s_mean: f64,
    pub wait_batch_s_max: f64,
    pub wait_batch_share: f64,
    /// Suspend, install and resume per step.
    pub weight_sync_s_mean: f64,
    /// Seconds per trained trajectory in each stage (weighted by trajectories).
    pub stages: job::runtime::StageSeconds,
    /// At the last step, since the start: truncated trajectories; episodes cancelled as
    /// extras of full groups and over-provisioned groups cancelled, with the tokens and
    /// environment-seconds they wasted; groups aborted and evicted for staleness.
    pub truncated: u64,
    pub cancelled_episodes: u64,
    pub cancelled_groups: u64,
    pub cancelled_tokens: u64,
    pub cancelled_env_s: f64,
    pub stale_aborted: u64,
    pub stale_evicted: u64,
    /// How many steps each stage was the bottleneck of the critical path (the trajectory
    /// the step's rollout waited on last).
    #[serde(default)]
    pub critical_bottlenecks: BTreeMap<String, u64>,
    /// The same figures step by step.
    #[serde(default)]
    pub series: StepSeries,
}

/// Per-step series beside the means: one element per step, in order.
#[derive(Clone, Debug, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct StepSeries {
    pub step: Vec<u64>,
    pub step_s: Vec<f64>,
    /// The trainer waiting for its batch.
    pub wait_batch_s: Vec<f64>,
    pub rollout_s: Vec<f64>,
    /// The critical path's trajectory, its bottleneck stage, and each stage's share of its
    /// span (`reset`, `generate`, `env_step`, `reward`, `wait`).
    pub critical_trajectory: Vec<String>,
    pub critical_bottleneck: Vec<String>,
    pub critical_shares: BTreeMap<String, Vec<f64>>,
    /// The share of the context tokens looked up in the step's prefix caches (every pool)
    /// that they served (the first entry counts from the start of the run).
    pub prefix_hit_rate: Vec<f64>,
}

/// The series of `steps`.
fn step_series(steps: &[&StepMetrics]) -> StepSeries {
    let mut s = StepSeries::default();
    let mut before = (0u64, 0u64);
    for m in steps {
        let now = m.pools.values().fold((0, 0), |(h, l), p| {
            (h + p.prefix_hit_tokens, l + p.prefix_lookup_tokens)
        });
        let (hit, lookup) = (
            now.0.saturating_sub(before.0),
            now.1.saturating_sub(before.1),
        );
        s.prefix_hit_rate.push(if lookup > 0 {
            hit as f64 / lookup as f64
        } else {
            0.0
        });
        before = now;
        s.step.push(m.step);
        s.step_s.push(m.step_s);
        s.wait_batch_s.push(m.wait_batch_s);
        s.rollout_s.push(m.rollout.rollout_s);
        let c = m.rollout.critical.clone().unwrap_or_default();
        s.critical_trajectory.push(c.trajectory);
        s.critical_bottleneck.push(c.bottleneck);
        for (name, secs) in c.stages.named() {
            s.critical_shares
                .entry(name.to_string())
                .or_default()
                .push(if c.span_s > 0.0 { secs / c.span_s } else { 0.0 });
        }
    }
    s
}

/// The rollout figures of `steps`.
pub fn rollout_summary(steps: &[&StepMetrics]) -> RolloutSummary {
    let n = steps.len().max(1) as f64;
    let sum = |f: fn(&StepMetrics) -> f64| steps.iter().map(|m| f(m)).sum::<f64>();
    let last = steps.last();
    RolloutSummary {
        step_s_mean: sum(|m| m.step_s) / n,
        rollout_s_mean: sum(|m| m.rollout.rollout_s) / n,
        train_s_mean: sum(|m| m.train_s) / n,
        wait_batch_s_mean: sum(|m| m.wait_batch_s) / n,
        wait_batch_s_max: steps.iter().map(|m| m.wait_batch_s).fold(0.0, f64::max),
        wait_batch_share: sum(|m| m.wait_batch_s) / sum(|m| m.step_s).max(1e-9),
        weight_sync_s_mean: sum(|m| m.rollout.weight_sync_s) / n,
        stages: job::runtime::StageSeconds::weighted_mean(
            steps
                .iter()
                .map(|m| (m.rollout.stages, m.trajectories as f64)),
        ),
        truncated: last.map_or(0, |m| m.buffer.truncated),
        cancelled_episodes: last.map_or(0, |m| m.rollout.cancelled_episodes),
        cancelled_groups: last.map_or(0, |m| m.rollout.cancelled_groups),
        cancelled_tokens: last.map_or(0, |m| m.rollout.cancelled_tokens),
        cancelled_env_s: last.map_or(0.0, |m| m.rollout.cancelled_env_s),
        stale_aborted: last.map_or(0, |m| m.rollout.stale_aborted),
        stale_evicted: last.map_or(0, |m| m.rollout.stale_evicted),
        critical_bottlenecks: steps
            .iter()
            .filter_map(|m| m.rollout.critical.as_ref())
            .fold(BTreeMap::new(), |mut a, c| {
                *a.entry(c.bottleneck.clone()).or_default() += 1;
                a
            }),
        series: step_series(steps),
    }
}

/// A held-out task's pass@1 at its first and last evaluation.
#[derive(Debug, Serialize)]
pub struct EvalChange {
    pub step_start: u64,
    pub pass_at_1_start: f64,
    pub stderr_start: f64,
    pub step_end: u64,
    pub pass_at_1_end: f64,
    pub stderr_end: f64,
    /// `pass_at_1_end − pass_at_1_start`, in points (×100).
    pub change_points: f64,
}

/// The first and last evaluation of each held-out task.
pub fn eval_change(evals: &[job::runtime::eval::EvalRecord]) -> BTreeMap<String, EvalChange> {
    let mut out = BTreeMap::new();
    let (Some(first), Some(last)) = (evals.first(), evals.last()) else {
        return out;
    };
    for (task, a) in &first.tasks {
        if let Some(b) = last.tasks.get(task) {
            out.insert(
                task.clone(),
                EvalChange {
                    step_start: first.step,
                    pass_at_1_start: a.pass_at_1,
                    stderr_start: a.pass_at_1_stderr,
                    step_end: last.step,
                    pass_at_1_end: b.pass_at_1,
                    stderr_end: b.pass_at_1_stderr,
                    change_points: 100.0 * (b.pass_at_1 - a.pass_at_1),
                },
            );
        }
    }
    out
}

fn mean(v: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = v.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 { 0.0 } else { s / n as f64 }
}

/// One step of one task: step, success rate, mean reward, trajectories, seconds since start,
/// truncation rate.
type TaskStep = (u64, f64, f64, usize, f64, f64);

/// Mean of `f` over the steps, weighted by trajectories.
fn weighted(v: &[TaskStep], f: fn(&TaskStep) -> f64) -> f64 {
    let n: usize = v.iter().map(|x| x.3).sum();
    if n == 0 {
        0.0
    } else {
        v.iter().map(|x| f(x) * x.3 as f64).sum::<f64>() / n as f64
    }
}

/// The first index at which the trajectory-weighted success over the trailing `WINDOW` steps
/// (fewer at the very start) reached 0.9.
fn reached_90(v: &[TaskStep]) -> Option<usize> {
    (0..v.len()).find(|&i| weighted(&v[(i + 1).saturating_sub(WINDOW)..=i], |x| x.1) >= 0.9)
}

fn task_summary(v: &[TaskStep]) -> TaskSummary {
    let w = window(v.len());
    let head = &v[..v.len().min(w)];
    let tail = &v[v.len().saturating_sub(w)..];
    TaskSummary {
        success_start: weighted(head, |x| x.1),
        success_end: weighted(tail, |x| x.1),
        success_random: None,
        wall_s_at_90: reached_90(v).map(|i| v[i].4),
        reward_start: weighted(head, |x| x.2),
        reward_end: weighted(tail, |x| x.2),
        first_step_at_90: reached_90(v).map(|i| v[i].0),
        steps: v.len(),
        trajectories: v.iter().map(|x| x.3).sum(),
        truncation_rate: weighted(v, |x| x.5),
    }
}

/// Builds the summary from a job's step metrics.
pub fn summarise(job: &str, state: &str, steps: &[StepMetrics]) -> Summary {
    let evals: Vec<_> = steps.iter().flat_map(|m| m.eval.iter().cloned()).collect();
    let mut tasks: BTreeMap<String, Vec<TaskStep>> = BTreeMap::new();
    for m in steps {
        for (name, t) in &m.tasks {
            if t.trajectories > 0 {
                tasks.entry(name.clone()).or_default().push((
                    m.step,
                    t.success_rate,
                    t.mean_reward,
                    t.trajectories,
                    m.elapsed_s,
                    t.truncation_rate,
                ));
            }
        }
    }
    let tasks = tasks
        .into_iter()
        .map(|(name, v)| (name, task_summary(&v)))
        .collect();
    Summary {
        job: job.to_string(),
        state: state.to_string(),
        steps: steps.len() as u64,
        wall_s: steps.last().map(|m| m.elapsed_s).unwrap_or(0.0),
        trajectories: steps.iter().map(|m| m.trajectories).sum(),
        bubble_ratio_mean: mean(steps.iter().map(|m| m.bubble_ratio)),
        staleness_max: steps.iter().map(|m| m.staleness_max).max().unwrap_or(0),
        truncated: steps.iter().map(|m| m.buffer.truncated).max().unwrap_or(0),
        rollout: rollout_summary(&steps.iter().collect::<Vec<_>>()),
        tasks,
        eval_change: eval_change(&evals),
        eval: evals,
        rollarc_version: env!("CARGO_PKG_VERSION").to_string(),
        commit: env!("ROLLARC_COMMIT").to_string(),
        seed: None,
        spec: None,
    }
}

/// Writes `summary.json` into `dir`; returns its path.
pub fn write(dir: &Path, summary: &Summary) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("summary.json");
    let text = serde_json::to_string_pretty(summary).map_err(std::io::Error::other)?;
    std::fs::write(&path, text + "\n")?;
    Ok(path)
}
