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
    /// The ids of the trajectories the step in training trained on (step, ids), from its
    /// batch until its record is stored with them.
    trained: std::sync::Mutex<Option<(u64, Vec<String>)>>,
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
            trained: std::sync::Mutex::new(None),
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

    fn on_batch(&self, step: u64, batch: &Batch) {
        self.service.metrics.record_batch(step, batch);
        if !self.external {
            let ids = batch.trajectories().map(|t| t.id.clone()).collect();
            *self.trained.lock().unwrap_or_else(|p| p.into_inner()) = Some((step, ids));
        }
    }

    fn on_step(&self, m: &StepMetrics) -> Result<(), ObserverError> {
        let metrics = serde_json::to_value(m)?;
        let pending = self
            .trained
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let trained = match pending {
            Some((step, ids)) if step == m.step => ids,
            // An external trainer's acknowledgement marks its rows.
            None if self.external => Vec::new(),
            _ => {
                return Err(format!("the record of step {} came without its batch", m.step).into());
            }
        };
        let trained: Vec<&str> = trained.iter().map(String::as_str).collect();
        self.service
            .store
            .complete_step(&self.id, m.step, &metrics, &trained)?;
        self.service.metrics.record_step(&self.id, m);
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
