//! Test harness: spec builders, an in-process service on port 0, a child-process service for
//! crash tests, and HTTP helpers that poll for readiness instead of sleeping.

#![allow(
    clippy::too_many_lines,
    reason = "test code: the 100-line limit is on shipped code; a test reads top to bottom"
)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actors::types::{Batch, Trajectory};
use job::runtime::{ObserverError, StepMetrics, StepObserver};
use job::spec::JobSpec;
use service::service::Service;

pub mod chaos;
pub mod fakes;
pub mod server;

/// A small fully simulated spec (TOML) with knobs to tweak per test.
pub struct SpecBuilder {
    pub tasks: Vec<String>,
    pub pools: Vec<String>,
    pub rollout: Vec<String>,
    pub extra: Vec<String>,
    pub seed: u64,
    pub preset: Option<String>,
}

impl Default for SpecBuilder {
    fn default() -> Self {
        Self {
            tasks: Vec::new(),
            pools: Vec::new(),
            rollout: Vec::new(),
            extra: Vec::new(),
            seed: 1,
            preset: None,
        }
    }
}

impl SpecBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    /// A multi-turn task with variable step latency.
    pub fn multi_turn(mut self, domain: &str, extra: &str) -> Self {
        self.tasks.push(format!(
            r#"[[tasks]]
domain = "{domain}"
group_size = 4
max_turns = 6
max_tokens_per_turn = 128
{extra}
[tasks.env]
kind = "sim"
reset_latency_s = {{ lognormal = {{ mu = -1.0, sigma = 1.0 }} }}
step_latency_s = {{ normal = {{ mean = 2.0, std = 1.5 }} }}
turns = {{ uniform = {{ low = 2, high = 6 }} }}
observation_tokens = {{ constant = 64 }}
response_tokens = {{ uniform = {{ low = 16, high = 128 }} }}
success_rate = 0.5
"#
        ));
        self
    }

    /// A single-turn decode-heavy task.
    pub fn single_turn(mut self, domain: &str, extra: &str) -> Self {
        self.tasks.push(format!(
            r#"[[tasks]]
domain = "{domain}"
group_size = 4
max_turns = 1
max_tokens_per_turn = 2048
{extra}
[tasks.env]
kind = "sim"
turns = {{ constant = 1 }}
observation_tokens = {{ constant = 32 }}
response_tokens = {{ uniform = {{ low = 512, high = 2048 }} }}
success_rate = 0.5
"#
        ));
        self
    }

    pub fn raw_task(mut self, toml: &str) -> Self {
        self.tasks.push(toml.to_string());
        self
    }

    pub fn pool(mut self, name: &str, device: &str, count: usize, extra: &str) -> Self {
        self.pools.push(format!(
            "[[pools]]\nname = \"{name}\"\ndevice = \"{device}\"\ncount = {count}\nbackend = {{ kind = \"sim\", model = \"qwen3-8b\"{extra} }}\n"
        ));
        self
    }

    pub fn rollout(mut self, line: &str) -> Self {
        self.rollout.push(line.to_string());
        self
    }

    pub fn extra(mut self, toml: &str) -> Self {
        self.extra.push(toml.to_string());
        self
    }

    pub fn seed(mut self, s: u64) -> Self {
        self.seed = s;
        self
    }

    pub fn preset(mut self, p: &str) -> Self {
        self.preset = Some(p.to_string());
        self
    }

    pub fn toml(&self) -> String {
        let mut s = format!("seed = {}\n", self.seed);
        if let Some(p) = &self.preset {
            s.push_str(&format!("preset = \"{p}\"\n"));
        }
        for t in &self.tasks {
            s.push_str(t);
        }
        for p in &self.pools {
            s.push_str(p);
        }
        s.push_str("[rollout]\n");
        for r in &self.rollout {
            s.push_str(r);
            s.push('\n');
        }
        for e in &self.extra {
            s.push_str(e);
            s.push('\n');
        }
        s
    }

    pub fn build(&self) -> JobSpec {
        match job::spec::parse(&self.toml(), job::spec::Format::Toml) {
            Ok(s) => s,
            Err(e) => panic!("test spec is invalid: {e}\n{}", self.toml()),
        }
    }
}

/// A job on the wall clock that takes a while: `steps` steps of `batch` groups, each turn's
/// environment step taking `step_s` seconds (cancel, restart and event-stream tests).
pub fn wall_clock_job(steps: u64, batch: usize, step_s: f64) -> String {
    SpecBuilder::new()
        .pool("h800", "H800", 1, "")
        .raw_task(&format!(
            "[[tasks]]\ndomain = \"slow\"\ngroup_size = 2\nmax_turns = 2\n[tasks.env]\nkind = \"sim\"\nstep_latency_s = {{ constant = {step_s} }}\nturns = {{ constant = 2 }}\nobservation_tokens = {{ constant = 8 }}\nresponse_tokens = {{ constant = 8 }}\n"
        ))
        .rollout(&format!("batch_size = {batch}"))
        .rollout(&format!("steps = {steps}"))
        .extra("[sim]\nclock = \"real\"")
        .toml()
}

