//! One instance's life: a child process (its own process group) on a free port, probed until
//! ready, served until it dies or is stopped; stopped by SIGTERM, SIGKILL after the grace.

use std::process::{ExitStatus, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::AsyncBufReadExt;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::deployment::{Deployment, Phase, event};
use crate::faas::config::Dur;
use crate::process::{ProcessError, Spawned};

/// Why an instance died or never became ready.
#[derive(Debug, thiserror::Error)]
enum InstanceFailure {
    #[error("no free port")]
    NoPort(#[source] std::io::Error),
    #[error("cannot start the function")]
    Start(#[source] ProcessError),
    #[error("exited during startup: {0}")]
    ExitedDuringStartup(ExitStatus),
    #[error("not ready after {0}")]
    NotReady(Dur),
    #[error("exited: {0}")]
    Exited(ExitStatus),
    #[error("wait failed")]
    Wait(#[source] ProcessError),
}

enum Exit {
    /// Failed to start, never became ready, or died during startup: what a crash loop is
    /// made of.
    Crashed(InstanceFailure),
    /// Died after it became ready and served (killed from outside, an OOM under load, a
    /// node drained): replaced at once, and not counted towards a crash loop. Such deaths
    /// cost calls, which the job's fault budget watches.
    DiedServing(InstanceFailure),
    Stopped,
}

/// A free port for a new instance. The kernel may hand the same ephemeral port to two binds in
/// a row once the first listener is closed, so ports given out recently are skipped (two
/// instances starting together would otherwise race for one port and one would die).
fn free_port() -> std::io::Result<u16> {
    static RECENT: Mutex<std::collections::VecDeque<u16>> =
        Mutex::new(std::collections::VecDeque::new());
    let mut recent = RECENT.lock().unwrap_or_else(|p| p.into_inner());
    let mut port = 0;
    for _ in 0..32 {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        port = l.local_addr()?.port();
        if !recent.contains(&port) {
            break;
        }
    }
    recent.push_back(port);
    while recent.len() > 1024 {
        recent.pop_front();
    }
    Ok(port)
}

/// Runs one instance to its end, then frees its slot (after a backoff when it crashed).
pub(super) async fn run_instance(dep: Arc<Deployment>, id: u64, mut stop: oneshot::Receiver<()>) {
    let exit = instance_life(&dep, id, &mut stop).await;
    let backoff = {
        let mut st = dep.lock();
        match &exit {
            Exit::Crashed(why) => {
                st.consecutive_crashes += 1;
                let tail: Vec<&str> = st.stderr_tail.iter().map(String::as_str).collect();
                st.last_failure = Some(if tail.is_empty() {
                    format!("instance {id} {}", crate::error_chain(why))
                } else {
                    format!(
                        "instance {id} {}; its stderr ended: {}",
                        crate::error_chain(why),
                        tail.join(" | ")
                    )
                });
                dep.counters.crashed.fetch_add(1, Ordering::Relaxed);
                event(&dep, "crashed");
                tracing::warn!(function = %dep.cfg.name, instance = id, why = %crate::error_chain(why), "instance failed; it will be replaced");
                if let Some(i) = st.instances.get_mut(&id) {
                    i.phase = Phase::Draining;
                }
                dep.publish(&st);
                Some(Duration::from_millis(
                    100 * 2u64.pow(st.consecutive_crashes.min(7)),
                ))
            }
            Exit::DiedServing(why) => {
                st.last_failure = Some(format!(
                    "instance {id} {} after it became ready",
                    crate::error_chain(why)
                ));
                dep.counters.died_serving.fetch_add(1, Ordering::Relaxed);
                event(&dep, "died");
                tracing::warn!(function = %dep.cfg.name, instance = id, why = %crate::error_chain(why), "a ready instance died; it will be replaced");
                if let Some(i) = st.instances.get_mut(&id) {
                    i.phase = Phase::Draining;
                }
                dep.publish(&st);
                None
            }
            Exit::Stopped => None,
        }
    };
    // A crashing function is not restarted in a tight loop: its slot stays taken for a backoff.
    if let Some(b) = backoff {
        tokio::select! {
            _ = tokio::time::sleep(b) => {}
            _ = dep.cancel.cancelled() => {}
        }
    }
    let mut st = dep.lock();
    st.instances.remove(&id);
    dep.publish(&st);
    drop(st);
    dep.poke.notify_one();
}

fn startup_failed(dep: &Deployment) {
    dep.counters
        .startup_failures
        .fetch_add(1, Ordering::Relaxed);
    event(dep, "startup_failed");
}

/// Starts the function's process on `port`, its stderr forwarded to the log.
fn start(dep: &Arc<Deployment>, id: u64, port: u16) -> Result<Spawned, ProcessError> {
    let cfg = &dep.cfg;
    let mut cmd = tokio::process::Command::new(&cfg.command);
    cmd.args(&cfg.args)
        .envs(&cfg.env)
        .env("PORT", port.to_string())
        .env("HOST", "127.0.0.1")
        .env("K_SERVICE", &cfg.name)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = crate::process::spawn(cmd)?;
    if let Some(stderr) = child.take_stderr() {
        let dep = dep.clone();
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                tracing::debug!(target: "rollarc::function", function = %dep.cfg.name, instance = id, "{}", line.chars().take(2000).collect::<String>());
                let mut st = dep.lock();
                if st.stderr_tail.len() >= super::deployment::STDERR_TAIL_LINES {
                    st.stderr_tail.pop_front();
                }
                st.stderr_tail.push_back(line.chars().take(300).collect());
            }
        });
    }
    Ok(child)
}

enum Startup {
    Ready,
    Failed(InstanceFailure),
    Stopped,
}

/// Readiness: probe every 200 ms with a 300 ms timeout until the startup deadline.
async fn wait_ready(
    dep: &Deployment,
    child: &mut Spawned,
    url: &str,
    stop: &mut oneshot::Receiver<()>,
) -> Startup {
    let cfg = &dep.cfg;
    let deadline = Instant::now() + cfg.startup_timeout.0;
    let probe_url = format!("{url}{}", cfg.readiness_path);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Startup::Failed(InstanceFailure::ExitedDuringStartup(status));
        }
        if let Ok(r) = dep
            .probe
            .get(&probe_url)
            .timeout(Duration::from_millis(300))
            .send()
            .await
            && r.status().is_success()
        {
            return Startup::Ready;
        }
        if Instant::now() >= deadline {
            startup_failed(dep);
            return Startup::Failed(InstanceFailure::NotReady(cfg.startup_timeout));
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = &mut *stop => return Startup::Stopped,
        }
    }
}

