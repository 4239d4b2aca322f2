//! The end-of-run report of `rollarc run`: `summary.json` with, per task, success at the start
//! and at the end of training, from the step metrics the store kept.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::job::StepMetrics;

/// Steps averaged for "at the start" and "at the end".
pub const WINDOW: usize = 5;

#[derive(Debug, Serialize)]
pub struct TaskSummary {
    /// Mean success over the first `WINDOW` steps that had trajectories of this task.
    pub success_start: f64,
    /// Mean success over the last `WINDOW` such steps.
    pub success_end: f64,
    pub reward_start: f64,
    pub reward_end: f64,
    /// First step whose success reached 0.9 (none: never).
    pub first_step_at_90: Option<u64>,
    pub steps: usize,
    pub trajectories: usize,
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
    pub tasks: BTreeMap<String, TaskSummary>,
}

fn mean(v: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = v.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 { 0.0 } else { s / n as f64 }
}

/// Builds the summary from a job's step metrics.
pub fn summarise(job: &str, state: &str, steps: &[StepMetrics]) -> Summary {
    let mut tasks: BTreeMap<String, Vec<(u64, f64, f64, usize)>> = BTreeMap::new();
    for m in steps {
        for (name, t) in &m.tasks {
            if t.trajectories > 0 {
                tasks.entry(name.clone()).or_default().push((m.step, t.success_rate, t.mean_reward, t.trajectories));
            }
        }
    }
    let tasks = tasks
        .into_iter()
        .map(|(name, v)| {
            let head = &v[..v.len().min(WINDOW)];
            let tail = &v[v.len().saturating_sub(WINDOW)..];
            let s = TaskSummary {
                success_start: mean(head.iter().map(|x| x.1)),
                success_end: mean(tail.iter().map(|x| x.1)),
                reward_start: mean(head.iter().map(|x| x.2)),
                reward_end: mean(tail.iter().map(|x| x.2)),
                first_step_at_90: v.iter().find(|x| x.1 >= 0.9).map(|x| x.0),
                steps: v.len(),
                trajectories: v.iter().map(|x| x.3).sum(),
            };
            (name, s)
        })
        .collect();
    Summary {
        job: job.to_string(),
        state: state.to_string(),
        steps: steps.len() as u64,
        wall_s: steps.last().map(|m| m.elapsed_s).unwrap_or(0.0),
        trajectories: steps.iter().map(|m| m.trajectories).sum(),
        bubble_ratio_mean: mean(steps.iter().map(|m| m.bubble_ratio)),
        staleness_max: steps.iter().map(|m| m.staleness_max).max().unwrap_or(0),
        tasks,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::TaskMetrics;

    fn step(i: u64, lake: f64) -> StepMetrics {
        let mut m = StepMetrics { step: i, elapsed_s: i as f64 * 2.0, trajectories: 8, ..StepMetrics::default() };
        m.tasks.insert("lake".into(), TaskMetrics { trajectories: 8, success_rate: lake, mean_reward: lake, mean_turns: 3.0 });
        m
    }

    #[test]
    fn start_and_end_are_window_means_and_the_90_percent_step_is_found() {
        let steps: Vec<StepMetrics> = (0..20).map(|i| step(i, i as f64 / 19.0)).collect();
        let s = summarise("j", "succeeded", &steps);
        let lake = &s.tasks["lake"];
        assert!((lake.success_start - (0.0 + 1.0 + 2.0 + 3.0 + 4.0) / 19.0 / 5.0).abs() < 1e-12);
        assert!((lake.success_end - (15.0 + 16.0 + 17.0 + 18.0 + 19.0) / 19.0 / 5.0).abs() < 1e-12);
        assert_eq!(lake.first_step_at_90, Some(18));
        assert_eq!((s.steps, s.trajectories, lake.trajectories), (20, 160, 160));
        assert_eq!(s.wall_s, 38.0);
        let dir = tempfile::tempdir().unwrap();
        let p = write(dir.path(), &s).unwrap();
        let back: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
        assert_eq!(back["tasks"]["lake"]["first_step_at_90"], 18);
    }
}