/// Keeps every batch handed to the trainer, with its step's record.
#[derive(Default)]
pub struct BatchLog {
    pub batches: Mutex<Vec<(StepMetrics, Batch)>>,
    /// The batch of the step in training, until its record comes.
    pending: Mutex<Option<(u64, Batch)>>,
}

impl StepObserver for BatchLog {
    fn on_batch(&self, step: u64, batch: &Batch) {
        *self.pending.lock().unwrap_or_else(|p| p.into_inner()) = Some((step, batch.clone()));
    }

    fn on_step(&self, m: &StepMetrics) -> Result<(), ObserverError> {
        let (step, batch) = self
            .pending
            .lock()
            .map_err(|_| "the batch log's lock is poisoned")?
            .take()
            .ok_or("a step's record came without its batch")?;
        if step != m.step {
            return Err(format!(
                "the record of step {} came after the batch of step {step}",
                m.step
            )
            .into());
        }
        self.batches
            .lock()
            .map_err(|_| "the batch log's lock is poisoned")?
            .push((m.clone(), batch));
        Ok(())
    }
}

/// Result of a virtual-time run with everything recorded.
pub struct Recorded {
    pub summary: job::runtime::JobSummary,
    pub batches: Vec<(StepMetrics, Batch)>,
    pub committed: Vec<Trajectory>,
}

pub fn run_recorded(spec: JobSpec) -> Recorded {
    let sink = Arc::new(actors::buffer::MemorySink::default());
    let log = Arc::new(BatchLog::default());
    let summary = match job::simrun::run_virtual_with(spec, sink.clone(), log.clone()) {
        Ok(s) => s,
        Err(e) => panic!("simulated job failed: {e}"),
    };
    let batches = std::mem::take(&mut *log.batches.lock().unwrap_or_else(|p| p.into_inner()));
    let committed = std::mem::take(&mut *sink.log.lock().unwrap_or_else(|p| p.into_inner()));
    Recorded {
        summary,
        batches,
        committed,
    }
}

/// An in-process service on 127.0.0.1:0 (the listener is kept: no rebind race).
pub struct TestServer {
    pub addr: SocketAddr,
    pub service: Arc<Service>,
    pub dir: tempfile::TempDir,
    pub client: reqwest::Client,
    _task: tokio::task::JoinHandle<()>,
}

impl TestServer {
    pub async fn start() -> Self {
        Self::start_with(service::server::EdgeLimits::default()).await
    }

    /// A server on the service's own connection loop with these edge limits.
    pub async fn start_with(limits: service::server::EdgeLimits) -> Self {
        Self::start_full(limits, service::access::Access::open(), None).await
    }

    /// A server behind `access` (tokens, rate limits, program policy).
    pub async fn start_with_access(access: service::access::Access) -> Self {
        Self::start_full(service::server::EdgeLimits::default(), access, None).await
    }

    /// A server whose jobs share a memory budget of `bytes`.
    pub async fn start_with_budget(bytes: u64) -> Self {
        let open = service::access::Access::open();
        Self::start_full(service::server::EdgeLimits::default(), open, Some(bytes)).await
    }

    async fn start_full(
        limits: service::server::EdgeLimits,
        access: service::access::Access,
        max_memory: Option<u64>,
    ) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let service = Service::open(&service::service::ServiceConfig {
            data_dir: dir.path().to_path_buf(),
            max_running: 2,
            max_memory,
            test_hooks: true,
        })
        .expect("service");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let app = service::api::router_with(service.clone(), Arc::new(access));
        let stop = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn(service::server::serve_on(
            listener,
            app,
            limits,
            stop,
            Duration::from_secs(1),
        ));
        Self {
            addr,
            service,
            dir,
            client: reqwest::Client::new(),
            _task: task,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }
}

/// Submits a job spec (TOML or JSON) to the service at `base`; returns the job's id.
pub async fn submit_job(
    client: &reqwest::Client,
    base: &str,
    body: impl Into<reqwest::Body>,
) -> String {
    let r = client
        .post(format!("{base}/v1/jobs"))
        .body(body)
        .send()
        .await
        .expect("submit");
    let v: serde_json::Value = r.json().await.expect("JSON answer");
    v["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no job id in {v}"))
        .to_string()
}

