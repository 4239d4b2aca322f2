//! Managed agents on env workers: the service opens the episode on its gateway and an env
//! worker of the task's pool runs the program in its own sandbox; the worker forwards the
//! program's gateway calls to the service's gateway with the episode's key, and reports how
//! the program ended, which is judged here as for a program run on this machine.
//!
//! A worker that is killed or loses its connection mid-episode fails the episode as
//! infrastructure (masked or resampled, never rewarded); one that refuses it (draining,
//! full) before it starts passes it to the next worker.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use actors::agent::{AgentEpisode, AgentOutcome, AgentRunner, Renderer};
use actors::env::remote::{AgentRunReport, RemoteTask};
use futures::future::BoxFuture;

use super::managed::{OUTPUT_TAIL_BYTES, judge, row_value};
use super::{episode_options, secs};
use crate::spec::AgentEnv;

/// Makes episode ids unique on a worker across the episodes of one task.
static RUNS: AtomicU64 = AtomicU64::new(0);

/// Runs a task's agent program per episode on its env pool's workers.
#[derive(Clone)]
pub struct RemoteRunner {
    spec: AgentEnv,
    renderer: Arc<Renderer>,
    gateway: Arc<gateway::Gateway>,
    task: Arc<RemoteTask>,
    /// The base URL of the service (its `/gateway` routes) as the workers reach it.
    base: String,
}

impl RemoteRunner {
    pub fn new(
        spec: AgentEnv,
        renderer: Arc<Renderer>,
        gateway: Arc<gateway::Gateway>,
        task: Arc<RemoteTask>,
        base: String,
    ) -> Self {
        Self {
            spec,
            renderer,
            gateway,
            task,
            base: base.trim_end_matches('/').to_string(),
        }
    }

    async fn play(&self, ep: AgentEpisode) -> AgentOutcome {
        let started = tokio::time::Instant::now();
        let opts = episode_options(&self.spec, &self.renderer, &ep);
        let opened = match self.gateway.open(opts, Arc::new(ep.shard.clone())) {
            Ok(o) => o,
            Err(e) => return AgentOutcome::Infra(format!("cannot open the episode: {e}")),
        };
        let _finish = super::FinishOnDrop(self.gateway.clone(), Some(opened.key.clone()));
        let body = serde_json::json!({
            "episode": format!("{}.{}", ep.id, RUNS.fetch_add(1, Ordering::Relaxed)),
            "key": opened.key,
            "gateway": self.base,
            "row": row_value(&ep),
        });
        let (report, url) = match self.task.run_agent(&body, secs(self.spec.timeout_s)).await {
            Ok(r) => r,
            Err(e) => return AgentOutcome::Infra(infra::error_chain(&e)),
        };
        let out = match captured(report) {
            Ok(o) => o,
            Err(why) => return AgentOutcome::Infra(format!("env worker {url}: {why}")),
        };
        let finished = self.gateway.finish(&opened.key).await.unwrap_or_default();
        judge(
            &self.spec,
            out,
            finished,
            started.elapsed().as_secs_f64(),
            &ep,
        )
    }
}

impl AgentRunner for RemoteRunner {
    fn run(&self, ep: AgentEpisode) -> BoxFuture<'static, AgentOutcome> {
        let me = self.clone();
        Box::pin(async move { me.play(ep).await })
    }
}

/// A worker's report as the program's captured output (or why the program did not run).
fn captured(r: AgentRunReport) -> Result<infra::process::CapturedOutput, String> {
    use std::os::unix::process::ExitStatusExt;
    if let Some(e) = r.error {
        return Err(e);
    }
    let raw = r.status.ok_or("the worker reported no exit status")?;
    let tail = |text: String| infra::process::Capped {
        data: text.into_bytes(),
        cap: OUTPUT_TAIL_BYTES,
        dropped: 0,
        keep_tail: true,
    };
    Ok(infra::process::CapturedOutput {
        status: std::process::ExitStatus::from_raw(raw),
        timed_out: r.timed_out,
        stdout: tail(r.stdout),
        stderr: tail(r.stderr),
    })
}
