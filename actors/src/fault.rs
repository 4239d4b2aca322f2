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
    /// Failures of the streak that were answers (the dependency ran and said no), the first
    /// at `answers_since`.
    answers: u64,
    answers_since: Instant,
}

/// How much shorter the window is for a streak of *answers* (an invalid score, an HTTP 500
/// from a live instance): those are not a transient blip of connections, and each costs
/// a masked trajectory. With the default 30 s window: 3 s.
pub const ANSWER_WINDOW_DIVISOR: u32 = 10;

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
        self.failed_as(dependency, why, false);
    }

    /// [`Faults::failed`] for a failure that was the dependency's answer (`answer`): a run
    /// of answers breaks it after `min_failures` over a tenth of the window.
    pub fn failed_as(&self, dependency: &str, why: &str, answer: bool) {
        let now = Instant::now();
        let fault = {
            let mut s = self.streaks.lock().unwrap_or_else(|p| p.into_inner());
            let streak = s.entry(dependency.to_string()).or_insert(Streak {
                failures: 0,
                since: now,
                answers: 0,
                answers_since: now,
            });
            streak.failures += 1;
            // Other failures in between (a call that ran out of time in the queue) do not
            // undo the answers: only a success ends the streak.
            if answer {
                if streak.answers == 0 {
                    streak.answers_since = now;
                }
                streak.answers += 1;
            }
            let over = now.duration_since(streak.since);
            let answers_over = now.duration_since(streak.answers_since);
            // Once enough answers show the dependency broken, any later failure of the streak
            // breaks it (its instances, ejected for their 5xx, then leave calls untried).
            let by_answers = streak.answers >= self.policy.min_failures
                && answers_over >= self.policy.window / ANSWER_WINDOW_DIVISOR;
            let by_window =
                streak.failures >= self.policy.min_failures && over >= self.policy.window;
            (by_window || by_answers).then(|| Fault {
                dependency: dependency.to_string(),
                failures: streak.failures,
                over_s: over.as_secs_f64(),
                last: why.to_string(),
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
        Box::pin(async move { self.score_detailed(traj).await.map(|s| s.score) })
    }

    fn score_detailed<'a>(
        &'a self,
        traj: &'a Trajectory,
    ) -> BoxFuture<'a, Result<crate::reward::Scored, RewardError>> {
        Box::pin(async move {
            let r = self.inner.score_detailed(traj).await;
            match &r {
                Ok(_) => self.faults.ok(&self.dependency),
                Err(e) => {
                    let mut why = infra::error_chain(e);
                    if let Some(c) = &self.context {
                        why = format!("{why} ({})", c());
                    }
                    self.faults.failed_as(&self.dependency, &why, is_answer(e));
                }
            }
            r
        })
    }
}

/// Whether a reward failure was the function's own answer: an invalid score, or an HTTP
/// error status from an instance that answered (not a connection that failed, a timeout or
/// an overloaded activator, which a restart or a burst explains).
fn is_answer(e: &RewardError) -> bool {
    use functions::client::ClientError;
    use infra::router::{CallFailure, RouterError};
    match e {
        RewardError::InvalidScore(_) => true,
        RewardError::Exhausted(ClientError::Invalid { .. }) => true,
        RewardError::Exhausted(ClientError::Router(RouterError::Rejected { .. })) => true,
        RewardError::Exhausted(ClientError::Router(
            RouterError::Failed {
                last: CallFailure::Status { status, .. },
                ..
            }
            | RouterError::DeadlineExceeded {
                last: Some(CallFailure::Status { status, .. }),
                ..
            },
        )) => *status >= 500 && *status != 503,
        _ => false,
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

    /// Round 2 (#35): answers (invalid scores, HTTP 500s) break a dependency after a tenth
    /// of the window; other failures neither do that nor undo the answers; a success ends
    /// the streak.
    #[tokio::test(start_paused = true)]
    async fn answers_break_a_dependency_after_a_tenth_of_the_window() {
        let f = faults();
        for _ in 0..10 {
            f.failed_as("fn", "connection refused", false);
        }
        tokio::time::advance(Duration::from_secs(2)).await;
        f.failed_as("fn", "connection refused", false);
        assert_eq!(
            f.fault(),
            None,
            "transport failures wait for the whole window"
        );
        for _ in 0..3 {
            f.failed_as("fn", "score 5 is outside [0, 1]", true);
        }
        assert_eq!(f.fault(), None, "not before a tenth of the window");
        f.ok("fn");
        tokio::time::advance(Duration::from_millis(600)).await;
        f.failed_as("fn", "score 5 is outside [0, 1]", true);
        f.failed_as("fn", "timed out in the queue", false);
        f.failed_as("fn", "score 5 is outside [0, 1]", true);
        tokio::time::advance(Duration::from_millis(500)).await;
        f.failed_as("fn", "score 5 is outside [0, 1]", true);
        assert!(
            f.fault().is_none(),
            "3 answers since the success, but over 0.5 s"
        );
        tokio::time::advance(Duration::from_millis(600)).await;
        // 3 answers over 1.1 s (more than a tenth of 10 s): the next failure of the streak,
        // whatever it is, breaks it.
        f.failed_as("fn", "no instance to try before the deadline", false);
        let fault = f.fault().expect("broken by answers");
        assert!(fault.over_s < 10.0, "{fault}");
        assert_eq!(fault.last, "no instance to try before the deadline");
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
