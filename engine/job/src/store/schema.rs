//! The store's SQL schema, and the migrations that bring a store written by an earlier
//! version up to it.

use rusqlite::Connection;

use super::StoreError;

/// Every table and index of the store (created if missing).
pub(super) const SCHEMA: &str = "
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
  updated_at_ms INTEGER NOT NULL,
  owner TEXT
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
CREATE TABLE IF NOT EXISTS attempts (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  job_id TEXT NOT NULL,
  started_at_ms INTEGER NOT NULL,
  ended_at_ms INTEGER,
  outcome TEXT,
  start_step INTEGER,
  boot INTEGER,
  start_seq INTEGER
);
CREATE INDEX IF NOT EXISTS attempts_job ON attempts (job_id, seq);
CREATE TABLE IF NOT EXISTS batches (
  job_id TEXT NOT NULL,
  step INTEGER NOT NULL,
  body TEXT NOT NULL,
  state TEXT NOT NULL,
  offer INTEGER NOT NULL DEFAULT 0,
  lease_until_ms INTEGER,
  stats TEXT,
  PRIMARY KEY (job_id, step)
);
CREATE TABLE IF NOT EXISTS announced_weights (
  job_id TEXT NOT NULL,
  version INTEGER NOT NULL,
  uri TEXT NOT NULL,
  format TEXT NOT NULL,
  at_ms INTEGER NOT NULL,
  identity TEXT,
  PRIMARY KEY (job_id, version)
);
";

/// Brings a store written by an earlier version up to the current schema.
pub(super) fn migrate(conn: &Connection) -> Result<(), StoreError> {
    let has_trained: bool = conn.query_row(
        "SELECT COUNT(*) FROM pragma_table_info('trajectories') WHERE name = 'trained_step'",
        [],
        |r| r.get::<_, i64>(0),
    )? > 0;
    if !has_trained {
        conn.execute_batch("ALTER TABLE trajectories ADD COLUMN trained_step INTEGER")?;
    }
    let has_owner: bool = conn.query_row(
        "SELECT COUNT(*) FROM pragma_table_info('jobs') WHERE name = 'owner'",
        [],
        |r| r.get::<_, i64>(0),
    )? > 0;
    if !has_owner {
        conn.execute_batch("ALTER TABLE jobs ADD COLUMN owner TEXT")?;
    }
    let has_start_step: bool = conn.query_row(
        "SELECT COUNT(*) FROM pragma_table_info('attempts') WHERE name = 'start_step'",
        [],
        |r| r.get::<_, i64>(0),
    )? > 0;
    if !has_start_step {
        conn.execute_batch("ALTER TABLE attempts ADD COLUMN start_step INTEGER")?;
    }
    for (col, ty) in [("boot", "INTEGER"), ("start_seq", "INTEGER")] {
        let has: bool = conn.query_row(
            "SELECT COUNT(*) FROM pragma_table_info('attempts') WHERE name = ?1",
            [col],
            |r| r.get::<_, i64>(0),
        )? > 0;
        if !has {
            conn.execute_batch(&format!("ALTER TABLE attempts ADD COLUMN {col} {ty}"))?;
        }
    }
    let has_identity: bool = conn.query_row(
        "SELECT COUNT(*) FROM pragma_table_info('announced_weights') WHERE name = 'identity'",
        [],
        |r| r.get::<_, i64>(0),
    )? > 0;
    if !has_identity {
        conn.execute_batch("ALTER TABLE announced_weights ADD COLUMN identity TEXT")?;
    }
    let has_submitted: bool = conn.query_row(
        "SELECT COUNT(*) FROM pragma_table_info('jobs') WHERE name = 'submitted'",
        [],
        |r| r.get::<_, i64>(0),
    )? > 0;
    if !has_submitted {
        // The spec as the client sent it: `{"format": "toml" | "json", "text": …}`.
        conn.execute_batch("ALTER TABLE jobs ADD COLUMN submitted TEXT")?;
    }
    Ok(())
}
