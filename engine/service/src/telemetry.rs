//! The metric catalogue of the service: every instrument in one place, names following
//! `rollarc_<subsystem>_<name>_<unit>[_total]`, labels bounded (pool, task, and `job_id` on
//! the job-scoped gauges: only running jobs have series — a job's are removed when it ends,
//! so the label takes at most `max_running` values at a time). Not `job`: Prometheus sets
//! that label on every scraped series (the scrape job's name) and would rename ours to
//! `exported_job`, so queries written with `job="…"` would find nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use infra::telemetry::prometheus;

use actors::types::Batch;
use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram};

use job::runtime::StepMetrics;

pub struct Catalogue {
    pub jobs_submitted: Counter<u64>,
    pub job_restarts: Counter<u64>,
    pub steps: Counter<u64>,
    pub trajectories: Counter<u64>,
    pub staleness: Histogram<u64>,
    jobs: JobGauges,
}

/// A job-scoped gauge: its name, help and labels after `job_id`.
const JOB_GAUGES: &[(&str, &str, &[&str])] = &[
    (
        "rollarc_job_step",
        "Training steps the job has completed",
        &[],
    ),
    (
        "rollarc_pool_utilisation_ratio",
        "Busy fraction of a generation pool since its job started",
        &["pool", "device"],
    ),
    (
        "rollarc_generation_bubble_ratio",
        "Idle fraction of the job's generation capacity since it started",
        &[],
    ),
    (
        "rollarc_task_success_ratio",
        "Success rate of the latest step's trajectories, by task",
        &["task"],
    ),
    (
        "rollarc_task_reward",
        "Mean reward of the latest step's trajectories, by task",
        &["task"],
    ),
    (
        "rollarc_trainer_loss",
        "Loss of the latest training step",
        &[],
    ),
    (
        "rollarc_trainer_kl",
        "KL estimate to the reference policy of the latest step",
        &[],
    ),
    (
        "rollarc_trainer_entropy",
        "Mean token entropy of the latest step",
        &[],
    ),
    (
        "rollarc_trainer_grad_norm",
        "Gradient norm of the latest step (before clipping)",
        &[],
    ),
    (
        "rollarc_trainer_learning_rate",
        "Learning rate of the latest step",
        &[],
    ),
    (
        "rollarc_env_restarts",
        "Environment actors restarted in the job",
        &[],
    ),
    (
        "rollarc_env_starts",
        "Environment resets in the job that found their sandbox running (start=warm) or started one (start=cold)",
        &["start"],
    ),
    (
        "rollarc_env_start_seconds",
        "Wall time of the latest step's resets that found or started a sandbox (quantile 0.5 or 0.99)",
        &["quantile"],
    ),
    (
        "rollarc_env_warm_hit_ratio",
        "Share of the latest step's sandbox starts that found their sandbox running",
        &[],
    ),
    (
        "rollarc_shard_restarts",
        "Generation engines restarted (frozen or failed) in the job",
        &[],
    ),
];

/// The job-scoped gauges, and which label sets each job has set (removed when it ends).
struct JobGauges {
    set: Mutex<BTreeMap<String, BTreeSet<LabelSet>>>,
}

/// A gauge (its index in [`JOB_GAUGES`]) and its label values, `job_id` first.
type LabelSet = (usize, Vec<String>);

/// The gauge vectors, registered once per process in the `/metrics` registry.
fn vecs() -> &'static [Option<prometheus::GaugeVec>] {
    static VECS: std::sync::OnceLock<Vec<Option<prometheus::GaugeVec>>> =
        std::sync::OnceLock::new();
    VECS.get_or_init(|| {
        let registry = infra::telemetry::Metrics::global().registry();
        JOB_GAUGES
            .iter()
            // One entry per gauge (none where it could not be made): indices stay aligned.
            .map(|(name, help, labels)| {
                let mut l = vec!["job_id"];
                l.extend_from_slice(labels);
                let v = prometheus::GaugeVec::new(prometheus::Opts::new(*name, *help), &l).ok()?;
                if let Err(e) = registry.register(Box::new(v.clone())) {
                    tracing::error!(metric = name, error = %e, "cannot register a job gauge");
                }
                Some(v)
            })
            .collect()
    })
}

impl JobGauges {
    fn new() -> Self {
        vecs();
        Self {
            set: Mutex::new(BTreeMap::new()),
        }
    }

