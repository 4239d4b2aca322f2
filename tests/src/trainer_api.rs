//! The trainer API (v1) against an in-process service: an external trainer leases each step's
//! batch, a lease that ends is offered again (and its late acknowledgement refused), a batch
//! given back is offered again at once, acknowledged batches mark their trajectories trained
//! and are never offered again, and the job completes its steps on the acknowledgements.

use std::time::Duration;

use serde_json::Value;
use tests::{SpecBuilder, TestServer, wait_job};

fn external_job(steps: u64) -> String {
    SpecBuilder::new()
        .pool("h800", "H800", 1, "")
        // Short environment steps: a step's batch is ready in a second or two of wall time
        // (the multi-turn default's 2 s steps made each step ~10 s).
        .raw_task(
            "[[tasks]]\ndomain = \"lake\"\ngroup_size = 4\nmax_turns = 6\nmax_tokens_per_turn = 128\n[tasks.env]\nkind = \"sim\"\nreset_latency_s = { constant = 0.05 }\nstep_latency_s = { uniform = { low = 0.05, high = 0.3 } }\nturns = { uniform = { low = 2, high = 6 } }\nobservation_tokens = { constant = 64 }\nresponse_tokens = { uniform = { low = 16, high = 128 } }\nsuccess_rate = 0.5\n",
        )
        .rollout("batch_size = 4")
        .rollout(&format!("steps = {steps}"))
        // No weights are announced here: the policy stays at version 0, so every step's
        // trajectories start there and α must cover the steps.
        .rollout("alpha = 8")
        .extra("[trainer]\nkind = \"external\"\nlease_s = 1")
        .toml()
}

async fn next(t: &TestServer, job: &str, wait_s: f64) -> (u16, Value) {
    let r = t
        .client
        .get(t.url(&format!("/v1/jobs/{job}/batches/next?wait_s={wait_s}")))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let v = if status == 200 {
        r.json().await.unwrap()
    } else {
        Value::Null
    };
    (status, v)
}

