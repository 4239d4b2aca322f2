//! `rollarc bench --what env-workers`: many concurrent episodes of a zero-latency game
//! (FrozenLake 4×4, built in) over env workers on loopback — separate `rollarc env-worker`
//! processes reached over HTTP/2, as a job's env pool reaches them — against the same
//! episodes on environments in this process, in one run:
//!
//! - the cost per step, remote and local: each path's CPU time (this process and, remote, the
//!   workers) over its steps, and its wall time over its steps;
//! - the memory per open episode on a worker (its RSS with every episode open, less its RSS
//!   before the first);
//! - resets per second (an episode's start: a slot reserved, the episode opened on a worker);
//! - sandbox starts per second without and with a warm pool: [`STARTS`] episodes each opened
//!   on a new sandboxed program (`rollarc env-serve` under bubblewrap, protocol 1), at most
//!   [`START_CAP`] booting at once, first each started for its reset, then taken from a warm
//!   pool filled beforehand (its fill time is the cold start rate in the background), after
//!   one unmeasured burst.
//!
//! Every episode of the first three calls an environment leased from a pool, as in a job.

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use actors::env::remote::{Membership, RemoteTask, WorkerPool, WorkerPoolConfig};
use actors::env::{EnvError, EnvFactory, EnvLease, EnvPool};
use infra::clock::wall_now;
use ractor::SpawnErr;

use job::wiring::envs::builtin;

const FROZENLAKE: &str = r#"{"kind":"frozenlake","size":4}"#;
/// Episodes of the sandbox-start measure, each on a program of its own.
const STARTS: usize = 32;
/// Programs booting at once in that measure (`max_concurrent_starts`).
const START_CAP: usize = 4;

