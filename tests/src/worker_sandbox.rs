//! The containment matrix on an env worker: a sandboxed external program registered on a
//! `rollarc env-worker` process meets the same limits as on the service (process count,
//! address space, wall-clock timeout, message size, file size), and the client sees each
//! as a failed call naming the limit.

use std::sync::Arc;
use std::time::Duration;

use actors::env::remote::{Membership, RemoteTask, WorkerPool, WorkerPoolConfig};
use actors::env::{EnvError, Environment};

use crate::env_workers::start_worker_on;

/// A shell command answering the protocol with `text` (shell variables in it expand).
fn reply(text: &str) -> String {
    format!(r#"echo "{{\"v\":1,\"ok\":true,\"observation\":\"{text}\"}}""#)
}

/// Resets one episode of `script` (a version-1 program, sandboxed by the worker) on the
/// worker, with the worker's call timeout `timeout_ms`.
async fn reset_on_worker(
    pool: &Arc<WorkerPool>,
    key: &str,
    script: &str,
    timeout_ms: u64,
) -> Result<String, EnvError> {
    let env = serde_json::json!({
        "kind": "external",
        "protocol": 1,
        "command": ["bash", "-c", script],
    });
    // The client waits longer than the worker, so the worker's own limit is what fires.
    let t = RemoteTask::new(
        Arc::clone(pool),
        key.into(),
        serde_json::json!({ "env": env, "call_timeout_s": timeout_ms as f64 / 1000.0 }),
        Duration::from_secs(60),
    );
    let mut e = t.env(0);
    let r = e.reset(0).await.map(|o| o.text);
    e.close().await;
    r
}

#[tokio::test]
async fn the_containment_matrix_holds_on_a_worker() {
    job::envs::check_sandbox().expect("the sandbox must work here");
    let w = start_worker_on("127.0.0.1:0", 8, None);
    let pool = WorkerPool::new(WorkerPoolConfig {
        name: "fleet".into(),
        membership: Membership::Urls(vec![w.url.clone()]),
        token: None,
    })
    .unwrap();
    // Fork bomb: process creation stops at the rlimit (512 per sandbox uid).
    let bomb = format!(
        "read l; (b() {{ b | b & }}; b) 2>/dev/null & sleep 2; c=0; for p in /proc/[0-9]*; do c=$((c+1)); done; {}",
        reply("procs:$c")
    );
    let r = reset_on_worker(&pool, "bomb", &bomb, 20_000).await.unwrap();
    let procs: usize = r.trim_start_matches("procs:").parse().unwrap();
    eprintln!("fork bomb on the worker: {procs} processes in the sandbox after 2 s");
    assert!(procs > 50 && procs <= 520, "{procs} processes");
    // Memory hog: the address-space limit stops it.
    let hog = format!(
        "read l; awk 'BEGIN{{s=\"x\"; while (1) s = s s}}' 2>/dev/null; {}",
        reply("awk-exit:$?")
    );
    let r = reset_on_worker(&pool, "hog", &hog, 20_000).await.unwrap();
    assert_ne!(r, "awk-exit:0", "unbounded allocation did not fail");
    // Infinite loop: the worker's call timeout fires and the call fails saying so.
    let t = tokio::time::Instant::now();
    let e = reset_on_worker(&pool, "loop", "read l; while :; do :; done", 500)
        .await
        .unwrap_err();
    let why = infra::error_chain(&e);
    assert!(why.contains("500ms"), "{why}");
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    // A gigabyte of output: cut at the message cap, not buffered.
    let e = reset_on_worker(
        &pool,
        "flood",
        "read l; head -c 1000000000 /dev/zero | tr '\\0' x; echo",
        20_000,
    )
    .await
    .unwrap_err();
    let why = infra::error_chain(&e);
    assert!(why.contains("1048576"), "{why}");
    // Writing a large file: the file-size limit stops it at 100 MB.
    let r = reset_on_worker(
        &pool,
        "big",
        &format!(
            "read l; head -c 200000000 /dev/zero > /tmp/big 2>/dev/null; {}",
            reply("size:$(stat -c %s /tmp/big)")
        ),
        20_000,
    )
    .await
    .unwrap();
    assert_eq!(r, "size:104857600");
    // The worker is still well and serving.
    let ok = reset_on_worker(&pool, "after", &format!("read l; {}", reply("fine")), 5_000).await;
    assert_eq!(ok.unwrap(), "fine");
}
