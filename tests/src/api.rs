//! The HTTP API contract against an in-process server on port 0.

use std::time::Duration;

use tests::{SpecBuilder, TestServer, page_all, wait_job};

fn small_job() -> SpecBuilder {
    SpecBuilder::new()
        .pool("h800", "H800", 1, "")
        .pool("h20", "H20", 1, "")
        .multi_turn("lake", "")
        .single_turn("math", "")
        .rollout("batch_size = 2")
        .rollout("steps = 3")
}

/// A job on the wall clock that takes a while (for cancel and the cluster view).
fn slow_job(steps: u64) -> String {
    tests::wall_clock_job(steps, 1, 0.05)
}

/// (body, expected status, expected code, fields that must be reported)
fn invalid_cases() -> Vec<(String, u16, &'static str, Vec<&'static str>)> {
    let good = small_job().toml();
    vec![
        (
            format!("bogus = 1\n{good}"),
            400,
            "invalid_spec",
            vec!["bogus"],
        ),
        (
            good.replace("group_size = 4", "group_size = 0"),
            400,
            "invalid_spec",
            vec!["tasks[0].group_size", "tasks[1].group_size"],
        ),
        (
            good.replace("device = \"H20\"", "device = \"TPU\""),
            400,
            "invalid_spec",
            vec!["pools[1].device"],
        ),
        (
            good.replace("max_turns = 6", "max_turns = \"six\""),
            400,
            "invalid_spec",
            vec!["tasks[0].max_turns"],
        ),
        (
            good.replace("steps = 3", "steps = 0\nalpha = 5000"),
            400,
            "invalid_spec",
            vec!["rollout.steps", "rollout.alpha"],
        ),
        (
            format!("{good}\n[mapping]\ndeclared = {{ lake = \"nowhere\", ghost = \"h800\" }}"),
            400,
            "invalid_spec",
            vec!["mapping.declared.lake", "mapping.declared.ghost"],
        ),
        (
            good.replace("success_rate = 0.5", "success_rate = 1.5"),
            400,
            "invalid_spec",
            vec!["tasks[0].env.success_rate", "tasks[1].env.success_rate"],
        ),
        (
            good.replace("[rollout]", "[rollout]\nbarrier = \"sometimes\""),
            400,
            "invalid_spec",
            vec!["rollout.barrier"],
        ),
        ("this is = = not toml".into(), 400, "invalid_spec", vec![""]),
        (
            "{\"tasks\": 3}".into(),
            400,
            "invalid_spec",
            vec!["tasks", "pools"],
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_specs_report_every_problem_with_its_field_path() {
    let s = TestServer::start().await;
    for (body, status, code, fields) in invalid_cases() {
        let r = s
            .client
            .post(s.url("/v1/jobs"))
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), status, "{body}");
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], code);
        let got: Vec<String> = v["error"]["fields"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|f| f["field"].as_str().unwrap_or("").to_string())
                    .collect()
            })
            .unwrap_or_default();
        for f in fields {
            assert!(
                got.iter().any(|g| g == f),
                "field {f:?} not reported; got {got:?}"
            );
        }
    }
    // Nothing was accepted.
    assert!(s.service.store.list().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_bodies_unknown_jobs_and_bad_queries_are_4xx_json() {
    let s = TestServer::start().await;
    let big = "#".repeat(service::api::MAX_BODY_BYTES + 10);
    let r = s
        .client
        .post(s.url("/v1/jobs"))
        .body(big)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(
        r.json::<serde_json::Value>().await.unwrap()["error"]["code"],
        "body_too_large"
    );
    let r = s
        .client
        .get(s.url("/v1/jobs/job-999"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(
        r.json::<serde_json::Value>().await.unwrap()["error"]["code"],
        "not_found"
    );
    let r = s
        .client
        .post(s.url("/v1/jobs/job-999/cancel"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = s.client.get(s.url("/v2/nothing")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(
        r.json::<serde_json::Value>().await.unwrap()["error"]["code"],
        "not_found"
    );
    let r = s.client.delete(s.url("/v1/jobs")).send().await.unwrap();
    assert_eq!(r.status(), 405);
    assert_eq!(
        r.json::<serde_json::Value>().await.unwrap()["error"]["code"],
        "method_not_allowed"
    );
    let id = tests::submit_job(&s.client, &s.url(""), small_job().toml()).await;
    for q in ["limit=0", "limit=5000", "after=-3", "limit=abc"] {
        let r = s
            .client
            .get(s.url(&format!("/v1/jobs/{id}/trajectories?{q}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{q}");
        assert_eq!(
            r.json::<serde_json::Value>().await.unwrap()["error"]["code"],
            "bad_request"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_a_running_job_and_a_second_cancel_conflicts() {
    let s = TestServer::start().await;
    let id = tests::submit_job(&s.client, &s.url(""), slow_job(1000)).await;
    wait_job(&s.client, &s.url(""), &id, Duration::from_secs(30), |v| {
        v["step"].as_u64().unwrap_or(0) >= 1
    })
    .await;
    // The cluster view shows the running job's pools.
    let c: serde_json::Value = s
        .client
        .get(s.url("/v1/cluster"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(c["jobs"][0]["id"], id.as_str());
    assert_eq!(c["jobs"][0]["pools"][0]["device"], "H800");
    assert!(c["devices"].as_array().unwrap().len() >= 5);
    let r = s
        .client
        .post(s.url(&format!("/v1/jobs/{id}/cancel")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    // The answer says what happens: the job is stopping, and which step was in flight (it
    // used to be the bare record, `state: running`).
    let a: serde_json::Value = r.json().await.unwrap();
    assert_eq!(a["cancel"]["outcome"], "stopping", "{a}");
    let done = a["step"].as_u64().unwrap();
    assert_eq!(
        a["cancel"]["in_flight_step"].as_u64(),
        Some(done + 1),
        "{a}"
    );
    let msg = a["cancel"]["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!("step {} of 1000 was in flight", done + 1))
            && msg.contains("cancelled once"),
        "{msg}"
    );
    let job = wait_job(&s.client, &s.url(""), &id, Duration::from_secs(30), |v| {
        v["state"] == "cancelled"
    })
    .await;
    assert!(job["step"].as_u64().unwrap() < 1000);
    let r = s
        .client
        .post(s.url(&format!("/v1/jobs/{id}/cancel")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409);
    assert_eq!(
        r.json::<serde_json::Value>().await.unwrap()["error"]["code"],
        "conflict"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_stream_reports_state_changes_and_every_step() {
    use futures::StreamExt;
    let s = TestServer::start().await;
    let id = tests::submit_job(&s.client, &s.url(""), slow_job(4)).await;
    let r = s
        .client
        .get(s.url(&format!("/v1/jobs/{id}/events")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let mut stream = r.bytes_stream();
    let mut text = String::new();
    let read = async {
        while let Some(chunk) = stream.next().await {
            text.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        }
    };
    tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .expect("stream ends after the terminal state");
    let events: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| serde_json::from_str(d.trim()).unwrap())
        .collect();
    let steps: Vec<u64> = events
        .iter()
        .filter(|e| e["type"] == "progress")
        .map(|e| e["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, vec![1, 2, 3, 4]);
    let states: Vec<&str> = events
        .iter()
        .filter(|e| e["type"] == "state")
        .map(|e| e["state"].as_str().unwrap())
        .collect();
    assert_eq!(states.last(), Some(&"succeeded"));
    assert!(states.contains(&"running") || states[0] == "running" || states[0] == "queued");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_readiness_metrics_and_openapi() {
    let s = TestServer::start().await;
    assert_eq!(
        s.client
            .get(s.url("/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        s.client
            .get(s.url("/readyz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let id = tests::submit_job(&s.client, &s.url(""), small_job().toml()).await;
    wait_job(&s.client, &s.url(""), &id, Duration::from_secs(60), |v| {
        v["state"] == "succeeded"
    })
    .await;
    let m = s
        .client
        .get(s.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(m.contains("rollarc_trainer_steps_total"), "{m}");
    // The job has ended: its job-scoped series are gone (they used to keep their last value).
    assert!(!series(&m, "rollarc_pool_utilisation_ratio", &id), "{m}");
    let api: serde_json::Value = s
        .client
        .get(s.url("/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    for p in [
        "/v1/jobs",
        "/v1/jobs/{id}",
        "/v1/jobs/{id}/cancel",
        "/v1/jobs/{id}/events",
        "/v1/jobs/{id}/trajectories",
        "/v1/cluster",
    ] {
        assert!(api["paths"].get(p).is_some(), "openapi lacks {p}");
    }
    assert!(api["components"]["schemas"].get("JobSpec").is_some());
    // Every templated path parameter is declared on every operation (OpenAPI 3 requires it).
    for (path, ops) in api["paths"].as_object().unwrap() {
        let names: Vec<&str> = path
            .split('{')
            .skip(1)
            .filter_map(|p| p.split('}').next())
            .collect();
        for (method, op) in ops.as_object().unwrap() {
            for n in &names {
                let declared = op["parameters"].as_array().is_some_and(|ps| {
                    ps.iter()
                        .any(|p| p["name"] == *n && p["in"] == "path" && p["required"] == true)
                });
                assert!(
                    declared,
                    "{method} {path} does not declare path parameter {n}"
                );
            }
        }
    }
    // Shutdown: readiness flips and intake stops.
    s.service.intake.cancel();
    assert_eq!(
        s.client
            .get(s.url("/readyz"))
            .send()
            .await
            .unwrap()
            .status(),
        503
    );
    let r = s
        .client
        .post(s.url("/v1/jobs"))
        .body(small_job().toml())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
}

/// Hardening: the trainer fault-injection hook is not part of the public API. A service
/// without `test_hooks` (the default of `rollarc serve`) refuses a spec naming it, with the
/// field, at the HTTP edge.
#[tokio::test]
async fn fault_injection_hooks_are_refused_unless_the_service_enables_them() {
    use service::service::{Service, ServiceConfig, ServiceError};
    let dir = tempfile::tempdir().unwrap();
    let service = Service::open(&ServiceConfig {
        data_dir: dir.path().to_path_buf(),
        max_running: 1,
        max_memory: None,
        test_hooks: false,
    })
    .unwrap();
    for hook in ["trainer_panic_at_step = 2", "trainer_panic_runs = 3"] {
        let body = small_job().extra(&format!("[sim]\n{hook}")).toml();
        let spec = job::spec::parse(&body, job::spec::Format::Toml).unwrap();
        let e = service.submit(spec).unwrap_err();
        assert!(matches!(e, ServiceError::TestHooksOff { .. }), "{e}");
        let r = axum::response::IntoResponse::into_response(service::api::ApiError::from(e));
        assert_eq!(r.status(), 400);
        let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let field = format!("sim.{}", hook.split(' ').next().unwrap());
        assert_eq!(v["error"]["fields"][0]["field"], field.as_str(), "{v}");
    }
    assert!(
        service.store.list().unwrap().is_empty(),
        "nothing was stored"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_trainer_dies_is_restarted_from_its_last_step() {
    let s = TestServer::start().await;
    let once = small_job()
        .rollout("steps = 5")
        .extra("[sim]\ntrainer_panic_at_step = 2");
    let body = once.toml().replacen("steps = 3\n", "", 1);
    let id = tests::submit_job(&s.client, &s.url(""), body).await;
    let job = wait_job(&s.client, &s.url(""), &id, Duration::from_secs(60), |v| {
        v["state"] == "succeeded" || v["state"] == "failed"
    })
    .await;
    assert_eq!(job["state"], "succeeded", "{job}");
    assert_eq!(job["step"], 5);
    let rows = page_all(&s.client, &s.url(""), &id, 100).await;
    assert!(
        rows.iter().any(|r| r.1.starts_with("r0-")) && rows.iter().any(|r| r.1.starts_with("r1-")),
        "the job ran twice"
    );
    // A fault in every run exhausts the restart policy: the job fails with the reason.
    let always = small_job().extra("[sim]\ntrainer_panic_at_step = 1\ntrainer_panic_runs = 100");
    let id = tests::submit_job(&s.client, &s.url(""), always.toml()).await;
    let job = wait_job(&s.client, &s.url(""), &id, Duration::from_secs(60), |v| {
        v["state"] == "failed" || v["state"] == "succeeded"
    })
    .await;
    assert_eq!(job["state"], "failed");
    assert_eq!(
        job["step"], 1,
        "every run resumed from the last completed step"
    );
    assert!(
        job["error"].as_str().unwrap_or("").contains("trainer"),
        "{job}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_example_succeeds_and_pages() {
    let s = TestServer::start().await;
    let body = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/sim-small.toml"
    ))
    .unwrap();
    let r = s
        .client
        .post(s.url("/v1/jobs"))
        .header("content-type", "application/toml")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let id = r.json::<serde_json::Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let job = wait_job(&s.client, &s.url(""), &id, Duration::from_secs(120), |v| {
        v["state"] == "succeeded" || v["state"] == "failed"
    })
    .await;
    assert_eq!(job["state"], "succeeded", "{job}");
    let rows = page_all(&s.client, &s.url(""), &id, 250).await;
    assert_eq!(
        rows.len() as u64,
        s.service.store.trajectory_count(&id).unwrap()
    );
    assert!(
        rows.len() >= 8 * 8 * 8,
        "8 steps × 8 groups × 8 trajectories at least"
    );
    // `newest`: the last page, still in cursor order (the dashboard opens on it).
    let text = s
        .client
        .get(s.url(&format!("/v1/jobs/{id}/trajectories?limit=7&newest=true")))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let newest: Vec<i64> = text
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["cursor"]
                .as_i64()
                .unwrap()
        })
        .collect();
    let tail: Vec<i64> = rows[rows.len() - 7..].iter().map(|r| r.0).collect();
    assert_eq!(newest, tail);
    // A simulated task has no random-policy baseline (its answers are not one-token actions).
    let b: serde_json::Value = s
        .client
        .get(s.url(&format!("/v1/jobs/{id}/baselines")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let tasks = b["tasks"].as_object().unwrap();
    assert!(
        !tasks.is_empty() && tasks.values().all(|v| v.is_null()),
        "{b}"
    );
}

/// Hardening: event streams of unknown ids are 404 and leave nothing behind; a finished job's
/// channel is dropped (a loop over unknown ids used to grow memory without bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_channels_exist_only_for_live_jobs() {
    let s = TestServer::start().await;
    for i in 0..200 {
        let r = s
            .client
            .get(s.url(&format!("/v1/jobs/x{i}/events")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404);
    }
    assert_eq!(
        s.service.event_channels(),
        0,
        "unknown ids created channels"
    );
    // A subscriber of a running job holds one channel until the job ends.
    let id = tests::submit_job(&s.client, &s.url(""), slow_job(2)).await;
    let r = s
        .client
        .get(s.url(&format!("/v1/jobs/{id}/events")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = tokio::time::timeout(Duration::from_secs(60), r.text())
        .await
        .expect("the stream ends with the job")
        .unwrap();
    assert!(text.contains("succeeded"), "{text}");
    assert_eq!(
        s.service.event_channels(),
        0,
        "a finished job kept its channel"
    );
    // A finished job still answers with its final state, without a channel.
    let r = s
        .client
        .get(s.url(&format!("/v1/jobs/{id}/events")))
        .send()
        .await
        .unwrap();
    assert!(r.text().await.unwrap().contains("succeeded"));
    assert_eq!(s.service.event_channels(), 0);
}

/// Hardening: every stored row says which training step consumed it, and the trajectories
/// endpoint can page only trained (or only untrained) rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_record_the_step_that_trained_them() {
    let s = TestServer::start().await;
    let id = tests::submit_job(&s.client, &s.url(""), small_job().toml()).await;
    let job = wait_job(&s.client, &s.url(""), &id, Duration::from_secs(60), |v| {
        v["state"] == "succeeded" || v["state"] == "failed"
    })
    .await;
    assert_eq!(job["state"], "succeeded", "{job}");
    let rows = |q: &'static str| {
        let (client, url) = (
            s.client.clone(),
            s.url(&format!("/v1/jobs/{id}/trajectories?limit=1000{q}")),
        );
        async move {
            client
                .get(url)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
                .collect::<Vec<_>>()
        }
    };
    let (all, trained, untrained) = (
        rows("").await,
        rows("&trained=true").await,
        rows("&trained=false").await,
    );
    assert_eq!(all.len(), trained.len() + untrained.len());
    // 3 steps × 2 groups × 4 trajectories, each step's batch marked with its step.
    assert_eq!(trained.len(), 24, "trained rows");
    let mut per_step = std::collections::BTreeMap::new();
    for r in &trained {
        *per_step
            .entry(r["trained_step"].as_u64().unwrap())
            .or_insert(0) += 1;
        assert!(
            r["trajectory"]["failure"].is_null(),
            "a failed row was trained: {r}"
        );
    }
    assert_eq!(
        per_step,
        std::collections::BTreeMap::from([(1, 8), (2, 8), (3, 8)])
    );
    assert!(untrained.iter().all(|r| r["trained_step"].is_null()));
}

/// Hardening: clients that never finish their headers are disconnected after the header-read
/// timeout, and connections beyond the cap wait instead of piling up (2,000 such clients used
/// to be held indefinitely).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_cut_off_and_connections_are_capped() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = TestServer::start_with(service::server::EdgeLimits {
        header_read_timeout: Duration::from_millis(500),
        max_connections: 4,
        ..Default::default()
    })
    .await;
    // Four clients take every slot and never finish their headers.
    let mut stalled = Vec::new();
    for _ in 0..4 {
        let mut c = tokio::net::TcpStream::connect(s.addr).await.unwrap();
        c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        stalled.push(c);
    }
    // A fifth, well-behaved request waits for a slot; it is answered once the stalled ones
    // are cut off, so by then every stalled connection has been closed by the server.
    let r = tokio::time::timeout(
        Duration::from_secs(20),
        s.client.get(s.url("/healthz")).send(),
    )
    .await
    .expect("answered once a slot frees")
    .unwrap();
    assert_eq!(r.status(), 200);
    for mut c in stalled {
        let mut buf = [0u8; 256];
        // A closed connection reads EOF (or a 408 first, then EOF).
        let n = tokio::time::timeout(Duration::from_secs(5), async {
            let mut total = 0;
            loop {
                match c.read(&mut buf).await {
                    Ok(0) | Err(_) => return total,
                    Ok(n) => total += n,
                }
            }
        })
        .await
        .expect("the server closed the slow connection");
        assert!(n < 256, "unexpected response to an unfinished request");
    }
}

/// Hardening (#35): clients that send a request body one byte at a time cannot lock others
/// out. 40 of them against a server of 16 connections: every `/healthz` on a new connection
/// is answered within 1 s throughout (a new connection evicts the one that has waited
/// longest), and each slow connection is closed by its body deadline at the latest. (With a
/// header-only timeout, 16 such clients used to hold the server for as long as they liked.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_request_bodies_do_not_lock_other_clients_out() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = TestServer::start_with(service::server::EdgeLimits {
        body_read_timeout: Duration::from_secs(2),
        max_connections: 16,
        max_connections_per_address: 16,
        ..Default::default()
    })
    .await;
    let addr = s.addr;
    let mut slow = tokio::task::JoinSet::new();
    for _ in 0..40 {
        slow.spawn(async move {
            let started = tokio::time::Instant::now();
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            let head = "POST /v1/jobs HTTP/1.1\r\nHost: x\r\ncontent-type: application/toml\r\ncontent-length: 1000\r\n\r\n";
            if c.write_all(head.as_bytes()).await.is_err() {
                return started.elapsed();
            }
            // One byte every 200 ms until the server closes the connection.
            loop {
                let mut buf = [0u8; 64];
                tokio::select! {
                    r = c.read(&mut buf) => if matches!(r, Ok(0) | Err(_)) {
                        return started.elapsed();
                    },
                    _ = tokio::time::sleep(Duration::from_millis(200)) => {
                        if c.write_all(b"x").await.is_err() {
                            return started.elapsed();
                        }
                    }
                }
            }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let fresh = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    for i in 0..20 {
        let r = tokio::time::timeout(Duration::from_secs(1), fresh.get(s.url("/healthz")).send())
            .await
            .unwrap_or_else(|_| panic!("/healthz #{i} not answered within 1 s"))
            .unwrap();
        assert_eq!(r.status(), 200);
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    // Every slow client was cut off: evicted, or closed at its 2 s body deadline.
    let all = tokio::time::timeout(Duration::from_secs(15), async {
        let mut longest = Duration::ZERO;
        while let Some(d) = slow.join_next().await {
            longest = longest.max(d.unwrap());
        }
        longest
    })
    .await
    .expect("every slow connection was closed");
    assert!(
        all < Duration::from_secs(6),
        "a slow body was held for {all:?}"
    );
}

/// Every knob of the spec (bounds declared once in `job::spec`) is in the served schema with
/// its bounds, default and meaning: a knob whose schema or field name is wrong would
/// otherwise document nothing.
#[test]
fn every_knob_is_documented_in_the_openapi_schema() {
    let mut api = service::api::openapi_document();
    let knobs = job::spec::catalogue::all();
    assert!(knobs.len() >= 20, "{} knobs", knobs.len());
    for k in knobs {
        let p = job::spec::catalogue::property(&mut api, k.schema, k.name)
            .map(|p| serde_json::Value::Object(p.clone()))
            .unwrap_or_else(|| panic!("{}: no {} {} in the schema", k.field, k.schema, k.name));
        assert_eq!(p["maximum"].as_f64(), Some(k.max), "{}", k.field);
        let low = if k.exclusive_min {
            "exclusiveMinimum"
        } else {
            "minimum"
        };
        assert_eq!(p[low].as_f64(), Some(k.min), "{}", k.field);
        assert_eq!(p["description"], k.doc, "{}", k.field);
        if let Some(d) = &k.default_json {
            assert_eq!(&p["default"], d, "{}", k.field);
        }
    }
}

/// The OpenAPI spec schema says what validation enforces: at each documented bound a field
/// is accepted, one past it the spec is rejected naming that field.
#[test]
fn the_schema_bounds_of_the_spec_match_validation() {
    use job::spec::{Format, parse};
    let api = service::api::openapi_document();
    let schemas = &api["components"]["schemas"];
    // (schema, property, field path in errors)
    let cases = [
        ("TaskSpec", "group_size", "tasks[0].group_size"),
        ("TaskSpec", "max_turns", "tasks[0].max_turns"),
        (
            "TaskSpec",
            "max_tokens_per_turn",
            "tasks[0].max_tokens_per_turn",
        ),
        ("TaskSpec", "envs", "tasks[0].envs"),
        ("TaskSpec", "redundancy", "tasks[0].redundancy"),
        ("PoolSpec", "count", "pools[0].count"),
        ("RolloutSpec", "batch_size", "rollout.batch_size"),
        ("RolloutSpec", "steps", "rollout.steps"),
        ("RolloutSpec", "alpha", "rollout.alpha"),
        (
            "RolloutSpec",
            "max_concurrent_episodes",
            "rollout.max_concurrent_episodes",
        ),
        (
            "RolloutSpec",
            "fault_min_failures",
            "rollout.fault_min_failures",
        ),
    ];
    let spec_with = |field: &str, value: i64| -> Vec<String> {
        let (section, key) = field.split_once('.').unwrap();
        let mut b = SpecBuilder::new().pool("h800", "H800", 1, "");
        let task = format!(
            "[[tasks]]\ndomain = \"t\"\nenv = {{ kind = \"arithmetic\" }}\n{}",
            if section == "tasks[0]" {
                format!("{key} = {value}\n")
            } else {
                String::new()
            }
        );
        b = b.raw_task(&task);
        if section == "rollout" {
            b = b.rollout(&format!("{key} = {value}"));
        }
        let mut toml = b.toml();
        if field == "pools[0].count" {
            toml = toml.replace("count = 1", &format!("count = {value}"));
        }
        match parse(&toml, Format::Toml) {
            Ok(_) => Vec::new(),
            Err(e) => e.0.into_iter().map(|f| f.field).collect(),
        }
    };
    for (schema, prop, field) in cases {
        let p = &schemas[schema]["properties"][prop];
        assert!(p.is_object(), "{schema}.{prop} is not in the document");
        if let Some(max) = p["maximum"].as_i64() {
            assert!(
                !spec_with(field, max).contains(&field.to_string()),
                "{field} = {max} (the schema's maximum) is rejected"
            );
            assert!(
                spec_with(field, max + 1).contains(&field.to_string()),
                "{field} = {} (past the schema's maximum) is accepted",
                max + 1
            );
        } else {
            panic!("{schema}.{prop} documents no maximum");
        }
        let min = p["minimum"].as_i64().unwrap_or(0);
        assert!(
            !spec_with(field, min).contains(&field.to_string()),
            "{field} = {min}"
        );
        if min > 0 {
            assert!(
                spec_with(field, min - 1).contains(&field.to_string()),
                "{field} = {} (under the schema's minimum) is accepted",
                min - 1
            );
        }
    }
}

/// The document's example spec is a valid spec, and its links name real operations.
#[test]
fn the_openapi_example_is_valid_and_links_resolve() {
    let doc = service::api::openapi_document();
    let example = &doc["components"]["schemas"]["JobSpec"]["examples"][0];
    let spec = job::spec::parse(&example.to_string(), job::spec::Format::Json);
    assert!(spec.is_ok(), "{spec:?}");
    let ops: Vec<&str> = doc["paths"]
        .as_object()
        .unwrap()
        .values()
        .flat_map(|m| m.as_object().unwrap().values())
        .filter_map(|o| o["operationId"].as_str())
        .collect();
    let links = doc["paths"]["/v1/jobs"]["post"]["responses"]["201"]["links"]
        .as_object()
        .unwrap();
    assert_eq!(links.len(), 3);
    for l in links.values() {
        assert!(ops.contains(&l["operationId"].as_str().unwrap()), "{l}");
    }
}

/// Whether `/metrics` text `m` has a `metric` series of job `job`.
fn series(m: &str, metric: &str, job: &str) -> bool {
    m.lines()
        .any(|l| l.starts_with(&format!("{metric}{{")) && l.contains(&format!("job_id=\"{job}\"")))
}

/// Two jobs at once each have their own series (a `job` label: they used to overwrite each
/// other's gauges), trainer and task numbers included; a job's series leave `/metrics` when
/// it ends, the other's stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_scoped_metrics_carry_the_job_and_leave_with_it() {
    let s = TestServer::start().await;
    let a = tests::submit_job(&s.client, &s.url(""), slow_job(1000)).await;
    let b = tests::submit_job(&s.client, &s.url(""), slow_job(1000)).await;
    for id in [&a, &b] {
        wait_job(&s.client, &s.url(""), id, Duration::from_secs(60), |v| {
            v["step"].as_u64().unwrap_or(0) >= 1
        })
        .await;
    }
    let scrape = || async {
        s.client
            .get(s.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    let m = scrape().await;
    for id in [&a, &b] {
        for metric in [
            "rollarc_job_step",
            "rollarc_pool_utilisation_ratio",
            "rollarc_generation_bubble_ratio",
            "rollarc_task_success_ratio",
            "rollarc_trainer_loss",
        ] {
            assert!(series(&m, metric, id), "{metric} of {id}:\n{m}");
        }
    }
    for id in [&a, &b] {
        s.client
            .post(s.url(&format!("/v1/jobs/{id}/cancel")))
            .send()
            .await
            .unwrap();
        wait_job(&s.client, &s.url(""), id, Duration::from_secs(60), |v| {
            v["state"] == "cancelled"
        })
        .await;
        let m = scrape().await;
        assert!(
            !m.lines().any(|l| l.contains(&format!("job_id=\"{id}\""))),
            "{id} left:\n{m}"
        );
        if id == &a {
            assert!(series(&m, "rollarc_job_step", &b), "{m}");
        }
    }
}

/// The first hour (#38): the job list leaves out each job's per-resource timeline unless
/// asked (`?timeline=true`): under 2 KB a job (4 jobs used to be 80 KB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_job_list_is_small_without_the_timeline() {
    let s = TestServer::start().await;
    let mut ids = Vec::new();
    ids.push(tests::submit_job(&s.client, &s.url(""), slow_job(2)).await);
    // Three tasks, as in the quickstart: the per-task numbers grow with them.
    let three = small_job().single_turn("sum", "").toml();
    ids.push(tests::submit_job(&s.client, &s.url(""), three).await);
    for id in &ids {
        let v = wait_job(&s.client, &s.url(""), id, Duration::from_secs(60), |v| {
            v["state"] == "succeeded" || v["state"] == "failed"
        })
        .await;
        assert_eq!(v["state"], "succeeded", "{v}");
    }
    let get = |q: &'static str| {
        let (c, url) = (s.client.clone(), s.url(&format!("/v1/jobs{q}")));
        async move { c.get(url).send().await.unwrap().text().await.unwrap() }
    };
    let full = get("?timeline=true").await;
    assert!(
        full.contains("\"timeline\""),
        "the timeline is there when asked"
    );
    let small = get("").await;
    assert!(!small.contains("\"timeline\""));
    let v: serde_json::Value = serde_json::from_str(&small).unwrap();
    let n = v["jobs"].as_array().unwrap().len();
    assert_eq!(n, 2);
    assert!(
        small.len() < 2048 * n,
        "{} bytes for {n} jobs: {small}",
        small.len()
    );
    eprintln!(
        "{} bytes for {n} jobs ({} with the timeline)",
        small.len(),
        full.len()
    );
    assert!(full.len() > small.len());
}

/// Hardening (#35): a dataset is never a file of the service's data directory (the store
/// holds every job and the tokens' hashes), whatever the policy allows, also through `..`
/// from the staging directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dataset_in_the_data_directory_is_refused() {
    let s = TestServer::start().await;
    let store = s.dir.path().join("rollarc.db");
    assert!(store.is_file());
    std::fs::create_dir_all(s.dir.path().join("inputs")).unwrap();
    let through = s.dir.path().join("inputs").join("..").join("rollarc.db");
    for path in [store, through] {
        let body = format!(
            "[[tasks]]\ndomain = \"rows\"\nenv = {{ kind = \"prompt\" }}\ndataset = {{ path = \"{}\", format = \"jsonl\" }}\n[[pools]]\nname = \"p\"\ndevice = \"H800\"\nbackend = {{ kind = \"sim\" }}\n",
            path.display()
        );
        let r = s
            .client
            .post(s.url("/v1/jobs"))
            .header("content-type", "application/toml")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(
            v["error"]["fields"][0]["field"], "tasks[0].dataset.path",
            "{v}"
        );
        assert!(
            v["error"]["fields"][0]["message"]
                .as_str()
                .unwrap()
                .contains("inside the service's data directory"),
            "{v}"
        );
    }
}