/// Polls `GET /v1/jobs/{id}` until `pred` holds or `timeout` passes.
pub async fn wait_job(
    client: &reqwest::Client,
    base: &str,
    id: &str,
    timeout: Duration,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Ok(r) = client.get(format!("{base}/v1/jobs/{id}")).send().await
            && let Ok(v) = r.json::<serde_json::Value>().await
            && pred(&v)
        {
            return v;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("job {id} did not reach the expected condition within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls `GET /v1/jobs/{id}` until the job has ended (neither queued nor running), at most
/// `timeout`; its last state.
pub async fn wait_ended(
    client: &reqwest::Client,
    base: &str,
    id: &str,
    timeout: Duration,
) -> serde_json::Value {
    wait_job(client, base, id, timeout, |v| {
        v["state"] != "running" && v["state"] != "queued"
    })
    .await
}

/// Pages through all trajectories of a job; returns (cursor, trajectory id) pairs.
pub async fn page_all(
    client: &reqwest::Client,
    base: &str,
    id: &str,
    limit: usize,
) -> Vec<(i64, String)> {
    all_rows(client, base, id, limit)
        .await
        .into_iter()
        .map(|row| {
            (
                row["cursor"].as_i64().expect("cursor"),
                row["trajectory"]["id"].as_str().expect("id").to_string(),
            )
        })
        .collect()
}

/// Every trajectory row of a job (as the NDJSON pages hold them), `limit` per page.
pub async fn all_rows(
    client: &reqwest::Client,
    base: &str,
    id: &str,
    limit: usize,
) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    let mut after = 0i64;
    loop {
        let r = client
            .get(format!(
                "{base}/v1/jobs/{id}/trajectories?after={after}&limit={limit}"
            ))
            .send()
            .await
            .expect("page");
        assert_eq!(r.status(), 200);
        let text = r.text().await.expect("body");
        let rows: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("ndjson line"))
            .collect();
        let Some(last) = rows.last() else {
            return out;
        };
        after = last["cursor"].as_i64().expect("cursor");
        out.extend(rows);
    }
}

/// The repository's root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the repository")
        .to_path_buf()
}

/// The interpreter with the agent SDKs (`make setup` installs them; `ROLLARC_AGENT_PYTHON`).
pub fn agent_python() -> String {
    std::env::var("ROLLARC_AGENT_PYTHON").unwrap_or_else(|_| {
        let home = std::env::var("HOME").unwrap_or_default();
        format!("{home}/.cache/rollarc/agent-sdks-venv/bin/python")
    })
}

/// The SmolLM2 checkpoint whose tokenizer agent tasks on simulated pools render with.
pub fn tokenizer() -> String {
    actors::model::llm::smollm2_path().display().to_string()
}

/// The `rollarc` binary built next to the test binary.
pub fn rollarc_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let mut dir = exe.parent().map(Path::to_path_buf).expect("exe dir");
    if dir.ends_with("deps") {
        dir.pop();
    }
    let bin = dir.join("rollarc");
    assert!(
        bin.exists(),
        "{} not found: build the workspace binaries first (cargo build --workspace)",
        bin.display()
    );
    bin
}

/// A `rollarc-fn` process serving one built-in function on a free port; killed when dropped.
pub struct FunctionProcess {
    pub child: std::process::Child,
    /// `http://ADDR`, as the function logged it.
    pub base: String,
}

impl Drop for FunctionProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `rollarc-fn` binary built next to `rollarc`.
pub fn fn_bin() -> PathBuf {
    rollarc_bin().with_file_name("rollarc-fn")
}

/// Starts `rollarc-fn NAME [--config CONFIG]` on a free port with extra environment variables,
/// and waits until it logs its address.
pub fn start_function(name: &str, config: Option<&str>, env: &[(&str, &str)]) -> FunctionProcess {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let mut cmd = Command::new(fn_bin());
    cmd.arg(name)
        .env("PORT", "0")
        .env("HOST", "127.0.0.1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(c) = config {
        cmd.args(["--config", c]);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("rollarc-fn starts");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(addr) = line.split("listening on ").nth(1) {
                let _ = tx.send(addr.trim().to_string());
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the function reports its address");
    FunctionProcess {
        child,
        base: format!("http://{addr}"),
    }
}

/// The policy versions that generated the tokens of a leased batch (trainer API JSON).
pub fn batch_versions(b: &serde_json::Value) -> std::collections::BTreeSet<u64> {
    b["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["samples"].as_array().into_iter().flatten())
        .flat_map(|s| s["version_spans"].as_array().into_iter().flatten())
        .filter_map(|v| v["version"].as_u64())
        .collect()
}
