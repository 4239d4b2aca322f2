//! Serverless reward offload: the router against misbehaving instances (in-process HTTP
//! servers standing in for functions), the local runtime with real `rollarc-fn` processes, and
//! a job whose reward function runs on the runtime.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::body::Bytes;
use bytes::Bytes as RawBytes;
use functions::client::{ClientError, FunctionClient, InvalidResponse};
use functions::protocol::{
    PROTOCOL_VERSION, ResponseError, Score, ScoreRequest, ScoreResponse, ScoredItem,
};
use infra::faas::{DeploymentConfig, Dur, FunctionRuntime, Scaling};
use infra::router::{Call, Endpoint, Router, RouterConfig, RouterError, Target};
use rand::{Rng, SeedableRng};
use tokio::sync::watch;
use tokio::time::Instant;

#[derive(Clone, Copy, Debug)]
enum Behaviour {
    Ok {
        delay_ms: u64,
    },
    /// Every other request fails with 500.
    FailHalf,
    /// 429 at once, with `Retry-After: 1`.
    Shed,
    Huge,
    OutOfRange,
    ForeignId,
    /// A `NaN` literal where the score goes (not JSON; some encoders emit it).
    NotANumber,
}

struct Fake {
    url: String,
    hits: Arc<AtomicU64>,
}

