//! `rollarc`: the service and its command-line client. The only crate that depends on all
//! three layers (`job`, `service`, `lab`); it parses the command line and hands each command to
//! the layer that owns it.

#![cfg_attr(
    test,
    allow(
        clippy::too_many_lines,
        reason = "the 100-line limit is on shipped code; a test reads top to bottom"
    )
)]

mod args;
mod cli;
mod local;
mod remote;
mod serve;
mod simulate;
mod spec_file;
mod train_client;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;

use args::{Cli, Cmd};

/// mimalloc instead of the system allocator: the simulator and the service allocate and free
/// many small objects per event (futures, messages, trajectories); glibc's malloc took a fifth
/// of a simulated week's run time, much of it consolidating free lists. Its v2 line, not v3
/// (the workspace's `libmimalloc-sys` features): at 10,000 episodes in flight v3 held 8.9 KiB
/// of resident memory per episode against v2's 6.6 (a heap of 4.8). Rollout, simulation and
/// training ran at the same speed within noise; the SmolLM2 trainer's peak is ≈ 10 % higher
/// (8.3 → 9.1 GiB in `bench --what llm-train`; docs/results.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `purge_delay` option (its index in `mi_option_t`, the same in its v2 and v3).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Freed memory stays with the allocator for reuse (mimalloc's `purge_delay = -1`) unless
/// `MIMALLOC_PURGE_DELAY` says otherwise. By default mimalloc hands freed pages back to the
/// kernel after 10 ms, and the trainer allocates and frees the same large tensors on every
/// pass, so each pass faulted its pages in again: the kernel zeroing them took a fifth of a
/// SmolLM2 training step, and keeping them made the step 1.35–1.5× faster (docs/results.md).
/// The cost: the process's resident memory stays at its peak.
#[allow(unsafe_code)]
fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets one of the allocator's global options (an atomic store in mimalloc);
        // -1 is a documented value of this option.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) }
    }
}

/// The log levels of a command: a service's log is its output (info); any other command's
/// output is its result, so its terminal shows warnings unless asked for more.
fn log_levels(cli: &Cli) -> infra::telemetry::LogLevels {
    use infra::telemetry::{DEBUG_LOG, DEFAULT_LOG, LogLevels, QUIET_LOG};
    let service = matches!(
        cli.cmd,
        Cmd::Serve { .. } | Cmd::EnvServe { .. } | Cmd::EnvWorker(_)
    );
    let stderr = match (cli.verbose, service) {
        (0, false) => QUIET_LOG,
        (0, true) | (1, _) => DEFAULT_LOG,
        _ => DEBUG_LOG,
    };
    // Only `run` and `serve` keep a log file (`log_file`); for the other commands an info
    // level there would build every info span and event for nothing (a simulated week's
    // turns: 5 % of its run time).
    let keeps_file = matches!(cli.cmd, Cmd::Serve { .. } | Cmd::Run { .. });
    LogLevels {
        stderr,
        file: match (cli.verbose, keeps_file) {
            (_, false) => stderr,
            (0 | 1, true) => DEFAULT_LOG,
            _ => DEBUG_LOG,
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

fn main() -> ExitCode {
    keep_freed_memory();
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

/// Success or failure as the process's exit code.
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

/// Hands the command to the function that runs it.
fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let server = cli.server;
    let client = || crate::cli::api_client(cli.token.as_deref());
    match cli.cmd {
        Cmd::Serve {
            addr,
            data_dir,
            config,
            insecure_public,
        } => serve::serve(addr, data_dir, config, insecure_public),
        Cmd::Token { name, role } => serve::token(&name, &role),
        Cmd::Submit { file, set } => remote::submit(&client()?, &server, &file, &set),
        Cmd::Status { id, json } => remote::status(&client()?, &server, id, json),
        Cmd::Cancel { id } => remote::cancel(&client()?, &server, &id),
        Cmd::Watch { id } => remote::watch(&client()?, &server, &id),
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
            remote::train(crate::train_client::TrainOptions {
                server,
                token: cli.token.clone(),
                job,
                out,
                trainer,
                model,
                wait: Duration::from_secs_f64(wait_s.clamp(0.0, 60.0)),
                quiet: false,
            })
        }
        Cmd::Run {
            file,
            set,
            data_dir,
            report,
        } => local::run_job(&file, &set, data_dir, &report),
        Cmd::Report { job, data_dir, out } => local::report(&job, &data_dir, &out),
        Cmd::Profile { job, data_dir, out } => local::profile(&job, &data_dir, &out),
        Cmd::Export {
            job,
            data_dir,
            version,
            format,
            out,
        } => local::export(&job, &data_dir, version, &format, &out),
        Cmd::Sim {
            file,
            set,
            preset,
            compare,
        } => simulate::sim(&file, &set, preset.as_deref(), &compare),
        Cmd::Scenario {
            file,
            json_out,
            quiet,
        } => simulate::scenario(&file, json_out, quiet),
        Cmd::BenchSim {
            files,
            out,
            parallel,
        } => simulate::bench_sim(files, &out, parallel),
        Cmd::Plan {
            scenario,
            budget,
            search,
            json_out,
            spec_out,
        } => simulate::plan(&scenario, budget, search.as_deref(), json_out, spec_out),
        Cmd::EnvServe { spec } => serve::env_serve(&spec),
        Cmd::EnvWorker(a) => serve::env_worker(&a),
        Cmd::Devices => {
            crate::cli::print_devices();
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench {
            episodes,
            what,
            preset_steps,
            seeds,
            goal,
            max_steps,
        } => {
            let llm = lab::bench::PresetsLlmOptions {
                max_steps,
                seeds,
                goal,
                ..Default::default()
            };
            simulate::bench(episodes, &what, preset_steps, &llm)
        }
    }
}
