//! Managed agent episodes on the worker (`POST /v1/tasks/{key}/agent`): the task's agent
//! program runs once in the sandbox, reaching the service's gateway only through a forwarder
//! of its own that adds the episode's key. The reply's headers go out once the episode holds
//! a slot and its program starts; its body, the report of how the program ended, when it
//! ends. A client that goes away stops the program (its process group is killed), as does
//! unregistering the task.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use actors::env::remote::AgentRunReport;
use axum::body::Body;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use job::agents::managed::{AgentProgram, GatewayWay, row_line};
use serde::Deserialize;

use super::{Hosting, Worker, error, lock};

/// The body of an agent episode's request.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AgentRun {
    /// The episode's id (unique within the task).
    pub episode: String,
    /// Its key on the service's gateway.
    pub key: String,
    /// The service's base URL as this worker reaches it.
    pub gateway: String,
    /// The dataset row the program gets on stdin.
    pub row: serde_json::Value,
}

/// Checks an agent run's fields.
fn check(run: &AgentRun) -> Result<(), String> {
    let fine = |s: &str, max: usize| {
        !s.is_empty() && s.len() <= max && s.chars().all(|c| c.is_ascii_graphic())
    };
    if !fine(&run.episode, 128) {
        return Err(format!(
            "episode {:?}: 1 to 128 printable characters",
            run.episode
        ));
    }
    if !fine(&run.key, 256) {
        return Err("key: 1 to 256 printable characters".into());
    }
    match reqwest::Url::parse(&run.gateway) {
        Ok(u) if u.scheme() == "http" && u.host_str().is_some_and(|h| !h.is_empty()) => Ok(()),
        _ => Err(format!(
            "gateway {:?}: the service's base URL (http://host:port)",
            run.gateway
        )),
    }
}

/// Gives back what an agent episode holds when its run ends or is dropped: its slot and its
/// count on the task and the worker.
struct Held {
    worker: Arc<Worker>,
    task: Arc<super::HostedTask>,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.task.running.fetch_sub(1, Ordering::Relaxed);
        self.worker.agents_running.fetch_sub(1, Ordering::Relaxed);
        self.worker.open.fetch_sub(1, Ordering::Relaxed);
        *lock(&self.task.last_call) = tokio::time::Instant::now();
    }
}

impl Worker {
    /// Runs one agent episode of task `key`.
    pub(in crate::env_worker) async fn run_agent(
        self: &Arc<Self>,
        key: &str,
        run: AgentRun,
    ) -> Response {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let Some(task) = self.task(key) else {
            return error(
                StatusCode::NOT_FOUND,
                "unknown_task",
                format!("task {key} is not registered here"),
            );
        };
        let Hosting::Agent(program) = &task.hosting else {
            return error(
                StatusCode::BAD_REQUEST,
                "not_agent_task",
                format!("task {key} hosts environments: its episodes use /call"),
            );
        };
        let program = Arc::clone(program);
        if let Err(why) = check(&run) {
            return error(StatusCode::BAD_REQUEST, "bad_request", why);
        }
        if let Err((status, code, msg)) = self.take_slot() {
            return error(status, code, msg);
        }
        task.running.fetch_add(1, Ordering::Relaxed);
        self.agents_running.fetch_add(1, Ordering::Relaxed);
        self.agent_runs.fetch_add(1, Ordering::Relaxed);
        *lock(&task.last_call) = tokio::time::Instant::now();
        let held = Held {
            worker: Arc::clone(self),
            task: Arc::clone(&task),
        };
        let (mut tx, rx) = tokio::sync::oneshot::channel::<AgentRunReport>();
        let stop = task.stop.clone();
        let worker = Arc::clone(self);
        tokio::spawn(async move {
            let report = tokio::select! {
                r = worker.play(&program, &run) => r,
                // The client went away: dropping the run kills the program.
                () = tx.closed() => return,
                () = stop.cancelled() => AgentRunReport {
                    error: Some("the task was unregistered".into()),
                    ..Default::default()
                },
            };
            drop(held);
            let _ = tx.send(report);
        });
        let body = futures::stream::once(async move {
            rx.await
                .map(|r| axum::body::Bytes::from(serde_json::to_vec(&r).unwrap_or_default()))
                .map_err(|_| std::io::Error::other("the agent's run ended without a report"))
        });
        (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            Body::from_stream(body),
        )
            .into_response()
    }

    /// The program's run, through a forwarder of its own.
    async fn play(&self, program: &AgentProgram, run: &AgentRun) -> AgentRunReport {
        let fwd = match super::super::forward::start(
            self.gateway_client.clone(),
            &run.gateway,
            &run.key,
            program.sandboxed(),
            Arc::clone(&self.forwarded),
        )
        .await
        {
            Ok(f) => f,
            Err(e) => {
                return AgentRunReport {
                    error: Some(format!("cannot start the gateway forwarder: {e}")),
                    ..Default::default()
                };
            }
        };
        let way = match (&fwd.socket, &fwd.url) {
            (Some(s), _) => GatewayWay::Socket(s),
            (None, Some(u)) => GatewayWay::Url(u),
            (None, None) => {
                return AgentRunReport {
                    error: Some("the gateway forwarder has no listener".into()),
                    ..Default::default()
                };
            }
        };
        let out = program
            .run(&run.key, &run.episode, row_line(&run.row), way)
            .await;
        drop(fwd);
        match out {
            Ok(o) => {
                use std::os::unix::process::ExitStatusExt;
                AgentRunReport {
                    status: Some(o.status.into_raw()),
                    timed_out: o.timed_out,
                    stdout: o.stdout.text(),
                    stderr: o.stderr.text(),
                    error: None,
                }
            }
            Err(e) => AgentRunReport {
                error: Some(e),
                ..Default::default()
            },
        }
    }
}
