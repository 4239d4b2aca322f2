//! Environments over dataset rows: `prompt` (one answer per row, checked against the row's
//! answer) and `chat` (a multi-turn conversation: the row's user messages are sent one per
//! turn, the environment answering each of the policy's answers with the next one; the last
//! answer is checked).
//!
//! The row comes with the reset (see [`crate::env::Record`]): `messages` (the prompt in chat
//! form, the dataset's system prompt first when it has one), `answer` (the ground truth, or
//! null) and the row's place. The answer is also the trajectory's reference, so reward
//! functions such as `math` score against it.

use crate::env::{EnvError, Environment, Observation, Record, StepOutcome};
use crate::model::llm::ChatMessage;

/// How the final answer is checked by the environment itself (its reward and `success`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Verifier {
    /// The `math` reward's equivalence check (last `\boxed{}`, "answer is", last number).
    #[default]
    Math,
    /// Trimmed text equality.
    Exact,
    /// No check: reward 0, success false; the task's reward functions decide.
    None,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DatasetEnvConfig {
    /// Send the row's user messages one per turn (`chat`) instead of all at once (`prompt`).
    pub multi_turn: bool,
    pub verifier: Verifier,
}

/// A dataset row served as a (possibly multi-turn) prompt.
pub struct DatasetEnv {
    cfg: DatasetEnvConfig,
    /// Messages still to send, one user turn (with what precedes it) per step.
    pending: Vec<Vec<ChatMessage>>,
    answer: Option<String>,
    done: bool,
}

/// A row's ground truth as text (strings as they are, numbers and others as JSON).
pub fn answer_text(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::Null => None,
        serde_json::Value::String(s) => Some(s.clone()),
        other => Some(other.to_string()),
    }
}

/// The messages of a record, checked: each needs a string `role` and `content`.
pub fn record_messages(record: &serde_json::Value) -> Result<Vec<ChatMessage>, EnvError> {
    let list = record
        .get("messages")
        .and_then(|m| m.as_array())
        .ok_or_else(|| EnvError::Reported("the dataset record has no `messages` list".into()))?;
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let field = |k: &str| {
                m.get(k).and_then(|v| v.as_str()).ok_or_else(|| {
                    EnvError::Reported(format!("message {i} of the record has no string `{k}`"))
                })
            };
            Ok(ChatMessage::new(field("role")?, field("content")?))
        })
        .collect()
}

impl DatasetEnv {
    pub fn new(cfg: DatasetEnvConfig) -> Self {
        Self {
            cfg,
            pending: Vec::new(),
            answer: None,
            done: true,
        }
    }

    /// Splits the messages into turns: each turn ends with a user message (what follows the
    /// last user message joins the last turn).
    fn turns(messages: Vec<ChatMessage>) -> Vec<Vec<ChatMessage>> {
        let mut turns = vec![Vec::new()];
        for m in messages {
            let user = m.role == "user";
            if let Some(last) = turns.last_mut() {
                last.push(m);
            }
            if user {
                turns.push(Vec::new());
            }
        }
        if turns.len() > 1 && turns.last().is_some_and(Vec::is_empty) {
            turns.pop();
        }
        turns
    }

    fn check(&self, action: &str) -> bool {
        let Some(reference) = &self.answer else {
            return false;
        };
        match self.cfg.verifier {
            Verifier::Math => functions::math::check(action, reference).correct,
            Verifier::Exact => action.trim() == reference.trim(),
            Verifier::None => false,
        }
    }
}

fn text_of(messages: &[ChatMessage]) -> String {
    let parts: Vec<&str> = messages.iter().map(|m| m.content.as_str()).collect();
    parts.join("\n")
}

impl Environment for DatasetEnv {
    async fn reset(&mut self, _seed: u64) -> Result<Observation, EnvError> {
        Err(EnvError::Reported(
            "a dataset environment needs a dataset row: give the task a `dataset`".into(),
        ))
    }

    async fn reset_with(
        &mut self,
        seed: u64,
        record: Option<Record>,
    ) -> Result<Observation, EnvError> {
        let Some(record) = record else {
            return self.reset(seed).await;
        };
        let messages = record_messages(&record)?;
        if !messages.iter().any(|m| m.role == "user") {
            return Err(EnvError::Reported(
                "the dataset record's prompt has no user message".into(),
            ));
        }
        self.answer = record.get("answer").and_then(answer_text);
        let mut turns = if self.cfg.multi_turn {
            Self::turns(messages)
        } else {
            vec![messages]
        };
        turns.reverse();
        let first = turns.pop().unwrap_or_default();
        self.pending = turns;
        self.done = false;
        Ok(Observation {
            text: text_of(&first),
            tokens: None,
            sim_response_len: None,
            reference: self
                .answer
                .as_ref()
                .map(|a| serde_json::json!({ "answer": a })),
            messages: Some(first),
        })
    }

