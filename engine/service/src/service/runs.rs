//! The run loop: queued jobs start while there is room (in count and in the memory budget),
//! each on its own thread and runtime, and each run's outcome is recorded (succeeded, failed,
//! cancelled, or queued again by the restart policy) before the next jobs start.

use std::sync::Arc;

use actors::supervisor::{Decision, RestartTracker};
use infra::error_chain;
use tokio_util::sync::CancellationToken;

use job::runtime::{self, JobError, JobRun};
use job::spec::{Clock, JobSpec};
use job::store::{JobSink, JobState};

use super::observer::ServiceObserver;
use super::{JOB_RESTART_POLICY, Running, Service};

impl Service {
    /// Starts queued jobs while there is room.
    pub fn dispatch(self: &Arc<Self>) {
        if self.intake.is_cancelled() {
            return;
        }
        let Ok(unfinished) = self.store.unfinished() else {
            return;
        };
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        for j in unfinished
            .into_iter()
            .filter(|j| j.state == JobState::Queued)
        {
            if running.len() >= self.max_running {
                break;
            }
            if running.contains_key(&j.id) {
                continue;
            }
            let Ok(Some(spec)) = self.store.spec(&j.id) else {
                continue;
            };
            // Jobs start in order while the running ones leave room in the memory budget; a
            // job that does not fit waits (it fits alone: admission checked that).
            let memory = crate::admission::estimate(&spec).total();
            let in_use: u64 = running.values().map(|r| r.memory).sum();
            if !running.is_empty() && in_use.saturating_add(memory) > self.memory_budget {
                break;
            }
            let epoch = self.store.resume_epoch(&j.id).unwrap_or(0);
            if self
                .store
                .transition(&j.id, JobState::Running, None)
                .unwrap_or(false)
            {
                let cancel = CancellationToken::new();
                let interrupted = Arc::new(std::sync::atomic::AtomicBool::new(false));
                let me = self.clone();
                let (id, c2, i2) = (j.id.clone(), cancel.clone(), interrupted.clone());
                let start_step = j.step;
                let thread = std::thread::Builder::new()
                    .name(format!("job-{}", j.id))
                    .spawn(move || me.run_job(id, spec, start_step, epoch, c2, i2))
                    .ok();
                running.insert(
                    j.id.clone(),
                    Running {
                        memory,
                        cancel,
                        interrupted,
                        thread,
                    },
                );
                self.running_count.send_replace(running.len());
                drop(running);
                self.emit_state(&j.id);
                running = self.running.lock().unwrap_or_else(|p| p.into_inner());
            }
        }
    }

    /// Runs job `id` on this thread to its end (from `start_step`, with resume `epoch`), then
    /// records the outcome and starts the next queued jobs.
    fn run_job(
        self: Arc<Self>,
        id: String,
        spec: JobSpec,
        start_step: u64,
        epoch: u64,
        cancel: CancellationToken,
        interrupted: Arc<std::sync::atomic::AtomicBool>,
    ) {
        // Recorded before anything of the job runs: an attempt that never ends is one during
        // which the process died (see `recover`).
        let attempt = self
            .store
            .start_attempt(&id, start_step, self.boot as u64)
            .map_err(|e| tracing::error!(job = %id, error = %error_chain(&e), "could not record the attempt"))
            .ok();
        let result = self.run_attempt(&id, spec, start_step, epoch, &cancel);
        let outcome = if interrupted.load(std::sync::atomic::Ordering::SeqCst) {
            None
        } else {
            Some(self.outcome(&id, &result))
        };
        if let Some(a) = attempt {
            let ended = outcome.as_ref().map_or("interrupted", |o| o.0.as_str());
            if let Err(e) = self.store.end_attempt(a, ended) {
                tracing::error!(job = %id, error = %error_chain(&e), "could not record the attempt's end");
            }
        }
        if let Some((state, reason)) = outcome {
            // Its series leave `/metrics` before anyone can see it ended.
            self.metrics.job_ended(&id);
            if let Err(e) = self.store.transition(&id, state, reason.as_deref()) {
                tracing::error!(job = %id, error = %e, "could not record the job's final state");
            }
            tracing::info!(job = %id, state = state.as_str(), "job finished");
            self.emit_state(&id);
        }
        if let Ok(mut r) = self.running.lock() {
            r.remove(&id);
            self.running_count.send_replace(r.len());
        }
        self.dispatch();
    }

    /// One attempt of job `id`: its runtime (a paused clock for a fully simulated job), its
    /// observer and sink, and the run itself, a panic included.
    fn run_attempt(
        self: &Arc<Self>,
        id: &str,
        spec: JobSpec,
        start_step: u64,
        epoch: u64,
        cancel: &CancellationToken,
    ) -> Result<runtime::JobSummary, JobError> {
        // Per-resource timelines for jobs on real hardware (a simulated cluster has thousands
        // of resources; its report is the simulation summary).
        let timeline = spec.clock() == Clock::Real;
        let rt = match spec.clock() {
            Clock::Virtual => job::simrun::virtual_runtime(),
            Clock::Real => tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build(),
        };
        let rt = rt.map_err(JobError::Runtime)?;
        let observer = Arc::new(ServiceObserver::new(self.clone(), id, &spec));
        let sink = Arc::new(JobSink {
            store: self.store.clone(),
            job: id.to_string(),
        });
        let checkpoint_dir = Some(self.data_dir.join("checkpoints").join(id));
        // Also before any step completed: an attempt may have stored rows.
        let resume = self.resume_cursor(id, start_step);
        let run = JobRun {
            id: id.to_string(),
            spec,
            start_step,
            resume,
            epoch,
            sink,
            observer,
            cancel: cancel.clone(),
            checkpoint_dir,
            functions: Some(self.functions.clone()),
            timeline,
            batches: Some(self.batches.clone()),
            shared_sim_functions: None,
            agents: Some(self.agents.clone()),
        };
        // A panic anywhere in the job's runtime fails (or restarts) this job only.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            rt.block_on(runtime::run(run))
        }))
        .unwrap_or_else(|p| {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(JobError::Panicked(msg))
        })
    }

    /// The state a finished (not interrupted) run leaves job `id` in, and why.
    fn outcome(
        &self,
        id: &str,
        result: &Result<runtime::JobSummary, JobError>,
    ) -> (JobState, Option<String>) {
        match result {
            Ok(_) => (JobState::Succeeded, None),
            Err(JobError::Cancelled) => (JobState::Cancelled, Some("cancelled".to_string())),
            Err(e @ (JobError::Escalated(_) | JobError::Panicked(_) | JobError::Call { .. })) => {
                // An actor of the job died or the runtime panicked. The engine supervisor's
                // policy: restart the job from its last completed step,
                // at most JOB_RESTART_POLICY.intensity times within its window, then fail it.
                let decision = self.job_restarts.lock().map(|mut m| {
                    m.entry(id.to_string())
                        .or_insert_with(|| RestartTracker::new(JOB_RESTART_POLICY))
                        .on_failure(tokio::time::Instant::now())
                });
                if decision.ok() == Some(Decision::Restart) {
                    self.metrics.job_restarts.add(1, &[]);
                    (
                        JobState::Queued,
                        Some(format!("restarting after failure: {}", error_chain(e))),
                    )
                } else {
                    (JobState::Failed, Some(error_chain(e)))
                }
            }
            Err(e) => (JobState::Failed, Some(error_chain(e))),
        }
    }
}
