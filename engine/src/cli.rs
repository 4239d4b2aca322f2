//! Command-line helpers: the progress display of a job (in-process or remote), its metrics,
//! the lines and tables other commands print, and the `sim` comparison. The benchmarks are in
//! [`lab::bench`].

use std::collections::BTreeMap;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use infra::clock::wall_now;
use tokio::sync::broadcast;

use job::runtime::{JobError, JobSummary};
use job::spec::{JobSpec, Preset};
use lab::report::Summary;
use lab::scenario::RunResult;
use service::service::JobEvent;

/// Why following a remote job failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WatchError {
    #[error(transparent)]
    Http(#[from] reqwest::Error),
    #[error("{status}: {body}")]
    Status {
        status: reqwest::StatusCode,
        body: String,
    },
    #[error("the token is not a valid HTTP header value")]
    BadToken,
}

/// Why `rollarc sim` failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SimError {
    #[error("unknown preset {0:?}, expected one of sync, sync_plus, one_off, areal, rollarc")]
    UnknownPreset(String),
    #[error(transparent)]
    Run(#[from] JobError),
    #[error(transparent)]
    Metrics(#[from] serde_json::Error),
}

fn bar(steps: u64) -> ProgressBar {
    let pb = ProgressBar::new(steps);
    pb.set_style(
        ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} steps {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
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

fn progress_msg_full(m: &serde_json::Value, extra: &str) -> String {
    let f = |p: &str| m.pointer(p).and_then(|v| v.as_f64()).unwrap_or(0.0);
    let step_s = f("/step_s").max(1e-9);
    format!(
        "v{} · {:.0} tok/s · bubble {:.2} · staleness {:.2}{extra}",
        f("/version"),
        (f("/prefill_tokens") + f("/decode_tokens")) / step_s,
        f("/bubble_ratio"),
        f("/staleness_mean")
    )
}

/// One bar per task: success as the bar, trajectories/s and turns in the message.
fn task_bar(mp: &indicatif::MultiProgress, name: &str) -> ProgressBar {
    let pb = mp.add(ProgressBar::new(100));
    pb.set_style(
        ProgressStyle::with_template("  {prefix:<12} [{bar:30}] {pos:>3}% success {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb.set_prefix(name.to_string());
    pb
}

/// Shows an in-process job's events until it ends, with a bar per task (success,
/// trajectories/s, turns) and `extra()` appended to the job bar's message at every step (e.g.
/// function instances); returns the last event. `rx`: none when the job had already ended
/// (see `Service::subscribe`).
pub(crate) async fn watch_events_with(
    rx: Option<broadcast::Receiver<JobEvent>>,
    first: Option<JobEvent>,
    extra: impl Fn() -> String,
) -> Option<JobEvent> {
    let mp = indicatif::MultiProgress::new();
    // Bars on a terminal; a plain line per step otherwise (a log, a pipe, CI).
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut tasks: BTreeMap<String, ProgressBar> = BTreeMap::new();
    let mut pb: Option<ProgressBar> = None;
    let mut last = first.clone();
    if let Some(JobEvent::State { state, .. }) = &first
        && state.is_terminal()
    {
        return first;
    }
    let Some(mut rx) = rx else {
        return first;
    };
    loop {
        match rx.recv().await {
            Ok(e) => {
                match &e {
                    JobEvent::Progress {
                        step,
                        steps,
                        metrics,
                        ..
                    } => {
                        if !tty {
                            println!(
                                "step {step}/{steps} {}",
                                progress_msg_full(metrics, &extra())
                            );
                            print_plain_tasks_and_evals(metrics);
                        }
                        let b = pb.get_or_insert_with(|| mp.add(bar(*steps)));
                        b.set_position(*step);
                        b.set_message(progress_msg_full(metrics, &extra()));
                        let step_s = metrics
                            .pointer("/step_s")
                            .and_then(|v| v.as_f64())
                            .unwrap_or(0.0)
                            .max(1e-9);
                        if let Some(ts) = metrics.get("tasks").and_then(|t| t.as_object()) {
                            for (name, t) in ts {
                                let g = |k: &str| t.get(k).and_then(|v| v.as_f64()).unwrap_or(0.0);
                                if g("trajectories") == 0.0 {
                                    continue;
                                }
                                let tb = tasks
                                    .entry(name.clone())
                                    .or_insert_with(|| task_bar(&mp, name));
                                tb.set_position((g("success_rate") * 100.0).round() as u64);
                                tb.set_message(format!(
                                    "· {:.1} traj/s · {:.1} turns",
                                    g("trajectories") / step_s,
                                    g("mean_turns")
                                ));
                            }
                        }
                    }
                    JobEvent::State { id, state, .. } => {
                        let b = pb.get_or_insert_with(|| mp.add(bar(0)));
                        b.set_prefix(format!("{id} {}", state.as_str()));
                    }
                    JobEvent::WeightsInstalled { .. } => {}
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
    for t in tasks.values() {
        // Keep the last success rate on screen (finish() would fill the bar).
        t.abandon();
    }
    last
}

/// The HTTP client of the client commands: sends `token` as a bearer token on every request.
pub(crate) fn api_client(token: Option<&str>) -> Result<reqwest::Client, WatchError> {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(t) = token {
        let mut v = reqwest::header::HeaderValue::from_str(&format!("Bearer {t}"))
            .map_err(|_| WatchError::BadToken)?;
        v.set_sensitive(true);
        headers.insert(reqwest::header::AUTHORIZATION, v);
    }
    Ok(reqwest::Client::builder()
        .default_headers(headers)
        .build()?)
}

/// Without a terminal: each task's success and any held-out evaluation of a step, a line
/// each.
fn print_plain_tasks_and_evals(metrics: &serde_json::Value) {
    if let Some(ts) = metrics.get("tasks").and_then(|t| t.as_object()) {
        for (name, t) in ts {
            let g = |k: &str| t.get(k).and_then(|v| v.as_f64()).unwrap_or(0.0);
            if g("trajectories") > 0.0 {
                println!(
                    "  {name}: success {:.3} · reward {:.3} · {:.1} turns",
                    g("success_rate"),
                    g("mean_reward"),
                    g("mean_turns")
                );
            }
        }
    }
    for e in metrics
        .get("eval")
        .and_then(|e| e.as_array())
        .into_iter()
        .flatten()
    {
        let step = e.get("step").and_then(|s| s.as_u64()).unwrap_or(0);
        for (name, t) in e
            .get("tasks")
            .and_then(|t| t.as_object())
            .into_iter()
            .flatten()
        {
            let g = |k: &str| t.get(k).and_then(|v| v.as_f64()).unwrap_or(0.0);
            println!(
                "  eval {name} after step {step}: pass@1 {:.3} ± {:.3} · pass@{} {:.3}",
                g("pass_at_1"),
                g("pass_at_1_stderr"),
                g("k"),
                g("pass_at_k")
            );
        }
    }
}

/// Follows a remote job's server-sent events.
pub(crate) async fn watch_remote(
    client: &reqwest::Client,
    server: &str,
    id: &str,
) -> Result<std::process::ExitCode, WatchError> {
    use futures::StreamExt;
    // Bars on a terminal; plain lines otherwise (a log, a pipe, CI).
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut pb: Option<ProgressBar> = None;
    let mut last_id: Option<String> = None;
    let mut ended = false;
    let mut drops = 0;
    while !ended {
        let mut req = client.get(format!("{server}/v1/jobs/{id}/events"));
        if let Some(l) = &last_id {
            req = req.header("last-event-id", l);
        }
        let r = req.send().await?;
        let status = r.status();
        if !status.is_success() {
            let body = r.text().await?;
            return Err(WatchError::Status { status, body });
        }
        let mut stream = r.bytes_stream();
        let mut buf = String::new();
        while let Some(chunk) = stream.next().await {
            let Ok(chunk) = chunk else { break };
            buf.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(pos) = buf.find('\n') {
                let line: String = buf.drain(..=pos).collect();
                let line = line.trim_end();
                if let Some(eid) = line.strip_prefix("id:") {
                    last_id = Some(eid.trim().to_string());
                    continue;
                }
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let Ok(v) = serde_json::from_str::<serde_json::Value>(data.trim()) else {
                    continue;
                };
                let u = |k: &str| v.get(k).and_then(|s| s.as_u64()).unwrap_or(0);
                match v.get("type").and_then(|t| t.as_str()) {
                    Some("progress") => {
                        let m = v.get("metrics").unwrap_or(&serde_json::Value::Null);
                        if tty {
                            let b = pb.get_or_insert_with(|| bar(u("steps")));
                            b.set_length(u("steps"));
                            b.set_position(u("step"));
                            b.set_message(progress_msg(m));
                        } else {
                            println!("{id} step {}/{} {}", u("step"), u("steps"), progress_msg(m));
                        }
                    }
                    Some("weights_installed") if !tty => {
                        println!("{id} weights v{} installed", u("version"));
                    }
                    Some("state") => {
                        let state = v.get("state").and_then(|s| s.as_str()).unwrap_or("");
                        ended = matches!(state, "succeeded" | "failed" | "cancelled");
                        if tty {
                            let b = pb.get_or_insert_with(|| bar(u("steps")));
                            b.set_position(u("step"));
                            b.set_prefix(format!("{id} {state}"));
                        } else if !ended {
                            println!("{id} {state} at step {}/{}", u("step"), u("steps"));
                        }
                    }
                    _ => {}
                }
            }
        }
        if !ended {
            // The connection dropped: resume after the last event seen.
            drops += 1;
            if drops > 30 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    // The bar stays where the job stopped (a cancelled job's bar is not filled).
    if let Some(b) = pb {
        b.abandon();
    }
    let r = client.get(format!("{server}/v1/jobs/{id}")).send().await?;
    let status = r.status();
    if !status.is_success() {
        let body = r.text().await?;
        return Err(WatchError::Status { status, body });
    }
    let j: serde_json::Value = r.json().await?;
    let u = |k: &str| j.get(k).and_then(|s| s.as_u64()).unwrap_or(0);
    let state = j["state"].as_str().unwrap_or("unknown");
    println!("{id} {state} after {}/{} steps", u("step"), u("steps"));
    if let Some(e) = j["error"].as_str() {
        println!("error: {e}");
    }
    Ok(if state == "succeeded" {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    })
}

pub(crate) fn print_metrics(m: &serde_json::Value) {
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
                t.get("success_rate")
                    .and_then(|v| v.as_f64())
                    .unwrap_or(0.0),
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
    print_functions(&s.functions);
}

/// One line per simulated function deployment: calls, instances, and its GPU time.
fn print_functions(functions: &std::collections::BTreeMap<String, actors::reward::FunctionUsage>) {
    for (name, u) in functions {
        let held = if u.gpus_per_instance > 0 {
            format!(
                "{:.0} GPU-s held ({} per instance), {:.1} % busy, batches of {:.1}",
                u.gpu_s(),
                u.gpus_per_instance,
                100.0 * u.utilisation(),
                u.mean_batch
            )
        } else {
            format!(
                "{:.0} instance-s held, {:.1} % busy",
                u.instance_s,
                100.0 * u.utilisation()
            )
        };
        println!(
            "    function {name}: {} calls, {} cold starts, peak {} instances, {held}",
            u.calls, u.cold_starts, u.peak_instances
        );
    }
}

/// `rollarc sim`: runs the spec (optionally under several presets) in virtual time.
pub(crate) fn sim(spec: JobSpec, preset: Option<&str>, compare: &[String]) -> Result<(), SimError> {
    let parse = |p: &str| Preset::parse(p).ok_or_else(|| SimError::UnknownPreset(p.to_string()));
    let base = match preset {
        Some(p) => spec.with_preset(parse(p)?),
        None => spec,
    };
    if compare.is_empty() {
        let t = wall_now();
        let s = job::simrun::run_virtual(base)?;
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
        let s = job::simrun::run_virtual(base.with_preset(p))?;
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

/// One run of a scenario, as `rollarc scenario` prints it.
pub(crate) fn print_run(r: &RunResult) {
    println!(
        "  {:<28} step {:>9.1} s  bubble {:.3}  trainer busy {:.2}  ({} steps, {:.0} simulated s, {:.2} s wall, {} events)  prefill/decode {:.1}  stale {}/{}  pools {}",
        r.name,
        r.metrics.get("step_s").copied().unwrap_or(0.0),
        r.metrics.get("bubble").copied().unwrap_or(0.0),
        r.metrics.get("trainer_busy").copied().unwrap_or(0.0),
        r.steps,
        r.simulated_s,
        r.wall_s,
        r.events,
        r.prefill_tokens as f64 / r.decode_tokens.max(1) as f64,
        r.stale_aborted,
        r.stale_evicted,
        r.pools
            .iter()
            .map(|(k, v)| format!(
                "{k} {v:.2} ({} groups)",
                r.pool_groups.get(k).copied().unwrap_or(0)
            ))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if r.jobs > 1 {
        println!("    {} jobs on one clock (figures are their mean)", r.jobs);
    }
    print_functions(&r.functions);
}

/// The per-task table of a job's report.
pub(crate) fn print_task_table(summary: &Summary) {
    println!(
        "{:<12} {:>14} {:>14} {:>12} {:>10} {:>10}",
        "task", "random policy", "success start", "success end", "≥90% at", "truncated"
    );
    for (name, t) in &summary.tasks {
        let at = t
            .first_step_at_90
            .map(|s| format!("step {s}"))
            .unwrap_or_else(|| "-".into());
        let random = t
            .success_random
            .map(|r| format!("{r:.3}"))
            .unwrap_or_else(|| "-".into());
        println!(
            "{name:<12} {random:>14} {:>14.3} {:>12.3} {at:>10} {:>9.1}%",
            t.success_start,
            t.success_end,
            100.0 * t.truncation_rate
        );
    }
    if summary.truncated > 0 {
        println!(
            "{} trajectories ended at their context budget (status truncated)",
            summary.truncated
        );
    }
    if !summary.eval_change.is_empty() {
        println!(
            "{:<16} {:>22} {:>22} {:>10}",
            "held-out task", "pass@1 start (± se)", "pass@1 end (± se)", "change"
        );
        for (name, c) in &summary.eval_change {
            println!(
                "{name:<16} {:>22} {:>22} {:>+9.1}pt",
                format!(
                    "{:.3} ± {:.3} @{}",
                    c.pass_at_1_start, c.stderr_start, c.step_start
                ),
                format!(
                    "{:.3} ± {:.3} @{}",
                    c.pass_at_1_end, c.stderr_end, c.step_end
                ),
                c.change_points
            );
        }
    }
}

/// `rollarc devices`: the GPUs found, with the profile the mapper would use, and the device
/// classes it knows.
pub(crate) fn print_devices() {
    match actors::device::discover_gpus() {
        Ok(gpus) if gpus.is_empty() => println!("no GPU found"),
        Ok(gpus) => {
            for g in gpus {
                println!(
                    "GPU {}: {} — {} SMs, {:.0} GB, {} MHz, mem {} MHz × {} bit → {:.0} TFLOP/s (est.), {:.2} TB/s",
                    g.ordinal,
                    g.name,
                    g.sms,
                    g.memory_bytes as f64 / 1e9,
                    g.clock_mhz,
                    g.memory_clock_mhz,
                    g.bus_width_bits,
                    g.profile.flops / 1e12,
                    g.profile.bandwidth / 1e12
                );
            }
        }
        Err(e) => println!("{e}"),
    }
    println!("device classes known to the mapper:");
    for n in actors::device::DeviceProfile::BUILTIN_NAMES {
        if let Some(d) = actors::device::DeviceProfile::builtin(n) {
            println!(
                "  {:5} {:8.1} TFLOP/s  {:5.2} TB/s  {:4.0} GB  cost ×{:.2}",
                d.name,
                d.flops / 1e12,
                d.bandwidth / 1e12,
                d.memory / 1e9,
                d.cost
            );
        }
    }
}

/// `rollarc status`: one line per job (id, state, steps, success, name).
pub(crate) fn job_table(jobs: &serde_json::Value) -> String {
    let mut out = format!(
        "{:<10} {:<10} {:>11} {:>8}  {}\n",
        "ID", "STATE", "STEP", "SUCCESS", "NAME"
    );
    for j in jobs.as_array().into_iter().flatten() {
        let u = |k: &str| j.get(k).and_then(|s| s.as_u64()).unwrap_or(0);
        let success = j
            .pointer("/metrics/success_rate")
            .and_then(|s| s.as_f64())
            .map_or("-".to_string(), |s| format!("{s:.2}"));
        out.push_str(&format!(
            "{:<10} {:<10} {:>11} {:>8}  {}\n",
            j["id"].as_str().unwrap_or("?"),
            j["state"].as_str().unwrap_or("?"),
            format!("{}/{}", u("step"), u("steps")),
            success,
            j["name"].as_str().unwrap_or("")
        ));
    }
    out
}

/// `rollarc status ID`: the job's state, progress, error and its tasks' latest numbers.
pub(crate) fn job_detail(j: &serde_json::Value) -> String {
    let u = |k: &str| j.get(k).and_then(|s| s.as_u64()).unwrap_or(0);
    let mut out = format!(
        "{} {} at step {}/{}{}\n",
        j["id"].as_str().unwrap_or("?"),
        j["state"].as_str().unwrap_or("?"),
        u("step"),
        u("steps"),
        j["name"]
            .as_str()
            .map(|n| format!(" ({n})"))
            .unwrap_or_default()
    );
    if let Some(e) = j["error"].as_str() {
        out.push_str(&format!("error: {e}\n"));
    }
    let m = &j["metrics"];
    if m.get("version").is_some() {
        out.push_str(&format!("{}\n", progress_msg(m)));
    }
    if let Some(tasks) = m["tasks"].as_object() {
        out.push_str(&format!(
            "  {:<14} {:>8} {:>8} {:>6}\n",
            "task", "success", "reward", "turns"
        ));
        for (name, t) in tasks {
            let f = |k: &str| t.get(k).and_then(|x| x.as_f64()).unwrap_or(0.0);
            out.push_str(&format!(
                "  {:<14} {:>8.3} {:>8.3} {:>6.1}\n",
                name,
                f("success_rate"),
                f("mean_reward"),
                f("mean_turns")
            ));
        }
    }
    out
}
