//! The `[eval]` section: held-out evaluation of the current policy during training.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::task::TaskSpec;
use super::{JobSpec, Problems};

/// Held-out evaluation: every `every` steps (and before the first step, and after the last)
/// the current policy answers each problem of each task `n` times, without training on it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EvalSpec {
    /// Steps between evaluations (0: only before the first step and after the last).
    #[serde(default)]
    pub every: u64,
    /// Evaluate the starting policy before the first step.
    #[serde(default = "default_true")]
    pub at_start: bool,
    /// Samples per problem: pass@1 and pass@n are reported.
    #[serde(default = "default_n")]
    #[schema(minimum = 1, maximum = 64)]
    pub n: usize,
    /// Sampling temperature of the evaluation episodes (0: greedy).
    #[serde(default = "default_temperature")]
    pub temperature: f64,
    /// Answer length per turn (default: each task's `max_tokens_per_turn`).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 1000000)]
    pub max_tokens: Option<u32>,
    /// Episodes run at once (default: each task's environments).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 100000)]
    pub concurrency: Option<usize>,
    /// The held-out tasks, written like `tasks` (each with `seeds` — the problems — or a
    /// `dataset`, all of whose rows are problems).
    #[schema(min_items = 1)]
    pub tasks: Vec<TaskSpec>,
}

fn default_true() -> bool {
    true
}
fn default_n() -> usize {
    4
}
fn default_temperature() -> f64 {
    1.0
}

/// Most evaluation episodes one evaluation may run (problems × n over all tasks).
pub const MAX_EVAL_EPISODES: u64 = 1_000_000;

impl EvalSpec {
    pub(super) fn check(&self, spec: &JobSpec, problems: &mut Problems) {
        if !(1..=64).contains(&self.n) {
            problems.push(
                "eval.n".into(),
                format!("must be in 1..=64, got {}", self.n),
            );
        }
        if !(self.temperature.is_finite() && (0.0..=10.0).contains(&self.temperature)) {
            problems.push(
                "eval.temperature".into(),
                format!("must be in [0, 10], got {}", self.temperature),
            );
        }
        if self.max_tokens == Some(0) {
            problems.push("eval.max_tokens".into(), "must be at least 1".into());
        }
        if self.concurrency == Some(0) {
            problems.push("eval.concurrency".into(), "must be at least 1".into());
        }
        if self.tasks.is_empty() {
            problems.push(
                "eval.tasks".into(),
                "name at least one held-out task".into(),
            );
        }
        let mut domains = std::collections::BTreeSet::new();
        let mut episodes = 0u64;
        for (i, t) in self.tasks.iter().enumerate() {
            let p = format!("eval.tasks[{i}]");
            if t.domain.trim().is_empty() {
                problems.push(format!("{p}.domain"), "must not be empty".into());
            } else if !domains.insert(t.domain.as_str()) {
                problems.push(
                    format!("{p}.domain"),
                    format!("duplicate evaluation task {:?}", t.domain),
                );
            }
            match (&t.seeds, &t.dataset) {
                (None, None) => problems.push(
                    format!("{p}.seeds"),
                    "a held-out task needs its problems: seeds = { start, count } or a dataset"
                        .into(),
                ),
                (Some(s), None) => episodes += s.count.saturating_mul(self.n as u64),
                _ => {}
            }
            // Checked like a training task (its dataset and seeds conflict is fine here:
            // the check below reports it).
            t.check(&p, spec, problems);
        }
        if episodes > MAX_EVAL_EPISODES {
            problems.push(
                "eval.tasks".into(),
                format!("{episodes} episodes per evaluation; at most {MAX_EVAL_EPISODES}"),
            );
        }
    }
}
