//! Scenario files: experiments on the simulated cluster, written as data.
//!
//! A scenario is a base job spec, a list of runs (each the base with some fields set, possibly
//! over a matrix of values), and checks that compare the runs' figures with the paper's: the
//! ratio of a metric between two runs (or the best of several) against a band, or an expected
//! ordering. Every run is the real scheduler and actors on the virtual clock, so a new
//! experiment needs a file, not code.
//!
//! ```toml
//! [scenario]
//! name = "sigma"
//! title = "..."
//! figure = "RollArt Fig. 11"
//! [base]            # a job spec
//! ...
//! [[runs]]
//! name = "turn-s{sigma}"
//! matrix = { sigma = [1, 3, 5] }
//! set = { preset = "sync_plus", "tasks[0].env.step_latency_s.normal.std" = "{sigma}" }
//! [[checks]]
//! name = "σ = {sigma} s"
//! matrix = { sigma = [1, 3, 5] }
//! ratio = ["turn-s{sigma}", "traj-s{sigma}"]
//! paper = [1.23, 1.51, 1.69]
//! tolerance = 0.15
//! ```
//!
//! The parts: `parse` reads the file and expands it, with `matrix` substituting matrix
//! variables and setting fields; `run` simulates the runs; `checks` holds the checks and
//! evaluates them; `results` is what comes out (and the table printed); `metric` is what a run
//! is measured by; `error` says what went wrong.

mod checks;
mod error;
mod matrix;
mod metric;
mod parse;
mod results;
mod run;

pub use checks::{CheckDef, CheckKind, Side, evaluate};
pub use error::{CheckError, RunError, ScenarioError};
pub use matrix::{BuildSpecError, SetPathError, build_spec, set_path};
pub use metric::Metric;
pub use parse::{RunDef, Scenario};
pub use results::{CheckResult, RunResult, ScenarioResult, table};
pub use run::{events_of, peak_rss_kib, peak_rss_mib, run, run_jobs, run_one};

#[cfg(test)]
mod golden;
#[cfg(test)]
mod tests;
