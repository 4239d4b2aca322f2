//! Reward scoring behind one trait: the serverless function client (issue: serverless reward),
//! dedicated local scorers, and the latency simulator used in virtual time. The simulated
//! serverless function (Knative autoscaling, usage) is in `serverless`, its GPU-served judge
//! model in `gpu`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use tokio::sync::{Mutex, Semaphore};

use crate::dist::Dist;
use crate::types::Trajectory;

mod gpu;
mod serverless;

pub use gpu::GpuService;
pub use serverless::{FunctionUsage, SimFunction};

#[derive(Debug, thiserror::Error)]
pub enum RewardError {
    /// The function could not be reached or kept failing (the router's retries included).
    #[error("reward call failed after retries")]
    Exhausted(#[source] functions::client::ClientError),
    /// The function answered with something that is not a valid score.
    #[error("reward function returned an invalid score")]
    InvalidScore(#[source] functions::client::InvalidResponse),
    /// A simulated function's call slots are gone (it is shutting down).
    #[error("reward function is closed")]
    Closed(#[source] tokio::sync::AcquireError),
}

/// Scores finished trajectories. Implementations are shared by all episodes of a job.
pub trait TrajectoryScorer: Send + Sync + 'static {
    /// Scores one trajectory as soon as it ends.
    fn score<'a>(&'a self, traj: &'a Trajectory) -> BoxFuture<'a, Result<f64, RewardError>>;

    /// The score with what the scorer said of it (a reward function's name and `details`),
    /// kept in the trajectory's `verdict`. By default the score alone.
    fn score_detailed<'a>(
        &'a self,
        traj: &'a Trajectory,
    ) -> BoxFuture<'a, Result<Scored, RewardError>> {
        Box::pin(async move {
            self.score(traj).await.map(|score| Scored {
                score,
                detail: None,
            })
        })
    }
}

/// A score and, where the scorer has one, its account: `{name, score, details}`.
#[derive(Clone, Debug, PartialEq)]
pub struct Scored {
    pub score: f64,
    pub detail: Option<serde_json::Value>,
}

/// The environment's own reward (sum of step rewards), with no call at all.
pub struct EnvRewardPassThrough;

impl TrajectoryScorer for EnvRewardPassThrough {
    fn score<'a>(&'a self, traj: &'a Trajectory) -> BoxFuture<'a, Result<f64, RewardError>> {
        Box::pin(async move { Ok(traj.turns.iter().map(|t| t.env_reward).sum()) })
    }
}

/// A simulated reward function: per-call latency, limited concurrency, and a cold start when
/// it has scaled to zero after being idle (serverless), or always warm (dedicated).
pub struct SimReward {
    latency: Dist,
    cold_start: Duration,
    idle_to_zero: Option<Duration>,
    slots: Semaphore,
    state: Mutex<SimRewardState>,
    pub calls: AtomicU64,
    pub cold_starts: AtomicU64,
}

struct SimRewardState {
    rng: SmallRng,
    last_call_end: Option<tokio::time::Instant>,
    warm: bool,
}

impl SimReward {
    /// `idle_to_zero = None` models dedicated (always warm) instances.
    pub fn new(
        latency: Dist,
        cold_start: Duration,
        concurrency: usize,
        idle_to_zero: Option<Duration>,
        seed: u64,
    ) -> Self {
        Self {
            latency,
            cold_start,
            idle_to_zero,
            slots: Semaphore::new(concurrency.max(1)),
            state: Mutex::new(SimRewardState {
                rng: SmallRng::seed_from_u64(seed),
                last_call_end: None,
                warm: idle_to_zero.is_none(),
            }),
            calls: AtomicU64::new(0),
            cold_starts: AtomicU64::new(0),
        }
    }
}

impl TrajectoryScorer for SimReward {
    fn score<'a>(&'a self, traj: &'a Trajectory) -> BoxFuture<'a, Result<f64, RewardError>> {
        Box::pin(async move {
            let _permit = self.slots.acquire().await.map_err(RewardError::Closed)?;
            self.calls.fetch_add(1, Ordering::Relaxed);
            let delay = {
                let mut st = self.state.lock().await;
                let now = tokio::time::Instant::now();
                if let (Some(idle), Some(last)) = (self.idle_to_zero, st.last_call_end)
                    && now.duration_since(last) > idle
                {
                    st.warm = false;
                }
                let mut d = crate::dist::seconds(self.latency.sample(&mut st.rng));
                if !st.warm {
                    self.cold_starts.fetch_add(1, Ordering::Relaxed);
                    d += self.cold_start;
                    st.warm = true;
                }
                d
            };
            tokio::time::sleep(delay).await;
            self.state.lock().await.last_call_end = Some(tokio::time::Instant::now());
            Ok(traj.turns.iter().map(|t| t.env_reward).sum())
        })
    }
}