/// Why the env-workers benchmark stopped.
#[derive(Debug, thiserror::Error)]
pub enum EnvWorkersBenchError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Spec(#[from] serde_json::Error),
    #[error(transparent)]
    Spawn(#[from] SpawnErr),
    #[error(transparent)]
    Env(#[from] EnvError),
    #[error("env worker: {0}")]
    Worker(String),
}

/// A worker process, killed when dropped.
struct WorkerProc {
    child: Child,
    url: String,
}

impl Drop for WorkerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_worker(exe: &str, slots: usize) -> Result<WorkerProc, EnvWorkersBenchError> {
    let child = Command::new(exe)
        .args(["env-worker", "--listen", "127.0.0.1:0", "--slots"])
        .arg(slots.to_string())
        .env_remove("ROLLARC_ENV_WORKER_TOKEN")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    // Killed when dropped, on the errors below too.
    let mut w = WorkerProc {
        child,
        url: String::new(),
    };
    let out = w
        .child
        .stdout
        .take()
        .ok_or_else(|| EnvWorkersBenchError::Worker("no stdout".into()))?;
    let mut line = String::new();
    std::io::BufReader::new(out).read_line(&mut line)?;
    w.url = line
        .trim()
        .strip_prefix("rollarc env-worker listening on ")
        .ok_or_else(|| EnvWorkersBenchError::Worker(format!("first line {line:?}")))?
        .to_string();
    Ok(w)
}

/// Resident memory of process `pid` in bytes (0 when it cannot be read).
fn rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// CPU seconds (user + system) of process `pid` (`self` for this one).
fn cpu_s(pid: &str) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // The fields after the command name (which may hold spaces) start after its ')'.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = [11, 12]
        .iter()
        .filter_map(|&i| f.get(i)?.parse::<f64>().ok())
        .sum();
    // USER_HZ is 100 on Linux.
    ticks / 100.0
}

/// What one path measured.
struct PathFigures {
    reset_s: f64,
    step_wall_s: f64,
    step_cpu_s: f64,
    /// Of `step_cpu_s`, this process's (the rest is the workers').
    step_cpu_here_s: f64,
}

/// Opens `episodes` episodes on environments leased from one pool (all at once, each in a
/// task of its own, as a job's episodes are), then steps each `steps` times. Returns the pool
/// and the leases, still open.
async fn run_path(
    factory: EnvFactory,
    episodes: usize,
    steps: usize,
    pids: &[u32],
) -> Result<(PathFigures, EnvPool, Vec<EnvLease>), EnvWorkersBenchError> {
    let cpu = || cpu_s("self") + pids.iter().map(|p| cpu_s(&p.to_string())).sum::<f64>();
    let timeout = Duration::from_secs(120);
    let pool = EnvPool::spawn("bench", episodes, factory, timeout, timeout, None).await?;
    let mut leases = Vec::with_capacity(episodes);
    for _ in 0..episodes {
        leases.push(pool.lease().await.ok_or(EnvError::Closed)?);
    }
    let t = wall_now();
    let resets = leases.into_iter().enumerate().map(|(i, mut env)| {
        tokio::spawn(async move {
            env.reset(i as u64, None).await?;
            Ok::<_, EnvError>(env)
        })
    });
    let mut leases = Vec::with_capacity(episodes);
    for r in futures::future::join_all(resets).await {
        leases.push(r.map_err(|e| EnvWorkersBenchError::Worker(e.to_string()))??);
    }
    let reset_s = t.elapsed().as_secs_f64();
    let (t, c, here) = (wall_now(), cpu(), cpu_s("self"));
    let walks = leases.into_iter().map(|mut env| {
        tokio::spawn(async move {
            for _ in 0..steps {
                // "up" from the start keeps the agent in place: the episode never ends.
                env.step("up".into(), Vec::new().into()).await?;
            }
            Ok::<_, EnvError>(env)
        })
    });
    let mut leases = Vec::with_capacity(episodes);
    for r in futures::future::join_all(walks).await {
        leases.push(r.map_err(|e| EnvWorkersBenchError::Worker(e.to_string()))??);
    }
    let figures = PathFigures {
        reset_s,
        step_wall_s: t.elapsed().as_secs_f64(),
        step_cpu_s: cpu() - c,
        step_cpu_here_s: cpu_s("self") - here,
    };
    Ok((figures, pool, leases))
}

/// The env-workers benchmark: `episodes` concurrent episodes over `workers` env workers on
/// loopback against the same in this process, `steps` steps each.
pub fn bench_env_workers(
    episodes: usize,
    workers: usize,
    steps: usize,
) -> Result<(), EnvWorkersBenchError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let exe = std::env::current_exe()?.display().to_string();
    let per_worker = episodes.div_ceil(workers);
    let procs = (0..workers)
        .map(|_| start_worker(&exe, per_worker))
        .collect::<Result<Vec<_>, _>>()?;
    let pids: Vec<u32> = procs.iter().map(|p| p.child.id()).collect();
    let spec: job::spec::EnvSpec = serde_json::from_str(FROZENLAKE)?;
    println!(
        "env-workers benchmark: {episodes} concurrent FrozenLake episodes, {steps} steps each, \
         on leased environments"
    );
    rt.block_on(async {
        // Local: each episode's game in this process.
        let local: EnvFactory = {
            let spec = spec.clone();
            Arc::new(move |_| {
                builtin(&spec).unwrap_or_else(|| {
                    Box::new(actors::env::builtin::frozenlake::FrozenLake::new(
                        Default::default(),
                    ))
                })
            })
        };
        let (l, local_pool, leases) = run_path(local, episodes, steps, &[]).await?;
        drop(leases);
        local_pool.stop().await;
        // Remote: the same episodes on the workers.
        let pool = WorkerPool::new(WorkerPoolConfig {
            name: "bench".into(),
            membership: Membership::Urls(procs.iter().map(|p| p.url.clone()).collect()),
            token: None,
        })?;
        let registration = serde_json::json!({ "env": spec, "call_timeout_s": 120.0 });
        let task = RemoteTask::new(
            pool.clone(),
            "bench".into(),
            registration,
            Duration::from_secs(120),
        );
        let remote: EnvFactory = Arc::new(move |i| Box::new(task.env(i)));
        let idle: u64 = pids.iter().map(|&p| rss(p)).sum();
        let (r, remote_pool, leases) = run_path(remote, episodes, steps, &pids).await?;
        let open: u64 = pids.iter().map(|&p| rss(p)).sum();
        let spread: Vec<usize> = pool.snapshot().iter().map(|(_, st)| st.mine).collect();
        drop(leases);
        remote_pool.stop().await;
        let total = (episodes * steps) as f64;
        println!(
            "  {:28} {:>12} {:>12} {:>14}",
            "", "local", "remote", "remote/local"
        );
        let row = |name: &str, lv: f64, rv: f64, unit: &str| {
            println!(
                "  {name:28} {:>9.1} {unit:2} {:>9.1} {unit:2} {:>13.1}×",
                lv,
                rv,
                rv / lv
            );
        };
        row(
            "CPU per step",
            l.step_cpu_s * 1e6 / total,
            r.step_cpu_s * 1e6 / total,
            "µs",
        );
        row(
            "wall time per step",
            l.step_wall_s * 1e6 / total,
            r.step_wall_s * 1e6 / total,
            "µs",
        );
        println!(
            "  {:28} {:>12} {:>9.1} µs",
            "  of which in this process",
            "",
            r.step_cpu_here_s * 1e6 / total
        );
        println!(
            "  {:28} {:>9.0} /s {:>9.0} /s",
            "resets",
            episodes as f64 / l.reset_s,
            episodes as f64 / r.reset_s
        );
        println!(
            "  memory per open episode on a worker: {:.1} KiB ({} workers: {:.0} MB idle, {:.0} MB \
             with every episode open); episodes per worker: {spread:?}",
            open.saturating_sub(idle) as f64 / 1024.0 / episodes as f64,
            workers,
            idle as f64 / 1e6,
            open as f64 / 1e6
        );
        sandbox_starts(&exe).await
    })
}

