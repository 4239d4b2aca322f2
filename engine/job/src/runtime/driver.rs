//! The step driver: per training step, get a batch → suspend → install → resume → train
//! (or, without overlap, suspend → train → install → resume), then record the step.

use std::sync::Arc;

use actors::buffer::BufferMsg;
use actors::call::call;
use actors::generation::InFlightPolicy;
use actors::trainer::TrainStats;
use actors::types::Batch;

use super::metrics::{BatchFigures, MetricSources, StepTimes, Timeline};
use super::protocol::{suspend_all, train, update_weights};
use super::scheduler::SchedMsg;
use super::spawn::JobActors;
use super::supervisor::SupervisorReport;
use super::{JobError, JobRun, JobSummary};
use crate::hub::FunctionHub;
use crate::spec::{Knobs, OnWeightUpdate};

/// Runs the job's remaining steps; returns the summary of this run.
pub(super) async fn drive(
    job: &JobRun,
    knobs: &Knobs,
    a: &JobActors,
    report: &Arc<SupervisorReport>,
    hub: Option<&Arc<FunctionHub>>,
    started: tokio::time::Instant,
) -> Result<JobSummary, JobError> {
    let mut d = Driver::new(job, knobs, a, report, hub, started);
    if let Some(e) = &a.evaluator
        && job.start_step == 0
        && e.due(0, knobs.steps)
    {
        d.evals.push(evaluate(e, 0, d.installed).await);
    }
    for step in job.start_step..knobs.steps {
        // The step's trace span (under the job's); episodes starting from now hang under it.
        // The first one was made before the scheduler started.
        let span = if step == job.start_step {
            a.trace_parent.get()
        } else {
            let s = step_span(step + 1, d.installed);
            a.trace_parent.set(s.clone());
            s
        };
        tracing::Instrument::instrument(d.step(step), span).await?;
    }
    let _ = a.scheduler.cast(SchedMsg::Shutdown);
    Ok(d.finish())
}

/// The step loop of one run: what its steps share, and what one step leaves to the next.
struct Driver<'a> {
    job: &'a JobRun,
    knobs: &'a Knobs,
    a: &'a JobActors,
    /// Where the step's metrics come from (and the supervisor's report of escalations).
    sources: MetricSources<'a>,
    /// What the shards do with in-flight requests when weights are installed.
    policy: InFlightPolicy,
    /// How long a step may wait for its batch, and train.
    step_limit: std::time::Duration,
    timeline: Timeline,
    /// The version the shards run.
    installed: u64,
    last_step_end: tokio::time::Instant,
    /// Evaluations waiting for a step record to carry them (the one before training).
    evals: Vec<super::eval::EvalRecord>,
    summary: JobSummary,
}

impl<'a> Driver<'a> {
    /// The driver of a run that starts at the job's `start_step`.
    fn new(
        job: &'a JobRun,
        knobs: &'a Knobs,
        a: &'a JobActors,
        report: &'a Arc<SupervisorReport>,
        hub: Option<&'a Arc<FunctionHub>>,
        started: tokio::time::Instant,
    ) -> Self {
        let policy = match knobs.on_weight_update {
            OnWeightUpdate::Abort => InFlightPolicy::Abort,
            OnWeightUpdate::Recompute => InFlightPolicy::Recompute,
        };
        let sources = MetricSources {
            started,
            pools: &a.pools,
            buffer: &a.buffer,
            scheduler: &a.scheduler,
            env_counters: &a.env_counters,
            shard_restarts: &a.shard_restarts,
            report,
            hub,
        };
        Self {
            job,
            knobs,
            a,
            sources,
            policy,
            step_limit: std::time::Duration::from_secs_f64(knobs.step_timeout_s),
            timeline: Timeline::new(job.timeline),
            installed: job.start_step,
            last_step_end: started,
            evals: Vec::new(),
            summary: JobSummary::default(),
        }
    }

