//! One `rollarc train` session against the service: leasing each batch, the optimiser step
//! on it and the export of its weights, and the announcement of those weights.

use std::path::PathBuf;

use actors::trainer::Trainer;
use actors::types::PolicyVersion;
use job::trainer_api::{TrainingBatch, file_sha256};

use super::{Api, Leased, TrainClientError, TrainSummary, export, weights_path};

/// What a `batches/next` call got.
pub(super) enum Lease {
    Batch(Leased),
    /// No batch within the wait; the job goes on.
    None,
    /// No batch, and the job has ended in this state.
    JobEnded(String),
}

/// A running `rollarc train`: the service, the trainer, and what it has done.
pub(super) struct Session<'a> {
    pub(super) api: Api,
    pub(super) job: &'a str,
    pub(super) weights_dir: PathBuf,
    pub(super) trainer: Box<dyn Trainer>,
    /// The newest version trained here (or restored from the checkpoint).
    pub(super) version: PolicyVersion,
    pub(super) out: TrainSummary,
}

impl Session<'_> {
    /// Leases the next batch, waiting up to `wait_s`; without one, whether the job ended.
    pub(super) async fn lease(&self, wait_s: f64) -> Result<Lease, TrainClientError> {
        let (api, job) = (&self.api, self.job);
        let url = format!("{}/v1/jobs/{job}/batches/next?wait_s={wait_s}", api.server);
        let r = api.send(api.client.get(&url), &url).await?;
        if r.status() == reqwest::StatusCode::NO_CONTENT {
            let rec: serde_json::Value = api.get_json(&format!("/v1/jobs/{job}")).await?;
            let state = rec["state"].as_str().unwrap_or("").to_string();
            if matches!(state.as_str(), "succeeded" | "failed" | "cancelled") {
                return Ok(Lease::JobEnded(state));
            }
            return Ok(Lease::None);
        }
        if !r.status().is_success() {
            return Err(Api::fail(&url, r).await);
        }
        r.json()
            .await
            .map(Lease::Batch)
            .map_err(|e| TrainClientError::Decode(e.to_string()))
    }

    /// Takes the optimiser step on `batch` and exports the new weights, unless the checkpoint
    /// already covers its step; returns the step's stats for the acknowledgement (`{}` when
    /// no step was taken).
    pub(super) async fn train_on(
        &mut self,
        batch: &TrainingBatch,
    ) -> Result<serde_json::Value, TrainClientError> {
        // Step k (counted from 1) produces policy version k.
        let step = batch.step;
        let next = step;
        if next <= self.version {
            return Ok(serde_json::json!({}));
        }
        let (s, w) = self
            .trainer
            .train(&batch.to_batch(), next)
            .await
            .map_err(|source| TrainClientError::Step { step, source })?;
        let w =
            w.ok_or_else(|| TrainClientError::Model("the trainer published no weights".into()))?;
        export(&self.weights_dir, &w, next)?;
        self.version = next;
        self.out.steps += 1;
        let mut stats = serde_json::json!({
            "loss": s.loss,
            "tokens": s.tokens,
            "trajectories": s.trajectories,
            "mean_reward": s.mean_reward,
            "seconds": s.seconds,
        });
        if let (Some(o), Ok(serde_json::Value::Object(n))) =
            (stats.as_object_mut(), serde_json::to_value(&s.numbers))
        {
            o.extend(n.into_iter().filter(|(_, v)| !v.is_null()));
        }
        Ok(stats)
    }

    /// Announces version `next`'s exported weights (`None`: not announced now, it was before:
    /// a 409, or its file already pruned).
    pub(super) async fn announce(
        &self,
        next: PolicyVersion,
    ) -> Result<Option<serde_json::Value>, TrainClientError> {
        let path = weights_path(&self.weights_dir, next);
        if next <= self.version && !path.is_file() {
            return Ok(None);
        }
        let uri = std::fs::canonicalize(&path).map_err(|source| TrainClientError::Io {
            path: path.clone(),
            source,
        })?;
        let sha = file_sha256(&uri).map_err(|source| TrainClientError::Io {
            path: uri.clone(),
            source,
        })?;
        self.api
            .post(
                &format!("/v1/jobs/{}/weights", self.job),
                &serde_json::json!({
                    "version": next,
                    "source": {"kind": "path", "uri": uri.display().to_string(),
                               "format": "safetensors", "sha256": sha},
                }),
            )
            .await
    }

    /// Acknowledges the batch leased as `batch_id` with the step's `stats`; false when the
    /// lease had ended (the batch comes back).
    pub(super) async fn acknowledge(
        &mut self,
        batch_id: &str,
        stats: &serde_json::Value,
    ) -> Result<bool, TrainClientError> {
        let acked = self
            .api
            .post(&format!("/v1/batches/{batch_id}/ack"), stats)
            .await?;
        match acked {
            Some(_) => self.out.acked += 1,
            None => self.out.leases_lost += 1,
        }
        Ok(acked.is_some())
    }
}
