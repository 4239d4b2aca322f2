//! The trainer API's core: a step's batch as an external trainer receives it
//! ([`TrainingBatch`]), the desk that offers batches durably (in the store, from assembly to
//! acknowledgement) and leases them, and the [`Trainer`] that hands each step's batch to the
//! desk and waits for its acknowledgement.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actors::rl::{AdvantageKind, advantages};
use actors::trainer::{StepResult, TrainError, TrainStats, Trainer};
use actors::types::{Batch, PolicyVersion, Trajectory, VersionSpan};
use actors::weights::Weights;
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use utoipa::ToSchema;

use crate::store::{AckOutcome, LeasedBatch, Store, StoreError};

/// One training step's batch, as offered to an external trainer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TrainingBatch {
    /// The step this batch trains.
    pub step: u64,
    /// Oldest and newest policy version that produced a token of the batch.
    pub policy_version_min: PolicyVersion,
    pub policy_version_max: PolicyVersion,
    pub groups: Vec<BatchGroup>,
}

/// A group of samples of one prompt (one environment seed).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct BatchGroup {
    pub group_id: u64,
    pub task: String,
    /// The environment seed every sample of the group started from.
    pub prompt_id: u64,
    pub samples: Vec<Sample>,
}

/// One trajectory as a token sequence.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Sample {
    pub trajectory_id: String,
    /// Every turn's observation then response tokens, exactly as generated.
    pub tokens: Vec<u32>,
    /// 1 where the policy generated the token (train on it), 0 for observations.
    pub loss_mask: Vec<u8>,
    /// The behaviour policy's log-probability of each token (0 where `loss_mask` is 0).
    pub behaviour_logprobs: Vec<f32>,
    /// Which policy version generated which response tokens, in order.
    #[schema(value_type = Vec<Object>)]
    pub version_spans: Vec<VersionSpan>,
    /// Each turn's response as `[start, end)` offsets into `tokens`.
    pub turn_bounds: Vec<[usize; 2]>,
    /// The trajectory's reward (null when its reward function failed).
    pub reward: Option<f64>,
    /// The environment's reward of each turn.
    pub per_turn_rewards: Vec<f64>,
    /// The job's advantage estimate over the group (0 with `advantage = "none"` or without a
    /// reward).
    pub advantage: f64,
    /// `completed`, or `failed` (no reward: mask it).
    pub status: String,
}

impl TrainingBatch {
    /// The batch of `batch`, with advantages from `estimator` per group (none: 0).
    pub fn from_batch(batch: &Batch, estimator: Option<AdvantageKind>) -> Self {
        let mut versions = batch.trajectories().flat_map(Trajectory::versions);
        let first = versions.next();
        let (lo, hi) = versions.fold((first, first), |(lo, hi), v| {
            (lo.map(|l| l.min(v)), hi.map(|h| h.max(v)))
        });
        let groups = batch
            .groups
            .iter()
            .map(|g| {
                let rewards: Vec<f64> = g.trajectories.iter().filter_map(|t| t.reward).collect();
                let mut adv = match estimator {
                    Some(k) => advantages(k, &rewards),
                    None => vec![0.0; rewards.len()],
                }
                .into_iter();
                let samples = g
                    .trajectories
                    .iter()
                    .map(|t| {
                        let a = if t.reward.is_some() {
                            adv.next().unwrap_or(0.0)
                        } else {
                            0.0
                        };
                        sample(t, a)
                    })
                    .collect();
                let first = g.trajectories.first();
                BatchGroup {
                    group_id: first.map_or(0, |t| t.group_id),
                    task: first.map(|t| t.task.clone()).unwrap_or_default(),
                    prompt_id: first.map_or(0, |t| t.seed),
                    samples,
                }
            })
            .collect();
        Self {
            step: batch.step,
            policy_version_min: lo.unwrap_or(0),
            policy_version_max: hi.unwrap_or(0),
            groups,
        }
    }

