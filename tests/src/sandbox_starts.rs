//! Sandbox start control with real programs: a cap on programs booting at once, a warm pool
//! of programs started ahead, on the service's machine and on an env worker, and the starts
//! in a job's step records.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use actors::env::Environment;
use actors::env::external::{ExternalConfig, ExternalEnv, ExternalStarts};
use actors::env::starts::{Start, StartCaps};

/// A protocol-1 program that boots for `boot_s` (its boot noted in `dir`: `seen` gets the
/// number of programs booting at that moment, one line per program), then answers each
/// reset with its seed.
fn booting_program(dir: &Path, boot_s: f64) -> Vec<String> {
    let d = dir.display();
    let script = format!(
        r#"n=$(ls -d "{d}"/b.* 2>/dev/null | wc -l); mkdir "{d}/b.$$"; echo $((n+1)) >> "{d}/seen"
sleep {boot_s}; rmdir "{d}/b.$$"
while read -r l; do
  case "$l" in
    *reset*) s=$(echo "$l" | sed -n 's/.*"seed":\([0-9]*\).*/\1/p'); echo "{{\"v\":1,\"ok\":true,\"observation\":\"seed $s\"}}" ;;
    *) echo '{{"v":1,"ok":true,"observation":"","reward":1.0,"terminated":true}}' ;;
  esac
done"#
    );
    vec!["sh".into(), "-c".into(), script]
}

fn config(command: Vec<String>) -> ExternalConfig {
    ExternalConfig {
        command,
        call_timeout: Duration::from_secs(20),
        max_message_bytes: 1 << 16,
        workdir: None,
        protocol: 1,
    }
}

/// Programs booted so far, and the most that booted at once.
fn boots(dir: &Path) -> (usize, usize) {
    let seen = std::fs::read_to_string(dir.join("seen")).unwrap_or_default();
    let counts: Vec<usize> = seen.lines().filter_map(|l| l.trim().parse().ok()).collect();
    (counts.len(), counts.into_iter().max().unwrap_or(0))
}

/// Programs booting now.
fn booting(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter(|e| {
                e.as_ref()
                    .is_ok_and(|e| e.file_name().to_string_lossy().starts_with("b."))
            })
            .count()
        })
        .unwrap_or(0)
}

