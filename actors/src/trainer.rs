//! The trainer behind one trait (built-in CPU trainer, simulated time model, external trainer)
//! and the trainer actor that runs steps one at a time.

use crate::error::SharedError;
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::types::{Batch, PolicyVersion};
use crate::weights::{WeightStoreMsg, Weights};

/// What one training step reports.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TrainStats {
    pub step: u64,
    pub version: PolicyVersion,
    pub loss: f64,
    pub tokens: u64,
    pub trajectories: u64,
    pub mean_reward: f64,
    pub seconds: f64,
    /// The optimiser's and the objective's diagnostics.
    pub numbers: TrainerNumbers,
}

/// What a training step measured besides its loss: the objective's parts, the optimiser's
/// state and the batch's shape. `None`: the trainer does not measure it (a simulated trainer
/// measures nothing; an external one reports what it acknowledges with).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct TrainerNumbers {
    /// The PPO-clip part of the loss (without the KL penalty).
    pub policy_loss: Option<f64>,
    /// k3 KL to the reference policy, per generated token (only with a KL penalty).
    pub kl: Option<f64>,
    /// Entropy of the policy at the generated positions, nats per token.
    pub entropy: Option<f64>,
    /// Global gradient norm before clipping.
    pub grad_norm: Option<f64>,
    /// The learning rate of the step (after warm-up and decay).
    pub lr: Option<f64>,
    /// Shares of generated tokens whose ratio hit the lower clip (negative advantage) or the
    /// upper clip (positive advantage).
    pub clip_frac_low: Option<f64>,
    pub clip_frac_high: Option<f64>,
    /// The importance weight π_θ / π_behaviour over generated tokens: mean and max.
    pub is_weight_mean: Option<f64>,
    pub is_weight_max: Option<f64>,
    /// Response tokens per trajectory of the batch: mean and max.
    pub response_len_mean: Option<f64>,
    pub response_len_max: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TrainError {
    #[error("the training step failed")]
    Step(#[source] SharedError),
    #[error("could not write the checkpoint {path}")]
    Checkpoint {
        path: std::path::PathBuf,
        #[source]
        source: SharedError,
    },
    #[error("the trainer's lock is poisoned (an earlier step panicked)")]
    Poisoned,
    #[error("the training thread failed")]
    Thread(#[source] SharedError),
}

/// What a training step gives back: its stats and, when it made one, the next policy
/// version's weights (an external trainer announces its weights separately).
pub type StepResult = Result<(TrainStats, Option<Weights>), TrainError>;

/// A trainer: consumes one batch, produces the next policy version's weights.
pub trait Trainer: Send + 'static {
    fn train(
        &mut self,
        batch: &Batch,
        next_version: PolicyVersion,
    ) -> futures::future::BoxFuture<'_, StepResult>;
}

/// A host's cores shared by a trainer and generation engines (a CPU deployment, as measured
/// by `rollarc profile`): engines charge the seconds they compute; a trainer that would use
/// every core alone loses `busy / cores` seconds to the generation that runs beside it.
#[derive(Debug)]
pub struct HostCpu {
    pub cores: f64,
    busy_ns: std::sync::atomic::AtomicU64,
}

impl HostCpu {
    pub fn new(cores: f64) -> Self {
        Self {
            cores: cores.max(1.0),
            busy_ns: Default::default(),
        }
    }

    /// An engine computed for `secs` (one core).
    pub fn charge(&self, secs: f64) {
        self.busy_ns.fetch_add(
            (secs.max(0.0) * 1e9) as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Engine seconds charged so far.
    pub fn busy_s(&self) -> f64 {
        self.busy_ns.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e9
    }
}

/// Time model of a GPU trainer: seconds per trained token divided over GPUs, plus a fixed
/// per-step overhead (optimizer, weight gather).
pub struct SimTrainer {
    pub seconds_per_token: f64,
    pub gpus: u32,
    pub step_overhead: Duration,
    /// Cores shared with the generation engines: their compute during a step slows it.
    pub host: Option<std::sync::Arc<HostCpu>>,
    pub modelled_weight_bytes: f64,
    /// Fault injection: panic when asked to train this step.
    pub panic_at_step: Option<u64>,
}

impl Trainer for SimTrainer {
    fn train(
        &mut self,
        batch: &Batch,
        next_version: PolicyVersion,
    ) -> futures::future::BoxFuture<'_, StepResult> {
        let tokens = batch.tokens() as u64;
        let trajectories = batch.trajectories().count() as u64;
        let mean_reward = if trajectories == 0 {
            0.0
        } else {
            batch
                .trajectories()
                .map(|t| t.reward.unwrap_or(0.0))
                .sum::<f64>()
                / trajectories as f64
        };
        let step = batch.step;
        if self.panic_at_step == Some(step) {
            panic!("injected trainer fault at step {step}");
        }
        Box::pin(async move {
            let mut secs = self.seconds_per_token * tokens as f64 / self.gpus.max(1) as f64
                + self.step_overhead.as_secs_f64();
            let before = self.host.as_ref().map(|h| h.busy_s());
            // A product of finite spec fields can still overflow a clock: an error, not a
            // panic of the trainer.
            let modelled = Duration::try_from_secs_f64(secs).map_err(|_| {
                TrainError::Step(crate::error::SharedError::new(std::io::Error::other(
                    format!(
                        "the modelled step time {secs} s ({tokens} tokens at {} s per token) is \
                     out of range",
                        self.seconds_per_token
                    ),
                )))
            })?;
            tokio::time::sleep(modelled).await;
            if let (Some(h), Some(before)) = (&self.host, before) {
                // The cores generation took while this step trained, made up afterwards.
                let lost = (h.busy_s() - before) / h.cores;
                tokio::time::sleep(Duration::try_from_secs_f64(lost).unwrap_or_default()).await;
                secs += lost;
            }
            let stats = TrainStats {
                step,
                version: next_version,
                loss: 0.0,
                tokens,
                trajectories,
                mean_reward,
                seconds: secs,
                numbers: TrainerNumbers::default(),
            };
            Ok((
                stats,
                Some(Weights::simulated(next_version, self.modelled_weight_bytes)),
            ))
        })
    }
}

pub enum TrainerMsg {
    /// Shared with the driver (a copy of every trajectory would double the batch's memory
    /// while it trains). The trainer drops its share before it answers, so the driver's is
    /// the last: it shows the batch to the observer and frees it before rollout resumes.
    Train(Arc<Batch>, RpcReplyPort<Result<TrainStats, TrainError>>),
}

/// Runs training steps one at a time and publishes each new version to the weight store.
pub struct TrainerActor;

pub struct TrainerArgs {
    pub trainer: Box<dyn Trainer>,
    pub weights: ActorRef<WeightStoreMsg>,
    pub start_version: PolicyVersion,
}

pub struct TrainerState {
    trainer: Box<dyn Trainer>,
    weights: ActorRef<WeightStoreMsg>,
    version: PolicyVersion,
}

impl Actor for TrainerActor {
    type Msg = TrainerMsg;
    type State = TrainerState;
    type Arguments = TrainerArgs;

    async fn pre_start(
        &self,
        _me: ActorRef<Self::Msg>,
        a: TrainerArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(TrainerState {
            trainer: a.trainer,
            weights: a.weights,
            version: a.start_version,
        })
    }

    async fn handle(
        &self,
        _me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            TrainerMsg::Train(batch, reply) => {
                let next = st.version + 1;
                let r = st.trainer.train(&batch, next).await;
                // Freed before the answer: the step driver lets its share go on it, and rollout
                // resumes after (a run holds one batch at a time, not two).
                drop(batch);
                let r = match r {
                    Ok((stats, Some(w))) => {
                        st.version = next;
                        st.weights.cast(WeightStoreMsg::Publish(Arc::new(w)))?;
                        Ok(stats)
                    }
                    Ok((stats, None)) => Ok(stats),
                    Err(e) => Err(e),
                };
                let _ = reply.send(r);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::{WeightStore, WeightStoreArgs};

    /// The step driver lets the batch go once the trainer has answered, before rollout
    /// resumes; that frees it only if the trainer keeps no share of it (in its state, or in
    /// the `Trainer` it runs) once it has answered. (On this single-threaded runtime the
    /// handler's drop order is not observable; the explicit drop before the answer is what
    /// holds on a multi-threaded one.)
    #[tokio::test(start_paused = true)]
    async fn the_trainer_lets_the_batch_go_before_it_answers() {
        let initial = Arc::new(Weights::simulated(0, 0.0));
        let (weights, _w) = Actor::spawn(None, WeightStore, WeightStoreArgs { keep: 2, initial })
            .await
            .expect("weight store");
        let trainer = SimTrainer {
            seconds_per_token: 0.0,
            gpus: 1,
            step_overhead: Duration::from_millis(5),
            host: None,
            modelled_weight_bytes: 0.0,
            panic_at_step: None,
        };
        let args = TrainerArgs {
            trainer: Box::new(trainer),
            weights,
            start_version: 0,
        };
        let (t, _h) = Actor::spawn(None, TrainerActor, args)
            .await
            .expect("trainer");
        for step in 0..3 {
            let batch = Arc::new(Batch {
                step,
                groups: Vec::new(),
            });
            let stats = ractor::call!(t, TrainerMsg::Train, batch.clone())
                .expect("the trainer answers")
                .expect("the step trains");
            assert_eq!(stats.version, step + 1);
            assert_eq!(
                Arc::strong_count(&batch),
                1,
                "step {step}: the trainer still held the batch when it answered"
            );
        }
    }
}