    pub fn trajectory_ids(&self) -> Vec<String> {
        self.groups
            .iter()
            .flat_map(|g| g.samples.iter().map(|s| s.trajectory_id.clone()))
            .collect()
    }
}

fn sample(t: &Trajectory, advantage: f64) -> Sample {
    let mut s = Sample {
        trajectory_id: t.id.clone(),
        tokens: Vec::new(),
        loss_mask: Vec::new(),
        behaviour_logprobs: Vec::new(),
        version_spans: Vec::new(),
        turn_bounds: Vec::new(),
        reward: t.reward,
        per_turn_rewards: t.turns.iter().map(|u| u.env_reward).collect(),
        advantage,
        status: if t.reward.is_some() && t.failure.is_none() {
            "completed".into()
        } else {
            "failed".into()
        },
    };
    for u in &t.turns {
        s.tokens.extend_from_slice(&u.observation_tokens);
        s.loss_mask
            .extend(std::iter::repeat_n(0, u.observation_tokens.len()));
        s.behaviour_logprobs
            .extend(std::iter::repeat_n(0.0, u.observation_tokens.len()));
        let start = s.tokens.len();
        s.tokens.extend_from_slice(&u.response_tokens);
        s.loss_mask
            .extend(std::iter::repeat_n(1, u.response_tokens.len()));
        s.behaviour_logprobs.extend_from_slice(&u.logprobs);
        // A response without logprobs (never from our engines) keeps the columns aligned.
        s.behaviour_logprobs.resize(s.tokens.len(), 0.0);
        s.turn_bounds.push([start, s.tokens.len()]);
        for v in &u.versions {
            match s.version_spans.last_mut() {
                Some(last) if last.version == v.version => last.tokens += v.tokens,
                _ => s.version_spans.push(*v),
            }
        }
    }
    s
}

/// Offers each job's batches to its external trainer: durable in the store, leased to one
/// trainer at a time, offered again when a lease ends or is given back.
pub struct BatchDesk {
    store: Store,
    /// Per job: woken when a batch is offered, acknowledged or given back.
    changed: Mutex<HashMap<String, Arc<Notify>>>,
}

/// How often waiters look at the store even without a wake-up (a lease that ends).
const RECHECK: Duration = Duration::from_millis(500);

impl BatchDesk {
    pub fn new(store: Store) -> Arc<Self> {
        Arc::new(Self {
            store,
            changed: Mutex::new(HashMap::new()),
        })
    }

    fn changed(&self, job: &str) -> Arc<Notify> {
        let mut g = self.changed.lock().unwrap_or_else(|p| p.into_inner());
        g.entry(job.to_string()).or_default().clone()
    }

    /// Stores the batch of a step (kept if one is stored for that step already: a restarted
    /// job offers what it had assembled) and wakes the trainers waiting for one.
    pub fn offer(&self, job: &str, batch: &TrainingBatch) -> Result<(), StoreError> {
        let body = serde_json::to_string(batch)?;
        self.store.put_batch(job, batch.step, &body)?;
        self.changed(job).notify_waiters();
        Ok(())
    }

    /// Leases the next batch of `job` for `lease`, waiting up to `wait` for one.
    pub async fn next(
        &self,
        job: &str,
        wait: Duration,
        lease: Duration,
    ) -> Result<Option<LeasedBatch>, StoreError> {
        let changed = self.changed(job);
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let woken = changed.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            let now = crate::store::now_ms();
            if let Some(b) = self.store.lease_batch(job, now, lease.as_millis() as i64)? {
                return Ok(Some(b));
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            let _ = tokio::time::timeout(left.min(RECHECK), woken).await;
        }
    }

