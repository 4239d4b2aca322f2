//! The API's error answer: the JSON body `{"error": {"code", "message", "fields"}}` with a
//! stable machine `code`, and how service and store errors map onto it.

use axum::Json;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::service::ServiceError;
use job::spec::FieldError;

/// The error body.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// Stable machine code: `invalid_spec`, `not_found`, `method_not_allowed`,
    /// `body_too_large`, `bad_request`, `unauthorized`, `forbidden`, `rate_limited`,
    /// `over_memory_budget`, `conflict`, `unsupported_media_type`, `shutting_down`,
    /// `internal`.
    pub code: &'static str,
    pub message: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub fields: Vec<FieldError>,
}

/// A failed request: its status, the error body, and the inner cause that is only logged.
#[derive(Debug)]
pub struct ApiError {
    pub(super) status: StatusCode,
    pub(super) code: &'static str,
    pub(super) message: String,
    pub(super) fields: Vec<FieldError>,
    /// What went wrong inside (logged once, at the response; never sent to the client).
    pub(super) cause: Option<String>,
}

impl ApiError {
    /// An error answer with no field errors.
    pub(super) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            fields: Vec::new(),
            cause: None,
        }
    }

    /// An internal error: the client gets a generic 500, the log gets the whole chain.
    pub(super) fn internal(cause: &dyn std::error::Error) -> Self {
        Self {
            cause: Some(infra::error_chain(cause)),
            ..Self::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "internal error",
            )
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            let error = self.cause.as_deref().unwrap_or(&self.message);
            tracing::error!(code = self.code, error, "request failed");
        }
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code,
                message: self.message,
                fields: self.fields,
            },
        };
        let mut r = (self.status, Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer realm=\"rollarc\""),
            );
        }
        if self.status == StatusCode::PAYLOAD_TOO_LARGE {
            // The unread body makes the connection unusable: tell the client not to pool it.
            r.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        r
    }
}

impl From<ServiceError> for ApiError {
    fn from(e: ServiceError) -> Self {
        match e {
            ServiceError::NotFound(id) => Self::new(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("job {id} not found"),
            ),
            ServiceError::ShuttingDown => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting_down",
                e.to_string(),
            ),
            ServiceError::Terminal { .. } => {
                Self::new(StatusCode::CONFLICT, "conflict", e.to_string())
            }
            ServiceError::TestHooksOff { field } => Self {
                fields: vec![FieldError {
                    field: field.into(),
                    message: e.to_string(),
                }],
                ..Self::new(StatusCode::BAD_REQUEST, "bad_request", e.to_string())
            },
            ServiceError::NoText { .. } => Self {
                fields: vec![FieldError {
                    field: "text".into(),
                    message: e.to_string(),
                }],
                ..Self::new(StatusCode::BAD_REQUEST, "bad_request", e.to_string())
            },
            ServiceError::OverBudget { ref parts, .. } => Self {
                fields: parts
                    .iter()
                    .map(|(field, message)| FieldError {
                        field: field.clone(),
                        message: message.clone(),
                    })
                    .collect(),
                ..Self::new(StatusCode::BAD_REQUEST, "over_memory_budget", e.to_string())
            },
            // Internals are logged (once, by the response), not leaked.
            other => Self::internal(&other),
        }
    }
}

impl From<job::store::StoreError> for ApiError {
    fn from(e: job::store::StoreError) -> Self {
        ServiceError::Store(e).into()
    }
}