    /// Runs training step `step` (0-based): waits for its batch, trains and installs weights,
    /// evaluates when due, and records the step.
    async fn step(&mut self, step: u64) -> Result<(), JobError> {
        let a = self.a;
        // The trainer's numbers land on it once the step is recorded (OTLP sees them too).
        let train_span = train_span();
        let t_wait = tokio::time::Instant::now();
        let batch = next_batch(self.job, a, self.sources.report, step, self.step_limit).await?;
        let wait_batch_s = t_wait.elapsed().as_secs_f64();
        let figures = BatchFigures::of(step, &batch);
        let (stats, t_train, weight_sync_s) = self
            .train_and_install(step, Arc::new(batch), &train_span)
            .await?;
        // Without overlap, the install after training counts in `train_s` too (generation
        // waits for both).
        let train_s = t_train.elapsed().as_secs_f64();
        let now = tokio::time::Instant::now();
        let times = StepTimes {
            step,
            step_s: now.duration_since(self.last_step_end).as_secs_f64(),
            train_s,
            wait_batch_s,
            weight_sync_s,
        };
        let mut m = self
            .sources
            .collect(times, &stats, figures, &mut self.timeline)
            .await?;
        record_trainer(&train_span, &m);
        if let Some(e) = &a.evaluator
            && e.due(step + 1, self.knobs.steps)
        {
            // The policy just trained: install it first (with overlap it would wait for the
            // next step).
            self.install_newest().await?;
            self.evals.push(evaluate(e, step + 1, self.installed).await);
        }
        m.eval = std::mem::take(&mut self.evals);
        self.last_step_end = now;
        self.job
            .observer
            .on_step(&m)
            .map_err(|source| JobError::Record {
                step: step + 1,
                source,
            })?;
        self.summary.steps_done = step + 1;
        self.summary.steps.push(m);
        Ok(())
    }

    /// Trains on `batch` (step `step`, 0-based) and installs the newest weights, overlapped
    /// with rollout or not as the job asks; returns the trainer's stats, when training began
    /// and the seconds spent installing weights. The batch is gone once trained (the observer
    /// has seen it), before rollout resumes.
    async fn train_and_install(
        &mut self,
        step: u64,
        batch: Arc<Batch>,
        train_span: &tracing::Span,
    ) -> Result<(TrainStats, tokio::time::Instant, f64), JobError> {
        let a = self.a;
        let mut weight_sync_s = 0.0;
        let t_train;
        let stats: TrainStats;
        if self.knobs.overlap_training {
            // Suspend, install the newest finished weights, resume; rollout goes on while
            // the step trains.
            let t_sync = tokio::time::Instant::now();
            self.install_newest().await?;
            weight_sync_s += t_sync.elapsed().as_secs_f64();
            t_train = tokio::time::Instant::now();
            stats = self.train(step, batch, train_span).await?;
        } else {
            // No overlap: generation pauses while training, then installs the fresh version.
            // (A scheduler that is gone fails the job through the supervisor.)
            let _ = a.scheduler.cast(SchedMsg::Training(true));
            suspend_all(&a.pools).await?;
            t_train = tokio::time::Instant::now();
            stats = self.train(step, batch, train_span).await?;
            let t_sync = tokio::time::Instant::now();
            self.install_newest().await?;
            weight_sync_s += t_sync.elapsed().as_secs_f64();
            let _ = a.scheduler.cast(SchedMsg::Training(false));
        }
        Ok((stats, t_train, weight_sync_s))
    }

    /// Trains on `batch` (step `step`, 0-based) under the step's `train` span, then shows it
    /// to the observer and lets it go: the trainer has dropped its share before answering,
    /// so the batch is freed here.
    async fn train(
        &self,
        step: u64,
        batch: Arc<Batch>,
        span: &tracing::Span,
    ) -> Result<TrainStats, JobError> {
        let stats = tracing::Instrument::instrument(
            train(
                &self.a.trainer,
                batch.clone(),
                &self.job.cancel,
                self.step_limit,
            ),
            span.clone(),
        )
        .await?;
        self.job.observer.on_batch(step + 1, &batch);
        Ok(stats)
    }

    /// Suspends the shards, installs the newest finished weights and resumes them.
    async fn install_newest(&mut self) -> Result<(), JobError> {
        let a = self.a;
        let now = update_weights(
            &a.pools,
            &a.weights,
            self.installed,
            self.policy,
            &a.scheduler,
        )
        .await?;
        self.installed = installed_now(self.job, self.installed, now);
        Ok(())
    }

