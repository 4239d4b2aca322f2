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
use infra::faas::Scaling;
use infra::faas::kpa::{ConcurrencyMeter, Kpa};

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

/// A simulated serverless function in virtual time: instances scaled by the Knative pod
/// autoscaler (the same [`Kpa`] state machine the local runtime runs), each serving up to its
/// container concurrency, a cold start for every instance started, requests waiting in the
/// activator while nothing can take them, and scale to zero after the grace period.
pub struct SimFunction {
    latency: Dist,
    cold_start: Duration,
    concurrency: u32,
    tick: Duration,
    state: std::sync::Mutex<FnState>,
    changed: tokio::sync::Notify,
    pub calls: AtomicU64,
    /// Instances started (each paid a cold start).
    pub cold_starts: AtomicU64,
    pub peak_instances: AtomicU64,
}

struct FnState {
    rng: SmallRng,
    kpa: Kpa,
    meter: ConcurrencyMeter,
    instances: Vec<SimInstance>,
    next_id: u64,
    ticking: bool,
}

#[derive(Clone, Copy)]
struct SimInstance {
    id: u64,
    ready_at: tokio::time::Instant,
    in_flight: u32,
}

impl FnState {
    fn ready(&self, now: tokio::time::Instant) -> u32 {
        self.instances.iter().filter(|i| i.ready_at <= now).count() as u32
    }

    fn start(&mut self, ready_at: tokio::time::Instant) {
        self.instances.push(SimInstance {
            id: self.next_id,
            ready_at,
            in_flight: 0,
        });
        self.next_id += 1;
    }
}

impl SimFunction {
    pub fn new(latency: Dist, cold_start: Duration, scaling: Scaling, seed: u64) -> Arc<Self> {
        let now = tokio::time::Instant::now();
        let concurrency = scaling.container_concurrency;
        let tick = scaling.tick_interval.0.max(Duration::from_millis(100));
        // Initial instances are warm (deployed before the job), like a deployment at rest.
        let initial = scaling.initial_scale.max(scaling.min_scale);
        let mut st = FnState {
            rng: SmallRng::seed_from_u64(seed),
            kpa: Kpa::new(scaling, now),
            meter: ConcurrencyMeter::new(now),
            instances: Vec::new(),
            next_id: 0,
            ticking: false,
        };
        for _ in 0..initial {
            st.start(now);
        }
        Arc::new(Self {
            latency,
            cold_start,
            concurrency: if concurrency == 0 {
                u32::MAX
            } else {
                concurrency
            },
            tick,
            state: std::sync::Mutex::new(st),
            changed: tokio::sync::Notify::new(),
            calls: AtomicU64::new(0),
            cold_starts: AtomicU64::new(0),
            peak_instances: AtomicU64::new(initial as u64),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FnState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Instances now (starting or ready).
    pub fn instances(&self) -> usize {
        self.lock().instances.len()
    }

    /// Applies a decision: starts instances (ready after the cold start) or stops idle ones.
    fn scale_to(self: &Arc<Self>, st: &mut FnState, desired: u32, now: tokio::time::Instant) {
        let have = st.instances.len() as u32;
        if desired > have {
            for _ in have..desired {
                st.start(now + self.cold_start);
            }
            self.cold_starts
                .fetch_add(u64::from(desired - have), Ordering::Relaxed);
            self.peak_instances
                .fetch_max(u64::from(desired), Ordering::Relaxed);
            let me = Arc::downgrade(self);
            let at = now + self.cold_start;
            tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                if let Some(me) = me.upgrade() {
                    me.changed.notify_waiters();
                }
            });
        } else if desired < have {
            // Stop idle instances, those still starting first.
            let mut excess = have - desired;
            st.instances
                .sort_by_key(|i| (std::cmp::Reverse(i.ready_at), i.id));
            st.instances.retain(|i| {
                if excess > 0 && i.in_flight == 0 {
                    excess -= 1;
                    false
                } else {
                    true
                }
            });
        }
    }

    /// The autoscaler's loop: one decision per tick while the function lives.
    fn start_ticking(self: &Arc<Self>, st: &mut FnState) {
        if st.ticking {
            return;
        }
        st.ticking = true;
        let me = Arc::downgrade(self);
        let tick = self.tick;
        tokio::spawn(async move {
            let mut every = tokio::time::interval(tick);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let Some(me) = me.upgrade() else { return };
                let now = tokio::time::Instant::now();
                let mut st = me.lock();
                let (avg, period) = st.meter.take(now);
                st.kpa.record(now, avg, period);
                let ready = st.ready(now);
                let waiting = st.meter.current();
                let d = st.kpa.decide(now, ready, waiting);
                me.scale_to(&mut st, d.desired, now);
                if st.instances.is_empty() && waiting == 0 && d.desired == 0 {
                    // At zero and idle: stop ticking until the next request.
                    st.ticking = false;
                    return;
                }
            }
        });
    }

    async fn acquire(self: &Arc<Self>) -> u64 {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let now = tokio::time::Instant::now();
                let mut st = self.lock();
                let cc = self.concurrency;
                // Least-loaded ready instance with room.
                if let Some(i) = st
                    .instances
                    .iter_mut()
                    .filter(|i| i.ready_at <= now && i.in_flight < cc)
                    .min_by_key(|i| (i.in_flight, i.id))
                {
                    i.in_flight += 1;
                    return i.id;
                }
                if st.instances.is_empty() {
                    // The activator's poke: scale from zero at once.
                    let waiting = st.meter.current();
                    let d = st.kpa.decide(now, 0, waiting);
                    self.scale_to(&mut st, d.desired.max(1), now);
                }
            }
            notified.await;
        }
    }
}

impl TrajectoryScorer for Arc<SimFunction> {
    fn score<'a>(&'a self, traj: &'a Trajectory) -> BoxFuture<'a, Result<f64, RewardError>> {
        Box::pin(async move {
            self.calls.fetch_add(1, Ordering::Relaxed);
            let delay = {
                let now = tokio::time::Instant::now();
                let mut st = self.lock();
                st.meter.add(now, 1);
                self.start_ticking(&mut st);
                Duration::from_secs_f64(self.latency.sample(&mut st.rng))
            };
            let slot = self.acquire().await;
            tokio::time::sleep(delay).await;
            {
                let now = tokio::time::Instant::now();
                let mut st = self.lock();
                st.meter.add(now, -1);
                // A busy instance is never scaled down, so it is still there.
                if let Some(i) = st.instances.iter_mut().find(|i| i.id == slot) {
                    i.in_flight = i.in_flight.saturating_sub(1);
                }
            }
            self.changed.notify_waiters();
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
        Box::pin(async move {
            let item = functions::protocol::ScoredItem {
                trajectory_id: traj.id.clone(),
                text: traj.final_text.clone(),
                token_ids: traj
                    .turns
                    .last()
                    .map(|t| t.response_tokens.clone())
                    .unwrap_or_default(),
                env_reward: traj.turns.iter().map(|t| t.env_reward).sum(),
            };
            let key = format!("{}/{}", self.key_prefix, traj.id);
            match self
                .client
                .score(&key, vec![item], traj.reference.clone())
                .await
            {
                Ok(scores) => scores.first().map(|s| s.score).ok_or_else(|| {
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

    #[test]
    fn a_simulated_serverless_function_scales_from_zero_with_cold_starts_and_back_to_zero() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(async {
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
            let t = traj();
            let calls = (0..40).map(|_| {
                let f = f.clone();
                let t = t.clone();
                async move { (f.score(&t).await, t0.elapsed()) }
            });
            let out = futures::future::join_all(calls).await;
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
}
