//! The metric catalogue of the service: every instrument in one place, names following
//! `rollarc_<subsystem>_<name>_<unit>[_total]`, labels bounded (pool, task).

use actors::types::Batch;
use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Gauge, Histogram};

use crate::job::StepMetrics;

pub struct Catalogue {
    pub jobs_submitted: Counter<u64>,
    pub job_restarts: Counter<u64>,
    pub steps: Counter<u64>,
    pub trajectories: Counter<u64>,
    pub pool_utilisation: Gauge<f64>,
    pub bubble_ratio: Gauge<f64>,
    pub staleness: Histogram<u64>,
    pub env_restarts: Gauge<u64>,
    pub shard_restarts: Gauge<u64>,
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
            pool_utilisation: m
                .f64_gauge("rollarc_pool_utilisation_ratio")
                .with_description("Busy fraction of a generation pool since its job started")
                .build(),
            bubble_ratio: m
                .f64_gauge("rollarc_generation_bubble_ratio")
                .with_description("Idle fraction of all generation capacity of the latest job step")
                .build(),
            staleness: m
                .u64_histogram("rollarc_trainer_staleness_versions")
                .with_description(
                    "Policy versions between a trajectory's start and its training step",
                )
                .with_boundaries(vec![0.0, 1.0, 2.0, 4.0, 8.0])
                .build(),
            env_restarts: m
                .u64_gauge("rollarc_env_restarts")
                .with_description("Environment actors restarted in the latest job")
                .build(),
            shard_restarts: m
                .u64_gauge("rollarc_shard_restarts")
                .with_description(
                    "Generation engines restarted (frozen or failed) in the latest job",
                )
                .build(),
        }
    }

    pub fn record_step(&self, m: &StepMetrics, batch: &Batch) {
        self.steps.add(1, &[]);
        for (task, t) in &m.tasks {
            self.trajectories.add(
                t.trajectories as u64,
                &[KeyValue::new("task", task.clone())],
            );
        }
        for (pool, p) in &m.pools {
            self.pool_utilisation.record(
                p.utilisation,
                &[
                    KeyValue::new("pool", pool.clone()),
                    KeyValue::new("device", p.device.clone()),
                ],
            );
        }
        self.bubble_ratio.record(m.bubble_ratio, &[]);
        for t in batch.trajectories() {
            self.staleness
                .record(m.step.saturating_sub(t.oldest_version()), &[]);
        }
        self.env_restarts.record(m.env_restarts, &[]);
        self.shard_restarts.record(m.shard_restarts, &[]);
    }
}

impl Default for Catalogue {
    fn default() -> Self {
        Self::new()
    }
}