    /// The summary of the run, once its steps are done.
    fn finish(self) -> JobSummary {
        let mut summary = self.summary;
        summary.elapsed_s = self.sources.started.elapsed().as_secs_f64();
        summary.functions = self
            .a
            .sim_functions
            .iter()
            .map(|(name, f)| (name.clone(), f.usage()))
            .collect();
        if let Some(last) = summary.steps.last() {
            summary.bubble_ratio = last.bubble_ratio;
            summary.pools = last.pools.clone();
            summary.trajectories_committed = last.buffer.committed;
        }
        summary
    }
}

/// The trace span of a step's training, its numbers recorded by [`record_trainer`].
fn train_span() -> tracing::Span {
    tracing::info_span!(
        target: infra::telemetry::TRACE_TARGET,
        "train",
        loss = tracing::field::Empty,
        policy_loss = tracing::field::Empty,
        kl = tracing::field::Empty,
        entropy = tracing::field::Empty,
        grad_norm = tracing::field::Empty,
        lr = tracing::field::Empty,
        clip_frac_low = tracing::field::Empty,
        clip_frac_high = tracing::field::Empty,
        is_weight_mean = tracing::field::Empty,
        is_weight_max = tracing::field::Empty,
        response_len_mean = tracing::field::Empty,
        response_len_max = tracing::field::Empty,
        trajectories = tracing::field::Empty,
    )
}

/// The step's trainer numbers on its `train` span.
fn record_trainer(span: &tracing::Span, m: &super::StepMetrics) {
    let t = &m.trainer;
    span.record("loss", m.loss);
    span.record("trajectories", m.trajectories);
    for (k, v) in [
        ("policy_loss", t.policy_loss),
        ("kl", t.kl),
        ("entropy", t.entropy),
        ("grad_norm", t.grad_norm),
        ("lr", t.lr),
        ("clip_frac_low", t.clip_frac_low),
        ("clip_frac_high", t.clip_frac_high),
        ("is_weight_mean", t.is_weight_mean),
        ("is_weight_max", t.is_weight_max),
        ("response_len_mean", t.response_len_mean),
    ] {
        if let Some(v) = v {
            span.record(k, v);
        }
    }
    if let Some(v) = t.response_len_max {
        span.record("response_len_max", v);
    }
}

/// The trace span of training step `step` (1-based), begun on policy `version`.
pub(super) fn step_span(step: u64, version: u64) -> tracing::Span {
    tracing::info_span!(
        target: infra::telemetry::TRACE_TARGET,
        "step",
        step,
        version,
    )
}

/// One evaluation, logged.
async fn evaluate(e: &super::eval::Evaluator, step: u64, version: u64) -> super::eval::EvalRecord {
    let r = e.run(step, version).await;
    for (task, m) in &r.tasks {
        tracing::info!(
            step,
            version,
            task = %task,
            pass_at_1 = m.pass_at_1,
            stderr = m.pass_at_1_stderr,
            pass_at_k = m.pass_at_k,
            k = m.k,
            seconds = r.seconds,
            "evaluation"
        );
    }
    r
}

/// Tells the observer when the shards moved to another version.
fn installed_now(job: &JobRun, before: u64, now: u64) -> u64 {
    if now != before {
        job.observer.on_weights_installed(now);
    }
    now
}

/// Waits for the batch of `step`, unless the job is cancelled or an actor escalated first.
async fn next_batch(
    job: &JobRun,
    a: &JobActors,
    report: &SupervisorReport,
    step: u64,
    limit: std::time::Duration,
) -> Result<Batch, JobError> {
    let mut escalated = report.escalated.subscribe();
    let mut faults = a.faults.subscribe();
    tokio::select! {
        biased;
        _ = job.cancel.cancelled() => Err(JobError::Cancelled),
        f = faults.wait_for(|f| f.is_some()) => match f.ok().and_then(|f| f.clone()) {
            Some(fault) => Err(fault.into()),
            // The budgets outlive the driver: a closed channel cannot happen here.
            None => Err(JobError::Escalated("the fault budgets were dropped".into())),
        },
        r = escalated.wait_for(|e| e.is_some()) => {
            let why = r.map(|e| e.clone().unwrap_or_default()).unwrap_or_default();
            Err(JobError::Escalated(why))
        }
        b = call(&a.buffer, |reply| BufferMsg::GetBatch { step, reply }, limit) => {
            b.map_err(JobError::call("sample buffer"))
        }
    }
}