async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..400 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_cap_boots_one_program_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let starts = ExternalStarts::new(
        config(booting_program(dir.path(), 0.3)),
        StartCaps::new(Some(1)),
        0,
    );
    let mut envs: Vec<ExternalEnv> = (0..4)
        .map(|_| ExternalEnv::with_starts(Arc::clone(&starts)))
        .collect();
    let began = tokio::time::Instant::now();
    let obs = futures::future::join_all(
        envs.iter_mut()
            .enumerate()
            .map(|(i, e)| e.reset(10 + i as u64)),
    )
    .await;
    let took = began.elapsed();
    for (i, o) in obs.into_iter().enumerate() {
        assert_eq!(o.unwrap().text, format!("seed {}", 10 + i));
    }
    assert!(envs.iter().all(|e| e.last_start() == Some(Start::Cold)));
    // One at a time: never two booting, so four boots of 0.3 s take 1.2 s at least.
    assert_eq!(boots(dir.path()), (4, 1));
    assert!(took >= Duration::from_millis(1200), "{took:?}");
    // A second episode finds its program running: warm, no new boot.
    envs[0].reset(99).await.unwrap();
    assert_eq!(envs[0].last_start(), Some(Start::Warm));
    assert_eq!(boots(dir.path()).0, 4);
    for e in &mut envs {
        e.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_pool_hands_out_booted_programs_and_refills() {
    let dir = tempfile::tempdir().unwrap();
    let starts = ExternalStarts::new(
        config(booting_program(dir.path(), 0.3)),
        StartCaps::default(),
        2,
    );
    until("two warm programs", || starts.ready() == 2).await;
    assert_eq!(boots(dir.path()).0, 2);
    let mut a = ExternalEnv::with_starts(Arc::clone(&starts));
    let mut b = ExternalEnv::with_starts(Arc::clone(&starts));
    // The warm programs answered their warm-up reset (seed 0); the episodes' own resets
    // come after it.
    assert_eq!(a.reset(7).await.unwrap().text, "seed 7");
    assert_eq!(b.reset(8).await.unwrap().text, "seed 8");
    assert_eq!(a.last_start(), Some(Start::Warm));
    assert_eq!(b.last_start(), Some(Start::Warm));
    // Both taken: the pool starts two more in the background.
    until("the pool refilled", || starts.ready() == 2).await;
    assert_eq!(boots(dir.path()).0, 4);
    assert_eq!(starts.failed_warmups(), 0);
    // Without a warm pool, a new environment starts its program: cold.
    let cold = ExternalStarts::new(
        config(booting_program(dir.path(), 0.0)),
        StartCaps::default(),
        0,
    );
    let mut c = ExternalEnv::with_starts(cold);
    assert_eq!(c.reset(3).await.unwrap().text, "seed 3");
    assert_eq!(c.last_start(), Some(Start::Cold));
    // A warm program that exits while it waits is not handed out: the reset starts one.
    let once = ExternalStarts::new(
        config(vec![
            "sh".into(),
            "-c".into(),
            r#"read -r l; echo '{"v":1,"ok":true,"observation":"once"}'; sleep 0.1"#.into(),
        ]),
        StartCaps::default(),
        1,
    );
    until("a warm program", || once.ready() == 1).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let mut d = ExternalEnv::with_starts(Arc::clone(&once));
    assert_eq!(d.reset(4).await.unwrap().text, "once");
    assert_eq!(d.last_start(), Some(Start::Cold));
    drop((d, once));
    // A program that cannot start fails its warm-ups and is not kept.
    let broken = ExternalStarts::new(
        config(vec!["sh".into(), "-c".into(), "exit 3".into()]),
        StartCaps::default(),
        1,
    );
    until("the failed warm-up", || broken.failed_warmups() == 1).await;
    assert_eq!(broken.ready(), 0);
    for e in [&mut a, &mut b, &mut c] {
        e.close().await;
    }
    // The pool's own programs die with it (the environments hold it too).
    drop((a, b, c));
    drop(starts);
    until("the warm programs gone", || {
        crate::envs::processes_with(&dir.path().display().to_string()).is_empty()
    })
    .await;
}

/// The pool's `warm` and `max_concurrent_starts` reach a worker with the task; its replies
/// say how each reset found its program, and its API counts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_keeps_a_tasks_warm_programs_and_reports_its_starts() {
    let dir = tempfile::tempdir().unwrap();
    let w = crate::env_workers::start_worker_on("127.0.0.1:0", 8, Some("tok"));
    let pool = crate::env_workers::pool(&[&w.url], Some("tok"));
    let env = serde_json::json!({
        "kind": "external", "sandbox": "none", "protocol": 1,
        "command": booting_program(dir.path(), 0.3),
    });
    let task = actors::env::remote::RemoteTask::new(
        Arc::clone(&pool),
        "starts".into(),
        serde_json::json!({
            "env": env, "call_timeout_s": 20, "warm": 2, "max_concurrent_starts": 1,
        }),
        Duration::from_secs(20),
    );
    // The first reset registers the task: its warm pool begins to fill then, one program at
    // a time, so this reset's own program starts cold behind them or takes the first ready.
    let mut first = task.env(0);
    assert_eq!(first.reset(1).await.unwrap().text, "seed 1");
    // Once two are ready, new episodes take them.
    until("two warm programs on the worker", || {
        boots(dir.path()).0 == 3 && booting(dir.path()) == 0
    })
    .await;
    // Their warm-up answers are read and they join the pool.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut a = task.env(1);
    let mut b = task.env(2);
    assert_eq!(a.reset(2).await.unwrap().text, "seed 2");
    assert_eq!(b.reset(3).await.unwrap().text, "seed 3");
    assert_eq!(a.last_start(), Some(Start::Warm));
    assert_eq!(b.last_start(), Some(Start::Warm));
    // Never two booting at once on the worker (the task's cap of 1).
    assert_eq!(boots(dir.path()).1, 1);
    let state = crate::env_workers::worker_state(&w.url, "tok").await;
    let s = &state["starts"];
    assert_eq!(s["starts"], 3, "{state}");
    assert!(s["warm"].as_u64().unwrap() >= 2, "{state}");
    assert!(s["p99_s"].as_f64().unwrap() > 0.0, "{state}");
    for e in [&mut first, &mut a, &mut b] {
        e.close().await;
    }
}

/// A job on the service's own machine with a `local` pool's start control: every step
/// record counts its starts, with their quantiles, and the totals add up.
#[test]
fn a_jobs_step_records_count_its_sandbox_starts() {
    // Boots for 0.1 s and crashes one step in three, so programs are replaced as the job
    // goes on.
    let script = format!("sleep 0.1; {}", crate::envs::CRASHING_PROGRAM);
    let spec = tests::SpecBuilder::new()
        .pool("h20", "H20", 1, "")
        .raw_task(&format!("[[tasks]]\ndomain = \"flaky\"\ngroup_size = 2\nmax_turns = 2\nenvs = 4\nenv = {{ kind = \"external\", sandbox = \"none\", command = [\"bash\", \"-c\", '''{script}'''] }}\n"))
        .rollout("batch_size = 2")
        .rollout("steps = 3")
        .rollout("max_retries_per_group = 8")
        .extra("[sim]\nclock = \"real\"\n[[env_pools]]\nname = \"local\"\nwarm = 2\nmax_concurrent_starts = 2\n")
        .build();
    let sink = Arc::new(actors::buffer::MemorySink::default());
    let s = job::simrun::run_blocking(spec, 0, 0, sink, Arc::new(tests::BatchLog::default()), None)
        .expect("the job completes");
    let last = s.steps.last().unwrap();
    let per_step: u64 = s.steps.iter().map(|m| m.env_starts.starts).sum();
    let warm: u64 = s.steps.iter().map(|m| m.env_starts.warm).sum();
    assert!(per_step > 0);
    // Starts recorded after the last step's record are in the totals only.
    assert!(last.env_warm_starts + last.env_cold_starts >= per_step);
    assert!(last.env_warm_starts >= warm && warm > 0, "{last:?}");
    assert!(last.env_cold_starts > 0, "the first programs start cold");
    for m in &s.steps {
        let st = &m.env_starts;
        if st.starts > 0 {
            assert!(st.p50_s > 0.0 && st.p99_s >= st.p50_s, "{st:?}");
            assert!((0.0..=1.0).contains(&st.warm_hit_rate));
        }
    }
}
