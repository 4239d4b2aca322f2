//! Managed agent episodes on env workers: a worker runs the task's agent program for one
//! episode (`POST /v1/tasks/{key}/agent`). It answers with its headers once the episode is
//! placed (a slot taken, the program starting) and with its body, the report of how the
//! program ended, when it ends: a refusal before that goes to the next worker, a connection
//! lost after it is the episode's failure (the program may have made calls already).

use std::sync::Arc;
use std::time::Duration;

use super::{NETWORK_MARGIN, RemoteTask, Unplaced};
use crate::env::EnvError;

/// How an agent episode's program ended on a worker, as the worker reports it.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AgentRunReport {
    /// The raw wait status (`ExitStatusExt::into_raw`); `None` when the program did not run.
    #[serde(default)]
    pub status: Option<i32>,
    #[serde(default)]
    pub timed_out: bool,
    /// The end of its stdout (its last line is its report) and of its stderr.
    #[serde(default)]
    pub stdout: String,
    #[serde(default)]
    pub stderr: String,
    /// Why it did not run (it could not be started).
    #[serde(default)]
    pub error: Option<String>,
}

impl RemoteTask {
    /// Runs one agent episode on a worker of the pool. `body` is the request the worker gets
    /// (the episode's id, key, row and where the gateway is); `run_for` the program's own time
    /// limit, which the worker enforces. Returns the worker's report and its URL.
    pub async fn run_agent(
        &self,
        body: &serde_json::Value,
        run_for: Duration,
    ) -> Result<(AgentRunReport, String), EnvError> {
        let pool = Arc::clone(&self.pool);
        pool.started().await;
        let limit = run_for + NETWORK_MARGIN;
        let placed = self
            .placed(|w| {
                let (pool, key) = (&pool, &self.key);
                async move { pool.post(&w, key, "agent", body, limit).await }
            })
            .await;
        let (resp, w) = match placed {
            Ok(v) => v,
            Err(Unplaced::TimedOut(w)) => {
                pool.closed_on(&w);
                return Err(EnvError::Timeout(limit));
            }
            Err(Unplaced::Failed(e)) => return Err(e),
        };
        // The body comes when the program ends: an error reading it is the connection
        // lost mid-episode (the worker killed or unreachable).
        let body = resp.bytes().await;
        pool.closed_on(&w);
        match body {
            Ok(b) => serde_json::from_slice::<AgentRunReport>(&b)
                .map(|r| (r, w.url.clone()))
                .map_err(|e| {
                    EnvError::Worker(format!(
                        "env pool {}: worker {} sent an unreadable report: {e}",
                        pool.name, w.url
                    ))
                }),
            Err(e) if e.is_timeout() => Err(EnvError::Timeout(limit)),
            Err(e) => {
                let why = infra::error_chain(&e);
                Err(self.lost(&w, super::CallError::Unreachable(why), limit))
            }
        }
    }
}
