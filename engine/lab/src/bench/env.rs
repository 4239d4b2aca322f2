//! `rollarc bench --what env`: steps per second through a leased environment for a built-in
//! game and for the external protocol (bare and sandboxed), the per-step overhead of protocol
//! and sandbox, and sandbox start time.

use std::sync::Arc;
use std::time::Duration;

use actors::env::external::{ExternalConfig, ExternalEnv};
use actors::env::{EnvError, EnvFactory, EnvPool};
use infra::clock::wall_now;
use infra::sandbox::{check_sandbox, sandboxed};
use ractor::SpawnErr;
use tokio::runtime::Runtime;

use job::wiring::envs::builtin;

/// The game every case plays.
const FROZENLAKE: &str = r#"{"kind":"frozenlake","size":4}"#;

/// Why the environment benchmark stopped.
#[derive(Debug, thiserror::Error)]
pub enum EnvBenchError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Spec(#[from] serde_json::Error),
    #[error(transparent)]
    Spawn(#[from] SpawnErr),
    #[error(transparent)]
    Env(#[from] EnvError),
}

fn external_config(command: Vec<String>) -> ExternalConfig {
    ExternalConfig {
        protocol: 1,
        command,
        call_timeout: Duration::from_secs(30),
        max_message_bytes: 1 << 20,
        workdir: None,
    }
}

fn external(cmd: Vec<String>) -> EnvFactory {
    Arc::new(move |_| Box::new(ExternalEnv::new(external_config(cmd.clone()))))
}

fn unreachable_env() -> Box<dyn actors::env::DynEnvironment> {
    Box::new(actors::env::builtin::frozenlake::FrozenLake::new(
        Default::default(),
    ))
}

/// Mean microseconds per step over `n` steps of one environment leased from a pool, as an
/// episode calls it.
fn per_step_us(rt: &Runtime, factory: EnvFactory, n: usize) -> Result<f64, EnvBenchError> {
    rt.block_on(async {
        let timeout = Duration::from_secs(30);
        let pool = EnvPool::spawn("bench", 1, factory, timeout, timeout, None).await?;
        let mut env = pool.lease().await.ok_or(EnvError::Closed)?;
        env.reset(0, None).await?;
        let t = wall_now();
        for _ in 0..n {
            // "up" at the start keeps the agent in place: the episode never ends.
            env.step("up".into(), Vec::new().into()).await?;
        }
        let el = t.elapsed().as_secs_f64();
        drop(env);
        pool.stop().await;
        Ok(el * 1e6 / n as f64)
    })
}

/// Mean milliseconds to start an external environment, reset it once and close it.
fn start_ms(rt: &Runtime, cmd: &[String], n: u64) -> Result<f64, EnvError> {
    rt.block_on(async {
        let t = wall_now();
        for i in 0..n {
            let mut e = ExternalEnv::new(external_config(cmd.to_vec()));
            actors::env::Environment::reset(&mut e, i).await?;
            actors::env::Environment::close(&mut e).await;
        }
        Ok(t.elapsed().as_secs_f64() * 1e3 / n as f64)
    })
}

/// Environment benchmark: steps per second through a leased environment for a built-in game
/// and for the external protocol (bare and sandboxed), the per-step overhead of protocol and
/// sandbox, and sandbox start time.
pub fn bench_env() -> Result<(), EnvBenchError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let exe = std::env::current_exe()?.display().to_string();
    let serve = vec![exe, "env-serve".to_string(), FROZENLAKE.to_string()];
    let spec: job::spec::EnvSpec = serde_json::from_str(FROZENLAKE)?;
    let builtin: EnvFactory =
        Arc::new(move |_| builtin(&spec).unwrap_or_else(|| unreachable_env()));
    let sandbox_ok = check_sandbox().is_ok();
    let mut cases: Vec<(&str, EnvFactory, usize)> = vec![
        ("built-in FrozenLake", builtin, 50_000),
        ("external (protocol)", external(serve.clone()), 10_000),
    ];
    if sandbox_ok {
        cases.push((
            "external, sandboxed",
            external(sandboxed(&serve, &[])),
            10_000,
        ));
    }
    println!("environment benchmark (FrozenLake 4×4, a leased environment):");
    let mut per_step = Vec::new();
    for (name, factory, n) in cases {
        let us = per_step_us(&rt, factory, n)?;
        println!("  {name:22} {:9.0} steps/s  {us:7.1} µs per step", 1e6 / us);
        per_step.push(us);
    }
    if per_step.len() >= 2 {
        println!(
            "  protocol overhead per step: {:.1} µs over the built-in",
            per_step[1] - per_step[0]
        );
    }
    if per_step.len() >= 3 {
        println!(
            "  sandbox overhead per step:  {:.1} µs over the bare protocol",
            per_step[2] - per_step[1]
        );
    }
    for (name, cmd) in [
        ("bare", serve.clone()),
        ("sandboxed", sandboxed(&serve, &[])),
    ] {
        if name == "sandboxed" && !sandbox_ok {
            println!("  sandbox start: skipped (bubblewrap unavailable)");
            continue;
        }
        let ms = start_ms(&rt, &cmd, 30)?;
        println!("  start + first reset + close, {name:9}: {ms:6.1} ms");
    }
    Ok(())
}