pub type SharedScorer = Arc<dyn TrajectoryScorer>;

/// A reward function reached through the router (serverless or dedicated instances, or a URL):
/// one call per trajectory as soon as it ends, keyed `job/trajectory@reward` so retries and
/// hedges give one result.
pub struct FunctionReward {
    pub client: functions::client::FunctionClient,
    /// Makes keys unique across the jobs sharing a function.
    pub key_prefix: String,
}

impl TrajectoryScorer for FunctionReward {
    fn score<'a>(&'a self, traj: &'a Trajectory) -> BoxFuture<'a, Result<f64, RewardError>> {
        Box::pin(async move { self.score_detailed(traj).await.map(|s| s.score) })
    }

    fn score_detailed<'a>(
        &'a self,
        traj: &'a Trajectory,
    ) -> BoxFuture<'a, Result<Scored, RewardError>> {
        Box::pin(async move {
            let item = functions::protocol::ScoredItem {
                trajectory_id: traj.id.clone(),
                text: traj.final_text.clone(),
                token_ids: traj
                    .turns
                    .last()
                    .map(|t| t.response_tokens.to_vec())
                    .unwrap_or_default(),
                env_reward: traj.turns.iter().map(|t| t.env_reward).sum(),
                transcript: traj
                    .agent
                    .as_ref()
                    .and_then(|a| serde_json::to_value(&a.transcript).ok()),
                row: traj.agent.as_ref().and_then(|a| a.row.clone()),
                calls: traj.agent.as_ref().map(|_| {
                    serde_json::Value::Array(
                        traj.turns
                            .iter()
                            .filter_map(|t| t.call.as_ref())
                            .filter_map(|c| serde_json::to_value(c).ok())
                            .collect(),
                    )
                }),
            };
            let key = format!("{}/{}", self.key_prefix, traj.id);
            match self
                .client
                .score(&key, vec![item], traj.reference.clone())
                .await
            {
                Ok(scores) => scores
                    .first()
                    .map(|s| Scored {
                        score: s.score,
                        detail: Some(serde_json::json!({
                            "name": self.client.reward_name(),
                            "score": s.score,
                            "details": s.details,
                        })),
                    })
                    .ok_or_else(|| {
                        RewardError::InvalidScore(functions::client::InvalidResponse::Missing {
                            id: traj.id.clone(),
                        })
                    }),
                Err(functions::client::ClientError::Invalid { reason, .. }) => {
                    Err(RewardError::InvalidScore(reason))
                }
                Err(e) => Err(RewardError::Exhausted(e)),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use infra::faas::Dur;
    use infra::faas::Scaling;

    fn traj() -> Trajectory {
        Trajectory::for_test(
            "t",
            crate::types::Turn {
                env_reward: 1.0,
                ..Default::default()
            },
            None,
        )
    }

    /// A paused current-thread runtime (virtual time).
    fn paused() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
    }

    /// `n` calls of `t` at once: each one's score and when it came back (since `t0`).
    async fn burst(
        f: &Arc<SimFunction>,
        t: &Trajectory,
        n: usize,
        t0: tokio::time::Instant,
    ) -> Vec<(Result<f64, RewardError>, Duration)> {
        let calls = (0..n).map(|_| async move { (f.score(t).await, t0.elapsed()) });
        futures::future::join_all(calls).await
    }

    #[test]
    fn a_simulated_serverless_function_scales_from_zero_with_cold_starts_and_back_to_zero() {
        paused().block_on(async {
            let scaling = Scaling {
                container_concurrency: 4,
                initial_scale: 0,
                stable_window: Dur::secs(10),
                scale_to_zero_grace_period: Dur::secs(5),
                ..Scaling::default()
            };
            let f = SimFunction::new(Dist::Constant(1.0), Duration::from_secs(3), scaling, 7);
            assert_eq!(f.instances(), 0);
            let t0 = tokio::time::Instant::now();
            // A burst of 40 calls at zero: the first instance starts on the activator's poke,
            // the autoscaler adds more; every call waits for a cold start, then 1 s of work.
            let out = burst(&f, &traj(), 40, t0).await;
            assert!(out.iter().all(|(r, _)| matches!(r, Ok(v) if *v == 1.0)));
            let first = out.iter().map(|(_, d)| *d).min().unwrap();
            let last = out.iter().map(|(_, d)| *d).max().unwrap();
            assert!(
                first >= Duration::from_secs(4),
                "cold start (3 s) + latency (1 s) before any answer: {first:?}"
            );
            assert!(
                f.cold_starts.load(Ordering::Relaxed) >= 2,
                "scaled past one instance"
            );
            // 40 calls at concurrency 4 on one instance would take 10 s of work: scaling out
            // must beat that.
            assert!(last < Duration::from_secs(3 + 10), "{last:?}");
            assert_eq!(f.calls.load(Ordering::Relaxed), 40);
            // Idle: back to zero after the stable window and the grace period.
            tokio::time::sleep(Duration::from_secs(60)).await;
            assert_eq!(f.instances(), 0, "scaled to zero when idle");
        });
    }

    fn judge(gpus: u32) -> GpuService {
        use crate::device::{DeviceProfile, Efficiency, ModelProfile};
        GpuService {
            device: DeviceProfile::builtin("H800").unwrap().group(gpus, 0.9),
            model: ModelProfile::builtin("qwen3-8b").unwrap(),
            efficiency: Efficiency::default(),
            gpus,
            max_batch: 8,
            verdict_tokens: 16,
            final_answer_only: false,
        }
    }

    #[test]
    fn a_gpu_reward_model_batches_its_calls_on_the_roofline_and_accounts_its_gpu_time() {
        paused().block_on(async {
            // One always-on instance of two GPUs (a dedicated reward deployment).
            let scaling = Scaling {
                container_concurrency: 64,
                initial_scale: 1,
                min_scale: 1,
                max_scale: 1,
                ..Scaling::default()
            };
            let g = judge(2);
            let f = SimFunction::serving(
                Dist::Constant(0.0),
                Duration::ZERO,
                scaling,
                7,
                Some(g.clone()),
            );
            // 20 trajectories of 4,000 tokens arrive together.
            let t = Trajectory::for_test(
                "t",
                crate::types::Turn {
                    observation_tokens: vec![1; 3_000].into(),
                    response_tokens: vec![2; 1_000].into(),
                    env_reward: 1.0,
                    ..Default::default()
                },
                None,
            );
            let t0 = tokio::time::Instant::now();
            let out = burst(&f, &t, 20, t0).await;
            assert!(out.iter().all(|(r, _)| matches!(r, Ok(v) if *v == 1.0)));
            let done = out.iter().map(|(_, d)| *d).max().unwrap().as_secs_f64();
            let u = f.usage();
            assert_eq!(u.calls, 20);
            // Batches of at most 8: at least 3 of them, and calls really were batched.
            assert!(u.batches >= 3 && u.batches < 20, "{u:?}");
            assert!(u.mean_batch > 1.0 && u.mean_batch <= 8.0, "{u:?}");
            // Batching amortises the verdict's decode: 8 calls in one batch beat 8 batches of
            // one, but never the prefill of everything they read.
            let one = g.batch_seconds(&[4_000.0]);
            let eight = g.batch_seconds(&[4_000.0; 8]);
            assert!(eight < 8.0 * one * 0.8, "{eight} vs 8 × {one}");
            let prefill =
                crate::device::prefill_seconds(&g.device, &g.model, g.efficiency, 32_000.0);
            assert!(eight > prefill);
            // The one instance served back to back, so it was busy until the last answer, and
            // the calls took the batches' roofline time.
            assert!((u.busy_instance_s - done).abs() < 1e-3, "{u:?} vs {done}");
            assert!(done >= 2.0 * eight && done <= 3.0 * eight + one, "{done}");
            // Idle afterwards: held, not busy. Two GPUs per instance.
            tokio::time::sleep(Duration::from_secs(100)).await;
            let u = f.usage();
            assert!((u.instance_s - (done + 100.0)).abs() < 1e-3, "{u:?}");
            assert!((u.gpu_s() - 2.0 * u.instance_s).abs() < 1e-9);
            assert!((u.utilisation() - done / (done + 100.0)).abs() < 1e-6);
            // A call after the idle spell adds its batch, not the idle time, to the busy time.
            let before = u.busy_instance_s;
            f.score(&t).await.unwrap();
            let u = f.usage();
            assert!(
                (u.busy_instance_s - before - one).abs() < 1e-3,
                "{u:?} vs {one}"
            );
        });
    }
}
