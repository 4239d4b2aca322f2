//! Reward scoring behind one trait: the serverless function client (issue: serverless reward),
//! dedicated local scorers, and the latency simulator used in virtual time.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use tokio::sync::{Mutex, Semaphore};

use crate::dist::Dist;
use crate::types::Trajectory;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RewardError {
    #[error("reward call failed after retries: {0}")]
    Exhausted(String),
    #[error("reward function returned an invalid score: {0}")]
    InvalidScore(String),
}

/// Scores finished trajectories. Implementations are shared by all episodes of a job.
pub trait RewardScorer: Send + Sync + 'static {
    /// Scores one trajectory as soon as it ends.
    fn score<'a>(&'a self, traj: &'a Trajectory) -> BoxFuture<'a, Result<f64, RewardError>>;
}

/// The environment's own reward (sum of step rewards), with no call at all.
pub struct EnvRewardPassThrough;

impl RewardScorer for EnvRewardPassThrough {
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
    pub fn new(latency: Dist, cold_start: Duration, concurrency: usize, idle_to_zero: Option<Duration>, seed: u64) -> Self {
        Self {
            latency,
            cold_start,
            idle_to_zero,
            slots: Semaphore::new(concurrency.max(1)),
            state: Mutex::new(SimRewardState { rng: SmallRng::seed_from_u64(seed), last_call_end: None, warm: idle_to_zero.is_none() }),
            calls: AtomicU64::new(0),
            cold_starts: AtomicU64::new(0),
        }
    }
}

impl RewardScorer for SimReward {
    fn score<'a>(&'a self, traj: &'a Trajectory) -> BoxFuture<'a, Result<f64, RewardError>> {
        Box::pin(async move {
            let _permit = self.slots.acquire().await.map_err(|e| RewardError::Exhausted(e.to_string()))?;
            self.calls.fetch_add(1, Ordering::Relaxed);
            let delay = {
                let mut st = self.state.lock().await;
                let now = tokio::time::Instant::now();
                if let (Some(idle), Some(last)) = (self.idle_to_zero, st.last_call_end)
                    && now.duration_since(last) > idle
                {
                    st.warm = false;
                }
                let mut d = Duration::from_secs_f64(self.latency.sample(&mut st.rng));
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

pub type SharedScorer = Arc<dyn RewardScorer>;

/// A reward function reached through the router (serverless or dedicated instances, or a URL):
/// one call per trajectory as soon as it ends, keyed `job/trajectory@reward` so retries and
/// hedges give one result.
pub struct FunctionReward {
    pub client: functions::client::FunctionClient,
    /// Makes keys unique across the jobs sharing a function.
    pub key_prefix: String,
}

impl RewardScorer for FunctionReward {
    fn score<'a>(&'a self, traj: &'a Trajectory) -> BoxFuture<'a, Result<f64, RewardError>> {
        Box::pin(async move {
            let item = functions::protocol::ScoredItem {
                trajectory_id: traj.id.clone(),
                text: traj.final_text.clone(),
                token_ids: traj.turns.last().map(|t| t.response_tokens.clone()).unwrap_or_default(),
                env_reward: traj.turns.iter().map(|t| t.env_reward).sum(),
            };
            let key = format!("{}/{}", self.key_prefix, traj.id);
            match self.client.score(&key, vec![item], traj.reference.clone()).await {
                Ok(scores) => scores.first().map(|s| s.score).ok_or_else(|| RewardError::InvalidScore("no score".into())),
                Err(functions::client::ClientError::Invalid { why, .. }) => Err(RewardError::InvalidScore(why)),
                Err(e) => Err(RewardError::Exhausted(e.to_string())),
            }
        })
    }
}
