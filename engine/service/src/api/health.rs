//! Liveness, readiness and the Prometheus metrics.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Extension, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use super::ApiError;
use crate::access::{Access, Principal, Role};
use crate::service::Service;

#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    pub status: &'static str,
}

/// Liveness.
#[utoipa::path(get, path = "/healthz", responses((status = 200, body = Health)))]
pub(super) async fn healthz() -> Json<Health> {
    Json(Health { status: "ok" })
}

/// Readiness: 503 once shutdown began.
#[utoipa::path(get, path = "/readyz", responses((status = 200, body = Health), (status = 503, body = Health)))]
pub(super) async fn readyz(State(s): State<Arc<Service>>) -> (StatusCode, Json<Health>) {
    if s.intake.is_cancelled() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(Health {
                status: "shutting_down",
            }),
        )
    } else {
        (StatusCode::OK, Json(Health { status: "ready" }))
    }
}

/// Prometheus text exposition, fed from the OpenTelemetry metrics pipeline.
#[utoipa::path(get, path = "/metrics", responses((status = 200, description = "Prometheus text format"), (status = 403, description = "with tokens and `metrics = \"token\"`: not an admin token (the series name every owner's jobs)", body = super::ErrorBody)))]
pub(super) async fn metrics(
    Extension(access): Extension<Arc<Access>>,
    principal: Option<Extension<Principal>>,
) -> Result<Response, ApiError> {
    // The series name every owner's jobs: with tokens, only an admin (or a scraper, when the
    // config opens `/metrics` on a private network) reads them.
    if !access.metrics_open() {
        match principal {
            Some(Extension(p)) => super::require(&p, Role::Admin)?,
            None => {
                return Err(ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "unauthorized",
                    "missing bearer token",
                ));
            }
        }
    }
    let text = infra::telemetry::Metrics::global()
        .render()
        .map_err(|e| ApiError::internal(&e))?;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}
