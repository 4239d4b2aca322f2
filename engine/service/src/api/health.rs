//! Liveness, readiness and the Prometheus metrics.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use super::ApiError;
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
#[utoipa::path(get, path = "/metrics", responses((status = 200, description = "Prometheus text format")))]
pub(super) async fn metrics() -> Result<Response, ApiError> {
    let text = infra::telemetry::Metrics::global()
        .render()
        .map_err(|e| ApiError::internal(&e))?;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}
