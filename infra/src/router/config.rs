//! The knobs of a router.

use std::time::Duration;

#[derive(Clone, Debug)]
pub struct RouterConfig {
    pub per_try_timeout: Duration,
    pub max_attempts: u32,
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    /// Retry budget: `retry_ratio` of calls plus `retry_min_per_sec`, over `retry_window`.
    pub retry_ratio: f32,
    pub retry_min_per_sec: u32,
    pub retry_window: Duration,
    pub eject_after: u32,
    pub eject_base: Duration,
    pub eject_max_percent: u32,
    /// Hedge after this latency percentile (e.g. 0.95); `None` = no hedging.
    pub hedge_percentile: Option<f32>,
    pub hedge_min_samples: u64,
    pub max_response_bytes: usize,
    /// Hard in-flight limit per instance (container concurrency); 0 = none.
    pub container_concurrency: u32,
    /// Activator buffer bound.
    pub buffer: usize,
    /// How long a 429/503-with-Retry-After keeps an instance looking busy at most.
    pub shed_penalty_cap: Duration,
    pub seed: u64,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            per_try_timeout: Duration::from_secs(30),
            max_attempts: 5,
            backoff_base: Duration::from_millis(25),
            backoff_cap: Duration::from_millis(250),
            retry_ratio: 0.2,
            retry_min_per_sec: 10,
            retry_window: Duration::from_secs(10),
            eject_after: 5,
            eject_base: Duration::from_secs(30),
            eject_max_percent: 10,
            hedge_percentile: None,
            hedge_min_samples: 20,
            max_response_bytes: 4 << 20,
            container_concurrency: 0,
            buffer: 10_000,
            shed_penalty_cap: Duration::from_secs(2),
            seed: 0,
        }
    }
}
