//! `rollarc bench --what scheduler`: the scheduler-overhead benchmark. Zero-latency
//! environments and an ideal (infinitely fast) device, so all wall time is orchestration:
//! actors, messages, buffer, scheduler.

use infra::clock::wall_now;

use crate::scenario::peak_rss_kib;
use job::runtime::JobError;
use job::spec::{self, SpecErrors};

/// Why the scheduler benchmark stopped.
#[derive(Debug, thiserror::Error)]
pub enum SchedulerBenchError {
    #[error(transparent)]
    Spec(#[from] SpecErrors),
    #[error(transparent)]
    Run(#[from] JobError),
}

/// The job: `episodes` concurrent episodes of `turns` turns on zero-latency backends.
fn spec_body(episodes: usize, turns: u64) -> String {
    let groups = (episodes / 8).max(1);
    format!(
        r#"
seed = 1
[[tasks]]
domain = "bench"
group_size = 8
max_turns = {turns}
max_tokens_per_turn = 8
envs = {episodes}
[tasks.env]
kind = "sim"
turns = {{ constant = {turns} }}
observation_tokens = {{ constant = 8 }}
response_tokens = {{ constant = 8 }}
[[pools]]
name = "ideal"
device = "IDEAL"
count = 8
backend = {{ kind = "sim", model = "tiny", max_batch = 100000 }}
[rollout]
barrier = "none"
alpha = 0
overlap_training = false
batch_size = {groups}
steps = 3
max_concurrent_episodes = {episodes}
[trainer]
kind = "sim"
seconds_per_token = 0.0
"#
    )
}

/// Issue #36's bounds on orchestration: time per environment step and memory per in-flight
/// trajectory at 10,000 concurrent episodes.
const STEP_BOUND_US: f64 = 10.0;
const TRAJ_BOUND_KIB: f64 = 8.0;

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "not met" }
}

/// The scheduler-overhead benchmark: zero-latency environments and an ideal (infinitely fast)
/// device, so all wall time is orchestration: actors, messages, buffer, scheduler.
pub fn bench_scheduler(episodes: usize) -> Result<(), SchedulerBenchError> {
    let turns = 5;
    let spec = spec::parse(&spec_body(episodes, turns), spec::Format::Toml)?;
    let rss0 = peak_rss_kib();
    let t = wall_now();
    let s = job::simrun::run_virtual(spec)?;
    let wall = t.elapsed().as_secs_f64();
    let rss1 = peak_rss_kib();
    let trajs = s.trajectories_committed.max(1);
    let steps = trajs * turns;
    let peak = s
        .steps
        .iter()
        .map(|m| m.scheduler.peak_active_episodes)
        .max()
        .unwrap_or(0)
        .max(1);
    println!(
        "scheduler overhead benchmark: {episodes} concurrent episodes, {turns} turns each, zero-latency backends"
    );
    println!("  trajectories {trajs}  env steps {steps}  wall {wall:.2} s");
    let per_step_us = wall * 1e6 / steps as f64;
    println!(
        "  per env step     {per_step_us:8.2} µs (generate + env.step + bookkeeping; bound {STEP_BOUND_US} µs: {})",
        verdict(per_step_us <= STEP_BOUND_US)
    );
    println!("  per trajectory   {:8.2} µs", wall * 1e6 / trajs as f64);
    println!(
        "  peak in flight   {peak} episodes; peak RSS {:.1} MiB (+{:.1} MiB during the run)",
        rss1 as f64 / 1024.0,
        (rss1.saturating_sub(rss0)) as f64 / 1024.0
    );
    let per_traj_kib = (rss1.saturating_sub(rss0)) as f64 / peak as f64;
    println!(
        "  memory per in-flight trajectory ≈ {per_traj_kib:.1} KiB (RSS growth / peak episodes; bound {TRAJ_BOUND_KIB} KiB: {})",
        verdict(per_traj_kib <= TRAJ_BOUND_KIB)
    );
    ray_beside(episodes.min(RAY_EPISODES), turns, wall * 1e6 / steps as f64);
    Ok(())
}

/// Concurrent episodes of the Ray probe at most: each Ray actor call costs milliseconds, so
/// 10,000 episodes would take minutes; the probe reports per step, like the loop above.
const RAY_EPISODES: usize = 1000;

/// The same loop on Ray async actors (`tests/bench-ray.py`), run just after ours when its
/// Python environment is there (`make bench-setup`); prints both per-step costs and the ratio.
fn ray_beside(episodes: usize, turns: u64, ours_us: f64) {
    let python = std::env::var_os("ROLLARC_RAY_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/rollarc/ray-venv/bin/python")
        });
    let script =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/bench-ray.py");
    let out = std::process::Command::new(&python)
        .arg(&script)
        .args([episodes.to_string(), turns.to_string()])
        .stderr(std::process::Stdio::null())
        .output();
    let line = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .next_back(),
        Ok(o) => {
            println!(
                "  Ray comparison failed ({}): run `make bench-setup`",
                o.status
            );
            return;
        }
        Err(e) => {
            println!(
                "  Ray comparison skipped ({}: {e}): run `make bench-setup`",
                python.display()
            );
            return;
        }
    };
    let Some(r) = line else {
        println!("  Ray comparison printed no result");
        return;
    };
    let theirs = r["us_per_step"].as_f64().unwrap_or(f64::NAN);
    println!(
        "  beside it, Ray {} async actors, the same loop ({episodes} episodes × {turns} turns, zero-latency actors): {theirs:.1} µs per env step = {:.0}× rollarc's {ours_us:.2} µs",
        r["ray"].as_str().unwrap_or("?"),
        theirs / ours_us
    );
}
