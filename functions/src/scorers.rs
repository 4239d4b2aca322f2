//! The registry of built-in scorers: `math`, `format`, `env` (`basic.rs`), `code` (`code/`),
//! `python` (`code/python_reward.rs`), `judge` (`judge/`) and `tool_use` (`tool_use.rs`), by name, with their JSON configurations. The trait lives in
//! `scorer.rs`; its items are re-exported here.

pub use crate::basic::{EnvConfig, EnvScorer, FormatConfig, FormatScorer, MathScorer};
pub use crate::scorer::{Cause, ScoreError, Scorer};

/// Builds a built-in scorer by name with its JSON configuration.
pub fn builtin(name: &str, config: Option<&str>) -> Result<Box<dyn Scorer>, ScoreError> {
    let cfg = |default: &str| config.unwrap_or(default).to_string();
    match name {
        "math" => Ok(Box::new(MathScorer)),
        "format" => {
            let c: FormatConfig = serde_json::from_str(&cfg("{}"))
                .map_err(|e| ScoreError::bad("format config", e))?;
            Ok(Box::new(FormatScorer::new(c)?))
        }
        "env" => {
            let c: EnvConfig =
                serde_json::from_str(&cfg("{}")).map_err(|e| ScoreError::bad("env config", e))?;
            Ok(Box::new(EnvScorer(c)))
        }
        "code" => {
            let c: crate::code::CodeConfig =
                serde_json::from_str(&cfg("{}")).map_err(|e| ScoreError::bad("code config", e))?;
            Ok(Box::new(crate::code::CodeScorer::new(c)?))
        }
        "python" => {
            let c: crate::code::PythonRewardConfig = serde_json::from_str(&cfg("{}"))
                .map_err(|e| ScoreError::bad("python config", e))?;
            Ok(Box::new(crate::code::PythonRewardScorer::new(c)?))
        }
        "tool_use" => {
            let c: crate::tool_use::ToolUseConfig = serde_json::from_str(&cfg("{}"))
                .map_err(|e| ScoreError::bad("tool_use config", e))?;
            Ok(Box::new(crate::tool_use::ToolUseScorer::new(c)?))
        }
        "judge" => {
            let c: crate::judge::JudgeConfig =
                serde_json::from_str(&cfg("{}")).map_err(|e| ScoreError::bad("judge config", e))?;
            Ok(Box::new(crate::judge::JudgeScorer::new(
                c,
                &infra::env::ProcessEnv,
            )?))
        }
        other => Err(ScoreError::BadRequest(format!(
            "unknown function {other:?}: math, format, env, code, python, judge or tool_use"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{PROTOCOL_VERSION, ScoreRequest, ScoredItem};

    fn req(texts: &[(&str, f64)], reference: Option<serde_json::Value>) -> ScoreRequest {
        ScoreRequest {
            protocol: PROTOCOL_VERSION.into(),
            idempotency_key: "k".into(),
            reward: "r@1".into(),
            reference,
            deadline_ms: 1000,
            items: texts
                .iter()
                .enumerate()
                .map(|(i, (t, r))| ScoredItem {
                    trajectory_id: format!("t{i}"),
                    text: t.to_string(),
                    token_ids: vec![],
                    env_reward: *r,
                    transcript: None,
                    calls: None,
                    row: None,
                })
                .collect(),
        }
    }

    fn run(s: &dyn Scorer, r: &ScoreRequest) -> Result<Vec<f64>, ScoreError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .map_err(|e| ScoreError::failed("runtime", e))?;
        Ok(rt
            .block_on(s.score(r))?
            .into_iter()
            .map(|s| s.score)
            .collect())
    }

    #[test]
    fn every_builtin_on_its_table() {
        let math = builtin("math", None).unwrap();
        assert_eq!(
            run(
                math.as_ref(),
                &req(
                    &[("\\boxed{12}", 0.0), ("11", 0.0)],
                    Some(serde_json::json!("12"))
                )
            )
            .unwrap(),
            vec![1.0, 0.0]
        );
        assert_eq!(
            run(
                math.as_ref(),
                &req(
                    &[("0.5", 0.0)],
                    Some(serde_json::json!({ "answer": "1/2" }))
                )
            )
            .unwrap(),
            vec![1.0]
        );
        assert!(
            run(math.as_ref(), &req(&[("1", 0.0)], None)).is_err(),
            "math without a reference is a bad request"
        );
        let fmt = builtin(
            "format",
            Some(r#"{"pattern": "^(left|right|up|down)$", "max_chars": 5}"#),
        )
        .unwrap();
        assert_eq!(
            run(
                fmt.as_ref(),
                &req(&[("left", 0.0), ("north", 0.0), ("right", 0.0)], None)
            )
            .unwrap(),
            vec![1.0, 0.0, 1.0]
        );
        assert!(builtin("format", Some(r#"{"pattern": "("}"#)).is_err());
        assert!(builtin("format", Some(r#"{"bogus": 1}"#)).is_err());
        let env = builtin(
            "env",
            Some(r#"{"scale": 2.0, "offset": -0.5, "min": -1.0, "max": 1.0}"#),
        )
        .unwrap();
        assert_eq!(
            run(
                env.as_ref(),
                &req(&[("", 0.0), ("", 1.0), ("", -5.0)], None)
            )
            .unwrap(),
            vec![-0.5, 1.0, -1.0]
        );
        assert!(run(env.as_ref(), &req(&[("", f64::NAN)], None)).is_err());
        assert!(builtin("judge9", None).is_err());
    }

    #[test]
    fn code_and_judge_are_built_in() {
        let code = builtin("code", Some(r#"{"sandbox": "none", "timeout_s": 5}"#)).unwrap();
        assert_eq!(code.name(), "code");
        let judge = builtin("judge", Some(r#"{"endpoint": "http://127.0.0.1:9", "model": "m", "rubric": "r", "mode": "group"}"#)).unwrap();
        assert_eq!(judge.name(), "judge");
        let msg = |r: Result<Box<dyn Scorer>, ScoreError>| {
            r.err().map(|e| infra::error_chain(&e)).unwrap_or_default()
        };
        assert!(
            msg(builtin("judge", None)).contains("judge config"),
            "a judge needs an endpoint, a model and a rubric"
        );
        assert!(msg(builtin("code", Some(r#"{"sandbox": "docker"}"#))).contains("code config"));
        assert!(
            msg(builtin("judge9", None))
                .contains("math, format, env, code, python, judge or tool_use")
        );
    }
}