async fn post(t: &TestServer, path: &str, body: &str) -> (u16, Value) {
    let r = t
        .client
        .post(t.url(path))
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// Every sample's columns line up: tokens, loss mask, behaviour logprobs; responses inside
/// their turn bounds; version spans cover exactly the generated tokens; advantages of a group
/// sum to 0 (GRPO).
fn check_batch(b: &Value) {
    let groups = b["groups"].as_array().unwrap();
    assert!(!groups.is_empty(), "{b}");
    for g in groups {
        let mut adv = 0.0;
        for s in g["samples"].as_array().unwrap() {
            let n = s["tokens"].as_array().unwrap().len();
            let mask: Vec<u64> = s["loss_mask"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            assert_eq!(mask.len(), n);
            assert_eq!(s["behaviour_logprobs"].as_array().unwrap().len(), n);
            let generated: u64 = mask.iter().sum();
            let in_bounds: u64 = s["turn_bounds"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| {
                    let (lo, hi) = (
                        b[0].as_u64().unwrap() as usize,
                        b[1].as_u64().unwrap() as usize,
                    );
                    assert!(mask[lo..hi].iter().all(|&m| m == 1));
                    (hi - lo) as u64
                })
                .sum();
            assert_eq!(in_bounds, generated);
            let spans: u64 = s["version_spans"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v["tokens"].as_u64().unwrap())
                .sum();
            assert_eq!(spans, generated, "{}", s["trajectory_id"]);
            assert_eq!(s["status"], "completed");
            adv += s["advantage"].as_f64().unwrap();
        }
        assert!(adv.abs() < 1e-6, "group advantages sum to {adv}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_external_trainer_leases_acknowledges_and_gives_back_batches() {
    let t = TestServer::start().await;
    let base = t.url("");
    let job = tests::submit_job(&t.client, &base, external_job(3)).await;

    // Step 1's batch, leased; it ends after a second and is offered again under a new lease.
    let (status, first) = next(&t, &job, 30.0).await;
    assert_eq!(status, 200);
    assert_eq!(first["step"], 1);
    assert_eq!(first["batch_id"], format!("{job}:1:1"));
    check_batch(&first);
    let (status, _) = next(&t, &job, 0.0).await;
    assert_eq!(
        status, 204,
        "the leased batch is not offered while its lease runs"
    );
    let (status, again) = next(&t, &job, 5.0).await;
    assert_eq!(status, 200);
    assert_eq!(again["batch_id"], format!("{job}:1:2"));
    assert_eq!(again["groups"], first["groups"], "the same batch, durable");
    let (status, v) = post(&t, &format!("/v1/batches/{job}:1:1/ack"), "{}").await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (409, Some("lease_lost"))
    );
    // Given back: offered again at once.
    let (status, v) = post(&t, &format!("/v1/batches/{job}:1:2/nack"), "").await;
    assert_eq!((status, v["state"].as_str()), (200, Some("offered_again")));
    let (status, third) = next(&t, &job, 0.0).await;
    assert_eq!(
        (status, third["batch_id"].as_str()),
        (200, Some(format!("{job}:1:3").as_str()))
    );

    // Acknowledged (twice: a retry is harmless), then the remaining steps.
    let mut trained = 0;
    let mut id = third["batch_id"].as_str().unwrap().to_string();
    let mut batch = third;
    for step in 0..3u64 {
        assert_eq!(batch["step"], step + 1);
        trained += batch["groups"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["samples"].as_array().unwrap().len())
            .sum::<usize>();
        for _ in 0..2 {
            let (status, v) = post(&t, &format!("/v1/batches/{id}/ack"), "{\"loss\": 0.25}").await;
            assert_eq!((status, v["state"].as_str()), (200, Some("acked")));
        }
        // A give-back after the acknowledgement: nothing is offered again, and the answer
        // says so (it used to answer `offered_again`).
        let (status, v) = post(&t, &format!("/v1/batches/{id}/nack"), "").await;
        assert_eq!(
            (status, v["error"]["code"].as_str()),
            (409, Some("already_acked"))
        );
        if step < 2 {
            // Step 1 in the binary encoding: the same document as MessagePack.
            let (status, b) = if step == 0 {
                let r = t
                    .client
                    .get(t.url(&format!("/v1/jobs/{job}/batches/next?wait_s=30")))
                    .header("accept", "application/msgpack")
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.headers()["content-type"], "application/msgpack");
                let status = r.status().as_u16();
                let bytes = r.bytes().await.unwrap();
                (status, rmp_serde::from_slice::<Value>(&bytes).unwrap())
            } else {
                next(&t, &job, 30.0).await
            };
            assert_eq!(status, 200);
            check_batch(&b);
            id = b["batch_id"].as_str().unwrap().to_string();
            batch = b;
        }
    }
    let done = wait_job(&t.client, &base, &job, Duration::from_secs(60), |v| {
        v["state"] == "succeeded" || v["state"] == "failed"
    })
    .await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(done["metrics"]["loss"], 0.25, "{}", done["metrics"]);
    // Nothing is offered once every batch is acknowledged.
    assert_eq!(next(&t, &job, 0.0).await.0, 204);
    let st: Value = t
        .client
        .get(t.url(&format!("/v1/jobs/{job}/staleness")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        (
            st["batches_acked"].as_u64(),
            st["batches_pending"].as_u64(),
            st["step"].as_u64()
        ),
        (Some(3), Some(0), Some(3)),
        "{st}"
    );
    assert_eq!(
        (st["version"].as_u64(), st["consumed"].as_u64()),
        (Some(0), Some(3)),
        "{st}"
    );
    assert!(st["admitted_groups"].as_u64().unwrap() >= 3, "{st}");
    // Exactly the acknowledged batches' trajectories are marked trained.
    let rows = t
        .client
        .get(t.url(&format!(
            "/v1/jobs/{job}/trajectories?trained=true&limit=1000"
        )))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(rows.lines().count(), trained);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_trainer_api_calls_are_4xx_naming_the_problem() {
    let t = TestServer::start().await;
    let base = t.url("");
    let job = tests::submit_job(&t.client, &base, external_job(1)).await;
    let (status, _) = next(&t, &job, 61.0).await;
    assert_eq!(status, 400);
    let r = t
        .client
        .get(t.url(&format!("/v1/jobs/{job}/batches/next?wait_s=61")))
        .send()
        .await
        .unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["fields"][0]["field"], "wait_s");
    let (status, v) = post(&t, "/v1/batches/nonsense/ack", "{}").await;
    assert_eq!(
        (status, v["error"]["fields"][0]["field"].as_str()),
        (400, Some("batch_id"))
    );
    let (status, _) = post(&t, &format!("/v1/batches/{job}:7:1/ack"), "{}").await;
    assert_eq!(status, 404);
    let (status, v) = post(&t, &format!("/v1/batches/{job}:1:1/ack"), "[1, 2]").await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (400, Some("bad_request"))
    );
    // A job that trains in process offers no batches.
    let inproc = tests::submit_job(
        &t.client,
        &base,
        SpecBuilder::new()
            .pool("h800", "H800", 1, "")
            .multi_turn("lake", "")
            .rollout("steps = 1")
            .toml(),
    )
    .await;
    let r = t
        .client
        .get(t.url(&format!("/v1/jobs/{inproc}/batches/next")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 409);
    let _ = t
        .client
        .post(t.url(&format!("/v1/jobs/{job}/cancel")))
        .send()
        .await;
}

/// SIGKILL of the service while a batch is leased: after the restart the same batch is
/// offered again; every trajectory is trained by exactly the step whose batch held it, and no
/// trajectory is in two acknowledged batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_leased_when_the_service_is_killed_is_offered_again_after_the_restart() {
    use tests::server::ServerProcess;
    let dir = tempfile::tempdir().unwrap();
    let client = reqwest::Client::new();
    let lease = |base: &str, job: &str| {
        let (client, url) = (
            client.clone(),
            format!("{base}/v1/jobs/{job}/batches/next?wait_s=30"),
        );
        async move {
            let r = client.get(url).send().await.unwrap();
            assert_eq!(r.status().as_u16(), 200);
            r.json::<Value>().await.unwrap()
        }
    };
    let ids = |b: &Value| -> Vec<String> {
        b["groups"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["samples"].as_array().unwrap().iter())
            .map(|s| s["trajectory_id"].as_str().unwrap().to_string())
            .collect()
    };
    let ack = |base: &str, b: &Value| {
        let url = format!("{base}/v1/batches/{}/ack", b["batch_id"].as_str().unwrap());
        let client = client.clone();
        async move {
            let r = client.post(url).body("{}").send().await.unwrap();
            assert_eq!(r.status().as_u16(), 200);
        }
    };
    let first = ServerProcess::start(dir.path());
    let job = tests::submit_job(&client, &first.base, external_job(3)).await;
    // Step 1 trained and acknowledged; step 2 leased when the service dies.
    let b0 = lease(&first.base, &job).await;
    ack(&first.base, &b0).await;
    let b1 = lease(&first.base, &job).await;
    assert_eq!(b1["step"], 2);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(first.child.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    drop(first);

    let second = ServerProcess::start(dir.path());
    // The lease (1 s) has ended by now or ends shortly: the same batch comes back.
    let again = lease(&second.base, &job).await;
    assert_eq!(again["step"], 2);
    assert_eq!(
        again["groups"], b1["groups"],
        "the batch assembled before the kill"
    );
    ack(&second.base, &again).await;
    let b2 = lease(&second.base, &job).await;
    assert_eq!(b2["step"], 3);
    ack(&second.base, &b2).await;
    let done = wait_job(&client, &second.base, &job, Duration::from_secs(60), |v| {
        v["state"] == "succeeded" || v["state"] == "failed"
    })
    .await;
    assert_eq!(done["state"], "succeeded", "{done}");
    // Trained rows: exactly the acknowledged batches' trajectories, each by its own step.
    let mut want: Vec<(String, u64)> = Vec::new();
    for (step, b) in [(1u64, &b0), (2, &again), (3, &b2)] {
        want.extend(ids(b).into_iter().map(|i| (i, step)));
    }
    let n = want.len();
    want.sort();
    want.dedup_by(|a, b| a.0 == b.0);
    assert_eq!(want.len(), n, "a trajectory is in two acknowledged batches");
    let rows = client
        .get(format!(
            "{}/v1/jobs/{job}/trajectories?trained=true&limit=1000",
            second.base
        ))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let mut got: Vec<(String, u64)> = rows
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (
                v["trajectory"]["id"].as_str().unwrap().to_string(),
                v["trained_step"].as_u64().unwrap(),
            )
        })
        .collect();
    got.sort();
    assert_eq!(got, want);
}

/// A job on the tiny built-in model trained by an external trainer, and that trainer's
/// weights: the base model's tensors, each scaled by `scale` (one tensor left out when
/// `drop_one`), written as safetensors at `path`.
fn tiny_external_job(steps: u64) -> String {
    SpecBuilder::new()
        .raw_task("[[tasks]]\ndomain = \"lake\"\ngroup_size = 2\nmax_turns = 3\nmax_tokens_per_turn = 4\nenv = { kind = \"frozenlake\", size = 4 }\n")
        .rollout("batch_size = 4")
        .rollout(&format!("steps = {steps}"))
        .rollout("alpha = 1")
        .extra("[[pools]]\nname = \"cpu\"\ndevice = \"CPU\"\ncount = 1\nbackend = { kind = \"builtin\", model = { d_model = 16, n_layers = 1, n_heads = 2, d_ff = 32, max_seq = 256 } }")
        .extra("[trainer]\nkind = \"external\"\nlease_s = 60")
        .toml()
}

fn write_weights(spec_toml: &str, path: &std::path::Path, scale: f64, drop_one: bool) -> String {
    use job::spec::ModelChoice;
    use job::wiring::TrainerPlan;
    let spec = job::spec::parse(spec_toml, job::spec::Format::Toml).unwrap();
    let inputs = job::resolve::resolve_models(&spec, &job::resolve::Host::process()).unwrap();
    let TrainerPlan::External {
        model: Some(ModelChoice::Tiny(cfg)),
        ..
    } = job::wiring::plan_trainer(&spec, &inputs).unwrap()
    else {
        panic!("a tiny-model job with an external trainer");
    };
    let parts =
        actors::model::runtime::BuiltinParts::new(cfg, Default::default(), spec.seed, 0, None)
            .unwrap();
    let mut map = std::collections::HashMap::new();
    for (n, t) in parts
        .initial
        .candle_tensors(&candle_core::Device::Cpu)
        .unwrap()
    {
        map.insert(n, (t * scale).unwrap());
    }
    if drop_one {
        let first = map.keys().min().cloned().unwrap();
        map.remove(&first);
    }
    candle_core::safetensors::save(&map, path).unwrap();
    path.display().to_string()
}

async fn announce(t: &TestServer, job: &str, body: Value) -> (u16, Value) {
    post(t, &format!("/v1/jobs/{job}/weights"), &body.to_string()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announced_weights_are_installed_and_generate_the_next_batches() {
    let t = TestServer::start().await;
    let base = t.url("");
    let toml = tiny_external_job(3);
    // The trainer's files live outside the service's data directory (which it refuses).
    let shared = tempfile::tempdir().unwrap();
    let v1 = write_weights(&toml, &shared.path().join("v1.safetensors"), 0.5, false);
    let inside = write_weights(&toml, &t.dir.path().join("v1.safetensors"), 0.5, false);
    let job = tests::submit_job(&t.client, &base, toml).await;
    // Every event of the job, collected until its stream ends.
    let events = {
        let (client, url) = (t.client.clone(), t.url(&format!("/v1/jobs/{job}/events")));
        tokio::spawn(async move { client.get(url).send().await.unwrap().text().await.unwrap() })
    };
    // The job runs at the base version: its first batch is leased before any announcement.
    let (status, b0) = next(&t, &job, 60.0).await;
    assert_eq!((status, b0["step"].as_u64()), (200, Some(1)));
    let versions = tests::batch_versions;
    assert_eq!(versions(&b0), [0].into());
    // Announcements are checked before they are recorded.
    let src = |uri: &str| json_src(uri, "safetensors");
    // Inside the data directory: refused by the path policy.
    let (status, v) = announce(
        &t,
        &job,
        serde_json::json!({"version": 1, "source": src(&inside)}),
    )
    .await;
    assert_eq!(
        (status, v["error"]["fields"][0]["field"].as_str()),
        (403, Some("source.uri")),
        "{v}"
    );
    for (body, field) in [
        (
            serde_json::json!({"version": 0, "source": src(&v1)}),
            "version",
        ),
        (
            serde_json::json!({"version": 1, "source": json_src(&v1, "gguf")}),
            "source.format",
        ),
        (
            serde_json::json!({"version": 1, "source": json_src(&v1, "onnx")}),
            "source.format",
        ),
        (
            serde_json::json!({"version": 1, "source": src("/nonexistent/v1.safetensors")}),
            "source.uri",
        ),
        (
            serde_json::json!({"version": 1, "source": {"kind": "path", "uri": v1, "format": "safetensors", "sha256": "00"}}),
            "source.sha256",
        ),
        (
            serde_json::json!({"version": 1, "source": {"kind": "nccl", "master_addr": "10.0.0.1", "master_port": 29500, "group_name": "g", "world_size": 2}}),
            "source.kind",
        ),
    ] {
        let (status, v) = announce(&t, &job, body).await;
        assert_eq!(
            (status, v["error"]["fields"][0]["field"].as_str()),
            (400, Some(field)),
            "{v}"
        );
    }
    let sha = {
        let bytes = std::fs::read(&v1).unwrap();
        service::access::hash_bytes(&bytes)
    };
    let (status, v) = announce(&t, &job, serde_json::json!({"version": 1, "source": {"kind": "path", "uri": format!("file://{v1}"), "format": "safetensors", "sha256": sha}})).await;
    assert_eq!(
        (status, v["state"].as_str()),
        (202, Some("announced")),
        "{v}"
    );
    let (status, v) = announce(
        &t,
        &job,
        serde_json::json!({"version": 1, "source": src(&v1)}),
    )
    .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (409, Some("version_not_newer"))
    );
    // No batch of step 9 exists yet: a version that far ahead is refused, naming the
    // convention (a trainer announcing batch.step + 1 is one ahead).
    let (status, v) = announce(
        &t,
        &job,
        serde_json::json!({"version": 9, "source": src(&v1)}),
    )
    .await;
    assert_eq!(
        (
            status,
            v["error"]["code"].as_str(),
            v["error"]["fields"][0]["field"].as_str()
        ),
        (409, Some("version_ahead_of_steps"), Some("version")),
        "{v}"
    );

    // Announced before step 0's acknowledgement: the shards install it at that boundary, and
    // the batches admitted from then on are generated by it (two were admitted before: α = 1).
    let mut last = b0;
    for step in 0..3u64 {
        if step > 0 {
            let (status, b) = next(&t, &job, 60.0).await;
            assert_eq!((status, b["step"].as_u64()), (200, Some(step + 1)), "{b}");
            last = b;
        }
        let id = last["batch_id"].as_str().unwrap().to_string();
        let (status, _) = post(&t, &format!("/v1/batches/{id}/ack"), "{}").await;
        assert_eq!(status, 200);
    }
    assert!(
        versions(&last).contains(&1),
        "step 2 has no token of version 1: {:?}",
        versions(&last)
    );
    let done = wait_job(&t.client, &base, &job, Duration::from_secs(120), |v| {
        v["state"] == "succeeded" || v["state"] == "failed"
    })
    .await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(done["metrics"]["version"], 1, "{}", done["metrics"]);
    let events = events.await.unwrap();
    assert!(
        events.contains("event: weights_installed") && events.contains("\"version\":1"),
        "{events}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_the_model_cannot_serve_fail_the_job_with_the_reason() {
    let t = TestServer::start().await;
    let base = t.url("");
    let toml = tiny_external_job(2);
    let shared = tempfile::tempdir().unwrap();
    let bad = write_weights(&toml, &shared.path().join("bad.safetensors"), 1.0, true);
    let job = tests::submit_job(&t.client, &base, toml).await;
    let (status, b) = next(&t, &job, 60.0).await;
    assert_eq!(status, 200);
    let (status, _) = announce(
        &t,
        &job,
        serde_json::json!({"version": 1, "source": json_src(&bad, "safetensors")}),
    )
    .await;
    assert_eq!(status, 202);
    let id = b["batch_id"].as_str().unwrap().to_string();
    assert_eq!(
        post(&t, &format!("/v1/batches/{id}/ack"), "{}").await.0,
        200
    );
    let done = wait_job(&t.client, &base, &job, Duration::from_secs(60), |v| {
        v["state"] == "succeeded" || v["state"] == "failed"
    })
    .await;
    assert_eq!(done["state"], "failed", "{done}");
    let error = done["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("has no tensor") && error.contains("version 1"),
        "{error}"
    );
}

/// Hardening round 2 (#35): weight announcements go through the one path policy. With
/// tokens and `readable_paths`, a file outside them is 403 whatever checksum comes with it
/// (`/etc/passwd` used to answer 202 with its true hash and 400 with a wrong one: a content
/// oracle); the resolved file is recorded, not the announced path (a symlink); and a file
/// replaced after its announcement is refused at the install, naming the change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weight_announcements_obey_the_path_policy_and_install_the_checked_file() {
    use service::access::{Access, AccessConfig, ProgramPolicy, Role, TokenEntry, hash_token};
    let shared = tempfile::tempdir().unwrap();
    let policy = ProgramPolicy {
        readable_paths: Some(vec![shared.path().display().to_string()]),
        ..Default::default()
    };
    let cfg = AccessConfig {
        tokens: vec![TokenEntry {
            name: "trainer".into(),
            role: Role::Submit,
            sha256: hash_token("trainer-secret"),
        }],
        ..Default::default()
    };
    let mut t = TestServer::start_with_access(Access::new(&cfg, policy).unwrap()).await;
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert("authorization", "Bearer trainer-secret".parse().unwrap());
    t.client = reqwest::Client::builder()
        .default_headers(headers)
        .build()
        .unwrap();
    let base = t.url("");
    let toml = tiny_external_job(2);
    let v1 = write_weights(&toml, &shared.path().join("v1.safetensors"), 0.5, false);
    let link = shared.path().join("latest.safetensors");
    std::os::unix::fs::symlink(&v1, &link).unwrap();
    let job = tests::submit_job(&t.client, &base, toml).await;
    let (status, b) = next(&t, &job, 60.0).await;
    assert_eq!(status, 200);
    let passwd = service::access::hash_bytes(&std::fs::read("/etc/passwd").unwrap());
    for sha in [passwd.as_str(), "00"] {
        let body = serde_json::json!({"version": 1, "source": {"kind": "path", "uri": "/etc/passwd", "format": "safetensors", "sha256": sha}});
        let (status, v) = announce(&t, &job, body).await;
        assert_eq!(
            (status, v["error"]["fields"][0]["field"].as_str()),
            (403, Some("source.uri")),
            "{v}"
        );
    }
    // Through a symlink: the resolved file is what is recorded.
    let (status, v) = announce(
        &t,
        &job,
        serde_json::json!({"version": 1, "source": json_src(&link.display().to_string(), "safetensors")}),
    )
    .await;
    assert_eq!(status, 202, "{v}");
    let recorded = t.service.batches.newest_weights(&job).unwrap().unwrap();
    assert_eq!(
        recorded.uri,
        std::fs::canonicalize(&v1).unwrap().display().to_string()
    );
    // Replaced after the announcement (another file at the same path): refused at the
    // install, not loaded.
    std::fs::remove_file(&v1).unwrap();
    write_weights(
        &tiny_external_job(2),
        std::path::Path::new(&v1),
        0.25,
        false,
    );
    let id = b["batch_id"].as_str().unwrap().to_string();
    assert_eq!(
        post(&t, &format!("/v1/batches/{id}/ack"), "{}").await.0,
        200
    );
    let done = wait_job(&t.client, &base, &job, Duration::from_secs(60), |v| {
        v["state"] == "succeeded" || v["state"] == "failed"
    })
    .await;
    assert_eq!(done["state"], "failed", "{done}");
    let error = done["error"].as_str().unwrap_or_default();
    assert!(error.contains("changed after it was checked"), "{error}");
}

fn json_src(uri: &str, format: &str) -> Value {
    serde_json::json!({"kind": "path", "uri": uri, "format": format})
}
