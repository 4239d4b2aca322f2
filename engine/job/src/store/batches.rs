//! Training batches for external trainers, durable from assembly to acknowledgement.
//!
//! A batch row is `ready` (offered to the next trainer that asks), `leased` (one trainer has
//! it until `lease_until_ms`; after that it is offered again) or `acked` (trained on: its
//! trajectories are marked with the step, and it is never offered again). Each lease gets the
//! next `offer` number, and a trainer acknowledges the lease it holds (`job:step:offer`): a
//! late answer to an expired lease is refused, so a batch is trained on at most once.

use rusqlite::{OptionalExtension, params};

use super::{Store, StoreError};

/// A batch handed to a trainer.
#[derive(Clone, Debug, PartialEq)]
pub struct LeasedBatch {
    pub step: u64,
    /// The lease: the batch's `offer`-th hand-out.
    pub offer: u64,
    pub lease_until_ms: i64,
    /// The batch as assembled (JSON).
    pub body: String,
}

/// What an acknowledgement (or a nack) found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AckOutcome {
    /// Applied now.
    Done,
    /// This lease was acknowledged before (a retried request): nothing changes.
    AlreadyAcked,
    /// The lease expired or was given back; the batch is (or was) offered again.
    LeaseLost,
    /// No such batch.
    Unknown,
}

impl Store {
    /// Stores the batch of `step` as ready, unless one is stored already (a restarted job
    /// re-offers what it had assembled). Returns whether this call stored it.
    pub fn put_batch(&self, job: &str, step: u64, body: &str) -> Result<bool, StoreError> {
        self.with(|c| {
            Ok(c.execute(
                "INSERT OR IGNORE INTO batches (job_id, step, body, state) VALUES (?1, ?2, ?3, 'ready')",
                params![job, step as i64, body],
            )? == 1)
        })
    }

    /// Leases the oldest batch of `job` that is ready or whose lease expired at `now_ms`,
    /// for `lease_ms`.
    pub fn lease_batch(
        &self,
        job: &str,
        now_ms: i64,
        lease_ms: i64,
    ) -> Result<Option<LeasedBatch>, StoreError> {
        self.with(|c| {
            let tx = c.transaction()?;
            let row: Option<(i64, i64, String)> = tx
                .query_row(
                    "SELECT step, offer, body FROM batches WHERE job_id = ?1 AND (state = 'ready' \
                     OR (state = 'leased' AND lease_until_ms <= ?2)) ORDER BY step LIMIT 1",
                    params![job, now_ms],
                    |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
                )
                .optional()?;
            let Some((step, offer, body)) = row else {
                return Ok(None);
            };
            let until = now_ms.saturating_add(lease_ms);
            tx.execute(
                "UPDATE batches SET state = 'leased', offer = ?1, lease_until_ms = ?2 \
                 WHERE job_id = ?3 AND step = ?4",
                params![offer + 1, until, job, step],
            )?;
            tx.commit()?;
            Ok(Some(LeasedBatch {
                step: step as u64,
                offer: (offer + 1) as u64,
                lease_until_ms: until,
                body,
            }))
        })
    }

    /// Acknowledges lease `offer` of the batch of `step`: marks it trained, with the trainer's
    /// `stats`, and marks its trajectories (`trajectory_ids`) as trained by step `step`
    /// (steps count from 1, as for in-process training), in one transaction.
    pub fn ack_batch(
        &self,
        job: &str,
        step: u64,
        offer: u64,
        now_ms: i64,
        stats: &str,
        trajectory_ids: &[String],
    ) -> Result<AckOutcome, StoreError> {
        self.with(|c| {
            let tx = c.transaction()?;
            let Some((state, current, until)) = lease_of(&tx, job, step)? else {
                return Ok(AckOutcome::Unknown);
            };
            if current != offer as i64 {
                return Ok(AckOutcome::LeaseLost);
            }
            match state.as_str() {
                "acked" => return Ok(AckOutcome::AlreadyAcked),
                "leased" if until.is_some_and(|u| u > now_ms) => {}
                _ => return Ok(AckOutcome::LeaseLost),
            }
            tx.execute(
                "UPDATE batches SET state = 'acked', stats = ?1 WHERE job_id = ?2 AND step = ?3",
                params![stats, job, step as i64],
            )?;
            {
                let mut mark = tx.prepare_cached(
                    "UPDATE trajectories SET trained_step = ?1 WHERE job_id = ?2 AND traj_id = ?3",
                )?;
                for t in trajectory_ids {
                    mark.execute(params![step as i64, job, t])?;
                }
            }
            tx.commit()?;
            Ok(AckOutcome::Done)
        })
    }

