//! The job store: one SQLite file in WAL mode holding jobs, their state transitions, per-step
//! metrics and trajectories. A trajectory is acknowledged only after its transaction commits;
//! its row id is the durable cursor of the trajectories endpoint.
//!
//! Files by part: this one holds the store and its jobs, `schema` the tables and migrations,
//! `trajectories` the trajectory rows, `attempts` the runs of a job, `batches` the training
//! batches and announced weights of external trainers.

use std::path::Path;
use std::sync::{Arc, Mutex};

use rusqlite::{Connection, OptionalExtension, params};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::spec::JobSpec;

mod attempts;
mod batches;
mod schema;
mod trajectories;

pub use attempts::Deaths;
pub use batches::{AckOutcome, AnnouncedWeights, LeasedBatch};
use schema::{SCHEMA, migrate};
pub use trajectories::{JobSink, RowFilter, TrainedFilter, TrajectoryRow, TurnText};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error")]
    Sqlite(#[from] rusqlite::Error),
    #[error("stored JSON is corrupt")]
    Json(#[from] serde_json::Error),
    #[error("the store lock was poisoned by a panic")]
    Poisoned,
}

/// Lifecycle state of a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Queued,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [
            Self::Queued,
            Self::Running,
            Self::Succeeded,
            Self::Failed,
            Self::Cancelled,
        ]
        .into_iter()
        .find(|x| x.as_str() == s)
    }

    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled)
    }
}

/// A job row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JobRecord {
    pub id: String,
    pub name: Option<String>,
    pub state: JobState,
    /// Training steps completed.
    pub step: u64,
    /// Training steps asked for.
    pub steps: u64,
    /// Latest step metrics (free-form, see the step records in docs/metrics.md).
    #[schema(value_type = Object)]
    pub metrics: serde_json::Value,
    pub error: Option<String>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// Name of the token that submitted the job (none: submitted without access control).
    pub owner: Option<String>,
    /// The spec's `tags`.
    #[serde(default)]
    pub tags: Vec<String>,
}

/// The SQLite store. Cheap to clone; calls are short and serialised by a mutex.
#[derive(Clone)]
pub struct Store {
    conn: Arc<Mutex<Connection>>,
}

/// Wall-clock timestamp for records (creation and transition times are facts about the real
/// world, not about the simulated clock).
pub fn now_ms() -> i64 {
    infra::clock::unix_ms()
}

