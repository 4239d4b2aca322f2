//! The faults of hardening round 2 (#35), each against a real `rollarc serve`: slow-body
//! clients while jobs run, a healthy reward function whose ready instances are killed from
//! outside about every second, and quick service restarts during a slow job's step. `make
//! chaos` runs them in their long form; the integration tests in their short form.

use std::time::Duration;

use serde::Serialize;

use crate::server::ServerProcess;
use crate::{SpecBuilder, submit_job, wait_job};

/// What [`slow_bodies`] saw.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SlowBodies {
    pub clients: usize,
    pub health_checks: usize,
    /// The slowest `/healthz` answer, in ms (every one must be under 1,000).
    pub slowest_healthz_ms: u64,
    /// Health checks not answered within 1 s.
    pub unanswered: usize,
}

/// `clients` connections that each send a `POST /v1/jobs` body one byte every 500 ms (and
/// reconnect when cut off), for `secs`; meanwhile a fresh connection asks `/healthz` every
/// 200 ms.
pub async fn slow_bodies(base: &str, clients: usize, secs: u64) -> SlowBodies {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = base.trim_start_matches("http://").to_string();
    let stop = tokio_util::sync::CancellationToken::new();
    let mut slow = tokio::task::JoinSet::new();
    for _ in 0..clients {
        let (addr, stop) = (addr.clone(), stop.clone());
        slow.spawn(async move {
            while !stop.is_cancelled() {
                let Ok(mut c) = tokio::net::TcpStream::connect(&addr).await else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                let head = "POST /v1/jobs HTTP/1.1\r\nHost: x\r\ncontent-type: application/toml\r\ncontent-length: 100000\r\n\r\n";
                if c.write_all(head.as_bytes()).await.is_err() {
                    continue;
                }
                let mut buf = [0u8; 256];
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        r = c.read(&mut buf) => if matches!(r, Ok(0) | Err(_)) { break },
                        _ = tokio::time::sleep(Duration::from_millis(500)) => {
                            if c.write_all(b"x").await.is_err() {
                                break;
                            }
                        }
                    }
                }
            }
        });
    }
    let fresh = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("client");
    let mut seen = SlowBodies {
        clients,
        ..Default::default()
    };
    let end = tokio::time::Instant::now() + Duration::from_secs(secs);
    while tokio::time::Instant::now() < end {
        let t0 = tokio::time::Instant::now();
        let ok = tokio::time::timeout(
            Duration::from_secs(1),
            fresh.get(format!("{base}/healthz")).send(),
        )
        .await
        .is_ok_and(|r| r.is_ok_and(|r| r.status() == 200));
        seen.health_checks += 1;
        if ok {
            seen.slowest_healthz_ms = seen.slowest_healthz_ms.max(t0.elapsed().as_millis() as u64);
        } else {
            seen.unanswered += 1;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.cancel();
    while slow.join_next().await.is_some() {}
    seen
}

/// What [`killed_instances`] saw.
#[derive(Clone, Debug, Default, Serialize)]
pub struct KilledInstances {
    pub kills: usize,
    pub state: String,
    pub error: String,
    pub rows: usize,
    pub scored: usize,
}

impl KilledInstances {
    /// The job succeeded with at least 99 % of its trajectories scored.
    pub fn clean(&self) -> bool {
        self.state == "succeeded" && self.rows > 0 && self.scored * 100 >= self.rows * 99
    }
}

/// A `command` reward function server (Python, stdlib only) that answers readiness, then
/// every scoring call as its mode (its one argument) says: `healthy` scores 1.0; `invalid`
/// scores 5.0 (outside [0, 1]); `sleep` answers after 30 s; `error500` answers 500. Its
/// interpreter takes a few hundred ms to start, so a killer often hits starting instances.
pub const SCORING_SERVER: &str = r#"
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
MODE = sys.argv[1]
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def reply(self, body):
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self.reply(b"{}")
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        if MODE == "sleep":
            time.sleep(30)
        if MODE == "error500":
            self.send_response(500)
            self.send_header("content-length", "13")
            self.end_headers()
            self.wfile.write(b"scorer broke\n")
            return
        score = 1.0 if MODE == "healthy" else 5.0
        scores = [{"trajectory_id": i["trajectory_id"], "score": score} for i in req["items"]]
        self.reply(json.dumps({"protocol": req["protocol"], "scores": scores}).encode())
ThreadingHTTPServer((os.environ["HOST"], int(os.environ["PORT"])), H).serve_forever()
"#;

/// A job scored by a healthy reward function (a `command` function, local placement, two
/// instances) whose every instance (every ready one with `ready_only`: a loaded machine
/// may start instances slower than they are killed, which is a crash loop by definition) is
/// SIGKILLed from outside every 700 ms until the job ends (`steps` steps).
pub async fn killed_instances(base: &str, steps: u64, ready_only: bool) -> KilledInstances {
    let client = reqwest::Client::new();
    let spec = SpecBuilder::new()
        .pool("h800", "H800", 1, "")
        .raw_task("[[tasks]]\ndomain = \"add\"\ngroup_size = 2\nmax_turns = 1\nmax_tokens_per_turn = 8\nreward = [\"healthy\"]\n[tasks.env]\nkind = \"arithmetic\"\n")
        .rollout("batch_size = 2")
        .rollout(&format!("steps = {steps}"))
        .extra(&format!("[sim]\nclock = \"real\"\n[trainer]\nkind = \"sim\"\nstep_overhead_s = 0.5\n[reward]\nplacement = \"local\"\n[reward.functions.healthy]\nkind = \"command\"\ncommand = \"python3\"\nargs = ['-c', '''{SCORING_SERVER}''', 'healthy']\ntimeout_s = 10\n[reward.functions.healthy.scaling]\nmin-scale = 2\ncontainer-concurrency = 4\n"))
        .toml();
    let id = submit_job(&client, base, spec).await;
    let mut out = KilledInstances::default();
    loop {
        let v: serde_json::Value = client
            .get(format!("{base}/v1/jobs/{id}"))
            .send()
            .await
            .expect("job")
            .json()
            .await
            .expect("json");
        if v["state"] != "queued" && v["state"] != "running" {
            out.state = v["state"].as_str().unwrap_or_default().to_string();
            out.error = v["error"].as_str().unwrap_or_default().to_string();
            break;
        }
        out.kills += kill_every_instance(&client, base, ready_only).await;
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    let (rows, _) = super::rows(&client, base, &id).await;
    out.rows = rows.len();
    out.scored = rows
        .values()
        .filter(|(_, _, t)| !t["reward"].is_null() && t["failure"].is_null())
        .count();
    out
}

/// SIGKILLs every function instance that has a process (ready, and starting unless
/// `ready_only`), as a node drain or `pkill -9` would; returns how many.
async fn kill_every_instance(client: &reqwest::Client, base: &str, ready_only: bool) -> usize {
    let Ok(r) = client.get(format!("{base}/v1/cluster")).send().await else {
        return 0;
    };
    let Ok(c) = r.json::<serde_json::Value>().await else {
        return 0;
    };
    c["functions"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|d| d["instances"].as_array().cloned().unwrap_or_default())
        .filter(|i| i["phase"] == "ready" || (!ready_only && i["phase"] == "starting"))
        .filter_map(|i| i["pid"].as_i64().map(|p| p as i32))
        .filter(|pid| {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*pid),
                nix::sys::signal::Signal::SIGKILL,
            )
            .is_ok()
        })
        .count()
}

