//! External agent episodes: a harness claims an admitted episode of a job with agent tasks
//! (`mode = "external"`), points its agent at the gateway with the episode's key, and
//! finishes it. See `job::agents::claims`.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::{Extension, Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::{ApiError, require, visible_job};
use crate::access::{Principal, Role};
use crate::service::Service;
use job::agents::{Claim, FinishReport, FinishStatus};
use job::spec::{AgentMode, EnvSpec, FieldError};

/// The longest a claim waits for an episode.
pub(super) const MAX_WAIT_S: f64 = 60.0;

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct ClaimQuery {
    /// Seconds to wait for an episode when none is offered (0..=60, default 0).
    pub wait_s: Option<f64>,
}

/// A finished episode.
#[derive(Debug, Serialize, ToSchema)]
pub(super) struct Finished {
    pub episode_id: u64,
    pub status: FinishStatus,
}

fn bad_field(field: &str, message: String) -> ApiError {
    ApiError {
        fields: vec![FieldError {
            field: field.into(),
            message: message.clone(),
        }],
        ..ApiError::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }
}

/// The gateway's base URL as the caller reached this service (its `Host`).
fn base_url(headers: &HeaderMap) -> String {
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .filter(|h| !h.is_empty() && h.chars().all(|c| c.is_ascii_graphic()))
        .unwrap_or("127.0.0.1");
    format!("http://{host}/gateway/v1")
}

/// Claims the oldest episode the job offers to external harnesses, waiting up to `wait_s` for
/// one: 200 with the claim, 204 when none is offered in time. Finish it before its deadline.
#[utoipa::path(post, path = "/v1/jobs/{id}/episodes:claim", params(("id" = String, Path, description = "job id"), ClaimQuery), responses((status = 200, body = Claim), (status = 204, description = "no episode within wait_s"), (status = 400, body = super::ErrorBody), (status = 403, body = super::ErrorBody), (status = 404, body = super::ErrorBody), (status = 409, description = "the job has no external agent task", body = super::ErrorBody)))]
pub(super) async fn claim(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    headers: HeaderMap,
    Path(id): Path<String>,
    q: Result<Query<ClaimQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = q.map_err(super::query_error)?;
    let wait = q.wait_s.unwrap_or(0.0);
    if !(wait.is_finite() && (0.0..=MAX_WAIT_S).contains(&wait)) {
        return Err(bad_field(
            "wait_s",
            format!("wait_s {wait} is not in 0..={MAX_WAIT_S} seconds"),
        ));
    }
    visible_job(&s, &p, &id)?;
    require(&p, Role::Submit)?;
    let external = s.store.spec(&id)?.is_some_and(|spec| {
        spec.tasks
            .iter()
            .any(|t| matches!(&t.env, EnvSpec::Agent(a) if a.mode == AgentMode::External))
    });
    if !external {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "not_an_external_agent_job",
            format!("job {id} has no task with env.kind = \"agent\" and mode = \"external\""),
        ));
    }
    let claims = &s.agents.claims;
    match claims
        .claim(&id, Duration::from_secs_f64(wait), &base_url(&headers))
        .await
    {
        Some(c) => Ok(Json(c).into_response()),
        None => Ok(StatusCode::NO_CONTENT.into_response()),
    }
}

/// Ends a claimed episode: `completed` (its answer is scored) or `failed` with a reason
/// (masked, never rewarded).
#[utoipa::path(post, path = "/v1/episodes/{id}/finish", params(("id" = u64, Path, description = "the claim's episode_id")), request_body = FinishReport, responses((status = 200, body = Finished), (status = 400, body = super::ErrorBody), (status = 403, body = super::ErrorBody), (status = 404, description = "no open claim with this id (finished, expired or never claimed)", body = super::ErrorBody)))]
pub(super) async fn finish(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
    body: Result<Json<FinishReport>, axum::extract::rejection::JsonRejection>,
) -> Result<Response, ApiError> {
    let episode: u64 = id
        .parse()
        .map_err(|_| bad_field("id", format!("{id:?} is not an episode id (a number)")))?;
    let Json(report) =
        body.map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", e.body_text()))?;
    if let Some(r) = report.reward
        && !r.is_finite()
    {
        return Err(bad_field("reward", format!("{r} is not a finite number")));
    }
    let unknown = || {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no open claim {episode} (never claimed, already finished, or expired)"),
        )
    };
    let claims = &s.agents.claims;
    let job = claims.job_of(episode).ok_or_else(unknown)?;
    // Another owner's episode is as unknown as a missing one.
    visible_job(&s, &p, &job).map_err(|_| unknown())?;
    require(&p, Role::Submit)?;
    let status = report.status;
    claims.finish(episode, report).map_err(|_| unknown())?;
    Ok(Json(Finished {
        episode_id: episode,
        status,
    })
    .into_response())
}
