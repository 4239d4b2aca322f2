//! The job store: one SQLite file in WAL mode holding jobs, their state transitions, per-step
//! metrics and trajectories. A trajectory is acknowledged only after its transaction commits;
//! its row id is the durable cursor of the trajectories endpoint.

use std::path::Path;
use std::sync::{Arc, Mutex};

use actors::buffer::{SinkError, TrajectorySink};
use actors::types::Trajectory;
use rusqlite::{Connection, OptionalExtension, params};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::spec::JobSpec;

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
    /// Latest step metrics (free-form, see the metric catalogue in the README).
    #[schema(value_type = Object)]
    pub metrics: serde_json::Value,
    pub error: Option<String>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

/// A trajectory row as served by the trajectories endpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TrajectoryRow {
    /// Durable cursor: pass it back as `after` to continue.
    pub cursor: i64,
    pub job_id: String,
    #[schema(value_type = Object)]
    pub trajectory: serde_json::Value,
}

/// The SQLite store. Cheap to clone; calls are short and serialised by a mutex.
#[derive(Clone)]
pub struct Store {
    conn: Arc<Mutex<Connection>>,
}

/// Wall-clock timestamp for records (creation and transition times are facts about the real
/// world, not about the simulated clock).
#[allow(clippy::disallowed_methods)]
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS jobs (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL UNIQUE,
  name TEXT,
  spec TEXT NOT NULL,
  state TEXT NOT NULL,
  step INTEGER NOT NULL DEFAULT 0,
  steps INTEGER NOT NULL,
  metrics TEXT NOT NULL DEFAULT '{}',
  error TEXT,
  created_at_ms INTEGER NOT NULL,
  updated_at_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS transitions (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  job_id TEXT NOT NULL,
  from_state TEXT,
  to_state TEXT NOT NULL,
  reason TEXT,
  at_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS step_metrics (
  job_id TEXT NOT NULL,
  step INTEGER NOT NULL,
  metrics TEXT NOT NULL,
  PRIMARY KEY (job_id, step)
);
CREATE TABLE IF NOT EXISTS trajectories (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  job_id TEXT NOT NULL,
  traj_id TEXT NOT NULL,
  body TEXT NOT NULL,
  UNIQUE (job_id, traj_id)
);
CREATE INDEX IF NOT EXISTS trajectories_job ON trajectories (job_id, seq);
";

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
        Ok(Self {
            conn: Arc::new(Mutex::new(conn)),
        })
    }

    pub fn in_memory() -> Result<Self, StoreError> {
        let conn = Connection::open_in_memory()?;
        conn.execute_batch(SCHEMA)?;
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

    /// Inserts a queued job; returns its id (`job-N`, N the insertion sequence).
    pub fn create_job(&self, spec: &JobSpec, steps: u64) -> Result<String, StoreError> {
        let spec_json = serde_json::to_string(spec)?;
        self.with(|c| {
            let tx = c.transaction()?;
            let t = now_ms();
            tx.execute(
                "INSERT INTO jobs (id, name, spec, state, steps, created_at_ms, updated_at_ms) VALUES ('pending', ?1, ?2, 'queued', ?3, ?4, ?4)",
                params![spec.name, spec_json, steps as i64, t],
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

    /// Records a completed training step and its metrics.
    pub fn complete_step(
        &self,
        id: &str,
        step: u64,
        metrics: &serde_json::Value,
    ) -> Result<(), StoreError> {
        let m = serde_json::to_string(metrics)?;
        self.with(|c| {
            let tx = c.transaction()?;
            tx.execute("INSERT OR REPLACE INTO step_metrics (job_id, step, metrics) VALUES (?1, ?2, ?3)", params![id, step as i64, m])?;
            tx.execute("UPDATE jobs SET step = MAX(step, ?1), metrics = ?2, updated_at_ms = ?3 WHERE id = ?4", params![step as i64, m, now_ms(), id])?;
            tx.commit()?;
            Ok(())
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

    pub fn get(&self, id: &str) -> Result<Option<JobRecord>, StoreError> {
        self.with(|c| {
            let row = c
                .query_row("SELECT id, name, state, step, steps, metrics, error, created_at_ms, updated_at_ms FROM jobs WHERE id = ?1", [id], row_to_job)
                .optional()?;
            row.map(finish_job).transpose()
        })
    }

    pub fn list(&self) -> Result<Vec<JobRecord>, StoreError> {
        self.with(|c| {
            let mut st = c.prepare("SELECT id, name, state, step, steps, metrics, error, created_at_ms, updated_at_ms FROM jobs ORDER BY seq")?;
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

    /// Appends a trajectory durably; returns its cursor. A trajectory id seen before for the
    /// job returns the cursor it already has (idempotent: never stored twice).
    pub fn append_trajectory(&self, job: &str, traj: &Trajectory) -> Result<i64, StoreError> {
        let body = serde_json::to_string(traj)?;
        self.with(|c| {
            let n = c.execute(
                "INSERT OR IGNORE INTO trajectories (job_id, traj_id, body) VALUES (?1, ?2, ?3)",
                params![job, traj.id, body],
            )?;
            if n == 1 {
                Ok(c.last_insert_rowid())
            } else {
                Ok(c.query_row(
                    "SELECT seq FROM trajectories WHERE job_id = ?1 AND traj_id = ?2",
                    params![job, traj.id],
                    |r| r.get(0),
                )?)
            }
        })
    }

    /// Trajectories of `job` after `cursor` in durable order.
    pub fn trajectories(
        &self,
        job: &str,
        after: i64,
        limit: usize,
    ) -> Result<Vec<TrajectoryRow>, StoreError> {
        self.with(|c| {
            let mut st = c.prepare("SELECT seq, body FROM trajectories WHERE job_id = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3")?;
            let rows =
                st.query_map(params![job, after, limit as i64], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))?.collect::<Result<Vec<_>, _>>()?;
            rows.into_iter().map(|(cursor, body)| Ok(TrajectoryRow { cursor, job_id: job.to_string(), trajectory: serde_json::from_str(&body)? })).collect()
        })
    }

    pub fn trajectory_count(&self, job: &str) -> Result<u64, StoreError> {
        self.with(|c| {
            Ok(c.query_row(
                "SELECT COUNT(*) FROM trajectories WHERE job_id = ?1",
                [job],
                |r| r.get::<_, i64>(0),
            )? as u64)
        })
    }

    /// The largest group id among a job's stored trajectories (every attempt's).
    pub fn max_group_id(&self, job: &str) -> Result<Option<u64>, StoreError> {
        self.with(|c| {
            Ok(c.query_row(
                "SELECT MAX(CAST(json_extract(body, '$.group_id') AS INTEGER)) FROM trajectories WHERE job_id = ?1",
                [job],
                |r| r.get::<_, Option<i64>>(0),
            )?
            .map(|g| g.max(0) as u64))
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
    ))
}

fn finish_job(
    (id, name, state, step, steps, metrics, error, created_at_ms, updated_at_ms): RawJob,
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
    })
}

/// The trajectory sink of one job: commits into the store before acknowledging.
pub struct JobSink {
    pub store: Store,
    pub job: String,
}

impl TrajectorySink for JobSink {
    fn commit(&self, traj: &Trajectory) -> Result<u64, SinkError> {
        self.store
            .append_trajectory(&self.job, traj)
            .map(|s| s as u64)
            .map_err(|e| SinkError {
                id: traj.id.clone(),
                message: e.to_string(),
            })
    }
}
