//! The commands over a local data directory: `run` (a job with the service in-process),
//! `report`, `profile` and `export`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, bail};
use service::service::{JobEvent, Service, ServiceConfig};

use crate::spec_file::read_spec;
use crate::{exit_code, log_file, runtime};

/// `rollarc run`: the service in-process; submit, watch, summary and report.
pub(crate) fn run_job(
    file: &Path,
    sets: &[String],
    data_dir: PathBuf,
    report: &Path,
) -> anyhow::Result<ExitCode> {
    let spec = read_spec(file, sets)?;
    runtime()?.block_on(async move {
        let service = Service::open(&ServiceConfig {
            data_dir: data_dir.clone(),
            max_running: 1,
            max_memory: None,
            test_hooks: false,
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

/// The store of `data_dir`, opened alone: a report may be written while a service runs on the
/// directory.
fn open_store(data_dir: &Path) -> anyhow::Result<job::store::Store> {
    let db = data_dir.join("rollarc.db");
    if !db.is_file() {
        bail!("{} holds no rollarc store (rollarc.db)", data_dir.display());
    }
    Ok(job::store::Store::open(&db)?)
}

/// `rollarc report`: writes the report of a job kept in `data_dir`.
pub(crate) fn report(job: &str, data_dir: &Path, out: &Path) -> anyhow::Result<ExitCode> {
    let store = open_store(data_dir)?;
    write_report(&store, data_dir, job, out)?;
    Ok(ExitCode::SUCCESS)
}

/// `rollarc profile`: derives a simulation spec from a finished job's telemetry.
pub(crate) fn profile(job: &str, data_dir: &Path, out: &Path) -> anyhow::Result<ExitCode> {
    let store = open_store(data_dir)?;
    let (spec, fit) = lab::profile::profile(&store, job)?;
    std::fs::write(out, serde_json::to_string_pretty(&spec)?)
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

/// `rollarc export`: writes a checkpoint job's policy for inference servers.
pub(crate) fn export(
    job: &str,
    data_dir: &Path,
    version: Option<u64>,
    format: &str,
    out: &Path,
) -> anyhow::Result<ExitCode> {
    let v = lab::export::export_job(data_dir, job, version, format, out)?;
    println!("exported {job} v{v} to {}", out.display());
    Ok(ExitCode::SUCCESS)
}

/// Writes job `id`'s report (summary, TensorBoard events, plots) to `dir` and prints where.
fn write_report(
    store: &job::store::Store,
    data_dir: &Path,
    id: &str,
    dir: &Path,
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
    let tb = dir
        .join("tensorboard")
        .join(service::tensorboard::run_name(id, j.name.as_deref()));
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

/// Prints how an in-process job ended, its metrics and its stored trajectories.
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
