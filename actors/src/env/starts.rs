//! Sandbox start control: how environment programs start, and what their starts cost.
//!
//! - A **start** is an episode's reset. It is **cold** when its sandbox (its environment
//!   program) had to be started for it, and **warm** when one was already running: kept from
//!   the environment's previous episode, or started ahead by a warm pool. Its **latency** is
//!   the reset's wall time, waiting for a start slot and the program's boot included: the
//!   time an episode waits before its first turn. In-process environments have no sandbox and
//!   report no start.
//! - [`StartCaps`] bound the programs starting at once (`max_concurrent_starts`): a program
//!   holds a slot of every cap from its spawn until it answers its first request, so a burst
//!   of resets boots a few programs at a time instead of all of them on a few cores.
//! - [`StartLog`] counts starts and keeps the latencies of the current step for its
//!   quantiles.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How a reset found its sandbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Start {
    /// Already running (the environment's own from an earlier episode, or a warm one).
    Warm,
    /// Started for this reset.
    Cold,
}

impl Start {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Warm => "warm",
            Self::Cold => "cold",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "warm" => Some(Self::Warm),
            "cold" => Some(Self::Cold),
            _ => None,
        }
    }
}

/// The caps a program start passes: each a number of programs that may be starting at once
/// (a task's or pool's, a worker's). Cheap to clone; clones share the caps.
#[derive(Clone, Debug, Default)]
pub struct StartCaps(Vec<Arc<Semaphore>>);

/// Slots held by one starting program (released when dropped).
#[derive(Debug)]
pub struct StartPermit(#[allow(dead_code)] Vec<OwnedSemaphorePermit>);

impl StartCaps {
    /// One cap of `n` starts at once (`None`: no cap).
    pub fn new(n: Option<usize>) -> Self {
        Self(
            n.map(|n| Arc::new(Semaphore::new(n.max(1))))
                .into_iter()
                .collect(),
        )
    }

    /// Both these caps and `other`'s.
    pub fn and(&self, other: &Self) -> Self {
        Self(self.0.iter().chain(&other.0).cloned().collect())
    }

    /// Whether any cap applies.
    pub fn is_capped(&self) -> bool {
        !self.0.is_empty()
    }

    /// Waits for a slot of every cap (always in the same order, so two starts cannot each
    /// hold what the other waits for).
    pub async fn acquire(&self) -> StartPermit {
        let mut held = Vec::with_capacity(self.0.len());
        for s in &self.0 {
            // The semaphores are never closed.
            if let Ok(p) = Arc::clone(s).acquire_owned().await {
                held.push(p);
            }
        }
        StartPermit(held)
    }
}

/// Most start latencies a span keeps for its quantiles (the latest ones; every start is
/// counted).
pub const MAX_STEP_SAMPLES: usize = 100_000;

/// Starts of a task's environments: counters since the start, and the latencies of the
/// current step (drained by [`StartLog::take_step`]).
#[derive(Debug, Default)]
pub struct StartLog {
    warm: AtomicU64,
    cold: AtomicU64,
    step: std::sync::Mutex<StepStarts>,
}

#[derive(Debug, Default)]
struct StepStarts {
    warm: u64,
    cold: u64,
    latencies_s: std::collections::VecDeque<f64>,
}

/// Starts over some span: counts, warm hit rate and latency quantiles.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StartStats {
    /// Resets that found or started a sandbox.
    pub starts: u64,
    /// Of which found one running.
    pub warm: u64,
    /// `warm / starts` (0 without starts).
    pub warm_hit_rate: f64,
    /// Median reset wall time of those starts, seconds (0 without starts).
    pub p50_s: f64,
    /// 99th percentile, seconds.
    pub p99_s: f64,
}

