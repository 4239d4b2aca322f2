//! What a scenario's runs are measured by.

use serde::{Deserialize, Serialize};

use crate::job::JobSummary;

/// What a run is measured by.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// Mean training-step time after the warm-up steps (virtual seconds).
    #[default]
    StepS,
    /// Trained trajectories per second after the warm-up steps.
    Throughput,
    /// Idle fraction of generation capacity over the run.
    Bubble,
    /// Fraction of the step the trainer trains (the rest it waits for data).
    TrainerBusy,
    /// Total virtual time of the run.
    ElapsedS,
}

impl Metric {
    pub const ALL: [Metric; 5] = [
        Metric::StepS,
        Metric::Throughput,
        Metric::Bubble,
        Metric::TrainerBusy,
        Metric::ElapsedS,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::StepS => "step_s",
            Self::Throughput => "throughput",
            Self::Bubble => "bubble",
            Self::TrainerBusy => "trainer_busy",
            Self::ElapsedS => "elapsed_s",
        }
    }

    /// The metric of a finished run.
    pub fn of(self, s: &JobSummary, warmup: u64) -> f64 {
        let steps: Vec<_> = s.steps.iter().filter(|m| m.step >= warmup).collect();
        let steps = if steps.is_empty() {
            s.steps.iter().collect()
        } else {
            steps
        };
        let n = steps.len().max(1) as f64;
        match self {
            Self::StepS => steps.iter().map(|m| m.step_s).sum::<f64>() / n,
            Self::Throughput => {
                let t: f64 = steps.iter().map(|m| m.step_s).sum();
                steps.iter().map(|m| m.trajectories as f64).sum::<f64>() / t.max(1e-9)
            }
            Self::Bubble => s.bubble_ratio,
            Self::TrainerBusy => {
                steps
                    .iter()
                    .map(|m| (m.train_s / m.step_s.max(1e-9)).min(1.0))
                    .sum::<f64>()
                    / n
            }
            Self::ElapsedS => s.elapsed_s,
        }
    }
}
