//! Command-line helpers: progress display, the `sim` comparison and the scheduler benchmark.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::broadcast;

use crate::job::JobSummary;
use crate::service::JobEvent;
use crate::spec::{self, JobSpec, Preset};

fn bar(steps: u64) -> ProgressBar {
    let pb = ProgressBar::new(steps);
    pb.set_style(ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} steps {msg}").unwrap_or_else(|_| ProgressStyle::default_bar()));
    pb
}

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

/// Shows an in-process job's events until it ends; returns the last event.
pub async fn watch_events(mut rx: broadcast::Receiver<JobEvent>, first: Option<JobEvent>) -> Option<JobEvent> {
    let mut pb: Option<ProgressBar> = None;
    let mut last = first.clone();
    if let Some(JobEvent::State { state, .. }) = &first
        && state.is_terminal()
    {
        return first;
    }
    loop {
        match rx.recv().await {
            Ok(e) => {
                match &e {
                    JobEvent::Progress { step, steps, metrics, .. } => {
                        let b = pb.get_or_insert_with(|| bar(*steps));
                        b.set_position(*step);
                        b.set_message(progress_msg(metrics));
                    }
                    JobEvent::State { id, state, .. } => {
                        let b = pb.get_or_insert_with(|| bar(0));
                        b.set_prefix(format!("{id} {}", state.as_str()));
                    }
                }
                let end = matches!(&e, JobEvent::State { state, .. } if state.is_terminal());
                last = Some(e);
                if end {
                    break;
                }
            }
            Err(broadcast::error::RecvError::Lagged(_)) => continue,
            Err(broadcast::error::RecvError::Closed) => break,
        }
    }
    if let Some(b) = pb {
        b.finish();
    }
    last
}

/// Follows a remote job's server-sent events.
pub async fn watch_remote(server: &str, id: &str) -> anyhow::Result<std::process::ExitCode> {
    use futures::StreamExt;
    let r = reqwest::get(format!("{server}/v1/jobs/{id}/events")).await?;
    if !r.status().is_success() {
        anyhow::bail!("{}: {}", r.status(), r.text().await?);
    }
    let mut stream = r.bytes_stream();
    let mut buf = String::new();
    let mut pb: Option<ProgressBar> = None;
    let mut ok = false;
    while let Some(chunk) = stream.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk?));
        while let Some(pos) = buf.find('\n') {
            let line: String = buf.drain(..=pos).collect();
            let Some(data) = line.trim_end().strip_prefix("data:") else { continue };
            let Ok(v) = serde_json::from_str::<serde_json::Value>(data.trim()) else { continue };
            match v.get("type").and_then(|t| t.as_str()) {
                Some("progress") => {
                    let steps = v.get("steps").and_then(|s| s.as_u64()).unwrap_or(0);
                    let b = pb.get_or_insert_with(|| bar(steps));
                    b.set_length(steps);
                    b.set_position(v.get("step").and_then(|s| s.as_u64()).unwrap_or(0));
                    b.set_message(progress_msg(v.get("metrics").unwrap_or(&serde_json::Value::Null)));
                }
                Some("state") => {
                    let state = v.get("state").and_then(|s| s.as_str()).unwrap_or("");
                    let b = pb.get_or_insert_with(|| bar(v.get("steps").and_then(|s| s.as_u64()).unwrap_or(0)));
                    b.set_prefix(format!("{id} {state}"));
                    ok = state == "succeeded";
                }
                _ => {}
            }
        }
    }
    if let Some(b) = pb {
        b.finish();
    }
    Ok(if ok { std::process::ExitCode::SUCCESS } else { std::process::ExitCode::FAILURE })
}

pub fn print_metrics(m: &serde_json::Value) {
    let f = |p: &str| m.pointer(p).and_then(|v| v.as_f64()).unwrap_or(0.0);
    println!(
        "time {:.1} s · trajectories/s {:.2} · bubble ratio {:.3} · staleness mean {:.2} max {}",
        f("/elapsed_s"),
        f("/trajectories_per_s"),
        f("/bubble_ratio"),
        f("/staleness_mean"),
        f("/staleness_max")
    );
    if let Some(pools) = m.get("pools").and_then(|p| p.as_object()) {
        for (name, p) in pools {
            println!(
                "  pool {name:8} {:5} ×{}  utilisation {:.3}  groups {}",
                p.get("device").and_then(|v| v.as_str()).unwrap_or(""),
                p.get("shards").and_then(|v| v.as_u64()).unwrap_or(0),
                p.get("utilisation").and_then(|v| v.as_f64()).unwrap_or(0.0),
                p.get("groups").and_then(|v| v.as_u64()).unwrap_or(0)
            );
        }
    }
    if let Some(tasks) = m.get("tasks").and_then(|p| p.as_object()) {
        for (name, t) in tasks {
            println!(
                "  task {name:12} success {:.3}  mean turns {:.1}",
                t.get("success_rate").and_then(|v| v.as_f64()).unwrap_or(0.0),
                t.get("mean_turns").and_then(|v| v.as_f64()).unwrap_or(0.0)
            );
        }
    }
}

