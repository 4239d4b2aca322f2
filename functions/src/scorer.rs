//! The scorer trait and its error: what every reward function implements.

use futures::future::BoxFuture;

use crate::protocol::{Score, ScoreRequest};

/// The cause under a [`ScoreError`]: the typed error of whatever failed (a process, an HTTP
/// call, a configuration parser).
pub type Cause = Box<dyn std::error::Error + Send + Sync + 'static>;

#[derive(Debug, thiserror::Error)]
pub enum ScoreError {
    /// The request, or the scorer's configuration, is wrong: the caller's fault.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The scorer could not score.
    #[error("scorer failed: {0}")]
    Failed(String),
    /// A [`BadRequest`](Self::BadRequest) with its cause.
    #[error("bad request: {what}")]
    BadInput {
        what: String,
        #[source]
        source: Cause,
    },
    /// A [`Failed`](Self::Failed) with its cause.
    #[error("scorer failed: {what}")]
    Broken {
        what: String,
        #[source]
        source: Cause,
    },
}

impl ScoreError {
    /// A bad request or configuration caused by `source`.
    pub fn bad(what: impl Into<String>, source: impl Into<Cause>) -> Self {
        Self::BadInput {
            what: what.into(),
            source: source.into(),
        }
    }

    /// A scorer failure caused by `source`.
    pub fn failed(what: impl Into<String>, source: impl Into<Cause>) -> Self {
        Self::Broken {
            what: what.into(),
            source: source.into(),
        }
    }

    /// Whether the caller is at fault (HTTP 400) rather than the scorer (HTTP 500).
    pub fn is_bad_request(&self) -> bool {
        matches!(self, Self::BadRequest(_) | Self::BadInput { .. })
    }

    /// The message for the caller: what went wrong and its causes, without the class prefix.
    pub fn message(&self) -> String {
        match self {
            Self::BadRequest(m) | Self::Failed(m) => m.clone(),
            Self::BadInput { what, source } | Self::Broken { what, source } => {
                format!("{what}: {}", infra::error_chain(source.as_ref()))
            }
        }
    }
}

/// A reward function: scores every item of a request.
pub trait Scorer: Send + Sync + 'static {
    fn name(&self) -> &str;
    fn score<'a>(&'a self, req: &'a ScoreRequest) -> BoxFuture<'a, Result<Vec<Score>, ScoreError>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_carry_their_causes_and_classes() {
        let cause = "x".parse::<u32>().unwrap_err();
        let e = ScoreError::bad("format config", cause.clone());
        assert!(e.is_bad_request());
        assert_eq!(e.to_string(), "bad request: format config");
        assert_eq!(e.message(), format!("format config: {cause}"));
        assert_eq!(
            infra::error_chain(&e),
            format!("bad request: format config: {cause}")
        );
        let e = ScoreError::failed("code", cause);
        assert!(!e.is_bad_request());
        assert!(!ScoreError::Failed("m".into()).is_bad_request());
        assert_eq!(ScoreError::BadRequest("m".into()).message(), "m");
    }
}
