//! `rollarc`: the service and its command-line client. The only crate that depends on all
//! three layers (`job`, `service`, `lab`); it parses the command line and hands each command to
//! the layer that owns it.

mod cli;
mod train_client;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use job::spec::{self, Format, JobSpec};
use service::service::{JobEvent, Service, ServiceConfig};

#[derive(Parser)]
#[command(name = "rollarc", version = lab::VERSION, about = "Rollout engine for agentic RL")]
struct Cli {
    /// Address of a running service (client commands).
    #[arg(
        long,
        global = true,
        visible_alias = "service",
        env = "ROLLARC_SERVER",
        default_value = "http://127.0.0.1:8080"
    )]
    server: String,
    /// Bearer token of the client commands (a service with `[access]` tokens needs one).
    #[arg(long, global = true, env = "ROLLARC_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// More log on the terminal: `-v` info, `-vv` debug (`RUST_LOG` overrides). Commands
    /// show warnings only by default; `serve` logs at info. `run` and `serve` also keep the
    /// whole log (info, or debug with `-vv`) in DATA_DIR/logs/rollarc.log.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    cmd: Cmd,
}

/// The log levels of a command: a service's log is its output (info); any other command's
/// output is its result, so its terminal shows warnings unless asked for more.
fn log_levels(cli: &Cli) -> infra::telemetry::LogLevels {
    use infra::telemetry::{DEBUG_LOG, DEFAULT_LOG, LogLevels, QUIET_LOG};
    let service = matches!(cli.cmd, Cmd::Serve { .. } | Cmd::EnvServe { .. });
    let stderr = match (cli.verbose, service) {
        (0, false) => QUIET_LOG,
        (0, true) | (1, _) => DEFAULT_LOG,
        _ => DEBUG_LOG,
    };
    LogLevels {
        stderr,
        file: if cli.verbose >= 2 {
            DEBUG_LOG
        } else {
            DEFAULT_LOG
        },
    }
}

