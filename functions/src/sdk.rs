//! Serve a scorer as an HTTP function under the Knative runtime contract: listen on `$PORT`,
//! answer readiness on `GET /healthz`, keep no state between requests, limit request bodies,
//! answer errors as JSON, and on SIGTERM stop accepting and finish in-flight requests.

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::protocol::{PROTOCOL_VERSION, ScoreRequest, ScoreResponse};
use crate::scorer::Scorer;

/// Largest accepted request body.
pub const MAX_REQUEST_BYTES: usize = 8 << 20;

struct FnError(StatusCode, &'static str, String);

impl IntoResponse for FnError {
    fn into_response(self) -> Response {
        let mut r = (
            self.0,
            Json(serde_json::json!({ "error": { "code": self.1, "message": self.2 } })),
        )
            .into_response();
        if self.0 == StatusCode::PAYLOAD_TOO_LARGE {
            // The unread body makes the connection unusable: tell the client not to pool it.
            r.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        r
    }
}

/// The function's routes: `POST /` (and `POST /v1/score`) score, `GET /healthz` readiness.
pub fn router(scorer: Arc<dyn Scorer>) -> Router {
    Router::new()
        .route("/", post(score))
        .route("/v1/score", post(score))
        .route("/healthz", get(healthz))
        .layer(DefaultBodyLimit::max(MAX_REQUEST_BYTES))
        .with_state(scorer)
}

async fn healthz(State(s): State<Arc<dyn Scorer>>) -> Json<serde_json::Value> {
    Json(serde_json::json!({ "status": "ok", "function": s.name(), "protocol": PROTOCOL_VERSION }))
}

async fn score(
    State(s): State<Arc<dyn Scorer>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<ScoreResponse>, FnError> {
    let body = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            FnError(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                format!("request body exceeds {MAX_REQUEST_BYTES} bytes"),
            )
        } else {
            FnError(StatusCode::BAD_REQUEST, "bad_request", e.body_text())
        }
    })?;
    let req: ScoreRequest = serde_json::from_slice(&body).map_err(|e| {
        FnError(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("not a scoring request: {e}"),
        )
    })?;
    if req.protocol != PROTOCOL_VERSION {
        return Err(FnError(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("protocol {:?} is not {PROTOCOL_VERSION}", req.protocol),
        ));
    }
    if req.items.is_empty() {
        return Err(FnError(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "no items to score".into(),
        ));
    }
    let scores = s.score(&req).await.map_err(|e| {
        if e.is_bad_request() {
            FnError(StatusCode::BAD_REQUEST, "bad_request", e.message())
        } else {
            FnError(
                StatusCode::INTERNAL_SERVER_ERROR,
                "scorer_failed",
                e.message(),
            )
        }
    })?;
    let resp = ScoreResponse {
        protocol: PROTOCOL_VERSION.into(),
        scores,
    };
    // A scorer must never emit NaN, infinities or foreign ids.
    resp.validate(&req, f64::MIN, f64::MAX).map_err(|e| {
        FnError(
            StatusCode::INTERNAL_SERVER_ERROR,
            "scorer_failed",
            e.to_string(),
        )
    })?;
    Ok(Json(resp))
}

/// Serves until `shutdown` resolves, then finishes in-flight requests.
pub async fn serve(
    scorer: Arc<dyn Scorer>,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(scorer))
        .with_graceful_shutdown(shutdown)
        .await
}