impl Store {
    /// Opens (or creates) the store at `path`.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let conn = Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        // NORMAL in WAL mode: a commit survives a process crash (SIGKILL); only an OS crash
        // can lose the last transactions.
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.execute_batch(SCHEMA)?;
        migrate(&conn)?;
        Ok(Self {
            conn: Arc::new(Mutex::new(conn)),
        })
    }

    pub fn in_memory() -> Result<Self, StoreError> {
        let conn = Connection::open_in_memory()?;
        conn.execute_batch(SCHEMA)?;
        migrate(&conn)?;
        Ok(Self {
            conn: Arc::new(Mutex::new(conn)),
        })
    }

    fn with<T>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut c = self.conn.lock().map_err(|_| StoreError::Poisoned)?;
        f(&mut c)
    }

    /// Inserts a queued job owned by `owner`; returns its id (`job-N`, N the insertion
    /// sequence).
    pub fn create_job(
        &self,
        spec: &JobSpec,
        steps: u64,
        owner: Option<&str>,
    ) -> Result<String, StoreError> {
        let spec_json = serde_json::to_string(spec)?;
        self.with(|c| {
            let tx = c.transaction()?;
            let t = now_ms();
            tx.execute(
                "INSERT INTO jobs (id, name, spec, state, steps, created_at_ms, updated_at_ms, owner) VALUES ('pending', ?1, ?2, 'queued', ?3, ?4, ?4, ?5)",
                params![spec.name, spec_json, steps as i64, t, owner],
            )?;
            let seq = tx.last_insert_rowid();
            let id = format!("job-{seq}");
            tx.execute("UPDATE jobs SET id = ?1 WHERE seq = ?2", params![id, seq])?;
            tx.execute("INSERT INTO transitions (job_id, from_state, to_state, at_ms) VALUES (?1, NULL, 'queued', ?2)", params![id, t])?;
            tx.commit()?;
            Ok(id)
        })
    }

    pub fn spec(&self, id: &str) -> Result<Option<JobSpec>, StoreError> {
        let s: Option<String> = self.with(|c| {
            Ok(
                c.query_row("SELECT spec FROM jobs WHERE id = ?1", [id], |r| r.get(0))
                    .optional()?,
            )
        })?;
        s.map(|s| serde_json::from_str(&s).map_err(StoreError::from))
            .transpose()
    }

    /// Moves a job to `to`, recording the transition; returns false if the job is unknown or
    /// already terminal.
    pub fn transition(
        &self,
        id: &str,
        to: JobState,
        reason: Option<&str>,
    ) -> Result<bool, StoreError> {
        self.with(|c| {
            let tx = c.transaction()?;
            let from: Option<String> = tx.query_row("SELECT state FROM jobs WHERE id = ?1", [id], |r| r.get(0)).optional()?;
            let Some(from) = from else { return Ok(false) };
            if JobState::parse(&from).is_some_and(|s| s.is_terminal()) {
                return Ok(false);
            }
            let t = now_ms();
            let error = if to == JobState::Failed { reason } else { None };
            tx.execute("UPDATE jobs SET state = ?1, updated_at_ms = ?2, error = COALESCE(?3, error) WHERE id = ?4", params![to.as_str(), t, error, id])?;
            tx.execute(
                "INSERT INTO transitions (job_id, from_state, to_state, reason, at_ms) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![id, from, to.as_str(), reason, t],
            )?;
            tx.commit()?;
            Ok(true)
        })
    }

    /// Records a completed step: its metrics, the job's progress and which trajectories the
    /// step trained on, in one transaction.
    pub fn complete_step(
        &self,
        id: &str,
        step: u64,
        metrics: &serde_json::Value,
        trained: &[&str],
    ) -> Result<(), StoreError> {
        let m = serde_json::to_string(metrics)?;
        self.with(|c| {
            let tx = c.transaction()?;
            {
                let mut mark = tx.prepare_cached(
                    "UPDATE trajectories SET trained_step = ?1 WHERE job_id = ?2 AND traj_id = ?3",
                )?;
                for t in trained {
                    mark.execute(params![step as i64, id, t])?;
                }
            }
            tx.execute("INSERT OR REPLACE INTO step_metrics (job_id, step, metrics) VALUES (?1, ?2, ?3)", params![id, step as i64, m])?;
            tx.execute("UPDATE jobs SET step = MAX(step, ?1), metrics = ?2, updated_at_ms = ?3 WHERE id = ?4", params![step as i64, m, now_ms(), id])?;
            tx.commit()?;
            Ok(())
        })
    }

    /// The step records of job `id` after step `after` (steps count from 1), oldest first, at
    /// most `limit`.
    pub fn step_page(
        &self,
        id: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<(u64, serde_json::Value)>, StoreError> {
        self.with(|c| {
            let mut st = c.prepare(
                "SELECT step, metrics FROM step_metrics WHERE job_id = ?1 AND step > ?2 ORDER BY step LIMIT ?3",
            )?;
            let rows = st
                .query_map(params![id, after as i64, limit as i64], |r| {
                    Ok((r.get::<_, i64>(0)? as u64, r.get::<_, String>(1)?))
                })?
                .collect::<Result<Vec<_>, _>>()?;
            rows.into_iter()
                .map(|(s, m)| Ok((s, serde_json::from_str(&m)?)))
                .collect()
        })
    }

    pub fn step_metrics(&self, id: &str) -> Result<Vec<serde_json::Value>, StoreError> {
        self.with(|c| {
            let mut st =
                c.prepare("SELECT metrics FROM step_metrics WHERE job_id = ?1 ORDER BY step")?;
            let rows = st
                .query_map([id], |r| r.get::<_, String>(0))?
                .collect::<Result<Vec<_>, _>>()?;
            rows.iter()
                .map(|s| serde_json::from_str(s).map_err(StoreError::from))
                .collect()
        })
    }

    /// Keeps the spec as the client sent it (`format`: `toml` or `json`), beside the
    /// normalised form the job runs.
    pub fn set_submitted(&self, id: &str, format: &str, text: &str) -> Result<(), StoreError> {
        let v = serde_json::json!({ "format": format, "text": text }).to_string();
        self.with(|c| {
            c.execute(
                "UPDATE jobs SET submitted = ?1 WHERE id = ?2",
                params![v, id],
            )?;
            Ok(())
        })
    }

    /// The spec as the client sent it: (format, text); `None` for a job submitted before it
    /// was kept (or in process).
    pub fn submitted(&self, id: &str) -> Result<Option<(String, String)>, StoreError> {
        let v: Option<String> = self.with(|c| {
            Ok(
                c.query_row("SELECT submitted FROM jobs WHERE id = ?1", [id], |r| {
                    r.get::<_, Option<String>>(0)
                })
                .optional()?
                .flatten(),
            )
        })?;
        let Some(v) = v else { return Ok(None) };
        let v: serde_json::Value = serde_json::from_str(&v)?;
        Ok(Some((
            v["format"].as_str().unwrap_or("json").to_string(),
            v["text"].as_str().unwrap_or_default().to_string(),
        )))
    }

    pub fn get(&self, id: &str) -> Result<Option<JobRecord>, StoreError> {
        self.with(|c| {
            let row = c
                .query_row("SELECT id, name, state, step, steps, metrics, error, created_at_ms, updated_at_ms, owner, json_extract(spec, '$.tags') FROM jobs WHERE id = ?1", [id], row_to_job)
                .optional()?;
            row.map(finish_job).transpose()
        })
    }

    pub fn list(&self) -> Result<Vec<JobRecord>, StoreError> {
        self.with(|c| {
            let mut st = c.prepare("SELECT id, name, state, step, steps, metrics, error, created_at_ms, updated_at_ms, owner, json_extract(spec, '$.tags') FROM jobs ORDER BY seq")?;
            let rows = st.query_map([], row_to_job)?.collect::<Result<Vec<_>, _>>()?;
            rows.into_iter().map(finish_job).collect()
        })
    }

    /// Jobs that were queued or running when the service last stopped, oldest first.
    pub fn unfinished(&self) -> Result<Vec<JobRecord>, StoreError> {
        Ok(self
            .list()?
            .into_iter()
            .filter(|j| !j.state.is_terminal())
            .collect())
    }
}

type RawJob = (
    String,
    Option<String>,
    String,
    i64,
    i64,
    String,
    Option<String>,
    i64,
    i64,
    Option<String>,
    Option<String>,
);

fn row_to_job(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawJob> {
    Ok((
        r.get(0)?,
        r.get(1)?,
        r.get(2)?,
        r.get(3)?,
        r.get(4)?,
        r.get(5)?,
        r.get(6)?,
        r.get(7)?,
        r.get(8)?,
        r.get(9)?,
        r.get(10)?,
    ))
}

fn finish_job(
    (id, name, state, step, steps, metrics, error, created_at_ms, updated_at_ms, owner, tags): RawJob,
) -> Result<JobRecord, StoreError> {
    Ok(JobRecord {
        id,
        name,
        state: JobState::parse(&state).unwrap_or(JobState::Failed),
        step: step as u64,
        steps: steps as u64,
        metrics: serde_json::from_str(&metrics)?,
        error,
        created_at_ms,
        updated_at_ms,
        owner,
        tags: tags
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default(),
    })
}