/// Where `run` and `serve` keep their whole log.
fn log_file(data_dir: &std::path::Path) {
    let path = data_dir.join("logs").join("rollarc.log");
    if let Err(e) = infra::telemetry::log_to_file(&path) {
        tracing::warn!(path = %path.display(), error = %e, "cannot write the log file");
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the service.
    Serve {
        /// HOST:PORT to listen on (overrides the config file).
        #[arg(long)]
        addr: Option<String>,
        /// Directory of the store (overrides the config file).
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// Service config (TOML: addr, data_dir, max_running, grace_s, max_memory_gib,
        /// insecure_public,
        /// [access] tokens / metrics / rate_limit, [policy] executables / allow_unsandboxed).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Listen on a non-loopback address even without access tokens.
        #[arg(long)]
        insecure_public: bool,
    },
    /// Print a new API token and the `[[access.tokens]]` entry (its SHA-256) for the service
    /// config. The token is shown once; the config keeps only its digest.
    Token {
        #[arg(long)]
        name: String,
        /// read, submit or admin.
        #[arg(long, default_value = "submit")]
        role: String,
    },
    /// Submit a job spec (TOML or JSON) to a running service.
    Submit {
        file: PathBuf,
        /// Change one field of the file: PATH=VALUE, e.g. `--set rollout.steps=20 --set
        /// tasks[0].group_size=4` (VALUE read as TOML, else as a string).
        #[arg(long = "set", value_name = "PATH=VALUE")]
        set: Vec<String>,
    },
    /// Show one job, or list all, as a table (`--json`: the raw records).
    Status {
        id: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Follow a job's progress.
    Watch { id: String },
    /// Cancel a job.
    Cancel { id: String },
    /// Train a job with `trainer = { kind = "external" }` as an external process: the
    /// built-in trainer, speaking only the trainer API (lease a batch, step, export the weights
    /// as safetensors under --out, announce them, acknowledge). Resumes from its checkpoint.
    Train {
        /// The job to train.
        #[arg(long)]
        job: String,
        /// The trainer's directory (checkpoints in trainer/, exported weights in weights/); the
        /// service reads the weights from here: a shared path outside its data directory.
        #[arg(long)]
        out: PathBuf,
        /// The built-in trainer's settings: a job spec whose [trainer] is kind = "builtin"
        /// (e.g. examples/quickstart.toml), or a file with that table alone. Default: the
        /// built-in trainer's defaults.
        #[arg(long)]
        trainer: Option<PathBuf>,
        /// The base checkpoint, when the service's path to it is not this machine's.
        #[arg(long)]
        model: Option<PathBuf>,
        /// Seconds one batch request waits (at most 60).
        #[arg(long, default_value_t = 30.0)]
        wait_s: f64,
    },
    /// Run a job with the service in-process: submit, watch, summary; exit code 0 on success.
    Run {
        file: PathBuf,
        /// Change one field of the file: PATH=VALUE, e.g. `--set rollout.steps=20 --set
        /// tasks[0].group_size=4` (VALUE read as TOML, else as a string).
        #[arg(long = "set", value_name = "PATH=VALUE")]
        set: Vec<String>,
        #[arg(long, default_value = "data")]
        data_dir: PathBuf,
        /// Where the end-of-run report (`summary.json`) goes.
        #[arg(long, default_value = "report")]
        report: PathBuf,
    },
    /// Write the report (summary.json, plots) of a job kept in a data directory.
    Report {
        job: String,
        #[arg(long, default_value = "data")]
        data_dir: PathBuf,
        #[arg(long, default_value = "report")]
        out: PathBuf,
    },
    /// Derive a simulation spec from a finished real job's telemetry (measured engine-step,
    /// training and environment costs), for `rollarc sim` to predict it at other settings.
    Profile {
        job: String,
        #[arg(long, default_value = "data")]
        data_dir: PathBuf,
        /// Where the simulation spec (JSON) goes.
        #[arg(long, default_value = "profiled.json")]
        out: PathBuf,
    },
    /// Export the policy a checkpoint job trained (its newest checkpoint, or `--version`) as
    /// a GGUF file or a Hugging Face directory, for inference servers.
    Export {
        job: String,
        #[arg(long, default_value = "data")]
        data_dir: PathBuf,
        #[arg(long)]
        version: Option<u64>,
        /// gguf (f32), gguf-q8 (q8_0 matrices) or hf.
        #[arg(long, default_value = "gguf")]
        format: String,
        #[arg(long)]
        out: PathBuf,
    },
    /// Run a fully simulated job in virtual time and print its figures.
    Sim {
        file: PathBuf,
        /// Change one field of the file: PATH=VALUE, e.g. `--set rollout.steps=20 --set
        /// tasks[0].group_size=4` (VALUE read as TOML, else as a string).
        #[arg(long = "set", value_name = "PATH=VALUE")]
        set: Vec<String>,
        /// Override the spec's preset.
        #[arg(long)]
        preset: Option<String>,
        /// Run under several presets and print the ratios against the first.
        #[arg(long, value_delimiter = ',')]
        compare: Vec<String>,
    },
    /// Run a scenario file (experiments on the simulated cluster) and check it against the paper.
    Scenario {
        file: PathBuf,
        /// Write the results as JSON here.
        #[arg(long)]
        json_out: Option<PathBuf>,
        /// Only the table (no line per run).
        #[arg(long)]
        quiet: bool,
    },
    /// Run every scenario (default: examples/sim/*.toml), print the table against the paper,
    /// write summary.json and plots.
    BenchSim {
        files: Vec<PathBuf>,
        #[arg(long, default_value = "report/sim")]
        out: PathBuf,
        /// Scenario processes at once.
        #[arg(long, default_value_t = 2)]
        parallel: usize,
    },
    /// Capacity planner: search trainer size and rollout hardware mix under a cost budget
    /// (H20 = 1) with the simulator, and recommend the fastest.
    Plan {
        scenario: PathBuf,
        #[arg(long)]
        budget: f64,
        /// Write the candidates as JSON here.
        #[arg(long)]
        json_out: Option<PathBuf>,
    },
    /// Serve a built-in environment over the environment protocol on stdin/stdout, e.g.
    /// `rollarc env-serve '{"kind":"frozenlake","size":4}'`.
    EnvServe { spec: String },
    /// List GPUs with the profile the mapper would use.
    Devices,
    /// Benchmarks: scheduler overhead (zero-latency simulated backends) and the built-in model.
    Bench {
        #[arg(long, default_value_t = 10_000)]
        episodes: usize,
        /// scheduler, model, llm, servers, env, functions, presets, batches or all.
        #[arg(long, default_value = "all")]
        what: String,
        /// Training steps per run of the preset benchmark.
        #[arg(long, default_value_t = 12)]
        preset_steps: u64,
    },
}

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
    #[serde(default)]
    access: service::access::AccessConfig,
    #[serde(default)]
    policy: service::access::ProgramPolicy,
}

/// Whether a job file is YAML (by its extension).
fn is_yaml(file: &std::path::Path) -> bool {
    file.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("yaml") || e.eq_ignore_ascii_case("yml"))
}