impl StartStats {
    /// The stats of `warm` warm starts among `latencies` (seconds, any order).
    pub fn from_latencies(warm: u64, starts: u64, latencies: &mut [f64]) -> Self {
        latencies.sort_by(f64::total_cmp);
        Self {
            starts,
            warm,
            warm_hit_rate: if starts == 0 {
                0.0
            } else {
                warm as f64 / starts as f64
            },
            p50_s: quantile(latencies, 0.50),
            p99_s: quantile(latencies, 0.99),
        }
    }
}

/// The nearest-rank quantile `q` of sorted `v` (0 when empty).
pub fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let rank = (q * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl StartLog {
    /// Records a reset that took `latency` and found its sandbox as `start` said.
    pub fn record(&self, start: Start, latency: Duration) {
        let mut st = lock(&self.step);
        match start {
            Start::Warm => {
                self.warm.fetch_add(1, Ordering::Relaxed);
                st.warm += 1;
            }
            Start::Cold => {
                self.cold.fetch_add(1, Ordering::Relaxed);
                st.cold += 1;
            }
        }
        if st.latencies_s.len() == MAX_STEP_SAMPLES {
            st.latencies_s.pop_front();
        }
        st.latencies_s.push_back(latency.as_secs_f64());
    }

    /// Starts since the log began: (warm, cold).
    pub fn totals(&self) -> (u64, u64) {
        (
            self.warm.load(Ordering::Relaxed),
            self.cold.load(Ordering::Relaxed),
        )
    }

    /// The stats of the starts since the last call, and a new span.
    pub fn take_step(&self) -> StartStats {
        let mut l = Vec::new();
        let (warm, cold) = self.take_step_into(&mut l);
        StartStats::from_latencies(warm, warm + cold, &mut l)
    }

    /// Like [`Self::take_step`], for several logs together: appends this span's latencies to
    /// `into` and gives its (warm, cold) counts.
    pub fn take_step_into(&self, into: &mut Vec<f64>) -> (u64, u64) {
        let st = std::mem::take(&mut *lock(&self.step));
        into.extend(st.latencies_s);
        (st.warm, st.cold)
    }

    /// The stats of the starts since the last [`Self::take_step`] (of the latest
    /// [`MAX_STEP_SAMPLES`] for the quantiles), leaving them there.
    pub fn peek_step(&self) -> StartStats {
        let st = lock(&self.step);
        let mut l = Vec::from(st.latencies_s.clone());
        StartStats::from_latencies(st.warm, st.warm + st.cold, &mut l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_nearest_rank_and_the_step_span_resets() {
        let log = StartLog::default();
        for ms in 1..=100u64 {
            let s = if ms % 4 == 0 {
                Start::Cold
            } else {
                Start::Warm
            };
            log.record(s, Duration::from_millis(ms));
        }
        let s = log.take_step();
        assert_eq!((s.starts, s.warm), (100, 75));
        assert!((s.warm_hit_rate - 0.75).abs() < 1e-12);
        assert!((s.p50_s - 0.050).abs() < 1e-9, "{}", s.p50_s);
        assert!((s.p99_s - 0.099).abs() < 1e-9, "{}", s.p99_s);
        assert_eq!(log.take_step(), StartStats::default());
        assert_eq!(log.totals(), (75, 25));
    }

    #[tokio::test(start_paused = true)]
    async fn a_start_holds_a_slot_of_every_cap() {
        let a = StartCaps::new(Some(2));
        let b = StartCaps::new(Some(1));
        let both = a.and(&b);
        let p1 = both.acquire().await;
        // `b` is full: a second start through both waits, one through `a` alone does not.
        let only_a = a.acquire().await;
        let second = tokio::time::timeout(Duration::from_secs(1), both.acquire()).await;
        assert!(second.is_err(), "the second start passed a full cap");
        drop(p1);
        drop(only_a);
        let p2 = tokio::time::timeout(Duration::from_secs(1), both.acquire()).await;
        assert!(p2.is_ok(), "the freed slot was not given");
        assert!(!StartCaps::new(None).is_capped());
    }
}
