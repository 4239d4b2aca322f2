//! Following a job: the progress bars (or plain lines) of an in-process job's events and of a
//! remote job's server-sent events, and the HTTP client of the client commands.

use std::collections::BTreeMap;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::broadcast;

use service::service::JobEvent;

use super::progress_msg;

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

/// How long the first step may take before [`FIRST_STEP_NOTE`] is shown.
const FIRST_STEP_NOTE_AFTER: std::time::Duration = std::time::Duration::from_secs(15);

/// Why a first step can be slow, shown once when it is.
const FIRST_STEP_NOTE: &str = "still waiting for step 1: the first step waits for the \
    environments' first resets, and bridges and external programs start once (Python imports \
    its packages, reasoning-gym builds its dataset), which can take tens of seconds on a busy \
    machine; later steps do not pay it";

/// The job's bar: `steps` long, its state as the prefix, its progress as the message.
fn bar(steps: u64) -> ProgressBar {
    let pb = ProgressBar::new(steps);
    pb.set_style(
        ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} steps {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb
}

/// A step's progress with its token throughput, and `extra` at the end.
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
    let mut told = false;
    loop {
        // A first step that takes long is most often the environments' start: say so once.
        let next = if pb.is_none() && !told {
            match tokio::time::timeout(FIRST_STEP_NOTE_AFTER, rx.recv()).await {
                Ok(r) => r,
                Err(_) => {
                    told = true;
                    if tty {
                        let _ = mp.println(FIRST_STEP_NOTE);
                    } else {
                        println!("{FIRST_STEP_NOTE}");
                    }
                    continue;
                }
            }
        } else {
            rx.recv().await
        };
        match next {
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
