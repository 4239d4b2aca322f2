//! Fault budgets of a job's dependencies (its reward functions, each task's environments).
//!
//! A dependency that keeps failing — every call since its last success failed, at least
//! `min_failures` of them over at least `window` — is declared broken, and the job fails with
//! an error naming the dependency, how long and how often it failed, and its last failure.
//! One success ends a streak: a flaky dependency costs masked trajectories, a broken one
//! costs at most the window (plus one call's timeout) instead of the job's whole run.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::reward::{RewardError, SharedScorer, TrajectoryScorer};
use crate::types::Trajectory;

/// When a streak of failures breaks a dependency.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FaultPolicy {
    pub window: Duration,
    pub min_failures: u64,
}

/// Why a job stopped: one of its dependencies is broken.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error(
    "{dependency} is failing: {failures} consecutive failures over {over_s:.1} s, no success \
     in between; last failure: {last}"
)]
pub struct Fault {
    /// E.g. ``reward function `math` `` or ``environments of task `lake` ``.
    pub dependency: String,
    pub failures: u64,
    pub over_s: f64,
    pub last: String,
}

struct Streak {
    failures: u64,
    since: Instant,
}

/// The fault budgets of one job.
pub struct Faults {
    policy: FaultPolicy,
    streaks: Mutex<BTreeMap<String, Streak>>,
    tripped: watch::Sender<Option<Fault>>,
}

impl Faults {
    pub fn new(policy: FaultPolicy) -> Arc<Self> {
        Arc::new(Self {
            policy,
            streaks: Mutex::new(BTreeMap::new()),
            tripped: watch::Sender::new(None),
        })
    }

    /// A call to `dependency` succeeded: its streak ends.
    pub fn ok(&self, dependency: &str) {
        let mut s = self.streaks.lock().unwrap_or_else(|p| p.into_inner());
        if !s.is_empty() {
            s.remove(dependency);
        }
    }

    /// A call to `dependency` failed with `why`; breaks it once the streak is long enough.
    pub fn failed(&self, dependency: &str, why: &str) {
        let now = Instant::now();
        let fault = {
            let mut s = self.streaks.lock().unwrap_or_else(|p| p.into_inner());
            let streak = s.entry(dependency.to_string()).or_insert(Streak {
                failures: 0,
                since: now,
            });
            streak.failures += 1;
            let over = now.duration_since(streak.since);
            (streak.failures >= self.policy.min_failures && over >= self.policy.window).then(|| {
                Fault {
                    dependency: dependency.to_string(),
                    failures: streak.failures,
                    over_s: over.as_secs_f64(),
                    last: why.to_string(),
                }
            })
        };
        if let Some(f) = fault {
            self.trip(f);
        }
    }

    /// Breaks a dependency at once (e.g. a deployment whose instances crash-loop). The first
    /// fault is kept.
    pub fn trip(&self, fault: Fault) {
        self.tripped.send_if_modified(|t| {
            if t.is_some() {
                return false;
            }
            tracing::error!(dependency = %fault.dependency, error = %fault, "dependency broken");
            *t = Some(fault);
            true
        });
    }

    /// The first fault, once there is one.
    pub fn subscribe(&self) -> watch::Receiver<Option<Fault>> {
        self.tripped.subscribe()
    }

    pub fn fault(&self) -> Option<Fault> {
        self.tripped.borrow().clone()
    }
}

/// What is known about a dependency's instances when a call fails (e.g. a deployment's
/// ready count and its last instance failure).
pub type Context = Box<dyn Fn() -> String + Send + Sync>;

/// A reward function whose calls count against the job's fault budget.
pub struct GuardedScorer {
    dependency: String,
    inner: SharedScorer,
    faults: Arc<Faults>,
    context: Option<Context>,
}

impl GuardedScorer {
    pub fn wrap(
        function: &str,
        inner: SharedScorer,
        faults: Arc<Faults>,
        context: Option<Context>,
    ) -> SharedScorer {
        Arc::new(Self {
            dependency: format!("reward function `{function}`"),
            inner,
            faults,
            context,
        })
    }
}

impl TrajectoryScorer for GuardedScorer {
    fn score<'a>(&'a self, traj: &'a Trajectory) -> BoxFuture<'a, Result<f64, RewardError>> {
        Box::pin(async move {
            let r = self.inner.score(traj).await;
            match &r {
                Ok(_) => self.faults.ok(&self.dependency),
                Err(e) => {
                    let mut why = infra::error_chain(e);
                    if let Some(c) = &self.context {
                        why = format!("{why} ({})", c());
                    }
                    self.faults.failed(&self.dependency, &why);
                }
            }
            r
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn faults() -> Arc<Faults> {
        Faults::new(FaultPolicy {
            window: Duration::from_secs(10),
            min_failures: 3,
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_streak_breaks_only_when_long_and_many() {
        let f = faults();
        // Many failures in a short time: not yet (a burst of concurrent calls failing together).
        for _ in 0..10 {
            f.failed("fn", "boom");
        }
        assert_eq!(f.fault(), None);
        tokio::time::advance(Duration::from_secs(11)).await;
        f.failed("fn", "still boom");
        let fault = f.fault().expect("broken after the window");
        assert_eq!(fault.dependency, "fn");
        assert_eq!(fault.failures, 11);
        assert!(fault.over_s >= 10.0);
        assert_eq!(fault.last, "still boom");
        assert!(
            fault
                .to_string()
                .contains("fn is failing: 11 consecutive failures")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn one_success_ends_a_streak_and_dependencies_are_separate() {
        let f = faults();
        f.failed("a", "x");
        f.failed("a", "x");
        tokio::time::advance(Duration::from_secs(20)).await;
        f.ok("a");
        f.failed("a", "x");
        f.failed("b", "y");
        tokio::time::advance(Duration::from_secs(20)).await;
        f.failed("a", "x");
        assert_eq!(
            f.fault(),
            None,
            "a's streak restarted after its success: 2 failures"
        );
        f.failed("b", "y");
        f.failed("b", "y");
        assert_eq!(f.fault().map(|x| x.dependency), Some("b".into()));
        // The first fault stays.
        f.trip(Fault {
            dependency: "c".into(),
            failures: 1,
            over_s: 0.0,
            last: String::new(),
        });
        assert_eq!(f.fault().map(|x| x.dependency), Some("b".into()));
    }
}
