//! A real Prometheus (the Debian package) scrapes a real `rollarc serve`; the queries that
//! docs/metrics.md ("Prometheus") documents return data, names carry no doubled suffix, the
//! router's latency buckets fit a value in seconds, and a job's series leave once it ends.

use std::process::{Command, Stdio};
use std::time::Duration;

/// A running `prometheus`, killed on drop.
struct Prometheus {
    child: std::process::Child,
    base: String,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    fn start(target: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - job_name: rollarc\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        // A free port for its web API (bound, then released for it).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect(
                "the prometheus binary (Debian package `prometheus`; `make setup` installs it)",
            );
        Self {
            child,
            base: format!("http://127.0.0.1:{port}"),
            _dir: dir,
        }
    }

    /// The instant query's result vector (empty while Prometheus is not up yet).
    async fn query(&self, c: &reqwest::Client, q: &str) -> Vec<serde_json::Value> {
        let encoded: String = q
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect();
        let Ok(r) = c
            .post(format!("{}/api/v1/query", self.base))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!("query={encoded}"))
            .send()
            .await
        else {
            return Vec::new();
        };
        let v: serde_json::Value = r.json().await.unwrap_or_default();
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// Polls `q` until its result satisfies `ok` (60 s at most).
    async fn until(
        &self,
        c: &reqwest::Client,
        q: &str,
        ok: impl Fn(&[serde_json::Value]) -> bool,
    ) -> Vec<serde_json::Value> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let r = self.query(c, q).await;
            if ok(&r) {
                return r;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "Prometheus query {q:?} never satisfied the test (last result: {r:?})"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

fn value(r: &serde_json::Value) -> f64 {
    r["value"][1].as_str().unwrap().parse().unwrap()
}

fn job_spec() -> String {
    tests::SpecBuilder::new()
        .pool("h800", "H800", 1, "")
        .raw_task("[[tasks]]\ndomain = \"add\"\ngroup_size = 2\nmax_turns = 1\nreward = [\"math\"]\n[tasks.env]\nkind = \"arithmetic\"\n")
        .raw_task("[[tasks]]\ndomain = \"slow\"\ngroup_size = 2\nmax_turns = 2\n[tasks.env]\nkind = \"sim\"\nstep_latency_s = { constant = 0.05 }\nreset_latency_s = { constant = 0.02 }\nturns = { constant = 2 }\nobservation_tokens = { constant = 8 }\nresponse_tokens = { constant = 8 }\nsandbox = { warm = 1, max_concurrent_starts = 2 }\n")
        .rollout("batch_size = 2")
        .rollout("steps = 100000")
        .extra("[sim]\nclock = \"real\"\n[reward.functions.math]\nkind = \"builtin\"\nfunction = \"math\"\n")
        .toml()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_the_documented_series() {
    let dir = tempfile::tempdir().unwrap();
    let server = tests::server::ServerProcess::start(&dir.path().join("data"));
    let c = reqwest::Client::new();
    let id = tests::submit_job(&c, &server.base, job_spec()).await;
    let prom = Prometheus::start(server.base.trim_start_matches("http://"));
    prom.until(&c, "up{job=\"rollarc\"}", |r| {
        r.first().is_some_and(|x| value(x) == 1.0)
    })
    .await;
    let job_step = format!("rollarc_job_step{{job_id=\"{id}\"}}");
    prom.until(&c, &job_step, |r| {
        r.first().is_some_and(|x| value(x) >= 3.0)
    })
    .await;
    // Every name docs/metrics.md documents answers a query as written there.
    for q in [
        "rollarc_jobs_submitted_total",
        "rollarc_trainer_steps_total",
        "rollarc_buffer_trajectories_total{task=\"add\"}",
        "rollarc_trainer_staleness_versions_bucket",
        "rollarc_function_instances{state=\"ready\"}",
        "rollarc_function_desired_instances",
        "rollarc_function_instance_events_total",
        "rollarc_router_calls_total",
        "rollarc_router_tries_total",
        "rollarc_router_call_duration_seconds_count",
        &format!("rollarc_pool_utilisation_ratio{{job_id=\"{id}\",pool=\"h800\"}}"),
        &format!("rollarc_generation_bubble_ratio{{job_id=\"{id}\"}}"),
        &format!("rollarc_task_success_ratio{{job_id=\"{id}\",task=\"add\"}}"),
        &format!("rollarc_task_reward{{job_id=\"{id}\",task=\"slow\"}}"),
        &format!("rollarc_trainer_loss{{job_id=\"{id}\"}}"),
        &format!("rollarc_env_starts{{job_id=\"{id}\",start=\"cold\"}}"),
        &format!("rollarc_env_start_seconds{{job_id=\"{id}\",quantile=\"0.99\"}}"),
        &format!("rollarc_env_warm_hit_ratio{{job_id=\"{id}\"}}"),
    ] {
        prom.until(&c, q, |r| !r.is_empty()).await;
    }
    // No doubled unit or `_total` suffix anywhere.
    let doubled = prom
        .query(
            &c,
            "{__name__=~\"rollarc_.*(_total_total|_seconds_seconds|_ratio_ratio)\"}",
        )
        .await;
    assert!(doubled.is_empty(), "{doubled:?}");
    // The router's latency in seconds, with buckets that resolve milliseconds: the p99 of
    // local reward calls is well under a second (the old millisecond buckets read 4.95 s).
    let p99 = prom
        .until(
            &c,
            "histogram_quantile(0.99, sum by (le) (rollarc_router_call_duration_seconds_bucket))",
            |r| !r.is_empty(),
        )
        .await;
    let p99 = value(&p99[0]);
    assert!(p99 > 0.0 && p99 < 1.0, "router p99 {p99} s");
    // Cancelling the job takes its series away (stale at the next scrape).
    let r = c
        .post(format!("{}/v1/jobs/{id}/cancel", server.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    prom.until(&c, &job_step, |r| r.is_empty()).await;
    prom.until(&c, &format!("{{job_id=\"{id}\"}}"), |r| r.is_empty())
        .await;
    // Process-wide series stay.
    assert!(
        !prom
            .query(&c, "rollarc_router_calls_total")
            .await
            .is_empty()
    );
}
