//! Command-line helpers: the progress display of a job (in-process or remote), its metrics,
//! the lines and tables other commands print, and the `sim` comparison. The benchmarks are in
//! [`lab::bench`].

mod print;
mod sim;
mod watch;

pub(crate) use print::{
    job_detail, job_table, print_devices, print_metrics, print_run, print_task_table,
};
pub(crate) use sim::sim;
pub(crate) use watch::{WatchError, api_client, watch_events_with, watch_remote};

/// A step's progress in one line: version, success, throughput, bubble and staleness.
fn progress_msg(m: &serde_json::Value) -> String {
    let f = |p: &str| m.pointer(p).and_then(|v| v.as_f64()).unwrap_or(0.0);
    format!(
        "v{} success {:.2} traj/s {:.1} bubble {:.2} staleness {:.2}",
        f("/version"),
        f("/success_rate"),
        f("/trajectories_per_s"),
        f("/bubble_ratio"),
        f("/staleness_mean")
    )
}
