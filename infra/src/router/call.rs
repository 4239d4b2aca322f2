//! A call, its reply, and how calls fail.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

/// One function call. Clones of it (retries, hedges) share its count of tries.
#[derive(Clone, Debug)]
pub struct Call {
    /// Same key → same result (trajectory id + reward spec version).
    pub key: String,
    pub body: Bytes,
    pub deadline: Instant,
    /// Tries at instances made for this call (retries and hedges included).
    tries: Arc<AtomicU64>,
    /// The latest try's failure (what a call that runs out of time reports).
    last: Arc<std::sync::Mutex<Option<CallFailure>>>,
}

impl Call {
    pub fn new(key: impl Into<String>, body: impl Into<Bytes>, deadline: Instant) -> Self {
        Self {
            key: key.into(),
            body: body.into(),
            deadline,
            tries: Arc::default(),
            last: Arc::default(),
        }
    }

    /// Records a try's failure.
    pub(super) fn failed_try(&self, f: &CallFailure) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(f.clone());
    }

    /// The latest try's failure, if a try failed.
    pub fn last_failure(&self) -> Option<CallFailure> {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Counts one try at an instance.
    pub(super) fn tried(&self) {
        self.tries.fetch_add(1, Ordering::Relaxed);
    }

    /// Tries made so far for this call.
    pub fn tries(&self) -> u64 {
        self.tries.load(Ordering::Relaxed)
    }
}

/// A function's answer (2xx, or a non-retryable 4xx the caller should see).
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: u16,
    pub body: Bytes,
    pub instance: u64,
}

#[derive(Clone, Debug, thiserror::Error)]
pub enum RouterError {
    #[error(
        "function {function} is overloaded (activator buffer full); retry after {retry_after_ms} ms"
    )]
    Overloaded {
        function: String,
        retry_after_ms: u64,
    },
    #[error("function {function}: deadline exceeded after {attempts} attempt(s){}", last.as_ref().map(|l| format!("; the last try: {}", crate::error_chain(l))).unwrap_or_default())]
    DeadlineExceeded {
        function: String,
        attempts: u64,
        /// The latest try's failure, when a try failed before the deadline (e.g. a 500
        /// that was being retried).
        last: Option<CallFailure>,
    },
    #[error("function {function}: failed after {attempts} attempt(s)")]
    Failed {
        function: String,
        attempts: u64,
        /// The last try's failure (or the router's own, when no try answered).
        #[source]
        last: CallFailure,
    },
    #[error("function {function} rejected the request with {status}: {body}")]
    Rejected {
        function: String,
        status: u16,
        body: String,
    },
}

/// Why one try failed, and, as [`RouterError::Failed`]'s `last`, why a call failed.
#[derive(Clone, Debug, thiserror::Error)]
pub enum CallFailure {
    /// No usable HTTP answer: connecting, sending or reading the body failed.
    #[error("transport error")]
    Transport(#[source] Arc<reqwest::Error>),
    #[error("try timed out after {0:?}")]
    Timeout(Duration),
    #[error("response body over {limit} bytes")]
    BodyTooLarge { limit: usize },
    /// A retryable status (408, 429, 5xx).
    #[error("status {status}")]
    Status {
        status: u16,
        retry_after: Option<Duration>,
        /// The start of the body (at most 300 bytes, lossy UTF-8).
        body_excerpt: String,
    },
    /// The router's service stack failed (not a try: e.g. its buffer worker is gone).
    #[error("router service failed")]
    Service(#[source] Arc<dyn std::error::Error + Send + Sync>),
    /// The task running the call ended without an answer.
    #[error("router task ended")]
    TaskEnded(#[source] Arc<tokio::task::JoinError>),
}

impl CallFailure {
    /// Whether another try may succeed.
    pub(super) fn retryable(&self) -> bool {
        match self {
            CallFailure::Status { status, .. } => *status == 429 || *status >= 500,
            _ => true,
        }
    }
}
