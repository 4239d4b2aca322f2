//! Restart policies: OTP-style intensity within a window, then escalate; with counters.

use std::collections::VecDeque;
use std::time::Duration;

/// At most `intensity` restarts within `window`; one more escalates to the parent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestartPolicy {
    pub intensity: u32,
    pub window: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        Self {
            intensity: 3,
            window: Duration::from_secs(5),
        }
    }
}

/// What a supervisor does about one failed child.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Restart,
    Escalate,
}

/// Tracks restarts of one supervisor against its policy.
#[derive(Debug)]
pub struct RestartTracker {
    policy: RestartPolicy,
    recent: VecDeque<tokio::time::Instant>,
    pub restarts: u64,
    pub failures: u64,
    pub escalations: u64,
}

impl RestartTracker {
    pub fn new(policy: RestartPolicy) -> Self {
        Self {
            policy,
            recent: VecDeque::new(),
            restarts: 0,
            failures: 0,
            escalations: 0,
        }
    }

    /// Records a failure at `now` and decides.
    pub fn on_failure(&mut self, now: tokio::time::Instant) -> Decision {
        self.failures += 1;
        while self
            .recent
            .front()
            .is_some_and(|t| now.duration_since(*t) > self.policy.window)
        {
            self.recent.pop_front();
        }
        if self.recent.len() as u32 >= self.policy.intensity {
            self.escalations += 1;
            return Decision::Escalate;
        }
        self.recent.push_back(now);
        self.restarts += 1;
        Decision::Restart
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn escalates_past_intensity_and_forgets_old_failures() {
        let mut t = RestartTracker::new(RestartPolicy {
            intensity: 2,
            window: Duration::from_secs(5),
        });
        let now = tokio::time::Instant::now();
        assert_eq!(t.on_failure(now), Decision::Restart);
        assert_eq!(
            t.on_failure(now + Duration::from_secs(1)),
            Decision::Restart
        );
        assert_eq!(
            t.on_failure(now + Duration::from_secs(2)),
            Decision::Escalate
        );
        // Both earlier failures are outside the window by now.
        assert_eq!(
            t.on_failure(now + Duration::from_secs(9)),
            Decision::Restart
        );
        assert_eq!((t.restarts, t.escalations, t.failures), (3, 1, 4));
    }
}
