//! A job's stored trajectories, paged by cursor, as NDJSON.

use std::sync::Arc;

use axum::extract::{Extension, Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use utoipa::IntoParams;

use super::{ApiError, ErrorBody, page_limit, visible_job};
use crate::access::Principal;
use crate::service::Service;
use job::spec::FieldError;
use job::store::{RowFilter, TrainedFilter, TrajectoryRow};

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PageQuery {
    /// Cursor of the last trajectory already seen (0 = from the start).
    pub after: Option<i64>,
    /// Page size, 1..=1000 (default 100).
    pub limit: Option<usize>,
    /// `true`: only rows a training step consumed; `false`: only rows none consumed.
    pub trained: Option<bool>,
    /// `true`: add each turn's observation and response as text (`text`), decoded by the
    /// job's tokenizer (400 for a job on simulated pools).
    pub text: Option<bool>,
    /// `true`: `text` (implied) also gives each response token decoded alone
    /// (`response_pieces`), for a per-token view.
    pub pieces: Option<bool>,
    /// `true`: the newest `limit` rows after `after` instead of the oldest (still in cursor
    /// order), e.g. for a viewer that opens on the latest trajectories.
    pub newest: Option<bool>,
    /// Only this task's trajectories.
    pub task: Option<String>,
    /// Only those that succeeded (`true`) or did not (`false`).
    pub success: Option<bool>,
    /// Only those whose reward is at least this (masked rows have none and never match).
    pub min_reward: Option<f64>,
    /// Only those whose reward is at most this.
    pub max_reward: Option<f64>,
    /// Only those that started from this policy version.
    pub version: Option<u64>,
    /// Only this group's members.
    pub group: Option<u64>,
}

/// Trajectories after a cursor, as NDJSON in durable order.
#[utoipa::path(get, path = "/v1/jobs/{id}/trajectories", params(("id" = String, Path, description = "job id"), PageQuery), responses((status = 200, description = "one TrajectoryRow per line (NDJSON)", content_type = "application/x-ndjson", body = TrajectoryRow), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn trajectories(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
    q: Result<Query<PageQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = q.map_err(super::query_error)?;
    let limit = page_limit(q.limit)?;
    let after = q.after.unwrap_or(0);
    if after < 0 {
        return Err(ApiError {
            fields: vec![FieldError {
                field: "after".into(),
                message: "must be >= 0".into(),
            }],
            ..ApiError::new(StatusCode::BAD_REQUEST, "bad_request", "negative cursor")
        });
    }
    visible_job(&s, &p, &id)?;
    let trained = match q.trained {
        None => TrainedFilter::All,
        Some(true) => TrainedFilter::Trained,
        Some(false) => TrainedFilter::Untrained,
    };
    for (field, v) in [("min_reward", q.min_reward), ("max_reward", q.max_reward)] {
        if v.is_some_and(|x| !x.is_finite()) {
            return Err(ApiError {
                fields: vec![FieldError {
                    field: field.into(),
                    message: "must be a finite number".into(),
                }],
                ..ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "bad_request",
                    "not a finite number",
                )
            });
        }
    }
    let filter = RowFilter {
        trained,
        task: q.task.clone(),
        success: q.success,
        min_reward: q.min_reward,
        max_reward: q.max_reward,
        version: q.version,
        group: q.group,
    };
    let mut rows =
        s.store
            .trajectories_where(&id, after, limit, &filter, q.newest == Some(true))?;
    let pieces = q.pieces == Some(true);
    if q.text == Some(true) || pieces {
        let svc = s.clone();
        let job = id.clone();
        let tok = tokio::task::spawn_blocking(move || svc.tokenizer(&job))
            .await
            .map_err(|e| ApiError::internal(&e))??;
        for r in &mut rows {
            r.text = Some(tok.turns_with(&r.trajectory, pieces));
        }
    }
    let mut out = String::new();
    for r in &rows {
        out.push_str(&serde_json::to_string(r).unwrap_or_default());
        out.push('\n');
    }
    let next = rows.last().map_or(after, |r| r.cursor);
    Ok((
        [
            (header::CONTENT_TYPE, "application/x-ndjson".to_string()),
            (
                header::HeaderName::from_static("x-next-cursor"),
                next.to_string(),
            ),
        ],
        out,
    )
        .into_response())
}

