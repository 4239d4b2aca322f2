//! The caller's side of the protocol: builds a scoring request, sends it through the router
//! (`infra::router`), and accepts only a valid answer — protocol, one finite in-range score per
//! asked trajectory, nothing foreign. Invalid answers are rejected and counted, never used.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use infra::router::{Call, CallFailure, Router, RouterError};

use crate::protocol::{
    PROTOCOL_VERSION, ResponseError, Score, ScoreRequest, ScoreResponse, ScoredItem,
};

#[derive(Clone, Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Router(#[from] RouterError),
    #[error("function {function} returned an invalid response")]
    Invalid {
        function: String,
        #[source]
        reason: InvalidResponse,
    },
    #[error("cannot encode a request for function {function}")]
    Encode {
        function: String,
        #[source]
        source: Arc<serde_json::Error>,
    },
}

/// Why a function's response was rejected.
#[derive(Clone, Debug, thiserror::Error)]
pub enum InvalidResponse {
    #[error("response body over {limit} bytes")]
    Oversized { limit: usize },
    #[error("not a scoring response")]
    Undecodable(#[source] Arc<serde_json::Error>),
    /// Decoded, but fails the checks against its request.
    #[error("response does not answer its request")]
    Rejected(#[source] ResponseError),
    #[error("no score for {id}")]
    Missing { id: String },
}

impl InvalidResponse {
    /// The metric label of this kind of rejection.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Oversized { .. } => "oversized",
            Self::Undecodable(_) => "undecodable",
            Self::Rejected(ResponseError::Protocol { .. }) => "protocol",
            Self::Rejected(ResponseError::NotFinite { .. }) => "not_finite",
            Self::Rejected(ResponseError::OutOfRange { .. }) => "out_of_range",
            Self::Rejected(ResponseError::UnknownTrajectory { .. }) => "foreign_id",
            Self::Rejected(ResponseError::Count { .. }) | Self::Missing { .. } => "count",
        }
    }
}

/// A reward function as the engine calls it.
pub struct FunctionClient {
    router: Arc<Router>,
    /// Reward spec name and version, part of every idempotency key.
    reward: String,
    min: f64,
    max: f64,
    timeout: Duration,
    pub rejected: AtomicU64,
}

fn rejected_counter() -> &'static opentelemetry::metrics::Counter<u64> {
    static C: std::sync::OnceLock<opentelemetry::metrics::Counter<u64>> =
        std::sync::OnceLock::new();
    C.get_or_init(|| {
        infra::telemetry::Metrics::global()
            .meter()
            .u64_counter("rollarc_function_rejected_responses")
            .with_description("Function responses rejected: undecodable, wrong protocol, non-finite or out-of-range score, foreign trajectory id, oversized")
            .build()
    })
}

impl FunctionClient {
    /// The reward spec's name and version, as in every idempotency key.
    pub fn reward_name(&self) -> &str {
        &self.reward
    }

    pub fn new(
        router: Arc<Router>,
        reward: impl Into<String>,
        range: (f64, f64),
        timeout: Duration,
    ) -> Self {
        Self {
            router,
            reward: reward.into(),
            min: range.0,
            max: range.1,
            timeout,
            rejected: AtomicU64::new(0),
        }
    }

    fn reject(&self, reason: InvalidResponse) -> ClientError {
        self.rejected.fetch_add(1, Ordering::Relaxed);
        let label = reason.label();
        rejected_counter().add(
            1,
            &[
                opentelemetry::KeyValue::new("function", self.router.metrics_label().to_string()),
                opentelemetry::KeyValue::new("reason", label),
            ],
        );
        tracing::warn!(
            function = self.router.function(),
            reason = label,
            why = %infra::error_chain(&reason),
            "function response rejected"
        );
        ClientError::Invalid {
            function: self.router.function().to_string(),
            reason,
        }
    }

    /// Scores items (one trajectory or a group) under the key `key@reward`.
    pub async fn score(
        &self,
        key: &str,
        items: Vec<ScoredItem>,
        reference: Option<serde_json::Value>,
    ) -> Result<Vec<Score>, ClientError> {
        let req = ScoreRequest {
            protocol: PROTOCOL_VERSION.into(),
            idempotency_key: format!("{key}@{}", self.reward),
            reward: self.reward.clone(),
            reference,
            deadline_ms: self.timeout.as_millis() as u64,
            items,
        };
        let body = serde_json::to_vec(&req).map_err(|e| ClientError::Encode {
            function: self.router.function().into(),
            source: Arc::new(e),
        })?;
        let call = Call::new(
            req.idempotency_key.clone(),
            Bytes::from(body),
            tokio::time::Instant::now() + self.timeout,
        );
        let reply = match self.router.call(call).await {
            Ok(r) => r,
            Err(RouterError::Failed {
                last: CallFailure::BodyTooLarge { limit },
                ..
            }) => {
                return Err(self.reject(InvalidResponse::Oversized { limit }));
            }
            Err(e) => return Err(e.into()),
        };
        let resp: ScoreResponse = serde_json::from_slice(&reply.body)
            .map_err(|e| self.reject(InvalidResponse::Undecodable(Arc::new(e))))?;
        resp.validate(&req, self.min, self.max)
            .map_err(|e| self.reject(InvalidResponse::Rejected(e)))?;
        // In the order asked.
        let mut out = Vec::with_capacity(req.items.len());
        for it in &req.items {
            match resp
                .scores
                .iter()
                .find(|s| s.trajectory_id == it.trajectory_id)
            {
                Some(s) => out.push(s.clone()),
                None => {
                    return Err(self.reject(InvalidResponse::Missing {
                        id: it.trajectory_id.clone(),
                    }));
                }
            }
        }
        Ok(out)
    }
}
