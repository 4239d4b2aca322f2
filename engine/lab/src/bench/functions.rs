//! `rollarc bench --what functions`: router overhead against a direct call, burst from zero,
//! overload absorb, and retry amplification under instance kills, on real `rollarc-fn`
//! processes of the local runtime.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use functions::protocol::{PROTOCOL_VERSION, ScoreRequest, ScoredItem};
use infra::clock::wall_now;
use infra::faas::runtime::RuntimeError;
use infra::faas::{Deployment, DeploymentConfig, Dur, FunctionRuntime, Scaling};
use infra::router::{Call, Router, RouterConfig, RouterError, Target};
use rand::{Rng, SeedableRng};
use tokio::task::JoinError;
use tokio::time::Instant;

/// Why the functions benchmark stopped.
#[derive(Debug, thiserror::Error)]
pub enum FunctionsBenchError {
    #[error(transparent)]
    Runtime(#[from] std::io::Error),
    #[error(transparent)]
    Deploy(#[from] RuntimeError),
    #[error(transparent)]
    Http(#[from] reqwest::Error),
    #[error(transparent)]
    Router(#[from] RouterError),
    #[error(transparent)]
    Join(#[from] JoinError),
}

/// A scoring request for key `k`.
fn body(k: &str) -> Bytes {
    let req = ScoreRequest {
        protocol: PROTOCOL_VERSION.into(),
        idempotency_key: k.into(),
        reward: "bench@1".into(),
        reference: Some(serde_json::json!("42")),
        deadline_ms: 30_000,
        items: vec![ScoredItem {
            trajectory_id: k.into(),
            text: "the answer is 42".into(),
            token_ids: vec![],
            env_reward: 0.0,
            transcript: None,
            calls: None,
            row: None,
        }],
    };
    Bytes::from(serde_json::to_vec(&req).unwrap_or_default())
}

fn call(k: String) -> Call {
    let body = body(&k);
    Call::new(k, body, Instant::now() + Duration::from_secs(60))
}

/// The `p` quantile of `v` (sorts it).
fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// Waits (up to 30 s) until `n` instances of `d` are ready.
async fn wait_ready(d: &Deployment, n: u32) {
    let t = Instant::now();
    while d.status().ready < n && t.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Deploys `name` (the math scorer) with `scaling`, and a router over it.
fn deploy(
    runtime: &FunctionRuntime,
    bin: &str,
    name: &str,
    scaling: Scaling,
) -> Result<(Arc<Deployment>, Arc<Router>), RuntimeError> {
    let concurrency = scaling.container_concurrency;
    let mut cfg = DeploymentConfig::new(name, bin.to_string(), vec!["math".into()]);
    cfg.scaling = scaling;
    let dep = runtime.deploy(cfg)?;
    let router = Router::new(
        name,
        Target::Local(dep.clone()),
        RouterConfig {
            container_concurrency: concurrency,
            ..RouterConfig::default()
        },
    );
    Ok((dep, router))
}

/// 1. Router overhead at a fixed rate: 200 calls/s, 1,000 calls, one warm instance.
async fn router_overhead(runtime: &FunctionRuntime, bin: &str) -> Result<(), FunctionsBenchError> {
    let mut cfg = DeploymentConfig::new("bench-direct", bin.to_string(), vec!["math".into()]);
    cfg.scaling = Scaling {
        min_scale: 1,
        initial_scale: 1,
        ..Scaling::default()
    };
    let dep = runtime.deploy(cfg)?;
    wait_ready(&dep, 1).await;
    let url = dep
        .endpoints()
        .borrow()
        .first()
        .map(|e| e.url.clone())
        .unwrap_or_default();
    let router = Router::new(
        "bench-direct",
        Target::Local(dep.clone()),
        RouterConfig::default(),
    );
    let client = reqwest::Client::new();
    let (mut direct, mut routed) = (Vec::new(), Vec::new());
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    for i in 0..1000 {
        tick.tick().await;
        let t = wall_now();
        client
            .post(&url)
            .body(body(&format!("d{i}")))
            .send()
            .await?
            .bytes()
            .await?;
        direct.push(t.elapsed().as_secs_f64() * 1e3);
        tick.tick().await;
        let t = wall_now();
        router.call(call(format!("r{i}"))).await?;
        routed.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let (d50, d99, r50, r99) = (
        pct(&mut direct, 0.5),
        pct(&mut direct, 0.99),
        pct(&mut routed, 0.5),
        pct(&mut routed, 0.99),
    );
    println!(
        "  router overhead @200/s: direct p50 {d50:.3} ms p99 {d99:.3} ms; routed p50 {r50:.3} ms p99 {r99:.3} ms; Δp50 {:.3} ms Δp99 {:.3} ms",
        r50 - d50,
        r99 - d99
    );
    Ok(())
}

/// 2. Burst from zero: 200 simultaneous calls to a deployment at zero.
async fn burst_from_zero(runtime: &FunctionRuntime, bin: &str) -> Result<(), FunctionsBenchError> {
    let scaling = Scaling {
        initial_scale: 0,
        container_concurrency: 8,
        tick_interval: Dur::millis(500),
        ..Scaling::default()
    };
    let (dep, router) = deploy(runtime, bin, "bench-burst", scaling)?;
    let t0 = wall_now();
    let hs: Vec<_> = (0..200)
        .map(|i| {
            let (r, c) = (router.clone(), call(format!("b{i}")));
            tokio::spawn(async move {
                let t = wall_now();
                (r.call(c).await.is_ok(), t.elapsed().as_secs_f64())
            })
        })
        .collect();
    let (mut errors, mut max_lat, mut first) = (0, 0.0f64, f64::MAX);
    for h in hs {
        let (ok, lat) = h.await?;
        errors += usize::from(!ok);
        max_lat = max_lat.max(lat);
        first = first.min(lat);
    }
    let st = dep.status();
    println!(
        "  burst from zero: 200 calls, errors {errors}, first answer {first:.3} s (cold start), max latency {max_lat:.3} s, all done {:.3} s, instances started {}",
        t0.elapsed().as_secs_f64(),
        st.instances_started
    );
    Ok(())
}

/// 3. Overload absorb: one instance, container concurrency 1, 1,000 simultaneous calls.
async fn overload_absorb(runtime: &FunctionRuntime, bin: &str) -> Result<(), FunctionsBenchError> {
    let scaling = Scaling {
        min_scale: 1,
        max_scale: 1,
        initial_scale: 1,
        container_concurrency: 1,
        ..Scaling::default()
    };
    let (dep, router) = deploy(runtime, bin, "bench-absorb", scaling)?;
    wait_ready(&dep, 1).await;
    let t0 = wall_now();
    let hs: Vec<_> = (0..1000)
        .map(|i| {
            let (r, c) = (router.clone(), call(format!("a{i}")));
            tokio::spawn(async move { r.call(c).await.is_ok() })
        })
        .collect();
    let mut ok = 0;
    for h in hs {
        ok += usize::from(h.await?);
    }
    println!(
        "  overload absorb: 1 instance, concurrency 1, 1,000 simultaneous: {ok}/1000 succeeded in {:.3} s, peak queue {}",
        t0.elapsed().as_secs_f64(),
        router.stats().snapshot().peak_queued
    );
    Ok(())
}

/// SIGKILLs the process group of a random ready instance every 500 ms until `stop`; returns
/// how many kills it sent.
async fn kill_randomly(dep: Arc<Deployment>, stop: Arc<AtomicBool>) -> u32 {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
    let mut kills = 0u32;
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let pids = dep.ready_pids();
        if let Some(&p) = pids.get(rng.random_range(0..pids.len().max(1))) {
            infra::process::kill_group(p);
            kills += 1;
        }
    }
    kills
}

/// 4. Retry amplification: 3 instances, SIGKILL of a random one every 500 ms, open-loop load.
async fn kills_under_load(runtime: &FunctionRuntime, bin: &str) -> Result<(), FunctionsBenchError> {
    let scaling = Scaling {
        min_scale: 3,
        initial_scale: 3,
        container_concurrency: 4,
        ..Scaling::default()
    };
    let (dep, router) = deploy(runtime, bin, "bench-kill", scaling)?;
    wait_ready(&dep, 3).await;
    let stop = Arc::new(AtomicBool::new(false));
    let killer = tokio::spawn(kill_randomly(dep.clone(), stop.clone()));
    // Open loop: 400 calls/s for 10 s.
    let t0 = wall_now();
    let mut tick = tokio::time::interval(Duration::from_micros(2500));
    let mut hs = Vec::with_capacity(4000);
    for i in 0..4000 {
        tick.tick().await;
        let (r, c) = (router.clone(), call(format!("k{i}")));
        hs.push(tokio::spawn(async move { r.call(c).await.is_ok() }));
    }
    let mut ok = 0;
    for h in hs {
        ok += usize::from(h.await?);
    }
    stop.store(true, Ordering::Relaxed);
    let kills = killer.await?;
    let st = router.stats().snapshot();
    println!(
        "  kills under load: 4,000 calls at 400/s in {:.2} s, {kills} SIGKILLs, success {:.3}%, tries/calls {:.3}, retries {}, budget exhausted {}",
        t0.elapsed().as_secs_f64(),
        100.0 * ok as f64 / 4000.0,
        st.tries as f64 / st.calls.max(1) as f64,
        st.retries,
        st.budget_exhausted
    );
    Ok(())
}

/// `rollarc bench --what functions`: router overhead against a direct call, burst from zero,
/// overload absorb, and retry amplification under instance kills, on real `rollarc-fn`
/// processes of the local runtime.
pub fn bench_functions() -> Result<(), FunctionsBenchError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let bin = job::hub::default_fn_bin().to_string_lossy().into_owned();
        let runtime = FunctionRuntime::new();
        println!("functions benchmark (release, real rollarc-fn processes, 2 cores)");
        router_overhead(&runtime, &bin).await?;
        burst_from_zero(&runtime, &bin).await?;
        overload_absorb(&runtime, &bin).await?;
        kills_under_load(&runtime, &bin).await?;
        runtime.shutdown().await;
        Ok(())
    })
}