    /// Gives lease `offer` of the batch of `step` back: the batch is offered again at once.
    pub fn nack_batch(&self, job: &str, step: u64, offer: u64) -> Result<AckOutcome, StoreError> {
        self.with(|c| {
            let Some((state, current, _)) = lease_of(c, job, step)? else {
                return Ok(AckOutcome::Unknown);
            };
            if current != offer as i64 || state != "leased" {
                return Ok(if state == "acked" && current == offer as i64 {
                    AckOutcome::AlreadyAcked
                } else {
                    AckOutcome::LeaseLost
                });
            }
            c.execute(
                "UPDATE batches SET state = 'ready', lease_until_ms = NULL WHERE job_id = ?1 AND step = ?2",
                params![job, step as i64],
            )?;
            Ok(AckOutcome::Done)
        })
    }

    /// The newest step whose batch was offered (0: none yet).
    pub fn newest_batch_step(&self, job: &str) -> Result<u64, StoreError> {
        self.with(|c| {
            Ok(c.query_row(
                "SELECT COALESCE(MAX(step), 0) FROM batches WHERE job_id = ?1",
                [job],
                |r| r.get::<_, i64>(0),
            )? as u64)
        })
    }

    /// The trainer's stats of the batch of `step`, once acknowledged.
    pub fn batch_acked(&self, job: &str, step: u64) -> Result<Option<String>, StoreError> {
        self.with(|c| {
            Ok(c.query_row(
                "SELECT stats FROM batches WHERE job_id = ?1 AND step = ?2 AND state = 'acked'",
                params![job, step as i64],
                |r| r.get::<_, Option<String>>(0),
            )
            .optional()?
            .map(Option::unwrap_or_default))
        })
    }

    /// The stored batch of `step` (JSON), whatever its state.
    pub fn batch_body(&self, job: &str, step: u64) -> Result<Option<String>, StoreError> {
        self.with(|c| {
            Ok(c.query_row(
                "SELECT body FROM batches WHERE job_id = ?1 AND step = ?2",
                params![job, step as i64],
                |r| r.get(0),
            )
            .optional()?)
        })
    }

    /// (ready or leased, acknowledged) batches of `job`.
    pub fn batch_counts(&self, job: &str) -> Result<(u64, u64), StoreError> {
        self.with(|c| {
            Ok(c.query_row(
                "SELECT COALESCE(SUM(state != 'acked'), 0), COALESCE(SUM(state = 'acked'), 0) \
                 FROM batches WHERE job_id = ?1",
                params![job],
                |r| Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64)),
            )?)
        })
    }
}

impl Store {
    /// Records that the trainer of `job` announced `version` at `uri`; refused (false) unless
    /// `version` is above every version announced before.
    pub fn announce_weights(
        &self,
        job: &str,
        version: u64,
        uri: &str,
        format: &str,
        identity: Option<&infra::files::Identity>,
    ) -> Result<bool, StoreError> {
        let identity = identity.and_then(|i| serde_json::to_string(i).ok());
        self.with(|c| {
            let tx = c.transaction()?;
            let newest: Option<i64> = tx.query_row(
                "SELECT MAX(version) FROM announced_weights WHERE job_id = ?1",
                params![job],
                |r| r.get(0),
            )?;
            if newest.is_some_and(|n| n >= version as i64) {
                return Ok(false);
            }
            tx.execute(
                "INSERT INTO announced_weights (job_id, version, uri, format, at_ms, identity) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                params![job, version as i64, uri, format, super::now_ms(), identity],
            )?;
            tx.commit()?;
            Ok(true)
        })
    }