async fn fake(b: Behaviour) -> Fake {
    let hits = Arc::new(AtomicU64::new(0));
    let h = hits.clone();
    let app = axum::Router::new().route(
        "/",
        axum::routing::post(move |body: Bytes| {
            let h = h.clone();
            async move {
                let n = h.fetch_add(1, Ordering::SeqCst);
                let req: ScoreRequest = serde_json::from_slice(&body).expect("a scoring request");
                let ok = |score: f64, id: Option<&str>| {
                    let scores = req
                        .items
                        .iter()
                        .map(|i| Score { trajectory_id: id.unwrap_or(&i.trajectory_id).to_string(), score, details: serde_json::Value::Null })
                        .collect();
                    (
                        axum::http::StatusCode::OK,
                        [("retry-after", "0")],
                        serde_json::to_vec(&ScoreResponse { protocol: PROTOCOL_VERSION.into(), scores }).unwrap(),
                    )
                };
                match b {
                    Behaviour::Ok { delay_ms } => {
                        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                        ok(1.0, None)
                    }
                    Behaviour::FailHalf if n.is_multiple_of(2) => (axum::http::StatusCode::INTERNAL_SERVER_ERROR, [("retry-after", "0")], b"boom".to_vec()),
                    Behaviour::FailHalf => ok(1.0, None),
                    Behaviour::Shed => (axum::http::StatusCode::TOO_MANY_REQUESTS, [("retry-after", "1")], b"busy".to_vec()),
                    Behaviour::Huge => (axum::http::StatusCode::OK, [("retry-after", "0")], vec![b' '; 6 << 20]),
                    Behaviour::OutOfRange => ok(7.0, None),
                    Behaviour::ForeignId => ok(1.0, Some("someone-else")),
                    Behaviour::NotANumber => {
                        let id = &req.items[0].trajectory_id;
                        let text = format!(r#"{{"protocol":"{PROTOCOL_VERSION}","scores":[{{"trajectory_id":"{id}","score":NaN}}]}}"#);
                        (axum::http::StatusCode::OK, [("retry-after", "0")], text.into_bytes())
                    }
                }
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", l.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    Fake { url, hits }
}

fn endpoints(urls: &[&str]) -> (watch::Sender<Vec<Endpoint>>, Target) {
    let eps = urls
        .iter()
        .enumerate()
        .map(|(i, u)| Endpoint {
            id: i as u64 + 1,
            url: u.to_string(),
        })
        .collect();
    let (tx, rx) = watch::channel(eps);
    (tx, Target::Endpoints(rx))
}

fn item(id: &str) -> ScoredItem {
    ScoredItem {
        trajectory_id: id.into(),
        text: "42".into(),
        token_ids: vec![],
        env_reward: 0.0,
        transcript: None,
        calls: None,
        row: None,
    }
}

fn client(router: Arc<Router>) -> FunctionClient {
    FunctionClient::new(router, "test@1", (0.0, 1.0), Duration::from_secs(10))
}

async fn run_calls(
    c: &Arc<FunctionClient>,
    n: usize,
    concurrency: usize,
    tag: &str,
) -> Vec<Result<Vec<Score>, ClientError>> {
    let sem = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let mut hs = Vec::new();
    for i in 0..n {
        let (c, sem, key) = (c.clone(), sem.clone(), format!("{tag}-{i}"));
        hs.push(tokio::spawn(async move {
            let _p = sem.acquire().await.unwrap();
            c.score(&key, vec![item(&key)], Some(serde_json::json!("42")))
                .await
        }));
    }
    let mut out = Vec::new();
    for h in hs {
        out.push(h.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_half_failing_instances_are_ejected_and_no_call_is_lost() {
    let good = fake(Behaviour::Ok { delay_ms: 5 }).await;
    let slow = fake(Behaviour::Ok { delay_ms: 3_000 }).await;
    let flaky = fake(Behaviour::FailHalf).await;
    let (_tx, target) = endpoints(&[&good.url, &slow.url, &flaky.url]);
    // 30 % may be ejected here (3 instances: at least one, at most 10 % → 1 by default).
    // Container concurrency 1 and 8 calls at once: the balancer cannot simply avoid the bad
    // instances, so they must be ejected.
    let cfg = RouterConfig {
        per_try_timeout: Duration::from_millis(300),
        eject_max_percent: 70,
        container_concurrency: 1,
        backoff_base: Duration::from_millis(5),
        ..RouterConfig::default()
    };
    let router = Router::new("t", target, cfg);
    let c = Arc::new(client(router.clone()));
    let results = run_calls(&c, 300, 8, "a").await;
    assert!(
        results.iter().all(|r| r.is_ok()),
        "{:?}",
        results.iter().find(|r| r.is_err())
    );
    let st = router.stats().snapshot();
    assert!(
        st.ejections >= 2,
        "slow and flaky must both be ejected: {st:?}"
    );
    // After the ejections the good instance carries the traffic.
    let before = (
        slow.hits.load(Ordering::SeqCst),
        flaky.hits.load(Ordering::SeqCst),
    );
    let results = run_calls(&c, 100, 8, "b").await;
    assert!(results.iter().all(|r| r.is_ok()));
    let after = (
        slow.hits.load(Ordering::SeqCst),
        flaky.hits.load(Ordering::SeqCst),
    );
    assert_eq!(after, before, "ejected instances still got traffic");
    // Retries stayed within the budget: amplification well under 2×.
    let st = router.stats().snapshot();
    assert!(
        (st.tries as f64) / (st.calls as f64) < 1.5,
        "amplification {st:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_429_instance_does_not_attract_traffic() {
    let good = fake(Behaviour::Ok { delay_ms: 20 }).await;
    let shed = fake(Behaviour::Shed).await;
    let (_tx, target) = endpoints(&[&good.url, &shed.url]);
    let router = Router::new(
        "t",
        target,
        RouterConfig {
            backoff_base: Duration::from_millis(5),
            ..RouterConfig::default()
        },
    );
    let c = Arc::new(client(router.clone()));
    let results = run_calls(&c, 200, 4, "s").await;
    assert!(results.iter().all(|r| r.is_ok()));
    let (g, s) = (
        good.hits.load(Ordering::SeqCst),
        shed.hits.load(Ordering::SeqCst),
    );
    // A shedding instance answers 20× faster than the good one; measured by latency alone it
    // would take most calls. Held as slow for its Retry-After, it gets a small share.
    assert!(s * 10 < g, "the 429 instance got {s} tries against {g}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malicious_responses_are_rejected_and_counted() {
    type Expect = fn(&InvalidResponse) -> bool;
    let cases: [(Behaviour, Expect); 4] = [
        (Behaviour::Huge, |r| {
            matches!(r, InvalidResponse::Oversized { .. })
        }),
        (Behaviour::OutOfRange, |r| {
            matches!(
                r,
                InvalidResponse::Rejected(ResponseError::OutOfRange { .. })
            )
        }),
        (Behaviour::ForeignId, |r| {
            matches!(
                r,
                InvalidResponse::Rejected(ResponseError::UnknownTrajectory { .. })
            )
        }),
        (Behaviour::NotANumber, |r| {
            matches!(r, InvalidResponse::Undecodable(_))
        }),
    ];
    for (b, expected) in cases {
        let f = fake(b).await;
        let (_tx, target) = endpoints(&[&f.url]);
        let router = Router::new(
            "t",
            target,
            RouterConfig {
                max_attempts: 1,
                ..RouterConfig::default()
            },
        );
        let c = client(router);
        let r = c.score("k", vec![item("t1")], None).await;
        match r {
            Err(ClientError::Invalid { reason, .. }) => {
                assert!(expected(&reason), "{b:?}: {}", infra::error_chain(&reason))
            }
            other => panic!("{b:?} was accepted: {other:?}"),
        }
        assert_eq!(c.rejected.load(Ordering::SeqCst), 1, "{b:?} not counted");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_one_result_even_with_concurrent_retried_and_hedged_calls() {
    let f = fake(Behaviour::Ok { delay_ms: 100 }).await;
    let (_tx, target) = endpoints(&[&f.url]);
    let router = Router::new(
        "t",
        target,
        RouterConfig {
            hedge_percentile: Some(0.5),
            hedge_min_samples: 1,
            ..RouterConfig::default()
        },
    );
    let call = |k: &str| {
        Call::new(
            k,
            RawBytes::from(serde_json::to_vec(&req_for(k)).unwrap()),
            Instant::now() + Duration::from_secs(5),
        )
    };
    let (a, b) = tokio::join!(router.call(call("same")), router.call(call("same")));
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.body, b.body);
    assert_eq!(router.call(call("same")).await.unwrap().body, a.body);
    let st = router.stats().snapshot();
    assert_eq!(
        st.calls, 1,
        "three calls with one key dispatched once: {st:?}"
    );
    assert_eq!(st.deduplicated, 2);
    // Hedged calls (p50 hedge after warm-up) still give one result per key.
    for i in 0..20 {
        router.call(call(&format!("h{i}"))).await.unwrap();
    }
    let st = router.stats().snapshot();
    assert_eq!(st.calls, 21);
    assert!(st.tries >= st.calls, "{st:?}");
}

fn req_for(key: &str) -> ScoreRequest {
    ScoreRequest {
        protocol: PROTOCOL_VERSION.into(),
        idempotency_key: key.into(),
        reward: "t@1".into(),
        reference: None,
        deadline_ms: 5000,
        items: vec![item(key)],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_instance_times_out_per_try_and_calls_still_finish() {
    let good = fake(Behaviour::Ok { delay_ms: 1 }).await;
    // Accepts connections, never answers.
    let hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hole_url = format!("http://{}/", hole.local_addr().unwrap());
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = hole.accept().await {
            held.push(s);
        }
    });
    let (_tx, target) = endpoints(&[&good.url, &hole_url]);
    let router = Router::new(
        "t",
        target,
        RouterConfig {
            per_try_timeout: Duration::from_millis(200),
            eject_max_percent: 50,
            ..RouterConfig::default()
        },
    );
    let c = Arc::new(client(router.clone()));
    let t = Instant::now();
    let results = tokio::time::timeout(Duration::from_secs(30), run_calls(&c, 60, 6, "x"))
        .await
        .expect("no hung call");
    assert!(results.iter().all(|r| r.is_ok()));
    let st = router.stats().snapshot();
    // The hole was tried (the per-try timeout fired and the call went elsewhere), then ejected
    // or avoided by the balancer.
    let hole_tries = st.per_instance.get(&2).copied().unwrap_or(0);
    assert!(
        hole_tries >= 1,
        "the blackholed instance was never tried: {st:?}"
    );
    assert!(st.retries >= 1, "{st:?}");
    assert!(st.ejections >= 1 || hole_tries <= 5, "{st:?}");
    assert!(t.elapsed() < Duration::from_secs(20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_activator_absorbs_up_to_its_bound_and_sheds_past_it_fast() {
    let f = fake(Behaviour::Ok { delay_ms: 2 }).await;
    // One instance with container concurrency 1: 200 simultaneous calls all succeed.
    let (_tx, target) = endpoints(&[&f.url]);
    let router = Router::new(
        "t",
        target,
        RouterConfig {
            container_concurrency: 1,
            ..RouterConfig::default()
        },
    );
    let c = Arc::new(client(router.clone()));
    let results = run_calls(&c, 200, 200, "o").await;
    assert!(results.iter().all(|r| r.is_ok()));
    assert!(router.stats().snapshot().peak_queued >= 100);
    // A bound of 8 with a slow instance: the excess fails at once with Overloaded.
    let slow = fake(Behaviour::Ok { delay_ms: 500 }).await;
    let (_tx2, target) = endpoints(&[&slow.url]);
    let router = Router::new(
        "t",
        target,
        RouterConfig {
            container_concurrency: 1,
            buffer: 8,
            ..RouterConfig::default()
        },
    );
    let c = Arc::new(client(router.clone()));
    let t = Instant::now();
    let results = run_calls(&c, 40, 40, "p").await;
    let overloaded = results
        .iter()
        .filter(|r| matches!(r, Err(ClientError::Router(RouterError::Overloaded { .. }))))
        .count();
    assert!(overloaded >= 20, "only {overloaded} shed");
    assert!(results.iter().all(
        |r| r.is_ok() || matches!(r, Err(ClientError::Router(RouterError::Overloaded { .. })))
    ));
    assert!(t.elapsed() < Duration::from_secs(10));
}

fn fn_bin() -> String {
    tests::rollarc_bin()
        .with_file_name("rollarc-fn")
        .to_string_lossy()
        .into_owned()
}

fn fast_scaling() -> Scaling {
    Scaling {
        container_concurrency: 2,
        stable_window: Dur::secs(3),
        panic_window_percentage: 20.0,
        scale_to_zero_grace_period: Dur::secs(1),
        tick_interval: Dur::millis(200),
        initial_scale: 0,
        ..Scaling::default()
    }
}

async fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scales_from_zero_with_buffered_requests_and_back_to_zero() {
    let rt = FunctionRuntime::new();
    let mut cfg = DeploymentConfig::new("math", fn_bin(), vec!["math".into()]);
    cfg.scaling = fast_scaling();
    let dep = rt.deploy(cfg).unwrap();
    assert_eq!(
        dep.status().ready + dep.status().starting,
        0,
        "initial-scale 0 starts at zero"
    );
    let router = Router::new(
        "math",
        Target::Local(dep.clone()),
        RouterConfig {
            container_concurrency: 2,
            ..RouterConfig::default()
        },
    );
    let c = Arc::new(client(router.clone()));
    // 24 requests at zero: all wait in the activator, all succeed once instances are ready.
    let results = run_calls(&c, 24, 24, "z").await;
    assert!(
        results.iter().all(|r| r.is_ok()),
        "{:?}",
        results.iter().find(|r| r.is_err())
    );
    let st = dep.status();
    assert!(
        st.instances_started >= 2,
        "24 waiting at concurrency 2 × 0.7 needs several instances: {st:?}"
    );
    assert!(st.peak_requests >= 20);
    // No traffic: stable window (3 s) + grace (1 s) → zero, processes gone.
    let pids: Vec<u32> = dep.ready_pids();
    wait_until("scale to zero", Duration::from_secs(20), || {
        let s = dep.status();
        s.ready + s.starting + s.draining == 0
    })
    .await;
    for p in pids {
        assert!(
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(p as i32), None).is_err(),
            "instance {p} still alive"
        );
    }
    rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_random_instances_under_load_loses_no_request() {
    let rt = FunctionRuntime::new();
    let mut cfg = DeploymentConfig::new("env", fn_bin(), vec!["env".into()]);
    cfg.scaling = Scaling {
        min_scale: 3,
        initial_scale: 3,
        ..fast_scaling()
    };
    let dep = rt.deploy(cfg).unwrap();
    wait_until("3 ready", Duration::from_secs(20), || {
        dep.status().ready == 3
    })
    .await;
    let router = Router::new(
        "env",
        Target::Local(dep.clone()),
        RouterConfig {
            container_concurrency: 2,
            backoff_base: Duration::from_millis(10),
            ..RouterConfig::default()
        },
    );
    let c = Arc::new(client(router.clone()));
    let killer = {
        let dep = dep.clone();
        tokio::spawn(async move {
            let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
            let mut kills = 0;
            for _ in 0..6 {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let pids = dep.ready_pids();
                if pids.is_empty() {
                    continue;
                }
                let p = pids[rng.random_range(0..pids.len())];
                let _ = nix::sys::signal::killpg(
                    nix::unistd::Pid::from_raw(p as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
                kills += 1;
            }
            kills
        })
    };
    let results = run_calls(&c, 1500, 12, "k").await;
    let kills = killer.await.unwrap();
    let ok = results.iter().filter(|r| r.is_ok()).count();
    assert!(kills >= 4, "only {kills} kills");
    assert_eq!(
        ok,
        results.len(),
        "lost {}: {:?}",
        results.len() - ok,
        results.iter().find(|r| r.is_err())
    );
    let st = router.stats().snapshot();
    let amp = st.tries as f64 / st.calls as f64;
    assert!(amp <= 1.2, "retry amplification {amp:.3}: {st:?}");
    // Every kill was seen (a ready instance's death, or a crash during startup) and the
    // instance replaced.
    wait_until(
        "deaths counted and replacements ready",
        Duration::from_secs(20),
        || {
            let s = dep.status();
            s.instances_crashed + s.instances_died_serving >= kills as u64 && s.ready >= 3
        },
    )
    .await;
    rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_scores_every_trajectory_once_through_the_runtime_which_scales_to_zero_after() {
    let s = tests::TestServer::start().await;
    let spec = tests::SpecBuilder::new()
        .pool("h800", "H800", 1, "")
        .raw_task("[[tasks]]\ndomain = \"add\"\ngroup_size = 2\nmax_turns = 1\nreward = [\"math\"]\n[tasks.env]\nkind = \"arithmetic\"\n")
        .rollout("batch_size = 4")
        .rollout("steps = 3")
        .extra("[sim]\nclock = \"real\"\n[reward]\nplacement = \"serverless\"\n[reward.functions.math]\nkind = \"builtin\"\nfunction = \"math\"\n[reward.functions.math.scaling]\ninitial-scale = 0\ncontainer-concurrency = 2\nstable-window = \"3s\"\nscale-to-zero-grace-period = \"1s\"\ntick-interval = \"200ms\"\npanic-window-percentage = 20\n")
        .toml();
    let r = s
        .client
        .post(s.url("/v1/jobs"))
        .body(spec)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    let id = r.json::<serde_json::Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    // While it runs, the function shows up in /v1/cluster with instances.
    let mut saw_instances = false;
    let t = Instant::now();
    loop {
        let c: serde_json::Value = s
            .client
            .get(s.url("/v1/cluster"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if c["functions"]
            .as_array()
            .is_some_and(|f| f.iter().any(|d| d["ready"].as_u64().unwrap_or(0) > 0))
        {
            saw_instances = true;
        }
        let j: serde_json::Value = s
            .client
            .get(s.url(&format!("/v1/jobs/{id}")))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if j["state"] != "running" && j["state"] != "queued" {
            assert_eq!(j["state"], "succeeded", "{j}");
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(120), "job did not finish");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        saw_instances,
        "the function never had a ready instance in /v1/cluster"
    );
    let text = s
        .client
        .get(s.url(&format!("/v1/jobs/{id}/trajectories?limit=1000")))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let trajs: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["trajectory"].clone())
        .collect();
    assert!(
        trajs.len() >= 12,
        "3 steps × 4 trajectories, got {}",
        trajs.len()
    );
    let view = s.service.functions.view();
    let f = view
        .iter()
        .find(|v| v.deployment.name.starts_with("math-"))
        .expect("math deployment");
    let router = f.router.as_ref().unwrap();
    // Every scored trajectory is one call, none deduplicated or lost; kept trajectories all carry a reward.
    assert!(
        trajs.iter().all(|t| t["reward"].is_number()),
        "a trajectory without reward"
    );
    assert!(
        router.calls as usize >= trajs.len(),
        "calls {} < trajectories {}",
        router.calls,
        trajs.len()
    );
    assert_eq!(router.deduplicated, 0);
    assert_eq!(router.failures, 0);
    // And back to zero once idle.
    wait_until("scale to zero", Duration::from_secs(20), || {
        s.service
            .functions
            .view()
            .iter()
            .all(|v| v.deployment.ready + v.deployment.starting == 0)
    })
    .await;
    // Scored exactly once: one HTTP try per call, one call per key.
    assert_eq!(router.tries, router.calls, "{router:?}");
    let metrics = s
        .client
        .get(s.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("rollarc_function_instances"),
        "instances gauge not exported"
    );
    assert!(metrics.contains("rollarc_router_calls_total"));
    // Prometheus names carry their suffix once; the latency histogram is in seconds with
    // buckets that fit calls of milliseconds.
    assert!(!metrics.contains("_total_total"), "doubled counter suffix");
    assert!(!metrics.contains("_seconds_seconds"), "doubled unit suffix");
    assert!(
        metrics.contains("rollarc_router_call_duration_seconds_bucket")
            && metrics.contains("le=\"0.005\""),
        "latency buckets"
    );
    // Tries are counted per call: concurrent calls do not count each other's attempts.
    let name = &f.deployment.name;
    let tries: f64 = metrics
        .lines()
        .filter(|l| {
            l.starts_with("rollarc_router_tries_total{")
                && l.contains(&format!("function=\"{name}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(tries as u64, router.calls, "exported tries for {name}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_placement_gives_the_job_dedicated_warm_instances_removed_at_its_end() {
    let s = tests::TestServer::start().await;
    let spec = tests::SpecBuilder::new()
        .pool("h800", "H800", 1, "")
        .raw_task("[[tasks]]\ndomain = \"add\"\ngroup_size = 2\nmax_turns = 1\nreward = [\"shaped\"]\n[tasks.env]\nkind = \"arithmetic\"\n")
        .rollout("batch_size = 4")
        .rollout("steps = 3")
        .extra("[sim]\nclock = \"real\"\n[reward]\nplacement = \"local\"\n[reward.functions.shaped]\nkind = \"builtin\"\nfunction = \"env\"\nconfig = { scale = 0.5, offset = 0.25 }\n")
        .toml();
    let r = s
        .client
        .post(s.url("/v1/jobs"))
        .body(spec)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    let id = r.json::<serde_json::Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let mut dedicated = None;
    let t = Instant::now();
    loop {
        if let Some(v) = s
            .service
            .functions
            .view()
            .into_iter()
            .find(|v| v.deployment.name.starts_with(&id))
        {
            dedicated = Some(v.deployment.name.clone());
        }
        let j: serde_json::Value = s
            .client
            .get(s.url(&format!("/v1/jobs/{id}")))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if j["state"] != "running" && j["state"] != "queued" {
            assert_eq!(j["state"], "succeeded", "{j}");
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(120), "job did not finish");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let name = dedicated.expect("no deployment named after the job");
    // Shaped pass-through: env reward r ∈ {0, 1} → 0.5·r + 0.25.
    let text = s
        .client
        .get(s.url(&format!("/v1/jobs/{id}/trajectories?limit=1000")))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for l in text.lines() {
        let r = serde_json::from_str::<serde_json::Value>(l).unwrap()["trajectory"]["reward"]
            .as_f64()
            .unwrap();
        assert!(
            r == 0.25 || r == 0.75,
            "reward {r} is not a shaped env reward"
        );
    }
    wait_until(
        "dedicated deployment removed",
        Duration::from_secs(20),
        || {
            s.service
                .functions
                .view()
                .iter()
                .all(|v| v.deployment.name != name)
        },
    )
    .await;
    // Metrics label the deployment without its job (bounded: the label of every job's
    // dedicated `shaped` deployment is the same), and its instance gauges are back at 0.
    let label = name
        .strip_prefix(&format!("{id}-"))
        .expect("named after the job");
    let metrics = s
        .client
        .get(s.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let with_function: Vec<&str> = metrics
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains("function=\""))
        .collect();
    assert!(
        with_function.iter().all(|l| !l.contains(id.as_str())),
        "a function label holds the job id: {with_function:#?}"
    );
    let series = |metric: &str| {
        with_function
            .iter()
            .filter(|l| l.starts_with(metric) && l.contains(&format!("function=\"{label}\"")))
            .count()
    };
    assert!(
        series("rollarc_router_calls_total") > 0,
        "{with_function:#?}"
    );
    assert!(series("rollarc_function_instance_events_total") > 0);
    for l in with_function.iter().filter(|l| {
        l.starts_with("rollarc_function_instances{")
            || l.starts_with("rollarc_function_desired_instances{")
    }) {
        assert!(l.ends_with(" 0"), "a removed deployment's gauge: {l}");
    }
}
