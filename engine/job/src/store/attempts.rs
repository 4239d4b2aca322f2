//! The attempts to run a job: when each started and how it ended, the deaths that count
//! towards a crash loop, and the epoch a resumed run's trajectory ids carry.

use rusqlite::params;

use super::{Store, StoreError, now_ms};

impl Store {
    /// Records that an attempt to run `job` from `start_step` starts now; returns its number.
    pub fn start_attempt(&self, job: &str, start_step: u64) -> Result<i64, StoreError> {
        self.with(|c| {
            c.execute(
                "INSERT INTO attempts (job_id, started_at_ms, start_step) VALUES (?1, ?2, ?3)",
                params![job, now_ms(), start_step as i64],
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

    /// Attempts of `job` that never ended: the process died while running them.
    ///
    /// Counts the latest attempts, back to the first one that ended normally or completed a
    /// training step: a job killed while making progress (an operator's restart, a host
    /// failure) is resumed however often that happens; one that takes the process down
    /// before completing any step is a crash loop.
    pub fn died_attempts(&self, job: &str) -> Result<u64, StoreError> {
        self.with(|c| {
            let step: i64 = c.query_row("SELECT step FROM jobs WHERE id = ?1", [job], |r| {
                r.get(0)
            })?;
            let mut st = c.prepare(
                "SELECT COALESCE(start_step, 0), ended_at_ms IS NULL FROM attempts WHERE job_id = ?1 ORDER BY seq DESC",
            )?;
            let attempts = st
                .query_map([job], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, bool>(1)?)))?
                .collect::<Result<Vec<_>, _>>()?;
            // Newest first: the step each attempt reached is where the next one started.
            let mut reached = step;
            let mut deaths = 0;
            for (start, died) in attempts {
                if !died || reached > start {
                    break;
                }
                deaths += 1;
                reached = start;
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
        store.start_attempt(&id, 0).unwrap();
        store.complete_step(&id, 2, &metrics, &[]).unwrap();
        assert_eq!(store.died_attempts(&id).unwrap(), 0);
        // Resumed at 2, died before a step: one.
        store.start_attempt(&id, 2).unwrap();
        assert_eq!(store.died_attempts(&id).unwrap(), 1);
        // Again: two in a row.
        store.start_attempt(&id, 2).unwrap();
        assert_eq!(store.died_attempts(&id).unwrap(), 2);
        // An attempt that ends normally resets the count.
        let a = store.start_attempt(&id, 2).unwrap();
        store.end_attempt(a, "interrupted").unwrap();
        assert_eq!(store.died_attempts(&id).unwrap(), 0);
        store.start_attempt(&id, 2).unwrap();
        assert_eq!(store.died_attempts(&id).unwrap(), 1);
    }
}