    fn set(&self, job: &str, metric: &str, labels: &[&str], value: f64) {
        let Some(i) = JOB_GAUGES.iter().position(|g| g.0 == metric) else {
            return;
        };
        let Some(v) = vecs().get(i).and_then(Option::as_ref) else {
            return;
        };
        let mut all = vec![job.to_string()];
        all.extend(labels.iter().map(|s| s.to_string()));
        let refs: Vec<&str> = all.iter().map(String::as_str).collect();
        if let Ok(g) = v.get_metric_with_label_values(&refs) {
            g.set(value);
            if let Ok(mut s) = self.set.lock() {
                s.entry(job.to_string()).or_default().insert((i, all));
            }
        }
    }

    fn remove(&self, job: &str) {
        let Some(sets) = self.set.lock().ok().and_then(|mut s| s.remove(job)) else {
            return;
        };
        for (i, labels) in sets {
            let refs: Vec<&str> = labels.iter().map(String::as_str).collect();
            if let Some(v) = vecs().get(i).and_then(Option::as_ref) {
                let _ = v.remove_label_values(&refs);
            }
        }
    }
}

impl Catalogue {
    pub fn new() -> Self {
        let m = infra::telemetry::Metrics::global().meter();
        Self {
            jobs_submitted: m
                .u64_counter("rollarc_jobs_submitted")
                .with_description("Jobs accepted by the API")
                .build(),
            job_restarts: m
                .u64_counter("rollarc_engine_job_restarts")
                .with_description("Jobs restarted by the engine supervisor after a failure")
                .build(),
            steps: m
                .u64_counter("rollarc_trainer_steps")
                .with_description("Training steps completed")
                .build(),
            trajectories: m
                .u64_counter("rollarc_buffer_trajectories")
                .with_description("Trajectories trained on, by task")
                .build(),
            staleness: m
                .u64_histogram("rollarc_trainer_staleness_versions")
                .with_description(
                    "Policy versions between a trajectory's start and its training step",
                )
                .with_boundaries(vec![0.0, 1.0, 2.0, 4.0, 8.0])
                .build(),
            jobs: JobGauges::new(),
        }
    }

    /// The staleness of each trajectory of training step `step`'s (1-based) batch.
    pub fn record_batch(&self, step: u64, batch: &Batch) {
        for t in batch.trajectories() {
            self.staleness.record(
                step.saturating_sub(1).saturating_sub(t.oldest_version()),
                &[],
            );
        }
    }

    pub fn record_step(&self, job: &str, m: &StepMetrics) {
        self.steps.add(1, &[]);
        for (task, t) in &m.tasks {
            self.trajectories.add(
                t.trajectories as u64,
                &[KeyValue::new("task", task.clone())],
            );
        }
        let g = &self.jobs;
        g.set(job, "rollarc_job_step", &[], m.step as f64);
        for (pool, p) in &m.pools {
            g.set(
                job,
                "rollarc_pool_utilisation_ratio",
                &[pool, &p.device],
                p.utilisation,
            );
        }
        g.set(job, "rollarc_generation_bubble_ratio", &[], m.bubble_ratio);
        for (task, t) in &m.tasks {
            g.set(job, "rollarc_task_success_ratio", &[task], t.success_rate);
            g.set(job, "rollarc_task_reward", &[task], t.mean_reward);
        }
        g.set(job, "rollarc_trainer_loss", &[], m.loss);
        let n = &m.trainer;
        for (name, v) in [
            ("rollarc_trainer_kl", n.kl),
            ("rollarc_trainer_entropy", n.entropy),
            ("rollarc_trainer_grad_norm", n.grad_norm),
            ("rollarc_trainer_learning_rate", n.lr),
        ] {
            if let Some(v) = v {
                g.set(job, name, &[], v);
            }
        }
        g.set(job, "rollarc_env_restarts", &[], m.env_restarts as f64);
        g.set(
            job,
            "rollarc_env_starts",
            &["warm"],
            m.env_warm_starts as f64,
        );
        g.set(
            job,
            "rollarc_env_starts",
            &["cold"],
            m.env_cold_starts as f64,
        );
        let st = &m.env_starts;
        if st.starts > 0 {
            g.set(job, "rollarc_env_start_seconds", &["0.5"], st.p50_s);
            g.set(job, "rollarc_env_start_seconds", &["0.99"], st.p99_s);
            g.set(job, "rollarc_env_warm_hit_ratio", &[], st.warm_hit_rate);
        }
        g.set(job, "rollarc_shard_restarts", &[], m.shard_restarts as f64);
    }

    /// The job ended: its series leave `/metrics` (they would otherwise keep their last
    /// value forever, and the `job` label would grow without bound).
    pub fn job_ended(&self, job: &str) {
        self.jobs.remove(job);
    }
}

impl Default for Catalogue {
    fn default() -> Self {
        Self::new()
    }
}
