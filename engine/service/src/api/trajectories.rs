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
use job::store::{TrainedFilter, TrajectoryRow};

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
    /// `true`: the newest `limit` rows after `after` instead of the oldest (still in cursor
    /// order), e.g. for a viewer that opens on the latest trajectories.
    pub newest: Option<bool>,
}

/// Trajectories after a cursor, as NDJSON in durable order.
#[utoipa::path(get, path = "/v1/jobs/{id}/trajectories", params(("id" = String, Path, description = "job id"), PageQuery), responses((status = 200, description = "one TrajectoryRow per line (NDJSON)", content_type = "application/x-ndjson", body = TrajectoryRow), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn trajectories(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
    q: Result<Query<PageQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) =
        q.map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", e.body_text()))?;
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
    let filter = match q.trained {
        None => TrainedFilter::All,
        Some(true) => TrainedFilter::Trained,
        Some(false) => TrainedFilter::Untrained,
    };
    let mut rows = s
        .store
        .trajectories(&id, after, limit, filter, q.newest == Some(true))?;
    if q.text == Some(true) {
        let svc = s.clone();
        let job = id.clone();
        let tok = tokio::task::spawn_blocking(move || svc.tokenizer(&job))
            .await
            .map_err(|e| ApiError::internal(&e))??;
        for r in &mut rows {
            r.text = Some(tok.turns(&r.trajectory));
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