    /// The newest version the trainer of `job` announced, and where.
    pub fn newest_weights(&self, job: &str) -> Result<Option<AnnouncedWeights>, StoreError> {
        self.with(|c| {
            Ok(c.query_row(
                "SELECT version, uri, format, identity FROM announced_weights WHERE job_id = ?1 ORDER BY version DESC LIMIT 1",
                params![job],
                |r| {
                    Ok(AnnouncedWeights {
                        version: r.get::<_, i64>(0)? as u64,
                        uri: r.get(1)?,
                        format: r.get(2)?,
                        identity: r
                            .get::<_, Option<String>>(3)?
                            .and_then(|s| serde_json::from_str(&s).ok()),
                    })
                },
            )
            .optional()?)
        })
    }
}

/// A policy version an external trainer announced: its file and the file's format.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AnnouncedWeights {
    pub version: u64,
    pub uri: String,
    /// `safetensors` or `gguf`.
    pub format: String,
    /// The file as it was checked at the announcement (the install re-checks it): none in
    /// stores written before identities were recorded.
    pub identity: Option<infra::files::Identity>,
}

type Lease = (String, i64, Option<i64>);

fn lease_of(c: &rusqlite::Connection, job: &str, step: u64) -> Result<Option<Lease>, StoreError> {
    Ok(c.query_row(
        "SELECT state, offer, lease_until_ms FROM batches WHERE job_id = ?1 AND step = ?2",
        params![job, step as i64],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
    )
    .optional()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_leased_once_at_a_time_reoffered_when_its_lease_ends_and_acked_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store.db");
        let s = Store::open(&path).unwrap();
        assert!(s.put_batch("j", 0, "{\"b\":0}").unwrap());
        assert!(s.put_batch("j", 1, "{\"b\":1}").unwrap());
        // A restarted job offering the same step again keeps what was stored.
        assert!(!s.put_batch("j", 0, "{\"other\":true}").unwrap());
        let a = s.lease_batch("j", 1_000, 500).unwrap().unwrap();
        assert_eq!((a.step, a.offer, a.body.as_str()), (0, 1, "{\"b\":0}"));
        // The leased batch is not offered while its lease runs; the next one is.
        let b = s.lease_batch("j", 1_100, 500).unwrap().unwrap();
        assert_eq!((b.step, b.offer), (1, 1));
        assert_eq!(s.lease_batch("j", 1_200, 500).unwrap(), None);
        // Step 0's lease ends: it is offered again under a new lease, and the old one's
        // acknowledgement is refused.
        let a2 = s.lease_batch("j", 1_500, 500).unwrap().unwrap();
        assert_eq!((a2.step, a2.offer), (0, 2));
        assert_eq!(
            s.ack_batch("j", 0, 1, 1_600, "{}", &[]).unwrap(),
            AckOutcome::LeaseLost
        );
        assert_eq!(
            s.ack_batch("j", 0, 2, 1_600, "{\"loss\":1.5}", &[])
                .unwrap(),
            AckOutcome::Done
        );
        assert_eq!(
            s.ack_batch("j", 0, 2, 1_700, "{}", &[]).unwrap(),
            AckOutcome::AlreadyAcked
        );
        assert_eq!(
            s.batch_acked("j", 0).unwrap().as_deref(),
            Some("{\"loss\":1.5}")
        );
        // A nack offers the batch again at once; an acked batch is never offered again.
        assert_eq!(s.nack_batch("j", 1, 1).unwrap(), AckOutcome::Done);
        let b2 = s.lease_batch("j", 1_700, 500).unwrap().unwrap();
        assert_eq!((b2.step, b2.offer), (1, 2));
        assert_eq!(s.lease_batch("j", 5_000, 500).unwrap().unwrap().step, 1);
        assert_eq!(s.batch_counts("j").unwrap(), (1, 1));
        assert_eq!(
            s.ack_batch("j", 9, 1, 0, "{}", &[]).unwrap(),
            AckOutcome::Unknown
        );
        // Everything above is on disk: a reopened store (a restarted service) sees it.
        drop(s);
        let s = Store::open(&path).unwrap();
        assert_eq!(s.batch_counts("j").unwrap(), (1, 1));
        assert_eq!(s.batch_body("j", 1).unwrap().as_deref(), Some("{\"b\":1}"));
        let again = s.lease_batch("j", 10_000, 500).unwrap().unwrap();
        assert_eq!((again.step, again.offer), (1, 4));
    }
}
