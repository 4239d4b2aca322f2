//! Function protocol v1: a scoring request carries one trajectory or a whole group; the
//! response carries one score per trajectory.

use serde::{Deserialize, Serialize};

/// Protocol version carried in every request and response.
pub const PROTOCOL_VERSION: &str = "rollarc.reward/v1";

/// One trajectory as a function sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScoredItem {
    pub trajectory_id: String,
    /// The final response text (decoded).
    #[serde(default)]
    pub text: String,
    #[serde(default)]
    pub token_ids: Vec<u32>,
    /// Reward the environment gave, for pass-through and shaping.
    #[serde(default)]
    pub env_reward: f64,
    /// Agent episodes: the whole conversation (messages with their tool calls and tool
    /// results, the last answer included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transcript: Option<serde_json::Value>,
    /// Agent episodes: each model call as the gateway served it (`api`, the `tool_calls` the
    /// policy made, `invalid_tool_call` when its calls were refused, `finish_reason`). Unlike
    /// the transcript, which holds what the agent sent (a worked example included), these
    /// are the policy's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calls: Option<serde_json::Value>,
    /// Agent episodes: the dataset row the agent was given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub row: Option<serde_json::Value>,
}

/// A scoring request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScoreRequest {
    pub protocol: String,
    /// Trajectory id + reward spec version: a retried call may run twice but yields one result.
    pub idempotency_key: String,
    /// Name and version of the reward spec.
    pub reward: String,
    #[serde(default)]
    pub reference: Option<serde_json::Value>,
    /// Milliseconds the caller will wait in all.
    pub deadline_ms: u64,
    pub items: Vec<ScoredItem>,
}

/// One score.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Score {
    pub trajectory_id: String,
    pub score: f64,
    #[serde(default)]
    pub details: serde_json::Value,
}

/// A scoring response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScoreResponse {
    pub protocol: String,
    pub scores: Vec<Score>,
}

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ResponseError {
    #[error("protocol {got:?} is not {PROTOCOL_VERSION}")]
    Protocol { got: String },
    #[error("score for {id} is not a finite number")]
    NotFinite { id: String },
    #[error("score for {id} is {score}, outside [{min}, {max}]")]
    OutOfRange {
        id: String,
        score: f64,
        min: f64,
        max: f64,
    },
    #[error("response scores trajectory {id}, which was not asked for")]
    UnknownTrajectory { id: String },
    #[error("response has {got} scores for {want} trajectories")]
    Count { got: usize, want: usize },
}

impl ScoreResponse {
    /// Checks a response against its request: protocol, one finite in-range score per item,
    /// no foreign trajectory ids.
    pub fn validate(&self, req: &ScoreRequest, min: f64, max: f64) -> Result<(), ResponseError> {
        if self.protocol != PROTOCOL_VERSION {
            return Err(ResponseError::Protocol {
                got: self.protocol.clone(),
            });
        }
        if self.scores.len() != req.items.len() {
            return Err(ResponseError::Count {
                got: self.scores.len(),
                want: req.items.len(),
            });
        }
        for s in &self.scores {
            if !req.items.iter().any(|i| i.trajectory_id == s.trajectory_id) {
                return Err(ResponseError::UnknownTrajectory {
                    id: s.trajectory_id.clone(),
                });
            }
            if !s.score.is_finite() {
                return Err(ResponseError::NotFinite {
                    id: s.trajectory_id.clone(),
                });
            }
            if s.score < min || s.score > max {
                return Err(ResponseError::OutOfRange {
                    id: s.trajectory_id.clone(),
                    score: s.score,
                    min,
                    max,
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> ScoreRequest {
        ScoreRequest {
            protocol: PROTOCOL_VERSION.into(),
            idempotency_key: "t1/math@1".into(),
            reward: "math@1".into(),
            reference: None,
            deadline_ms: 1000,
            items: vec![ScoredItem {
                trajectory_id: "t1".into(),
                text: "4".into(),
                token_ids: vec![],
                env_reward: 0.0,
                transcript: None,
                calls: None,
                row: None,
            }],
        }
    }

    fn resp(id: &str, score: f64) -> ScoreResponse {
        ScoreResponse {
            protocol: PROTOCOL_VERSION.into(),
            scores: vec![Score {
                trajectory_id: id.into(),
                score,
                details: serde_json::Value::Null,
            }],
        }
    }

    #[test]
    fn validation_table() {
        let r = req();
        let cases: [(ScoreResponse, Option<&str>); 4] = [
            (resp("t1", 1.0), None),
            (resp("t1", f64::NAN), Some("not a finite")),
            (resp("t1", 7.0), Some("outside")),
            (resp("t2", 1.0), Some("not asked for")),
        ];
        for (resp, want) in cases {
            match (resp.validate(&r, 0.0, 1.0), want) {
                (Ok(()), None) => {}
                (Err(e), Some(w)) => assert!(e.to_string().contains(w), "{e}"),
                (got, want) => panic!("got {got:?}, want {want:?}"),
            }
        }
    }
}