/// A group of a job: its members and the advantage each gets.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub(super) struct GroupView {
    pub job_id: String,
    pub group_id: u64,
    pub task: String,
    /// The job's advantage estimator (`grpo`, `dr_grpo`, `rloo`), as its trainer computes
    /// them (a simulated trainer stands for GRPO); `null` when an external trainer's batches
    /// carry none (`advantage = "none"`).
    pub estimator: Option<String>,
    /// Mean and sample standard deviation of the rewards of the unmasked members.
    pub reward_mean: Option<f64>,
    pub reward_std: Option<f64>,
    pub members: Vec<GroupMember>,
}

/// One member of a group.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub(super) struct GroupMember {
    pub cursor: i64,
    pub trajectory_id: String,
    pub reward: Option<f64>,
    pub success: bool,
    /// Its advantage among the members without a failure (masked members have none), by the
    /// trainer's own formula ([`actors::rl::advantages`]). Shown for every stored group,
    /// also one the trainer left out (too few valid members, all rewards equal, stale).
    pub advantage: Option<f64>,
    /// Why it was masked (no reward, no advantage).
    pub failure: Option<String>,
    pub trained_step: Option<u64>,
    pub response_tokens: usize,
    pub final_text: String,
}

/// A group's members (every attempt's rows of it) with their rewards and advantages: why do
/// these differ?
#[utoipa::path(get, path = "/v1/jobs/{id}/groups/{group}", params(("id" = String, Path, description = "job id"), ("group" = u64, Path, description = "group id")), responses((status = 200, body = GroupView), (status = 400, description = "a group id that is not a number", body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn group(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    path: Result<Path<(String, u64)>, axum::extract::rejection::PathRejection>,
) -> Result<axum::Json<GroupView>, ApiError> {
    let Path((id, group)) = path.map_err(|e| ApiError {
        fields: vec![FieldError {
            field: "group".into(),
            message: "must be a group id (a non-negative integer)".into(),
        }],
        ..ApiError::new(StatusCode::BAD_REQUEST, "bad_request", e.body_text())
    })?;
    visible_job(&s, &p, &id)?;
    let filter = RowFilter {
        group: Some(group),
        ..RowFilter::default()
    };
    let rows = s
        .store
        .trajectories_where(&id, 0, super::MAX_PAGE, &filter, false)?;
    if rows.is_empty() {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("{id} has no stored trajectory of group {group}"),
        ));
    }
    let spec = s.store.spec(&id)?;
    let kind = spec.as_ref().and_then(job::wiring::advantage_kind);
    let members: Vec<(TrajectoryRow, actors::types::Trajectory)> = rows
        .into_iter()
        .filter_map(|r| {
            let t = serde_json::from_value(r.trajectory.clone()).ok()?;
            Some((r, t))
        })
        .collect();
    // As the trainer does: a member with a failure is masked; the others count with their
    // reward (0 where none was given).
    let rewards: Vec<f64> = members
        .iter()
        .filter(|(_, t)| t.failure.is_none())
        .map(|(_, t)| t.reward.unwrap_or(0.0))
        .collect();
    let advantages = kind.map(|k| actors::rl::advantages(k, &rewards));
    let n = rewards.len() as f64;
    let mean = (n > 0.0).then(|| rewards.iter().sum::<f64>() / n);
    let std = mean
        .filter(|_| n > 1.0)
        .map(|m| (rewards.iter().map(|r| (r - m) * (r - m)).sum::<f64>() / (n - 1.0)).sqrt());
    let mut next = 0;
    let Some(task) = members.first().map(|(_, t)| t.task.clone()) else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("{id} has no readable trajectory of group {group}"),
        ));
    };
    let members = members
        .into_iter()
        .map(|(r, t)| {
            let advantage = t.failure.is_none().then(|| {
                let a = advantages.as_ref().and_then(|a| a.get(next).copied());
                next += 1;
                a
            });
            let advantage = advantage.flatten();
            GroupMember {
                cursor: r.cursor,
                trajectory_id: t.id.clone(),
                reward: t.reward,
                success: t.success,
                advantage,
                failure: t.failure.as_ref().map(|f| f.to_string()),
                trained_step: r.trained_step,
                response_tokens: t.response_tokens(),
                final_text: t.final_text.clone(),
            }
        })
        .collect();
    Ok(axum::Json(GroupView {
        job_id: id,
        group_id: group,
        task,
        estimator: kind.map(|k| format!("{k:?}").to_lowercase().replace("drgrpo", "dr_grpo")),
        reward_mean: mean,
        reward_std: std,
        members,
    }))
}
