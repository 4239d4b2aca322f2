//! The batch desk: each job's batches, durable in the store from assembly to
//! acknowledgement, leased to one external trainer at a time; and the weights trainers announce.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use super::TrainingBatch;
use crate::store::{AckOutcome, AnnouncedWeights, LeasedBatch, Store, StoreError};

/// Offers each job's batches to its external trainer: durable in the store, leased to one
/// trainer at a time, offered again when a lease ends or is given back.
pub struct BatchDesk {
    store: Store,
    /// Per job: woken when a batch is offered, acknowledged or given back.
    changed: Mutex<HashMap<String, Arc<Notify>>>,
}

/// How often waiters look at the store even without a wake-up (a lease that ends).
const RECHECK: Duration = Duration::from_millis(500);

impl BatchDesk {
    pub fn new(store: Store) -> Arc<Self> {
        Arc::new(Self {
            store,
            changed: Mutex::new(HashMap::new()),
        })
    }

    /// The wake-up of `job`'s waiters.
    fn changed(&self, job: &str) -> Arc<Notify> {
        let mut g = self.changed.lock().unwrap_or_else(|p| p.into_inner());
        g.entry(job.to_string()).or_default().clone()
    }

    /// Stores the batch of a step (kept if one is stored for that step already: a restarted
    /// job offers what it had assembled) and wakes the trainers waiting for one.
    pub fn offer(&self, job: &str, batch: &TrainingBatch) -> Result<(), StoreError> {
        let body = serde_json::to_string(batch)?;
        self.store.put_batch(job, batch.step, &body)?;
        self.changed(job).notify_waiters();
        Ok(())
    }

    /// Leases the next batch of `job` for `lease`, waiting up to `wait` for one.
    pub async fn next(
        &self,
        job: &str,
        wait: Duration,
        lease: Duration,
    ) -> Result<Option<LeasedBatch>, StoreError> {
        let changed = self.changed(job);
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let woken = changed.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            let now = crate::store::now_ms();
            if let Some(b) = self.store.lease_batch(job, now, lease.as_millis() as i64)? {
                return Ok(Some(b));
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            let _ = tokio::time::timeout(left.min(RECHECK), woken).await;
        }
    }

    /// Acknowledges lease `offer` of the batch of `step` with the trainer's `stats`.
    pub fn ack(
        &self,
        job: &str,
        step: u64,
        offer: u64,
        stats: &serde_json::Value,
    ) -> Result<AckOutcome, StoreError> {
        let Some(body) = self.store.batch_body(job, step)? else {
            return Ok(AckOutcome::Unknown);
        };
        let batch: TrainingBatch = serde_json::from_str(&body)?;
        let out = self.store.ack_batch(
            job,
            step,
            offer,
            crate::store::now_ms(),
            &stats.to_string(),
            &batch.trajectory_ids(),
        )?;
        self.changed(job).notify_waiters();
        Ok(out)
    }

    /// Gives lease `offer` back: the batch is offered again at once.
    pub fn nack(&self, job: &str, step: u64, offer: u64) -> Result<AckOutcome, StoreError> {
        let out = self.store.nack_batch(job, step, offer)?;
        self.changed(job).notify_waiters();
        Ok(out)
    }

    /// Waits until the batch of `step` is acknowledged; returns the trainer's stats.
    pub async fn acked(&self, job: &str, step: u64) -> Result<serde_json::Value, StoreError> {
        let changed = self.changed(job);
        loop {
            let woken = changed.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if let Some(stats) = self.store.batch_acked(job, step)? {
                return Ok(serde_json::from_str(&stats).unwrap_or(serde_json::Value::Null));
            }
            let _ = tokio::time::timeout(RECHECK, woken).await;
        }
    }

    /// Records an announced policy version (refused unless above every earlier one) and
    /// wakes the job's trainer side.
    pub fn announce(
        &self,
        job: &str,
        version: u64,
        uri: &str,
        format: &str,
        identity: Option<&infra::files::Identity>,
    ) -> Result<bool, StoreError> {
        let fresh = self
            .store
            .announce_weights(job, version, uri, format, identity)?;
        self.changed(job).notify_waiters();
        Ok(fresh)
    }

    /// The newest announced version of `job` and its file.
    pub fn newest_weights(&self, job: &str) -> Result<Option<AnnouncedWeights>, StoreError> {
        self.store.newest_weights(job)
    }

    /// (offered but not acknowledged, acknowledged) batches of `job`.
    pub fn counts(&self, job: &str) -> Result<(u64, u64), StoreError> {
        self.store.batch_counts(job)
    }
}
