//! Retry and hedge policies.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::Rng;
use rand::rngs::SmallRng;
use tokio::time::Instant;
use tower::BoxError;
use tower::retry::budget::{Budget, TpsBudget};

use super::call::{Call, CallFailure, Reply};
use super::stats::RouterStats;

/// Retries retryable failures within the budget, with full-jitter backoff that honours
/// `Retry-After`, never past the call's deadline.
#[derive(Clone)]
pub(super) struct RetryPolicy {
    pub(super) budget: Arc<TpsBudget>,
    pub(super) attempts: u32,
    pub(super) max_attempts: u32,
    pub(super) base: Duration,
    pub(super) cap: Duration,
    pub(super) rng: Arc<Mutex<SmallRng>>,
    pub(super) stats: Arc<RouterStats>,
}

impl tower::retry::Policy<Call, Result<Reply, CallFailure>, BoxError> for RetryPolicy {
    type Future = tokio::time::Sleep;

    fn retry(
        &mut self,
        req: &mut Call,
        result: &mut Result<Result<Reply, CallFailure>, BoxError>,
    ) -> Option<Self::Future> {
        let retry_after = match result {
            Ok(Ok(_)) => return None,
            Ok(Err(e)) if !e.retryable() => return None,
            Ok(Err(CallFailure::Status { retry_after, .. })) => *retry_after,
            Ok(Err(_)) => None,
            // Overloaded (activator full) is not retried here: no amplification of an overload.
            Err(_) => return None,
        };
        self.attempts += 1;
        if self.attempts >= self.max_attempts {
            return None;
        }
        let now = Instant::now();
        if now >= req.deadline {
            return None;
        }
        if !self.budget.withdraw() {
            self.stats.budget_exhausted.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        self.stats.retries.fetch_add(1, Ordering::Relaxed);
        // Full jitter: uniform in [0, min(cap, base · 2^attempt)], at least the Retry-After hint.
        let ceiling = self
            .cap
            .min(self.base * 2u32.saturating_pow(self.attempts.min(16)));
        let jitter = {
            let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
            ceiling.mul_f64(rng.random::<f64>())
        };
        let wait = jitter.max(retry_after.unwrap_or_default().min(self.cap * 4));
        let wake = (now + wait).min(req.deadline);
        Some(tokio::time::sleep_until(wake))
    }

    fn clone_request(&mut self, req: &Call) -> Option<Call> {
        Some(req.clone())
    }
}

/// Hedges within its own budget, never past the call's deadline.
#[derive(Clone)]
pub(super) struct HedgePolicy {
    pub(super) budget: Arc<TpsBudget>,
    pub(super) stats: Arc<RouterStats>,
}

impl tower::hedge::Policy<Call> for HedgePolicy {
    fn clone_request(&self, req: &Call) -> Option<Call> {
        Some(req.clone())
    }

    fn can_retry(&self, req: &Call) -> bool {
        let ok = Instant::now() < req.deadline && self.budget.withdraw();
        if ok {
            self.stats.hedges.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }
}
