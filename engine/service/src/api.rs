//! HTTP API v1 (axum). Errors are JSON `{"error": {"code", "message", "fields"}}` with a stable
//! machine `code`; request bodies are limited to [`MAX_BODY_BYTES`].

use std::sync::Arc;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Extension, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::access::{Access, Denied, Principal, Role};
use crate::service::{Service, ServiceError};
use job::spec::FieldError;
use job::store::JobRecord;

mod cluster;
mod episodes;
mod error;
mod events;
mod health;
mod jobs;
mod openapi;
mod trainer;
mod trajectories;

pub use cluster::{Cluster, ClusterJob, ClusterPool, DeviceView, EnvView};
pub use error::{ApiError, ErrorBody, ErrorDetail};
pub use health::Health;
pub use jobs::{Baselines, CancelAnswer, CancelInfo, Created, JobList, StepPage, StepRecord};
pub use openapi::{ApiDoc, openapi_document};
pub use trainer::MSGPACK;
pub use trajectories::PageQuery;

/// Largest accepted request body.
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// Largest page of trajectories.
pub const MAX_PAGE: usize = 1000;

/// The API without access control (every caller is the local admin).
pub fn router(service: Arc<Service>) -> Router {
    router_with(service, Arc::new(Access::open()))
}

/// The API behind `access`: every route but `/healthz`, `/readyz`, `/openapi.json` (and
/// `/metrics` when configured open) needs a token, and each request counts against its
/// token's rate limit.
pub fn router_with(service: Arc<Service>, access: Arc<Access>) -> Router {
    Router::new()
        .route("/v1/jobs", post(jobs::submit).get(jobs::list_jobs))
        .route("/v1/jobs/{id}", get(jobs::get_job))
        .route("/v1/jobs/{id}/spec", get(jobs::get_job_spec))
        .route("/v1/jobs/{id}/steps", get(jobs::job_steps))
        .route("/v1/jobs/{id}/baselines", get(jobs::job_baselines))
        .route("/v1/jobs/{id}/cancel", post(jobs::cancel_job))
        .route("/v1/jobs/{id}/events", get(events::job_events))
        .route(
            "/v1/jobs/{id}/trajectories",
            get(trajectories::trajectories),
        )
        .route("/v1/jobs/{id}/groups/{group}", get(trajectories::group))
        .route("/v1/jobs/{id}/batches/next", get(trainer::next_batch))
        .route("/v1/jobs/{id}/staleness", get(trainer::staleness))
        .route("/v1/jobs/{id}/weights", post(trainer::announce_weights))
        .route("/v1/jobs/{id}/episodes:claim", post(episodes::claim))
        .route("/v1/episodes/{id}/finish", post(episodes::finish))
        .route("/v1/batches/{batch_id}/ack", post(trainer::ack_batch))
        .route("/v1/batches/{batch_id}/nack", post(trainer::nack_batch))
        .route("/v1/cluster", get(cluster::cluster))
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(health::metrics))
        .route("/openapi.json", get(openapi::openapi))
        .route("/", get(crate::ui::index))
        .route("/ui/app.js", get(crate::ui::script))
        .route("/ui/app.css", get(crate::ui::style))
        .merge(gateway::http::router(
            service.gateway.clone(),
            gateway::http::DEFAULT_BODY_CAP,
        ))
        .fallback(no_route)
        .method_not_allowed_fallback(no_method)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(
            access.clone(),
            authorize,
        ))
        .layer(Extension(access))
        .with_state(service)
}

/// Routes anyone may call (the agent gateway's routes check their episode keys themselves).
fn is_open(path: &str, access: &Access) -> bool {
    matches!(path, "/healthz" | "/readyz" | "/openapi.json")
        || path.starts_with("/gateway/")
        || crate::ui::PATHS.contains(&path)
        || (path == "/metrics" && access.metrics_open())
}

/// Authenticates the caller (401 without a valid token, 429 over its rate) and hands the
/// handlers its [`Principal`].
async fn authorize(
    State(access): State<Arc<Access>>,
    mut req: Request,
    next: axum::middleware::Next,
) -> Response {
    if is_open(req.uri().path(), &access) {
        return next.run(req).await;
    }
    let auth = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let client = req
        .extensions()
        .get::<crate::access::ClientAddr>()
        .map(|c| c.0);
    match access.authenticate_from(auth, client) {
        Ok(p) => {
            req.extensions_mut().insert(p);
            next.run(req).await
        }
        Err(Denied::Unauthenticated(why)) => {
            ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", why).into_response()
        }
        Err(Denied::RateLimited { retry_after_s }) => {
            let mut r = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limited",
                format!(
                    "too many requests for this token (or, without a valid token, from this \
                     address); retry in {retry_after_s} s"
                ),
            )
            .into_response();
            r.headers_mut()
                .insert(header::RETRY_AFTER, retry_after_s.into());
            r
        }
    }
}

/// 403 unless the caller has at least `role`.
fn require(p: &Principal, role: Role) -> Result<(), ApiError> {
    if p.role >= role {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!(
                "this token's role ({:?}) may not do this; it needs {role:?}",
                p.role
            )
            .to_lowercase(),
        ))
    }
}

/// The job `id` if the caller may see it; another owner's job is as absent as a missing one
/// (404: ids of other owners are not revealed).
fn visible_job(s: &Service, p: &Principal, id: &str) -> Result<JobRecord, ApiError> {
    match s.store.get(id)? {
        Some(j) if p.owns(j.owner.as_deref()) => Ok(j),
        _ => Err(ServiceError::NotFound(id.to_string()).into()),
    }
}

/// A page size (`limit`, default 100) within 1..=`MAX_PAGE`.
fn page_limit(limit: Option<usize>) -> Result<usize, ApiError> {
    let limit = limit.unwrap_or(100);
    if (1..=MAX_PAGE).contains(&limit) {
        return Ok(limit);
    }
    Err(ApiError {
        fields: vec![FieldError {
            field: "limit".into(),
            message: format!("must be in 1..={MAX_PAGE}"),
        }],
        ..ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("limit {limit} out of range"),
        )
    })
}

/// The answer to a path no route serves.
async fn no_route(uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no route for {}", uri.path()),
    )
}

/// The answer to a method the path does not serve.
async fn no_method(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{method} is not allowed on {}", uri.path()),
    )
}

/// A query string that does not parse: 400 naming the parameter where the parser says which
/// (`min_reward: invalid float literal` → field `min_reward`).
pub(super) fn query_error(e: axum::extract::rejection::QueryRejection) -> ApiError {
    let text = e.body_text();
    let detail = text
        .split_once("query string: ")
        .map_or(text.as_str(), |(_, d)| d);
    let field = detail
        .split_once(": ")
        .map(|(f, m)| (f.trim(), m.trim()))
        .filter(|(f, _)| !f.is_empty() && f.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
    ApiError {
        fields: field
            .map(|(f, m)| FieldError {
                field: f.to_string(),
                message: m.to_string(),
            })
            .into_iter()
            .collect(),
        ..ApiError::new(StatusCode::BAD_REQUEST, "bad_request", text)
    }
}