fn summary_line(label: &str, s: &JobSummary, wall: Duration) {
    let steps = s.steps_done.max(1) as f64;
    println!(
        "{label:10} virtual {:9.1} s  steps/min {:7.3}  traj/s {:7.2}  bubble {:.3}  wall {:.2} s",
        s.elapsed_s,
        steps / (s.elapsed_s / 60.0).max(1e-9),
        s.trajectories_committed as f64 / s.elapsed_s.max(1e-9),
        s.bubble_ratio,
        wall.as_secs_f64()
    );
}

/// Wall time of a host-side measurement (simulations report virtual time separately).
#[allow(clippy::disallowed_methods)]
fn wall_now() -> std::time::Instant {
    std::time::Instant::now()
}

/// `rollarc sim`: runs the spec (optionally under several presets) in virtual time.
pub fn sim(spec: JobSpec, preset: Option<&str>, compare: &[String]) -> anyhow::Result<()> {
    let parse = |p: &str| Preset::parse(p).ok_or_else(|| anyhow::anyhow!("unknown preset {p:?}, expected one of sync, sync_plus, one_off, rollarc"));
    let base = match preset {
        Some(p) => spec.with_preset(parse(p)?),
        None => spec,
    };
    if compare.is_empty() {
        let t = wall_now();
        let s = crate::simrun::run_virtual(base)?;
        summary_line(s.steps.last().map_or("run", |_| "run"), &s, t.elapsed());
        if let Some(last) = s.steps.last() {
            print_metrics(&serde_json::to_value(last)?);
        }
        return Ok(());
    }
    let mut results = Vec::new();
    for name in compare {
        let p = parse(name)?;
        let t = wall_now();
        let s = crate::simrun::run_virtual(base.with_preset(p))?;
        summary_line(p.name(), &s, t.elapsed());
        results.push((p, s));
    }
    if let Some((first, fs)) = results.first() {
        for (p, s) in &results[1..] {
            println!(
                "{} is {:.2}× faster than {} (virtual time for the same {} steps)",
                first.name(),
                s.elapsed_s / fs.elapsed_s.max(1e-9),
                p.name(),
                fs.steps_done
            );
        }
    }
    Ok(())
}

fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

/// The scheduler-overhead benchmark: zero-latency environments and an ideal (infinitely fast)
/// device, so all wall time is orchestration: actors, messages, buffer, scheduler.
pub fn bench(episodes: usize) -> anyhow::Result<()> {
    let groups = (episodes / 8).max(1);
    let turns = 5;
    let body = format!(
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
    );
    let spec = spec::parse(&body, spec::Format::Toml).map_err(|e| anyhow::anyhow!("{e}"))?;
    let rss0 = peak_rss_kib();
    let t = wall_now();
    let s = crate::simrun::run_virtual(spec)?;
    let wall = t.elapsed().as_secs_f64();
    let rss1 = peak_rss_kib();
    let trajs = s.trajectories_committed.max(1);
    let steps = trajs * turns;
    let peak = s.steps.iter().map(|m| m.scheduler.peak_active_episodes).max().unwrap_or(0).max(1);
    println!("scheduler overhead benchmark: {episodes} concurrent episodes, {turns} turns each, zero-latency backends");
    println!("  trajectories {trajs}  env steps {steps}  wall {wall:.2} s");
    println!("  per env step     {:8.2} µs (generate + env.step + bookkeeping)", wall * 1e6 / steps as f64);
    println!("  per trajectory   {:8.2} µs", wall * 1e6 / trajs as f64);
    println!(
        "  peak in flight   {peak} episodes; peak RSS {:.1} MiB (+{:.1} MiB during the run)",
        rss1 as f64 / 1024.0,
        (rss1.saturating_sub(rss0)) as f64 / 1024.0
    );
    println!("  memory per in-flight trajectory ≈ {:.1} KiB (RSS growth / peak episodes)", (rss1.saturating_sub(rss0)) as f64 / peak as f64);
    Ok(())
}
