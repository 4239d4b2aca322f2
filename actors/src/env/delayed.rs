//! An environment with injected latency: after each reset and step it sleeps a sampled
//! extra time, so it is busy as a slow real environment would be (benchmarks of the built-in
//! games under realistic environment delays). Samples come from its own seeded RNG.

use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::SmallRng;

use super::{DynEnvironment, EnvError, Environment, Observation, Record, StepOutcome};
use crate::dist::Dist;

/// Longest injected delay of one call.
const MAX_DELAY_S: f64 = 3600.0;

pub struct Delayed {
    inner: Box<dyn DynEnvironment>,
    reset: Option<Dist>,
    step: Option<Dist>,
    rng: SmallRng,
}

impl Delayed {
    /// Wraps `inner`; `reset` / `step` are the extra seconds of each call (none: no delay).
    pub fn new(
        inner: Box<dyn DynEnvironment>,
        reset: Option<Dist>,
        step: Option<Dist>,
        seed: u64,
    ) -> Self {
        Self {
            inner,
            reset,
            step,
            rng: SmallRng::seed_from_u64(seed),
        }
    }

    async fn delay(which: Option<&Dist>, rng: &mut SmallRng) {
        if let Some(d) = which {
            let s = d.sample(rng);
            if s.is_finite() && s > 0.0 {
                tokio::time::sleep(Duration::from_secs_f64(s.min(MAX_DELAY_S))).await;
            }
        }
    }
}

impl Environment for Delayed {
    async fn reset(&mut self, seed: u64) -> Result<Observation, EnvError> {
        self.reset_with(seed, None).await
    }

    async fn reset_with(
        &mut self,
        seed: u64,
        record: Option<Record>,
    ) -> Result<Observation, EnvError> {
        let r = self.inner.reset_boxed(seed, record).await;
        Self::delay(self.reset.as_ref(), &mut self.rng).await;
        r
    }

    async fn step(
        &mut self,
        action: &str,
        action_tokens: &crate::tokens::Tokens,
    ) -> Result<StepOutcome, EnvError> {
        let r = self.inner.step_boxed(action, action_tokens).await;
        Self::delay(self.step.as_ref(), &mut self.rng).await;
        r
    }

    async fn close(&mut self) {
        self.inner.close_boxed().await;
    }

    async fn release(&mut self) {
        self.inner.release_boxed().await;
    }

    fn last_start(&self) -> Option<super::starts::Start> {
        self.inner.last_start_dyn()
    }
}