/// Starts per second of [`STARTS`] sandboxed programs, without and with a warm pool.
async fn sandbox_starts(exe: &str) -> Result<(), EnvWorkersBenchError> {
    use actors::env::Environment;
    use actors::env::external::{ExternalConfig, ExternalEnv, ExternalStarts};
    use actors::env::starts::{Start, StartCaps, StartLog};
    let program = vec![exe.to_string(), "env-serve".into(), FROZENLAKE.into()];
    let (command, how) = match job::wiring::envs::check_sandbox() {
        Ok(()) => (
            job::wiring::envs::sandboxed(&program, &[exe.to_string()]),
            "bubblewrap",
        ),
        Err(_) => (program, "none (bubblewrap does not work here)"),
    };
    let cfg = ExternalConfig {
        command,
        call_timeout: Duration::from_secs(60),
        max_message_bytes: 1 << 20,
        workdir: None,
        protocol: 1,
    };
    // One burst of resets, each on its own environment in a task of its own (as each
    // episode is); (seconds, stats).
    let burst = |starts: Arc<ExternalStarts>| async move {
        let log = Arc::new(StartLog::default());
        let began = wall_now();
        let tasks: Vec<_> = (0..STARTS)
            .map(|i| {
                let (starts, log) = (Arc::clone(&starts), Arc::clone(&log));
                tokio::spawn(async move {
                    let mut e = ExternalEnv::with_starts(starts);
                    let t = wall_now();
                    e.reset(i as u64).await?;
                    log.record(e.last_start().unwrap_or(Start::Cold), t.elapsed());
                    Ok::<_, EnvError>(e)
                })
            })
            .collect();
        let mut envs = Vec::new();
        for t in tasks {
            envs.push(
                t.await
                    .map_err(|e| EnvWorkersBenchError::Worker(e.to_string()))??,
            );
        }
        let secs = began.elapsed().as_secs_f64();
        for e in &mut envs {
            e.close().await;
        }
        Ok::<_, EnvWorkersBenchError>((secs, log.take_step()))
    };
    let caps = || StartCaps::new(Some(START_CAP));
    // One burst unmeasured first: the first starts read the program and the sandbox's tools
    // from disk (three times slower here).
    burst(ExternalStarts::new(cfg.clone(), caps(), 0)).await?;
    let (cold_s, cold) = burst(ExternalStarts::new(cfg.clone(), caps(), 0)).await?;
    let filled = wall_now();
    let pool = ExternalStarts::new(cfg, caps(), STARTS);
    while pool.ready() < STARTS {
        if pool.failed_warmups() > 0 {
            return Err(EnvWorkersBenchError::Worker(
                "a warm program failed to start".into(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let fill_s = filled.elapsed().as_secs_f64();
    let (warm_s, warm) = burst(Arc::clone(&pool)).await?;
    println!(
        "  sandbox starts ({STARTS} episodes, each on a new `rollarc env-serve` program, sandbox: \
         {how}; at most {START_CAP} booting at once):"
    );
    for (name, secs, st) in [
        ("no warm pool", cold_s, &cold),
        ("warm pool", warm_s, &warm),
    ] {
        println!(
            "  {name:28} {:>9.1} starts/s  p50 {:>7.1} ms  p99 {:>7.1} ms  warm hits {:.0} %",
            STARTS as f64 / secs,
            st.p50_s * 1e3,
            st.p99_s * 1e3,
            st.warm_hit_rate * 100.0
        );
    }
    println!(
        "  {:28} {:>9.1} starts/s  (the warm pool filling in the background)",
        "",
        STARTS as f64 / fill_s
    );
    Ok(())
}