/// A job file's text and format (TOML, JSON, or YAML — sent on as JSON), with `--set`
/// overrides applied (then as JSON).
fn spec_text(file: &std::path::Path, sets: &[String]) -> anyhow::Result<(String, Format)> {
    let body =
        std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
    if is_yaml(file) {
        let mut doc: serde_json::Value = yaml_serde::from_str(&body)
            .with_context(|| format!("{} is not valid YAML", file.display()))?;
        if !doc.is_object() {
            bail!(
                "{}: a job spec is a mapping (tasks, pools, …)",
                file.display()
            );
        }
        spec::apply_overrides(&mut doc, sets).map_err(|e| anyhow::anyhow!(e))?;
        return Ok((serde_json::to_string(&doc)?, Format::Json));
    }
    let fmt = if file.extension().is_some_and(|e| e == "json") {
        Format::Json
    } else {
        Format::Toml
    };
    if sets.is_empty() {
        return Ok((body, fmt));
    }
    let mut doc: serde_json::Value = match fmt {
        Format::Json => serde_json::from_str(&body)
            .with_context(|| format!("{} is not JSON", file.display()))?,
        Format::Toml => serde_json::to_value(
            toml::from_str::<toml::Table>(&body)
                .with_context(|| format!("{} is not TOML", file.display()))?,
        )?,
    };
    spec::apply_overrides(&mut doc, sets).map_err(|e| anyhow::anyhow!(e))?;
    Ok((serde_json::to_string(&doc)?, Format::Json))
}

