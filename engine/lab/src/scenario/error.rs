//! Why a scenario could not be loaded or run.

use super::matrix::BuildSpecError;
use job::runtime::JobError;

/// A scenario file that cannot be read, a run that cannot be built or simulated, or a check
/// that is not well formed; every error names the file and the run or check.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    #[error("{file}: not a valid scenario file")]
    Read {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: not a valid scenario file")]
    Syntax {
        file: String,
        #[source]
        source: toml::de::Error,
    },
    #[error("{file}: not a valid scenario file")]
    Base {
        file: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("{file}: run {run:?}")]
    Run {
        file: String,
        run: String,
        #[source]
        source: RunError,
    },
    #[error("{file}: check {check:?}")]
    Check {
        file: String,
        check: String,
        #[source]
        source: CheckError,
    },
}

/// What is wrong with one run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Spec(#[from] BuildSpecError),
    #[error("every backend must be simulated (kind = \"sim\")")]
    NotSimulated,
    #[error("duplicate run name")]
    Duplicate,
    #[error("jobs: must be in 1..=64, got {0}")]
    Jobs(u32),
    /// Boxed: a job's error is large, and most scenario errors are not simulation failures.
    #[error(transparent)]
    Simulation(#[from] Box<JobError>),
}

/// What is wrong with one check.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("give exactly one of ratio, order or value")]
    Kind,
    #[error("no run is named {0:?}")]
    UnknownRun(String),
    #[error("paper has {values} values for {rows} matrix rows")]
    PaperValues { values: usize, rows: usize },
    #[error("tolerance needs a numeric paper value")]
    ToleranceWithoutPaper,
    #[error("a ratio or value check needs band or tolerance")]
    NoBand,
}
