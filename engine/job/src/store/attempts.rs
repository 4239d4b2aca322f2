//! The attempts to run a job: when each started and how it ended, the deaths that count
//! towards a crash loop, and the epoch a resumed run's trajectory ids carry.

use rusqlite::params;

use super::{Store, StoreError, now_ms};

/// What the attempts of a job that the process died during say about the job: the
/// evidence that it takes the process down.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Deaths {
    /// The latest attempts, back to the first that ended normally or made progress (a
    /// trajectory committed, or a training step completed), during which the process died.
    pub in_a_row: u64,
    /// Of those, the ones that point at this job: it was the only job running when the
    /// process died. (A death while several jobs ran blames none of them: two SIGKILLs of
    /// a service with 47 jobs used to fail the two whose steps were slowest.)
    pub alone: u64,
}

impl Store {
    /// Records that an attempt to run `job` from `start_step` starts now, in the service
    /// process that started at `boot` (ms); returns its number.
    pub fn start_attempt(&self, job: &str, start_step: u64, boot: u64) -> Result<i64, StoreError> {
        self.with(|c| {
            let seq: i64 = c.query_row(
                "SELECT COALESCE(MAX(seq), 0) FROM trajectories",
                [],
                |r| r.get(0),
            )?;
            c.execute(
                "INSERT INTO attempts (job_id, started_at_ms, start_step, boot, start_seq) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![job, now_ms(), start_step as i64, boot as i64, seq],
            )?;
            Ok(c.last_insert_rowid())
        })
    }

    /// Records how an attempt ended (any way but the process dying).
    pub fn end_attempt(&self, attempt: i64, outcome: &str) -> Result<(), StoreError> {
        self.with(|c| {
            c.execute(
                "UPDATE attempts SET ended_at_ms = ?1, outcome = ?2 WHERE seq = ?3",
                params![now_ms(), outcome, attempt],
            )?;
            Ok(())
        })
    }

    /// The attempts of `job` that never ended (the process died while running them), newest
    /// first, back to the first that ended normally or made progress: a job killed while
    /// making progress (an operator's restart, a host failure) is resumed however often that
    /// happens. See [`Deaths`] for which of them blame the job.
    pub fn died_attempts(&self, job: &str) -> Result<Deaths, StoreError> {
        self.with(|c| {
            let step: i64 = c.query_row("SELECT step FROM jobs WHERE id = ?1", [job], |r| {
                r.get(0)
            })?;
            let mut st = c.prepare(
                "SELECT COALESCE(start_step, 0), ended_at_ms IS NULL, boot, start_seq \
                 FROM attempts WHERE job_id = ?1 ORDER BY seq DESC",
            )?;
            let attempts = st
                .query_map([job], |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        r.get::<_, bool>(1)?,
                        r.get::<_, Option<i64>>(2)?,
                        r.get::<_, Option<i64>>(3)?,
                    ))
                })?
                .collect::<Result<Vec<_>, _>>()?;
            // Newest first: the step each attempt reached is where the next one started, and
            // its trajectories are those committed after its start and before the next one's.
            let mut reached = step;
            let mut until_seq: Option<i64> = None;
            let mut deaths = Deaths::default();
            for (start, died, boot, start_seq) in attempts {
                let committed = match start_seq {
                    Some(from) => c.query_row(
                        "SELECT EXISTS (SELECT 1 FROM trajectories WHERE job_id = ?1 AND seq > ?2 AND seq <= ?3)",
                        params![job, from, until_seq.unwrap_or(i64::MAX)],
                        |r| r.get::<_, bool>(0),
                    )?,
                    None => false,
                };
                if !died || reached > start || committed {
                    break;
                }
                deaths.in_a_row += 1;
                let alone = match boot {
                    Some(b) => {
                        c.query_row(
                            "SELECT COUNT(*) FROM attempts WHERE boot = ?1 AND ended_at_ms IS NULL AND job_id != ?2",
                            params![b, job],
                            |r| r.get::<_, i64>(0),
                        )? == 0
                    }
                    // Recorded before boots were: the old rule (every such death counts).
                    None => true,
                };
                if alone {
                    deaths.alone += 1;
                }
                reached = start;
                until_seq = start_seq;
            }
            Ok(deaths)
        })
    }

    /// Rolls a job's trajectory ids into a per-run prefix on resume, so a resumed run never
    /// collides with ids committed before the restart.
    pub fn resume_epoch(&self, job: &str) -> Result<u64, StoreError> {
        self.with(|c| {
            Ok(c.query_row(
                "SELECT COUNT(*) FROM transitions WHERE job_id = ?1 AND to_state = 'running'",
                [job],
                |r| r.get::<_, i64>(0),
            )? as u64)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::JobSpec;

    #[test]
    fn only_deaths_without_progress_count_towards_a_crash_loop() {
        let store = Store::in_memory().unwrap();
        let spec: JobSpec = crate::spec::parse(
            "[[tasks]]\ndomain = \"t\"\nenv = { kind = \"arithmetic\" }\n[[pools]]\nname = \"p\"\ndevice = \"H800\"\ncount = 1\nbackend = { kind = \"sim\", model = \"qwen3-8b\" }\n",
            crate::spec::Format::Toml,
        )
        .unwrap();
        let id = store.create_job(&spec, 10, None).unwrap();
        let metrics = serde_json::json!({});
        // Died after completing steps 1 and 2: progress, not a crash loop.
        let deaths = |n, alone| Deaths { in_a_row: n, alone };
        store.start_attempt(&id, 0, 1).unwrap();
        store.complete_step(&id, 2, &metrics, &[]).unwrap();
        assert_eq!(store.died_attempts(&id).unwrap(), deaths(0, 0));
        // Resumed at 2, died before a step, alone: one.
        store.start_attempt(&id, 2, 2).unwrap();
        assert_eq!(store.died_attempts(&id).unwrap(), deaths(1, 1));
        // Again: two in a row.
        store.start_attempt(&id, 2, 3).unwrap();
        assert_eq!(store.died_attempts(&id).unwrap(), deaths(2, 2));
        // An attempt that ends normally resets the count.
        let a = store.start_attempt(&id, 2, 4).unwrap();
        store.end_attempt(a, "interrupted").unwrap();
        assert_eq!(store.died_attempts(&id).unwrap(), deaths(0, 0));
        store.start_attempt(&id, 2, 5).unwrap();
        assert_eq!(store.died_attempts(&id).unwrap(), deaths(1, 1));
        // Another job died in the same process: that death blames neither.
        let other = store.create_job(&spec, 10, None).unwrap();
        store.start_attempt(&other, 0, 6).unwrap();
        store.start_attempt(&id, 2, 6).unwrap();
        assert_eq!(store.died_attempts(&id).unwrap(), deaths(2, 1));
        assert_eq!(store.died_attempts(&other).unwrap(), deaths(1, 0));
        // A trajectory committed during an attempt is progress, even without a step.
        store.start_attempt(&id, 2, 7).unwrap();
        store
            .with(|c| {
                c.execute(
                    "INSERT INTO trajectories (job_id, traj_id, body) VALUES (?1, 'r7-1', '{}')",
                    [&id],
                )?;
                Ok(())
            })
            .unwrap();
        assert_eq!(store.died_attempts(&id).unwrap(), deaths(0, 0));
        // The next attempt starts after it: only its own trajectories count.
        store.start_attempt(&id, 2, 8).unwrap();
        assert_eq!(store.died_attempts(&id).unwrap(), deaths(1, 1));
    }
}
