//! Resuming after a restart: unfinished jobs are re-checked against today's limits and
//! queued again (unless they crash-loop the process), and a resumed job's admission continues
//! from the cursor of its last completed step.

use std::sync::Arc;

use infra::error_chain;
use job::runtime;
use job::spec::JobSpec;
use job::store::JobState;

use super::{Service, ServiceError};

/// Attempts of one job in a row during which the service process died while the job ran
/// alone and before it made progress (a trajectory committed, a training step completed),
/// after which the job is failed at the next start instead of run again: a spec that takes
/// the process down must not keep it crash-looping. A job killed while it makes progress is
/// resumed however often that happens, and a death while several jobs ran blames none of
/// them (see `job::store::Deaths`).
pub const MAX_PROCESS_DEATHS: u64 = 2;

/// Deaths in a row without progress after which a job is failed whoever else was running:
/// the backstop for a culprit that never runs alone.
pub const MAX_DEATHS_IN_A_ROW: u64 = 5;

impl Service {
    /// Re-queues jobs that were running when the service last stopped, then starts jobs.
    pub fn recover(self: &Arc<Self>) -> Result<usize, ServiceError> {
        self.recover_with(&|_| Vec::new())
    }

    /// [`Self::recover`], re-checking every unfinished job against today's limits first: the
    /// memory budget and `policy` (the programs the service allows, which may have changed
    /// since the job was accepted). A job that no longer passes is failed with the reason.
    pub fn recover_with(
        self: &Arc<Self>,
        policy: &dyn Fn(&JobSpec) -> Vec<job::spec::FieldError>,
    ) -> Result<usize, ServiceError> {
        let mut n = 0;
        for j in self.store.unfinished()? {
            if let Some(spec) = self.store.spec(&j.id)? {
                let why = match self.admit(&spec) {
                    Err(e) => Some(format!("not resumed: {e}")),
                    Ok(_) => {
                        let denied = policy(&spec);
                        (!denied.is_empty()).then(|| {
                            let fields: Vec<String> = denied
                                .iter()
                                .map(|f| format!("{}: {}", f.field, f.message))
                                .collect();
                            format!(
                                "not resumed: the service policy forbids {}",
                                fields.join("; ")
                            )
                        })
                    }
                };
                if let Some(why) = why {
                    tracing::error!(job = %j.id, error = %why, "failing a recovered job");
                    self.store.transition(&j.id, JobState::Failed, Some(&why))?;
                    continue;
                }
            }
            if j.state == JobState::Running {
                let deaths = self.store.died_attempts(&j.id)?;
                let why = if deaths.alone >= MAX_PROCESS_DEATHS {
                    Some(format!(
                        "the service process died {} times in a row while this job ran alone and \
                         before it made progress (no trajectory, no training step; the limit \
                         is {MAX_PROCESS_DEATHS}): it takes the process down, and is not run again",
                        deaths.alone
                    ))
                } else if deaths.in_a_row >= MAX_DEATHS_IN_A_ROW {
                    Some(format!(
                        "the service process died during {} attempts in a row to run this job, \
                         none making progress (the limit is {MAX_DEATHS_IN_A_ROW}); it is not \
                         run again",
                        deaths.in_a_row
                    ))
                } else {
                    None
                };
                if let Some(why) = why {
                    tracing::error!(job = %j.id, ?deaths, "crash loop: failing the job");
                    self.store.transition(&j.id, JobState::Failed, Some(&why))?;
                    continue;
                }
                self.store.transition(
                    &j.id,
                    JobState::Queued,
                    Some("service restarted; resuming from the last completed step"),
                )?;
                n += 1;
            }
        }
        self.dispatch();
        Ok(n)
    }

    /// Where a resumed job's admission continues: the cursor stored with its last completed
    /// step (its seeds go on from there: nothing trained is generated again), with group ids
    /// above every group stored by any attempt (rows of an interrupted attempt keep theirs).
    /// Without a stored cursor (older metrics), only the group-id floor is kept (the
    /// scheduler starts its sequences afresh but never reuses a stored group id).
    pub(super) fn resume_cursor(
        &self,
        id: &str,
        start_step: u64,
    ) -> Option<runtime::scheduler::Cursor> {
        // The record of the last completed step, by its row key (steps count from 1).
        let stored = (start_step > 0)
            .then(|| self.store.step_page(id, start_step - 1, 1))
            .transpose()
            .map_err(|e| tracing::warn!(job = %id, error = %error_chain(&e), "no step metrics to resume from"))
            .ok()
            .flatten()
            .and_then(|page| {
                let (step, last) = page.into_iter().next()?;
                (step == start_step).then_some(())?;
                serde_json::from_value::<runtime::scheduler::Cursor>(
                    last["scheduler"]["cursor"].clone(),
                )
                .ok()
            });
        let floor = self.store.max_group_id(id).ok().flatten().map(|g| g + 1);
        match (stored, floor) {
            (Some(mut c), f) => {
                c.next_group = c.next_group.max(f.unwrap_or(0));
                Some(c)
            }
            (None, Some(f)) => Some(runtime::scheduler::Cursor {
                next_group: f,
                ..Default::default()
            }),
            (None, None) => None,
        }
    }
}
