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
    let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    if version < 1 {
        conn.execute_batch(STEPS_FROM_ONE)?;
    }
    Ok(())
}

/// Version 1: steps count from 1 wherever they are stored, as everywhere they are shown.
/// Earlier stores kept 0-based steps in each step record's `metrics.step` (its row key was
/// already 1-based), in a job's latest `metrics.step`, and in the trainer API's batch rows
/// (key and body). The batch keys move up in two passes: no key is taken twice on the way.
const STEPS_FROM_ONE: &str = "
BEGIN;
UPDATE step_metrics SET metrics = json_set(metrics, '$.step', step) WHERE json_valid(metrics);
UPDATE jobs SET metrics = json_set(metrics, '$.step', json_extract(metrics, '$.step') + 1)
  WHERE json_valid(metrics) AND json_type(metrics, '$.step') = 'integer';
UPDATE batches SET step = -(step + 1);
UPDATE batches SET step = -step,
  body = CASE WHEN json_valid(body) THEN json_set(body, '$.step', -step) ELSE body END;
PRAGMA user_version = 1;
COMMIT;
";

#[cfg(test)]
mod tests {
    /// A store written before steps counted from 1 is brought up to it once: step records,
    /// the job's latest metrics and the batch rows; opening it again changes nothing.
    #[test]
    fn a_store_with_steps_from_zero_is_migrated_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rollarc.db");
        {
            let c = rusqlite::Connection::open(&path).unwrap();
            c.execute_batch(super::SCHEMA).unwrap();
            c.execute_batch(
                "INSERT INTO jobs (id, spec, state, step, steps, metrics, created_at_ms, updated_at_ms)
                   VALUES ('job-1', '{}', 'running', 2, 4, '{\"step\": 1, \"loss\": 0.5}', 0, 0);
                 INSERT INTO step_metrics VALUES ('job-1', 1, '{\"step\": 0}'), ('job-1', 2, '{\"step\": 1}');
                 INSERT INTO batches (job_id, step, body, state) VALUES
                   ('job-1', 0, '{\"step\": 0, \"groups\": []}', 'acked'),
                   ('job-1', 1, '{\"step\": 1, \"groups\": []}', 'acked'),
                   ('job-1', 2, '{\"step\": 2, \"groups\": []}', 'ready');",
            )
            .unwrap();
        }
        for _ in 0..2 {
            let s = crate::store::Store::open(&path).unwrap();
            let steps = s.step_metrics("job-1").unwrap();
            assert_eq!(
                steps.iter().map(|m| m["step"].as_u64()).collect::<Vec<_>>(),
                [Some(1), Some(2)]
            );
            let j = s.get("job-1").unwrap().unwrap();
            assert_eq!(
                (j.metrics["step"].as_u64(), j.metrics["loss"].as_f64()),
                (Some(2), Some(0.5))
            );
            drop(s);
            let c = rusqlite::Connection::open(&path).unwrap();
            let rows: Vec<(i64, String)> = c
                .prepare("SELECT step, body FROM batches ORDER BY step")
                .unwrap()
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap();
            assert_eq!(rows.iter().map(|r| r.0).collect::<Vec<_>>(), [1, 2, 3]);
            for (step, body) in &rows {
                let v: serde_json::Value = serde_json::from_str(body).unwrap();
                assert_eq!(v["step"].as_i64(), Some(*step));
            }
        }
    }
}