    /// Acknowledges lease `offer` of the batch of `step` with the trainer's `stats`.
    pub fn ack(
        &self,
        job: &str,
        step: u64,
        offer: u64,
        stats: &serde_json::Value,
    ) -> Result<AckOutcome, StoreError> {
        let Some(body) = self.store.batch_body(job, step)? else {
            return Ok(AckOutcome::Unknown);
        };
        let batch: TrainingBatch = serde_json::from_str(&body)?;
        let out = self.store.ack_batch(
            job,
            step,
            offer,
            crate::store::now_ms(),
            &stats.to_string(),
            &batch.trajectory_ids(),
        )?;
        self.changed(job).notify_waiters();
        Ok(out)
    }

    /// Gives lease `offer` back: the batch is offered again at once.
    pub fn nack(&self, job: &str, step: u64, offer: u64) -> Result<AckOutcome, StoreError> {
        let out = self.store.nack_batch(job, step, offer)?;
        self.changed(job).notify_waiters();
        Ok(out)
    }

    /// Waits until the batch of `step` is acknowledged; returns the trainer's stats.
    pub async fn acked(&self, job: &str, step: u64) -> Result<serde_json::Value, StoreError> {
        let changed = self.changed(job);
        loop {
            let woken = changed.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if let Some(stats) = self.store.batch_acked(job, step)? {
                return Ok(serde_json::from_str(&stats).unwrap_or(serde_json::Value::Null));
            }
            let _ = tokio::time::timeout(RECHECK, woken).await;
        }
    }

    /// Records an announced policy version (refused unless above every earlier one) and
    /// wakes the job's trainer side.
    pub fn announce(
        &self,
        job: &str,
        version: u64,
        uri: &str,
        format: &str,
    ) -> Result<bool, StoreError> {
        let fresh = self.store.announce_weights(job, version, uri, format)?;
        self.changed(job).notify_waiters();
        Ok(fresh)
    }

    /// The newest announced version of `job` and its file.
    pub fn newest_weights(&self, job: &str) -> Result<Option<(u64, String)>, StoreError> {
        self.store.newest_weights(job)
    }

    /// (offered but not acknowledged, acknowledged) batches of `job`.
    pub fn counts(&self, job: &str) -> Result<(u64, u64), StoreError> {
        self.store.batch_counts(job)
    }
}

/// What the job's engines run, so announced weights can be checked against it.
#[derive(Clone, Debug)]
pub enum ServedModel {
    /// Simulated engines: an announced version is a modelled publication of this size.
    Simulated { bytes: f64 },
    /// Real engines: every tensor, by name and shape, an announced file must hold; `plain`:
    /// the engines read plain rows (the tiny model), else shared candle tensors.
    Real {
        tensors: Vec<(String, Vec<usize>)>,
        plain: bool,
    },
}

impl ServedModel {
    pub fn of(w: &Weights) -> Self {
        let real = w
            .candle_tensors(&candle_core::Device::Cpu)
            .unwrap_or_default();
        if real.is_empty() {
            Self::Simulated {
                bytes: w.modelled_bytes,
            }
        } else {
            Self::Real {
                tensors: real
                    .into_iter()
                    .map(|(n, t)| (n, t.dims().to_vec()))
                    .collect(),
                plain: w.shared.is_none(),
            }
        }
    }

