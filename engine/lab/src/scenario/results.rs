//! What a scenario measured: the runs' figures, the checks' outcomes, and the table printed.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// What one run measured, and what the simulator cost.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunResult {
    pub name: String,
    pub preset: Option<String>,
    pub metrics: BTreeMap<String, f64>,
    pub steps: u64,
    /// Virtual seconds simulated.
    pub simulated_s: f64,
    /// Wall seconds the simulation took.
    pub wall_s: f64,
    /// Simulated events: engine steps (a fused step counts once), environment calls, finished
    /// trajectories (each a reward call and a buffer commit) and training steps.
    pub events: u64,
    /// Utilisation of every pool over the run.
    pub pools: BTreeMap<String, f64>,
    /// Groups admitted to every pool.
    pub pool_groups: BTreeMap<String, u64>,
    /// Tokens prefilled and decoded over the run (prefix-cache hits are not prefilled).
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    /// Groups aborted past the staleness bound, and groups evicted stale from the buffer
    /// (work thrown away).
    pub stale_aborted: u64,
    pub stale_evicted: u64,
    /// Where the step time went after the warm-up: rollout span, trainer waits, stages,
    /// weight syncs, cancelled work (the first job's, when the run has several).
    pub rollout: crate::report::RolloutSummary,
    /// Jobs run together on one virtual clock (metrics are their mean; `elapsed_s` the last
    /// to end).
    #[serde(default = "one_job")]
    pub jobs: u32,
    /// Simulated function deployments with their usage: the shared ones once, or each name
    /// summed over the jobs' own deployments.
    #[serde(default)]
    pub functions: BTreeMap<String, actors::reward::FunctionUsage>,
}

fn one_job() -> u32 {
    1
}

/// A check's outcome.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CheckResult {
    pub name: String,
    pub metric: String,
    pub what: String,
    pub paper: Option<String>,
    pub band: Option<[f64; 2]>,
    /// The ratio (ratio checks) or the value (value checks).
    pub ours: Option<f64>,
    /// The measured order (order checks).
    pub order: Option<Vec<String>>,
    pub pass: bool,
    pub note: Option<String>,
}

/// A scenario's results.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ScenarioResult {
    pub name: String,
    pub title: String,
    pub figure: String,
    pub notes: Option<String>,
    pub runs: Vec<RunResult>,
    pub checks: Vec<CheckResult>,
    pub wall_s: f64,
    pub events: u64,
    pub peak_rss_mib: f64,
}

/// The table of a scenario's checks, as printed.
pub fn table(results: &[ScenarioResult]) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "{:<12} {:<34} {:>12} {:>9} {:>15}  {}\n",
        "experiment", "check", "paper", "ours", "band", "in band"
    ));
    for r in results {
        for c in &r.checks {
            let ours = match (&c.ours, &c.order) {
                (Some(x), _) if c.what.contains(" / ") => format!("{x:.2}×"),
                (Some(x), _) => format!("{x:.2}"),
                (None, Some(o)) => o.join("<"),
                _ => "-".into(),
            };
            let band = c
                .band
                .map(|[a, b]| format!("[{a:.2}, {b:.2}]"))
                .unwrap_or_else(|| "order".into());
            out.push_str(&format!(
                "{:<12} {:<34} {:>12} {:>9} {:>15}  {}\n",
                r.name,
                c.name,
                c.paper.clone().unwrap_or_else(|| "-".into()),
                ours,
                band,
                if c.pass { "yes" } else { "NO" }
            ));
        }
    }
    out
}
