//! `rollarc serve` (the service, from its config file and options), `rollarc token` (a new
//! API token and its config entry) and `rollarc env-serve` (a built-in environment on
//! stdin/stdout).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use service::service::ServiceConfig;

use crate::{log_file, runtime};

/// The service config file of `rollarc serve --config`.
#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ServeConfig {
    addr: Option<String>,
    data_dir: Option<PathBuf>,
    max_running: Option<usize>,
    grace_s: Option<f64>,
    /// Memory budget of the running jobs together, in GiB (default: 60 % of the machine's).
    max_memory_gib: Option<f64>,
    #[serde(default)]
    insecure_public: bool,
    /// Accept the specs' fault-injection hooks (the project's own tests).
    #[serde(default)]
    test_hooks: bool,
    #[serde(default)]
    access: service::access::AccessConfig,
    #[serde(default)]
    policy: service::access::ProgramPolicy,
}

/// `rollarc token`: prints a new token and the config entry holding its digest.
pub(crate) fn token(name: &str, role: &str) -> anyhow::Result<ExitCode> {
    let role: service::access::Role = serde_json::from_value(serde_json::json!(role))
        .with_context(|| format!("--role must be read, submit or admin, got {role:?}"))?;
    let token =
        service::access::new_token().map_err(|_| anyhow::anyhow!("no system randomness"))?;
    println!("token (give it to the client, e.g. ROLLARC_TOKEN=…; it is not stored):\n  {token}");
    println!("service config entry:");
    println!("[[access.tokens]]");
    println!("name = {name:?}");
    println!("role = {:?}", format!("{role:?}").to_lowercase());
    println!("sha256 = {:?}", service::access::hash_token(&token));
    Ok(ExitCode::SUCCESS)
}

/// `rollarc serve`: the service on `addr` until it is told to stop.
pub(crate) fn serve(
    addr: Option<String>,
    data_dir: Option<PathBuf>,
    config: Option<PathBuf>,
    insecure_public: bool,
) -> anyhow::Result<ExitCode> {
    let cfg: ServeConfig = match config {
        Some(p) => toml::from_str(
            &std::fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))?,
        )
        .with_context(|| format!("invalid service config {}", p.display()))?,
        None => ServeConfig::default(),
    };
    let addr = addr.or(cfg.addr).unwrap_or_else(|| "127.0.0.1:8080".into());
    let data_dir = data_dir
        .or(cfg.data_dir)
        .unwrap_or_else(|| PathBuf::from("data"));
    log_file(&data_dir);
    let grace_s = cfg.grace_s.unwrap_or(10.0);
    if !(grace_s.is_finite() && (0.0..=job::spec::MAX_SECONDS).contains(&grace_s)) {
        bail!(
            "grace_s must be a number of seconds in [0, {}], got {grace_s}",
            job::spec::MAX_SECONDS
        );
    }
    let grace = Duration::from_secs_f64(grace_s);
    let max_running = cfg.max_running.unwrap_or(2);
    let max_memory = match cfg.max_memory_gib {
        None => None,
        Some(g) if g.is_finite() && g > 0.0 && g <= 1e6 => Some((g * (1u64 << 30) as f64) as u64),
        Some(g) => bail!("max_memory_gib must be a number of GiB in (0, 1e6], got {g}"),
    };
    let access =
        service::access::Access::new(&cfg.access, cfg.policy).context("invalid service config")?;
    let rt = runtime()?;
    rt.block_on(service::server::check_exposure(
        &addr,
        &access,
        insecure_public || cfg.insecure_public,
    ))?;
    rt.block_on(service::server::serve(
        &addr,
        ServiceConfig {
            data_dir,
            max_running,
            max_memory,
            test_hooks: cfg.test_hooks,
        },
        grace,
        access,
    ))?;
    Ok(ExitCode::SUCCESS)
}

/// `rollarc env-serve`: a built-in environment over the environment protocol.
pub(crate) fn env_serve(spec: &str) -> anyhow::Result<ExitCode> {
    let env: job::spec::EnvSpec = serde_json::from_str(spec)
        .context("the environment spec is not valid JSON for an env table")?;
    if job::wiring::envs::builtin(&env).is_none() {
        bail!("only built-in games can be served (frozenlake, sokoban, arithmetic, tictactoe)")
    }
    // Checked above: every call builds the same built-in game.
    let make = move || {
        job::wiring::envs::builtin(&env).unwrap_or_else(|| unreachable!("checked built-in"))
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(actors::env::protocol::serve(
        &make,
        tokio::io::BufReader::new(tokio::io::stdin()),
        tokio::io::stdout(),
    ))?;
    Ok(ExitCode::SUCCESS)
}

/// `rollarc env-worker`: environment sandboxes served to services on other machines.
pub(crate) fn env_worker(a: &crate::args::EnvWorkerArgs) -> anyhow::Result<ExitCode> {
    let (listen, slots, warm) = (a.listen.as_str(), a.slots, a.warm);
    let (max_concurrent_starts, drain_timeout_s) = (a.max_concurrent_starts, a.drain_timeout_s);
    if !(1..=100_000).contains(&slots) {
        bail!("--slots must be in 1..=100000, got {slots}");
    }
    if max_concurrent_starts == Some(0) {
        bail!("--max-concurrent-starts must be at least 1 (leave it out for no cap)");
    }
    if warm > job::spec::MAX_WARM as usize {
        bail!("--warm must be at most {}, got {warm}", job::spec::MAX_WARM);
    }
    if !(drain_timeout_s.is_finite() && (0.0..=job::spec::MAX_SECONDS).contains(&drain_timeout_s)) {
        bail!(
            "--drain-timeout-s must be a number of seconds in [0, {}], got {drain_timeout_s}",
            job::spec::MAX_SECONDS
        );
    }
    let token = match &a.token_file {
        Some(p) => Some(
            read_token(p).with_context(|| format!("cannot read the token file {}", p.display()))?,
        ),
        None => std::env::var("ROLLARC_ENV_WORKER_TOKEN").ok(),
    }
    .map(|t| t.trim().to_string())
    .filter(|t| !t.is_empty());
    let scratch = a.scratch_dir.clone().unwrap_or_else(std::env::temp_dir);
    let rt = runtime()?;
    rt.block_on(service::env_worker::run(
        listen,
        service::env_worker::WorkerConfig {
            slots,
            token,
            scratch,
            drain_timeout: Duration::from_secs_f64(drain_timeout_s),
            max_concurrent_starts,
            warm,
        },
        a.allow_no_token,
        |addr| {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "rollarc env-worker listening on http://{addr}");
            let _ = out.flush();
        },
    ))?;
    Ok(ExitCode::SUCCESS)
}

/// The operator's token file (its first 4 KiB: a token is one line).
fn read_token(path: &std::path::Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(4096)
        .read_to_string(&mut text)?;
    Ok(text)
}