/// What [`quick_restarts`] saw.
#[derive(Clone, Debug, Default, Serialize)]
pub struct QuickRestarts {
    pub restarts: usize,
    pub state: String,
    pub error: String,
    pub step: u64,
}

/// A job alone on the service whose training steps are slow (`step_s`, simulated trainer on
/// the wall clock) and whose trajectories are quick: the service is SIGKILLed and started
/// again `restarts` times in a row, each about 2 s into the resumed run (before a step can
/// complete); the job must resume every time and succeed.
pub async fn quick_restarts(dir: &std::path::Path, restarts: usize, step_s: f64) -> QuickRestarts {
    let client = reqwest::Client::new();
    let spec = SpecBuilder::new()
        .pool("h800", "H800", 1, "")
        .raw_task("[[tasks]]\ndomain = \"quick\"\ngroup_size = 2\nmax_turns = 1\n[tasks.env]\nkind = \"sim\"\nstep_latency_s = { constant = 0.05 }\nturns = { constant = 1 }\nobservation_tokens = { constant = 8 }\nresponse_tokens = { constant = 8 }\n")
        .rollout("batch_size = 2")
        .rollout("steps = 3")
        .extra(&format!(
            "[sim]\nclock = \"real\"\n[trainer]\nkind = \"sim\"\nstep_overhead_s = {step_s}\n"
        ))
        .toml();
    let mut server = ServerProcess::start(dir);
    let id = submit_job(&client, &server.base, spec).await;
    let mut out = QuickRestarts::default();
    for _ in 0..restarts {
        wait_job(&client, &server.base, &id, Duration::from_secs(60), |v| {
            v["state"] == "running"
        })
        .await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        server.sigkill();
        out.restarts += 1;
        server = ServerProcess::start(dir);
    }
    let v = wait_job(
        &client,
        &server.base,
        &id,
        Duration::from_secs_f64(60.0 + 4.0 * step_s),
        |v| v["state"] != "queued" && v["state"] != "running",
    )
    .await;
    out.state = v["state"].as_str().unwrap_or_default().to_string();
    out.error = v["error"].as_str().unwrap_or_default().to_string();
    out.step = v["step"].as_u64().unwrap_or(0);
    out
}
