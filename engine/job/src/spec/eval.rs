//! The `[eval]` section: held-out evaluation of the current policy during training.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::knob::{Knob, KnobInfo, knob};
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
    #[serde(default = "default_n")]
    pub n: usize,
    #[serde(default = "default_temperature")]
    pub temperature: f64,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub concurrency: Option<usize>,
    /// The held-out tasks, written like `tasks` (each with `seeds` — the problems — or a
    /// `dataset`, all of whose rows are problems).
    #[schema(min_items = 1)]
    pub tasks: Vec<TaskSpec>,
}

fn default_true() -> bool {
    true
}
pub const EVAL_N: Knob<usize> = knob(
    ("EvalSpec", "eval", "n"),
    (1, false, 64),
    Some(4),
    "",
    "Samples per problem: pass@1 and pass@n are reported.",
);
pub const EVAL_TEMPERATURE: Knob<f64> = knob(
    ("EvalSpec", "eval", "temperature"),
    (0.0, false, 10.0),
    Some(1.0),
    "",
    "Sampling temperature of the evaluation episodes (0: greedy).",
);
pub const EVAL_MAX_TOKENS: Knob<u32> = knob(
    ("EvalSpec", "eval", "max_tokens"),
    (1, false, 1_000_000),
    None,
    "each task's max_tokens_per_turn",
    "Answer length per turn.",
);
pub const EVAL_CONCURRENCY: Knob<usize> = knob(
    ("EvalSpec", "eval", "concurrency"),
    (1, false, super::MAX_EPISODES),
    None,
    "each task's environments",
    "Episodes run at once.",
);

/// The knobs of the `eval` section, in the manual's order.
pub(super) fn knobs() -> Vec<KnobInfo> {
    vec![
        EVAL_N.info(),
        EVAL_TEMPERATURE.info(),
        EVAL_MAX_TOKENS.info(),
        EVAL_CONCURRENCY.info(),
    ]
}

fn default_n() -> usize {
    EVAL_N.or_default(None)
}
fn default_temperature() -> f64 {
    EVAL_TEMPERATURE.or_default(None)
}

/// Most evaluation episodes one evaluation may run (problems × n over all tasks).
pub const MAX_EVAL_EPISODES: u64 = 1_000_000;

impl EvalSpec {
    pub(super) fn check(&self, spec: &JobSpec, problems: &mut Problems) {
        EVAL_N.check(Some(self.n), problems);
        EVAL_TEMPERATURE.check(Some(self.temperature), problems);
        EVAL_MAX_TOKENS.check(self.max_tokens, problems);
        EVAL_CONCURRENCY.check(self.concurrency, problems);
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
