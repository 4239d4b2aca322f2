//! The service's observer of a running job: records each step in the store, the metrics and
//! TensorBoard, and sends the job's progress and weight events.

use std::sync::Arc;

use actors::types::Batch;
use job::runtime::{ObserverError, StepMetrics, StepObserver};
use job::spec::JobSpec;

use super::{JobEvent, Service};

/// Watches one job's run for the service.
pub(super) struct ServiceObserver {
    service: Arc<Service>,
    id: String,
    steps: u64,
    /// An external trainer's acknowledgement marks the rows it trained on (the stored
    /// batch, which after a restart is not the one the job assembled again).
    external: bool,
    /// The job's TensorBoard events file (`DATA_DIR/tensorboard/JOB-NAME/`, [`crate::tensorboard::run_name`]), opened at its first
    /// step; a resumed attempt starts a file of its own beside it.
    tensorboard: std::sync::Mutex<Option<crate::tensorboard::EventWriter>>,
}

impl ServiceObserver {
    /// The observer of job `id` (run by `spec`) for `service`.
    pub(super) fn new(service: Arc<Service>, id: &str, spec: &JobSpec) -> Self {
        Self {
            service,
            id: id.to_string(),
            steps: spec.knobs().steps,
            external: matches!(spec.trainer, job::spec::TrainerSpec::External(_)),
            tensorboard: std::sync::Mutex::new(None),
        }
    }

    /// Appends the step's scalars to the job's TensorBoard events (a failure is logged, never
    /// the job's).
    fn tensorboard(&self, m: &StepMetrics) {
        // A record's timestamp: the store's wall clock.
        let now = job::store::now_ms() as f64 / 1e3;
        let Ok(mut w) = self.tensorboard.lock() else {
            return;
        };
        if w.is_none() {
            let name = self
                .service
                .store
                .get(&self.id)
                .ok()
                .flatten()
                .and_then(|j| j.name);
            let run = crate::tensorboard::run_name(&self.id, name.as_deref());
            let dir = self.service.data_dir.join("tensorboard").join(run);
            match crate::tensorboard::EventWriter::create(&dir, now) {
                Ok(x) => *w = Some(x),
                Err(e) => {
                    tracing::warn!(job = %self.id, dir = %dir.display(), error = %e, "no TensorBoard events");
                    return;
                }
            }
        }
        if let Some(x) = w.as_mut() {
            for (step, values) in crate::tensorboard::step_events(m) {
                if let Err(e) = x.scalars(step, now, &values) {
                    tracing::warn!(job = %self.id, error = %e, "TensorBoard events not written");
                }
            }
        }
    }
}

impl StepObserver for ServiceObserver {
    fn on_weights_installed(&self, version: u64) {
        self.service.send(
            &self.id,
            JobEvent::WeightsInstalled {
                id: self.id.clone(),
                version,
            },
        );
    }

    fn on_step(&self, m: &StepMetrics, batch: &Batch) -> Result<(), ObserverError> {
        let metrics = serde_json::to_value(m)?;
        let trained: Vec<&str> = if self.external {
            Vec::new()
        } else {
            batch.trajectories().map(|t| t.id.as_str()).collect()
        };
        self.service
            .store
            .complete_step(&self.id, m.step, &metrics, &trained)?;
        self.service.metrics.record_step(&self.id, m, batch);
        self.tensorboard(m);
        // The event stays small: the per-resource timeline (most of a step's record) is
        // served by `GET /v1/jobs/{id}/steps`.
        let mut metrics = metrics;
        if let Some(o) = metrics.as_object_mut() {
            o.remove("timeline");
        }
        self.service.send(
            &self.id,
            JobEvent::Progress {
                id: self.id.clone(),
                step: m.step,
                steps: self.steps,
                metrics,
            },
        );
        Ok(())
    }
}