    /// The weights of `version` announced at `path` (safetensors), checked tensor by tensor.
    pub fn load(&self, version: PolicyVersion, path: &str) -> Result<Weights, AnnouncedError> {
        let (tensors, plain) = match self {
            Self::Simulated { bytes } => return Ok(Weights::simulated(version, *bytes)),
            Self::Real { tensors, plain } => (tensors, *plain),
        };
        let bad = |why: String| AnnouncedError {
            version,
            path: path.into(),
            why,
        };
        let mut map = candle_core::safetensors::load(path, &candle_core::Device::Cpu)
            .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        let mut out = Vec::with_capacity(tensors.len());
        for (name, shape) in tensors {
            let t = map
                .remove(name)
                .ok_or_else(|| bad(format!("it has no tensor {name}")))?;
            if t.dims() != shape.as_slice() {
                return Err(bad(format!(
                    "{name} has shape {:?}, the model's is {shape:?}",
                    t.dims()
                )));
            }
            let t = t
                .to_dtype(candle_core::DType::F32)
                .map_err(|e| bad(format!("{name}: {e}")))?;
            out.push((name.clone(), t));
        }
        if let Some(extra) = map.keys().next() {
            return Err(bad(format!("it has a tensor the model lacks: {extra}")));
        }
        if !plain {
            return Ok(Weights::from_shared(version, out));
        }
        let mut rows = Vec::with_capacity(out.len());
        let mut bytes = 0.0;
        for (name, t) in out {
            let data: Vec<f32> = t
                .flatten_all()
                .and_then(|t| t.to_vec1())
                .map_err(|e| bad(format!("{name}: {e}")))?;
            bytes += data.len() as f64 * 4.0;
            rows.push(actors::weights::Tensor {
                name,
                shape: t.dims().to_vec(),
                data,
            });
        }
        Ok(Weights {
            version,
            tensors: rows,
            shared: None,
            modelled_bytes: bytes,
        })
    }
}

/// Announced weights the job cannot serve.
#[derive(Debug, thiserror::Error)]
#[error("the announced weights of version {version} at {path} cannot be served: {why}")]
pub struct AnnouncedError {
    pub version: PolicyVersion,
    pub path: String,
    pub why: String,
}

/// The trainer of a job with `trainer.kind = "external"`: each step's batch goes to the desk
/// and the step ends when a trainer acknowledges it; the newest version the trainer
/// announced by then becomes the step's weights (checked against what the engines serve).
pub struct ExternalTrainer {
    pub desk: Arc<BatchDesk>,
    pub job: String,
    pub estimator: Option<AdvantageKind>,
    pub served: ServedModel,
    /// The version the job runs (the newest announced one it picked up).
    pub version: PolicyVersion,
}

impl Trainer for ExternalTrainer {
    fn train(
        &mut self,
        batch: &Batch,
        _next_version: PolicyVersion,
    ) -> futures::future::BoxFuture<'_, StepResult> {
        let tb = TrainingBatch::from_batch(batch, self.estimator);
        let (tokens, trajectories) = (batch.tokens() as u64, batch.trajectories().count() as u64);
        let mean_reward = {
            let r: Vec<f64> = batch.trajectories().filter_map(|t| t.reward).collect();
            if r.is_empty() {
                0.0
            } else {
                r.iter().sum::<f64>() / r.len() as f64
            }
        };
        Box::pin(async move {
            let t = tokio::time::Instant::now();
            let store_err = |e: StoreError| TrainError::Step(actors::error::SharedError::new(e));
            self.desk.offer(&self.job, &tb).map_err(store_err)?;
            let stats = self
                .desk
                .acked(&self.job, tb.step)
                .await
                .map_err(store_err)?;
            let loss = stats
                .get("loss")
                .and_then(serde_json::Value::as_f64)
                .unwrap_or(0.0);
            // Weights the trainer announced by now (before acknowledging, if it wants the
            // next step generated by them).
            let mut weights = None;
            if let Some((v, path)) = self.desk.newest_weights(&self.job).map_err(store_err)?
                && v > self.version
            {
                let served = self.served.clone();
                let w = tokio::task::spawn_blocking(move || served.load(v, &path))
                    .await
                    .map_err(|e| TrainError::Thread(actors::error::SharedError::new(e)))?
                    .map_err(|e| TrainError::Step(actors::error::SharedError::new(e)))?;
                self.version = v;
                weights = Some(w);
            }
            Ok((
                TrainStats {
                    step: tb.step,
                    version: self.version,
                    loss,
                    tokens,
                    trajectories,
                    mean_reward,
                    seconds: t.elapsed().as_secs_f64(),
                },
                weights,
            ))
        })
    }
}