async fn instance_life(dep: &Arc<Deployment>, id: u64, stop: &mut oneshot::Receiver<()>) -> Exit {
    let port = match free_port() {
        Ok(p) => p,
        Err(e) => return Exit::Crashed(InstanceFailure::NoPort(e)),
    };
    let url = format!("http://127.0.0.1:{port}");
    let mut child = match start(dep, id, port) {
        Ok(c) => c,
        Err(e) => {
            startup_failed(dep);
            return Exit::Crashed(InstanceFailure::Start(e));
        }
    };
    dep.counters.started.fetch_add(1, Ordering::Relaxed);
    event(dep, "started");
    {
        let mut st = dep.lock();
        if let Some(i) = st.instances.get_mut(&id) {
            i.url = url.clone();
            i.pid = child.id();
        }
    }
    match wait_ready(dep, &mut child, &url, stop).await {
        Startup::Ready => {}
        Startup::Stopped => {
            let _ = child.kill_and_wait().await;
            return Exit::Stopped;
        }
        Startup::Failed(why) => {
            let _ = child.kill_and_wait().await;
            return Exit::Crashed(why);
        }
    }
    {
        let mut st = dep.lock();
        st.consecutive_crashes = 0;
        if let Some(i) = st.instances.get_mut(&id)
            && i.phase == Phase::Starting
        {
            i.phase = Phase::Ready;
        }
        dep.publish(&st);
    }
    dep.counters.ready.fetch_add(1, Ordering::Relaxed);
    event(dep, "ready");
    serve(dep, child, stop).await
}

/// A ready instance until it dies (its group is killed) or is stopped (drained).
async fn serve(dep: &Deployment, mut child: Spawned, stop: &mut oneshot::Receiver<()>) -> Exit {
    tokio::select! {
        status = child.wait() => {
            let why = match status {
                Ok(s) => InstanceFailure::Exited(s),
                Err(e) => InstanceFailure::Wait(e),
            };
            child.kill();
            Exit::DiedServing(why)
        }
        _ = &mut *stop => {
            // Drain: out of the endpoint set first (done by reconcile), a moment for routers to
            // see it, then SIGTERM; the function finishes its in-flight requests and exits.
            tokio::time::sleep(Duration::from_millis(50)).await;
            if let Ok(t) = child.terminate(dep.cfg.termination_grace.0).await
                && t.killed_after_grace
            {
                dep.counters.killed_after_grace.fetch_add(1, Ordering::Relaxed);
                event(dep, "killed");
            }
            Exit::Stopped
        }
    }
}
