//! The job supervisor: parent of every actor of a job. Its restart policy (intensity within a
//! window, then escalate) applies to environment actors, which their pool replaces; a failure
//! of a critical actor (scheduler, sample buffer, trainer, weight store) or a policy overrun
//! escalates: the job fails and, after a service restart, resumes from its last completed step.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use actors::supervisor::{Decision, RestartPolicy, RestartTracker};
use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, SupervisionEvent};
use tokio::sync::watch;

/// What the supervisor has seen, shared with the job runner.
pub struct SupervisorReport {
    pub failures: AtomicU64,
    pub escalated: watch::Sender<Option<String>>,
    critical: Mutex<Vec<ActorId>>,
}

impl SupervisorReport {
    pub fn set_critical(&self, ids: &[ActorId]) {
        if let Ok(mut c) = self.critical.lock() {
            c.extend_from_slice(ids);
        }
    }

    fn is_critical(&self, id: ActorId) -> bool {
        self.critical
            .lock()
            .map(|c| c.contains(&id))
            .unwrap_or(true)
    }
}

pub enum SupMsg {}

pub struct JobSupervisor;

pub struct SupState {
    report: Arc<SupervisorReport>,
    tracker: RestartTracker,
}

pub async fn spawn(
    _name: &str,
) -> Result<(ActorRef<SupMsg>, Arc<SupervisorReport>), ractor::SpawnErr> {
    let (tx, _) = watch::channel(None);
    let report = Arc::new(SupervisorReport {
        failures: AtomicU64::new(0),
        escalated: tx,
        critical: Mutex::new(Vec::new()),
    });
    let (a, _) = Actor::spawn(None, JobSupervisor, report.clone()).await?;
    Ok((a, report))
}

impl Actor for JobSupervisor {
    type Msg = SupMsg;
    type State = SupState;
    type Arguments = Arc<SupervisorReport>;

    async fn pre_start(
        &self,
        _me: ActorRef<Self::Msg>,
        report: Arc<SupervisorReport>,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(SupState {
            report,
            tracker: RestartTracker::new(RestartPolicy {
                intensity: 10,
                window: std::time::Duration::from_secs(5),
            }),
        })
    }

    async fn handle_supervisor_evt(
        &self,
        _me: ActorRef<Self::Msg>,
        evt: SupervisionEvent,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        if let SupervisionEvent::ActorFailed(cell, err) = evt {
            st.report.failures.fetch_add(1, Ordering::Relaxed);
            let id = cell.get_id();
            let critical = st.report.is_critical(id);
            let decision = st.tracker.on_failure(tokio::time::Instant::now());
            tracing::warn!(actor = %id, critical, error = %err, "an actor of the job failed");
            if critical || decision == Decision::Escalate {
                let why = if critical {
                    format!("critical actor {id} failed: {err}")
                } else {
                    format!("restart intensity exceeded after actor {id} failed: {err}")
                };
                st.report.escalated.send_replace(Some(why));
            }
        }
        Ok(())
    }
}
