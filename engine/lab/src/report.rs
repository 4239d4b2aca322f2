//! The end-of-run report of `rollarc run`: `summary.json` with, per task, success at the start
//! and at the end of training, from the step metrics the store kept; and the plots (success,
//! utilisation, the per-resource timeline).

mod canvas;
mod plots;
mod summary;
mod timeline;

pub(crate) use canvas::register_font;
pub use canvas::{DrawError, PlotError};
pub use plots::plots;
pub use summary::{
    EvalChange, RolloutSummary, Summary, TaskSummary, WINDOW, eval_change, rollout_summary,
    summarise, write,
};

#[cfg(test)]
mod tests;
