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
    println!(
        "  per env step     {:8.2} µs (generate + env.step + bookkeeping)",
        wall * 1e6 / steps as f64
    );
    println!("  per trajectory   {:8.2} µs", wall * 1e6 / trajs as f64);
    println!(
        "  peak in flight   {peak} episodes; peak RSS {:.1} MiB (+{:.1} MiB during the run)",
        rss1 as f64 / 1024.0,
        (rss1.saturating_sub(rss0)) as f64 / 1024.0
    );
    println!(
        "  memory per in-flight trajectory ≈ {:.1} KiB (RSS growth / peak episodes)",
        (rss1.saturating_sub(rss0)) as f64 / peak as f64
    );
    Ok(())
}