fn read_spec(file: &std::path::Path, sets: &[String]) -> anyhow::Result<JobSpec> {
    let (body, fmt) = spec_text(file, sets)?;
    job::resolve::accept(&body, fmt).map_err(|e| {
        let lines: Vec<String> =
            e.0.iter()
                .map(|f| {
                    format!(
                        "  {}: {}",
                        if f.field.is_empty() {
                            "(spec)"
                        } else {
                            &f.field
                        },
                        f.message
                    )
                })
                .collect();
        anyhow::anyhow!(
            "{} is not a valid job spec:\n{}",
            file.display(),
            lines.join("\n")
        )
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let _guard = infra::telemetry::init_tracing_with(&infra::env::ProcessEnv, log_levels(&cli));
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn exit_code(ok: bool) -> ExitCode {
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The runtime of the client commands and of an in-process service.
fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the runtime")
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let server = cli.server;
    let client = || crate::cli::api_client(cli.token.as_deref());
    match cli.cmd {
        Cmd::Serve {
            addr,
            data_dir,
            config,
            insecure_public,
        } => serve(addr, data_dir, config, insecure_public),
        Cmd::Token { name, role } => token(&name, &role),
        Cmd::Submit { file, set } => submit(&client()?, &server, &file, &set),
        Cmd::Status { id, json } => status(&client()?, &server, id, json),
        Cmd::Cancel { id } => cancel(&client()?, &server, &id),
        Cmd::Watch { id } => {
            Ok(runtime()?.block_on(crate::cli::watch_remote(&client()?, &server, &id))?)
        }
        Cmd::Train {
            job,
            out,
            trainer,
            model,
            wait_s,
        } => {
            let trainer = match trainer {
                Some(f) => crate::train_client::trainer_from_file(&f)?,
                None => crate::train_client::default_trainer(),
            };
            let o = crate::train_client::TrainOptions {
                server,
                token: cli.token.clone(),
                job,
                out,
                trainer,
                model,
                wait: std::time::Duration::from_secs_f64(wait_s.clamp(0.0, 60.0)),
                quiet: false,
            };
            let s = runtime()?.block_on(crate::train_client::train(o))?;
            println!(
                "job ended {}: {} steps trained here, {} batches acknowledged, newest version v{}",
                s.job_state, s.steps, s.acked, s.version
            );
            Ok(exit_code(s.job_state == "succeeded"))
        }
        Cmd::Run {
            file,
            set,
            data_dir,
            report,
        } => run_job(&file, &set, data_dir, &report),
        Cmd::Report { job, data_dir, out } => {
            // The store alone: a report may be written while a service runs on the directory.
            let db = data_dir.join("rollarc.db");
            if !db.is_file() {
                bail!("{} holds no rollarc store (rollarc.db)", data_dir.display());
            }
            let store = job::store::Store::open(&db)?;
            write_report(&store, &data_dir, &job, &out)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Profile { job, data_dir, out } => {
            let db = data_dir.join("rollarc.db");
            if !db.is_file() {
                bail!("{} holds no rollarc store (rollarc.db)", data_dir.display());
            }
            let store = job::store::Store::open(&db)?;
            let (spec, fit) = lab::profile::profile(&store, &job)?;
            std::fs::write(&out, serde_json::to_string_pretty(&spec)?)
                .with_context(|| format!("cannot write {}", out.display()))?;
            println!(
                "engine step {:.2} ms + {:.2} µs/token (fit error {:.1} %); training {:.3} s + {:.2} µs/token (fit error {:.1} %); {} steps, trajectories {:?}",
                fit.engine_step_s * 1e3,
                fit.engine_s_per_token * 1e6,
                100.0 * fit.engine_fit_error,
                fit.train_overhead_s,
                fit.train_s_per_token * 1e6,
                100.0 * fit.train_fit_error,
                fit.steps,
                fit.trajectories
            );
            println!(
                "wrote {} (try: rollarc sim {})",
                out.display(),
                out.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Export {
            job,
            data_dir,
            version,
            format,
            out,
        } => {
            let v = lab::export::export_job(&data_dir, &job, version, &format, &out)?;
            println!("exported {job} v{v} to {}", out.display());
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Sim {
            file,
            set,
            preset,
            compare,
        } => {
            let spec = read_spec(&file, &set)?;
            crate::cli::sim(spec, preset.as_deref(), &compare)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Scenario {
            file,
            json_out,
            quiet,
        } => scenario(&file, json_out, quiet),
        Cmd::BenchSim {
            files,
            out,
            parallel,
        } => bench_sim(files, &out, parallel),
        Cmd::Plan {
            scenario,
            budget,
            json_out,
        } => plan(&scenario, budget, json_out),
        Cmd::EnvServe { spec } => env_serve(&spec),
        Cmd::Devices => {
            crate::cli::print_devices();
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench {
            episodes,
            what,
            preset_steps,
        } => {
            let opts = lab::bench::BenchOptions {
                episodes,
                preset_file: std::path::Path::new("examples/quickstart.toml"),
                preset_steps,
            };
            lab::bench::run(&what, &opts, || {
                service::bench_batches::bench_batches().map_err(Into::into)
            })?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn token(name: &str, role: &str) -> anyhow::Result<ExitCode> {
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

fn serve(
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
        },
        grace,
        access,
    ))?;
    Ok(ExitCode::SUCCESS)
}

fn submit(
    client: &reqwest::Client,
    server: &str,
    file: &std::path::Path,
    sets: &[String],
) -> anyhow::Result<ExitCode> {
    let (body, fmt) = spec_text(file, sets)?;
    let ct = match fmt {
        Format::Json => "application/json",
        Format::Toml => "application/toml",
    };
    runtime()?.block_on(async {
        let r = client
            .post(format!("{server}/v1/jobs"))
            .header("content-type", ct)
            .body(body)
            .send()
            .await?;
        let status = r.status();
        let text = r.text().await?;
        if !status.is_success() {
            bail!("{status}: {text}");
        }
        println!("{text}");
        Ok(ExitCode::SUCCESS)
    })
}

fn status(
    client: &reqwest::Client,
    server: &str,
    id: Option<String>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    runtime()?.block_on(async {
        let one = id.is_some();
        let url = match id {
            Some(id) => format!("{server}/v1/jobs/{id}"),
            None => format!("{server}/v1/jobs"),
        };
        let r = client.get(url).send().await?;
        let status = r.status();
        let v: serde_json::Value = r.json().await?;
        if json || !status.is_success() {
            println!("{}", serde_json::to_string_pretty(&v)?);
        } else if one {
            print!("{}", crate::cli::job_detail(&v));
        } else {
            print!("{}", crate::cli::job_table(&v["jobs"]));
        }
        Ok(exit_code(status.is_success()))
    })
}

fn cancel(client: &reqwest::Client, server: &str, id: &str) -> anyhow::Result<ExitCode> {
    runtime()?.block_on(async {
        let r = client
            .post(format!("{server}/v1/jobs/{id}/cancel"))
            .send()
            .await?;
        let status = r.status();
        let body = r.text().await?;
        // The service's sentence (what the cancel does, or why it was refused), else the body.
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        match v
            .pointer("/cancel/message")
            .or_else(|| v.pointer("/error/message"))
            .and_then(|m| m.as_str())
        {
            Some(m) if status.is_success() => println!("{m}"),
            Some(m) => eprintln!("error: {m}"),
            None => println!("{body}"),
        }
        Ok(exit_code(status.is_success()))
    })
}

/// `rollarc run`: the service in-process; submit, watch, summary and report.
fn run_job(
    file: &std::path::Path,
    sets: &[String],
    data_dir: PathBuf,
    report: &std::path::Path,
) -> anyhow::Result<ExitCode> {
    let spec = read_spec(file, sets)?;
    runtime()?.block_on(async move {
        let service = Service::open(&ServiceConfig {
            data_dir: data_dir.clone(),
            max_running: 1,
            max_memory: None,
        })?;
        log_file(&data_dir);
        let id = service.submit(spec)?;
        let (first, rx) = service.subscribe(&id)?;
        let hub = service.functions.clone();
        let functions = move || {
            let v = hub.view();
            if v.is_empty() {
                return String::new();
            }
            let list: Vec<String> = v
                .iter()
                .map(|d| {
                    format!(
                        "{} {}/{}",
                        d.deployment.name, d.deployment.ready, d.deployment.desired
                    )
                })
                .collect();
            format!(" · functions {}", list.join(", "))
        };
        let last = crate::cli::watch_events_with(rx, Some(first), functions).await;
        print_summary(&service, &id)?;
        write_report(&service.store, service.data_dir(), &id, report)?;
        Ok(exit_code(matches!(
            last,
            Some(JobEvent::State {
                state: job::store::JobState::Succeeded,
                ..
            })
        )))
    })
}

fn scenario(
    file: &std::path::Path,
    json_out: Option<PathBuf>,
    quiet: bool,
) -> anyhow::Result<ExitCode> {
    let sc = lab::scenario::Scenario::load(file)?;
    println!(
        "{} — {} ({}): {} runs",
        sc.name,
        sc.title,
        sc.figure,
        sc.runs.len()
    );
    let res = lab::scenario::run(&sc, |r| {
        if !quiet {
            crate::cli::print_run(r);
        }
    })?;
    print!("{}", lab::scenario::table(std::slice::from_ref(&res)));
    if let Some(p) = json_out {
        std::fs::write(&p, serde_json::to_string_pretty(&res)?)
            .with_context(|| format!("cannot write {}", p.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

fn bench_sim(
    files: Vec<PathBuf>,
    out: &std::path::Path,
    parallel: usize,
) -> anyhow::Result<ExitCode> {
    let files = if files.is_empty() {
        let mut v: Vec<PathBuf> = std::fs::read_dir("examples/sim")
            .context("examples/sim")?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "toml"))
            .collect();
        v.sort();
        v
    } else {
        files
    };
    let exe = std::env::current_exe().context("cannot find this executable")?;
    // Checks outside the paper's band are reported (and explained in the scenario's notes),
    // not a failure of the benchmark.
    lab::simbench::run_all(&exe, &files, out, parallel)?;
    Ok(ExitCode::SUCCESS)
}

fn plan(
    scenario: &std::path::Path,
    budget: f64,
    json_out: Option<PathBuf>,
) -> anyhow::Result<ExitCode> {
    if !(budget.is_finite() && budget > 0.0) {
        bail!("--budget must be a positive cost (H20 = 1), got {budget}");
    }
    let sc = lab::scenario::Scenario::load(scenario)?;
    println!("planning {} under a budget of {budget:.0}", sc.name);
    let p = lab::plan::plan(&sc, budget, |c| {
        let roll: Vec<String> = c
            .rollout_gpus
            .iter()
            .map(|(d, g)| format!("{g} {d}"))
            .collect();
        println!(
            "  trainer {:>5} + {:<24} cost {:>7.0}: step {:>8.1} s",
            c.trainer_gpus,
            roll.join(" + "),
            c.cost,
            c.step_s
        );
    })?;
    print!("{}", lab::plan::render(&p));
    if let Some(out) = json_out {
        std::fs::write(&out, serde_json::to_string_pretty(&p)?)
            .with_context(|| format!("cannot write {}", out.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

fn env_serve(spec: &str) -> anyhow::Result<ExitCode> {
    let env: job::spec::EnvSpec = serde_json::from_str(spec)
        .context("the environment spec is not valid JSON for an env table")?;
    let Some(mut env) = job::wiring::envs::builtin(&env) else {
        bail!("only built-in games can be served (frozenlake, sokoban, arithmetic, tictactoe)")
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(actors::env::protocol::serve(
        env.as_mut(),
        tokio::io::BufReader::new(tokio::io::stdin()),
        tokio::io::stdout(),
    ))?;
    Ok(ExitCode::SUCCESS)
}

fn write_report(
    store: &job::store::Store,
    data_dir: &std::path::Path,
    id: &str,
    dir: &std::path::Path,
) -> anyhow::Result<()> {
    let Some(j) = store.get(id)? else {
        bail!(
            "no job {id} in the data directory {} (rollarc report JOB --data-dir DIR)",
            data_dir.display()
        );
    };
    let steps: Vec<job::runtime::StepMetrics> = store
        .step_metrics(id)?
        .into_iter()
        .map(serde_json::from_value)
        .collect::<Result<_, _>>()
        .context("stored step metrics")?;
    let mut summary = lab::report::summarise(id, j.state.as_str(), &steps);
    // The random-policy rate of each built-in game, measured on the environment itself.
    if let Some(spec) = store.spec(id)? {
        summary.seed = Some(spec.seed);
        summary.spec = serde_json::to_value(&spec).ok();
        for t in &spec.tasks {
            if let Some(s) = summary.tasks.get_mut(&t.domain) {
                s.success_random = job::baseline::random_policy_success(t, 4000, spec.seed);
            }
        }
    }
    crate::cli::print_task_table(&summary);
    let path = lab::report::write(dir, &summary)
        .with_context(|| format!("writing the report to {}", dir.display()))?;
    println!("report: {}", path.display());
    // The learning record for TensorBoard, rebuilt from the store (the service also writes
    // it live under DATA_DIR/tensorboard).
    let tb = dir.join("tensorboard").join(id);
    let _ = std::fs::remove_dir_all(&tb);
    let tb = service::tensorboard::write_steps(&tb, j.created_at_ms as f64 / 1e3, &steps)
        .with_context(|| format!("writing TensorBoard events under {}", dir.display()))?;
    println!("tensorboard: {}", tb.display());
    let random: std::collections::BTreeMap<String, f64> = summary
        .tasks
        .iter()
        .filter_map(|(n, t)| t.success_random.map(|r| (n.clone(), r)))
        .collect();
    match lab::report::plots(dir, &steps, &random) {
        Ok(files) => println!(
            "plots: {}",
            files
                .iter()
                .map(|f| f.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Err(e) => eprintln!("plots not drawn: {:#}", anyhow::Error::new(e)),
    }
    Ok(())
}

fn print_summary(service: &Arc<Service>, id: &str) -> anyhow::Result<()> {
    let Some(j) = service.store.get(id)? else {
        return Ok(());
    };
    println!(
        "job {} {} after {}/{} steps",
        j.id,
        j.state.as_str(),
        j.step,
        j.steps
    );
    if let Some(e) = &j.error {
        println!("error: {e}");
    }
    crate::cli::print_metrics(&j.metrics);
    println!(
        "trajectories stored: {}",
        service.store.trajectory_count(id)?
    );
    Ok(())
}