    async fn step(
        &mut self,
        action: &str,
        _tokens: &crate::tokens::Tokens,
    ) -> Result<StepOutcome, EnvError> {
        if self.done {
            return Err(EnvError::EpisodeOver);
        }
        if let Some(next) = self.pending.pop() {
            return Ok(StepOutcome {
                observation: Observation {
                    text: text_of(&next),
                    ..Observation::default()
                },
                ..StepOutcome::default()
            });
        }
        self.done = true;
        let success = self.check(action);
        Ok(StepOutcome {
            observation: Observation::default(),
            reward: if success { 1.0 } else { 0.0 },
            terminated: true,
            success,
            ..StepOutcome::default()
        })
    }

    async fn close(&mut self) {}
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn record(messages: serde_json::Value, answer: serde_json::Value) -> Option<Record> {
        Some(Arc::new(
            serde_json::json!({ "messages": messages, "answer": answer, "index": 0 }),
        ))
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
    }

    #[test]
    fn a_prompt_row_is_one_turn_checked_by_the_math_verifier() {
        rt().block_on(async {
            let mut env = DatasetEnv::new(DatasetEnvConfig::default());
            let msgs = serde_json::json!([
                {"role": "system", "content": "Think step by step."},
                {"role": "user", "content": "What is 6*7?"}
            ]);
            let obs = env.reset_with(3, record(msgs, "42".into())).await.unwrap();
            let m = obs.messages.unwrap();
            assert_eq!(m.len(), 2);
            assert_eq!(m[0].role, "system");
            assert_eq!(obs.reference, Some(serde_json::json!({"answer": "42"})));
            let s = env
                .step("so the answer is \\boxed{42}", &Default::default())
                .await
                .unwrap();
            assert!(s.terminated && s.success);
            assert_eq!(s.reward, 1.0);
            assert!(matches!(
                env.step("again", &Default::default()).await,
                Err(EnvError::EpisodeOver)
            ));
            // A wrong answer, and a numeric ground truth.
            env.reset_with(
                4,
                record(
                    serde_json::json!([{"role": "user", "content": "1+1?"}]),
                    2.into(),
                ),
            )
            .await
            .unwrap();
            let s = env.step("3", &Default::default()).await.unwrap();
            assert!(s.terminated && !s.success);
            assert_eq!(s.reward, 0.0);
        });
    }

    #[test]
    fn a_chat_row_sends_one_user_message_per_turn() {
        rt().block_on(async {
            let mut env = DatasetEnv::new(DatasetEnvConfig {
                multi_turn: true,
                verifier: Verifier::Exact,
            });
            let msgs = serde_json::json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."},
                {"role": "user", "content": "Now say yes."}
            ]);
            let obs = env.reset_with(0, record(msgs, "yes".into())).await.unwrap();
            assert_eq!(obs.messages.as_ref().map(Vec::len), Some(2));
            let s = env.step("red", &Default::default()).await.unwrap();
            assert!(!s.terminated);
            assert_eq!(s.observation.text, "Now say yes.");
            let s = env.step(" yes ", &Default::default()).await.unwrap();
            assert!(s.terminated && s.success);
        });
    }

    #[test]
    fn rows_without_a_usable_prompt_are_named() {
        rt().block_on(async {
            let mut env = DatasetEnv::new(DatasetEnvConfig::default());
            let e = env.reset(1).await.unwrap_err().to_string();
            assert!(e.contains("dataset"), "{e}");
            let e = env
                .reset_with(1, record(serde_json::json!([{"role": "user"}]), "1".into()))
                .await
                .unwrap_err()
                .to_string();
            assert!(e.contains("`content`"), "{e}");
            let e = env
                .reset_with(
                    1,
                    record(
                        serde_json::json!([{"role": "system", "content": "x"}]),
                        "1".into(),
                    ),
                )
                .await
                .unwrap_err()
                .to_string();
            assert!(e.contains("no user message"), "{e}");
        });
    }
}
