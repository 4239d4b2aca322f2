//! `tool_use`: shaping for agents — a small reward for each valid tool call the policy made
//! in an agent episode (its model calls' `tool_calls`: the gateway returns only valid calls
//! as structured calls; invalid ones went back as plain text), capped. Calls the agent wrote
//! into its own history (a worked example) do not count. Items without calls score 0.

use futures::future::BoxFuture;
use serde::Deserialize;

use crate::protocol::{Score, ScoreRequest};
use crate::scorer::{ScoreError, Scorer};

/// Configuration of `tool_use`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolUseConfig {
    /// Reward per valid tool call.
    #[serde(default = "default_per_call")]
    pub per_call: f64,
    /// The most the calls of one episode earn.
    #[serde(default = "default_max")]
    pub max: f64,
    /// Count only calls of these tools (default: every tool).
    #[serde(default)]
    pub tools: Vec<String>,
}

fn default_per_call() -> f64 {
    0.1
}
fn default_max() -> f64 {
    0.2
}

pub struct ToolUseScorer(pub ToolUseConfig);

impl ToolUseScorer {
    pub fn new(c: ToolUseConfig) -> Result<Self, ScoreError> {
        if !(c.per_call.is_finite() && c.max.is_finite() && c.per_call >= 0.0 && c.max >= 0.0) {
            return Err(ScoreError::BadRequest(
                "tool_use config: per_call and max must be finite and ≥ 0".into(),
            ));
        }
        Ok(Self(c))
    }

    /// Valid tool calls of the policy's model calls.
    fn calls(&self, calls: &serde_json::Value) -> usize {
        calls
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|m| m["tool_calls"].as_array().into_iter().flatten())
            .filter(|c| {
                self.0.tools.is_empty()
                    || c["name"]
                        .as_str()
                        .is_some_and(|n| self.0.tools.iter().any(|t| t == n))
            })
            .count()
    }
}

impl Scorer for ToolUseScorer {
    fn name(&self) -> &str {
        "tool_use"
    }

    fn score<'a>(&'a self, req: &'a ScoreRequest) -> BoxFuture<'a, Result<Vec<Score>, ScoreError>> {
        Box::pin(async move {
            Ok(req
                .items
                .iter()
                .map(|it| {
                    let n = it.calls.as_ref().map_or(0, |c| self.calls(c));
                    Score {
                        trajectory_id: it.trajectory_id.clone(),
                        score: (n as f64 * self.0.per_call).min(self.0.max),
                        details: serde_json::json!({ "valid_tool_calls": n }),
                    }
                })
                .collect())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{PROTOCOL_VERSION, ScoredItem};

    #[tokio::test]
    async fn valid_calls_of_the_named_tools_earn_up_to_the_cap() {
        let call = |name: &str| serde_json::json!({"id": "c", "name": name, "arguments": {}});
        let calls = serde_json::json!([
            {"api": "chat.completions", "tool_calls": [call("calculate"), call("other")], "finish_reason": "tool_calls"},
            {"api": "chat.completions", "tool_calls": [call("calculate")], "finish_reason": "tool_calls"},
            {"api": "chat.completions", "invalid_tool_call": "bad JSON", "finish_reason": "stop"},
        ]);
        // A worked example in the agent's own history is not the policy's call.
        let transcript = serde_json::json!([
            {"role": "assistant", "content": "", "tool_calls": [call("calculate")]},
        ]);
        let item = |id: &str, c: Option<serde_json::Value>| ScoredItem {
            trajectory_id: id.into(),
            text: String::new(),
            token_ids: vec![],
            env_reward: 0.0,
            transcript: Some(transcript.clone()),
            calls: c,
            row: None,
        };
        let req = ScoreRequest {
            protocol: PROTOCOL_VERSION.into(),
            idempotency_key: "k".into(),
            reward: "r@1".into(),
            reference: None,
            deadline_ms: 1000,
            items: vec![item("a", Some(calls)), item("b", None)],
        };
        let s = ToolUseScorer::new(ToolUseConfig {
            per_call: 0.05,
            max: 0.2,
            tools: vec!["calculate".into()],
        })
        .unwrap();
        let out = s.score(&req).await.unwrap();
        assert!(
            (out[0].score - 0.1).abs() < 1e-12,
            "two calculate calls: {out:?}"
        );
        assert_eq!(out[0].details["valid_tool_calls"], 2);
        assert_eq!(out[1].score, 0.0, "no calls of the policy, nothing earned");
        let capped = ToolUseScorer::new(ToolUseConfig {
            per_call: 0.5,
            max: 0.2,
            tools: vec![],
        })
        .unwrap();
        assert!((capped.score(&req).await.unwrap()[0].score - 0.2).abs() < 1e-12);
        assert!(
            ToolUseScorer::new(ToolUseConfig {
                per_call: f64::NAN,
                max: 0.2,
                tools: vec![]
            })
            .is_err()
        );
    }
}
