//! The scorer trait and the built-in scorers that need no model: `math`, `format`, `env`.

use futures::future::BoxFuture;
use serde::Deserialize;

use crate::math;
use crate::protocol::{Score, ScoreRequest};

#[derive(Debug, thiserror::Error)]
pub enum ScoreError {
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error("scorer failed: {0}")]
    Failed(String),
}

/// A reward function: scores every item of a request.
pub trait Scorer: Send + Sync + 'static {
    fn name(&self) -> &str;
    fn score<'a>(&'a self, req: &'a ScoreRequest) -> BoxFuture<'a, Result<Vec<Score>, ScoreError>>;
}

fn reference_text(req: &ScoreRequest) -> Result<String, ScoreError> {
    match &req.reference {
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(serde_json::Value::Number(n)) => Ok(n.to_string()),
        Some(serde_json::Value::Object(o)) => o
            .get("answer")
            .map(|a| a.as_str().map(str::to_string).unwrap_or_else(|| a.to_string()))
            .ok_or_else(|| ScoreError::BadRequest("reference has no \"answer\"".into())),
        _ => Err(ScoreError::BadRequest("math needs a reference answer (string, number or {\"answer\": …})".into())),
    }
}

/// `math`: 1 when the final answer is equivalent to the reference, else 0.
pub struct MathScorer;

impl Scorer for MathScorer {
    fn name(&self) -> &str {
        "math"
    }

    fn score<'a>(&'a self, req: &'a ScoreRequest) -> BoxFuture<'a, Result<Vec<Score>, ScoreError>> {
        Box::pin(async move {
            let reference = reference_text(req)?;
            Ok(req
                .items
                .iter()
                .map(|it| {
                    let c = math::check(&it.text, &reference);
                    Score {
                        trajectory_id: it.trajectory_id.clone(),
                        score: if c.correct { 1.0 } else { 0.0 },
                        details: serde_json::json!({ "extracted": c.extracted, "normalised": c.normalised, "reference": reference }),
                    }
                })
                .collect())
        })
    }
}

/// Configuration of `format`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FormatConfig {
    /// A regular expression the response must match (searched anywhere).
    #[serde(default)]
    pub pattern: Option<String>,
    /// Longest acceptable response, in characters.
    #[serde(default)]
    pub max_chars: Option<usize>,
    /// The response must contain each of these.
    #[serde(default)]
    pub required: Vec<String>,
}

/// `format`: 1 when the response passes every check, else 0; details list the failures.
pub struct FormatScorer {
    cfg: FormatConfig,
    re: Option<regex::Regex>,
}

impl FormatScorer {
    pub fn new(cfg: FormatConfig) -> Result<Self, ScoreError> {
        let re = cfg.pattern.as_deref().map(regex::Regex::new).transpose().map_err(|e| ScoreError::BadRequest(format!("pattern: {e}")))?;
        Ok(Self { cfg, re })
    }
}

impl Scorer for FormatScorer {
    fn name(&self) -> &str {
        "format"
    }

    fn score<'a>(&'a self, req: &'a ScoreRequest) -> BoxFuture<'a, Result<Vec<Score>, ScoreError>> {
        Box::pin(async move {
            Ok(req
                .items
                .iter()
                .map(|it| {
                    let mut failed = Vec::new();
                    if let Some(re) = &self.re
                        && !re.is_match(&it.text)
                    {
                        failed.push("pattern".to_string());
                    }
                    if self.cfg.max_chars.is_some_and(|m| it.text.chars().count() > m) {
                        failed.push("max_chars".to_string());
                    }
                    for r in &self.cfg.required {
                        if !it.text.contains(r.as_str()) {
                            failed.push(format!("required:{r}"));
                        }
                    }
                    Score {
                        trajectory_id: it.trajectory_id.clone(),
                        score: if failed.is_empty() { 1.0 } else { 0.0 },
                        details: serde_json::json!({ "failed": failed }),
                    }
                })
                .collect())
        })
    }
}

/// Configuration of `env`: score = clamp(scale · env_reward + offset, min, max).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvConfig {
    #[serde(default = "one")]
    pub scale: f64,
    #[serde(default)]
    pub offset: f64,
    #[serde(default = "neg_inf")]
    pub min: f64,
    #[serde(default = "pos_inf")]
    pub max: f64,
}

fn one() -> f64 {
    1.0
}
fn neg_inf() -> f64 {
    f64::MIN
}
fn pos_inf() -> f64 {
    f64::MAX
}

impl Default for EnvConfig {
    fn default() -> Self {
        Self { scale: 1.0, offset: 0.0, min: f64::MIN, max: f64::MAX }
    }
}

/// `env`: the environment's own reward, shaped.
pub struct EnvScorer(pub EnvConfig);

impl Scorer for EnvScorer {
    fn name(&self) -> &str {
        "env"
    }

    fn score<'a>(&'a self, req: &'a ScoreRequest) -> BoxFuture<'a, Result<Vec<Score>, ScoreError>> {
        Box::pin(async move {
            req.items
                .iter()
                .map(|it| {
                    if !it.env_reward.is_finite() {
                        return Err(ScoreError::BadRequest(format!("env_reward of {} is not finite", it.trajectory_id)));
                    }
                    let s = (self.0.scale * it.env_reward + self.0.offset).clamp(self.0.min, self.0.max);
                    Ok(Score { trajectory_id: it.trajectory_id.clone(), score: s, details: serde_json::json!({ "env_reward": it.env_reward }) })
                })
                .collect()
        })
    }
}

/// Builds a built-in scorer by name with its JSON configuration.
pub fn builtin(name: &str, config: Option<&str>) -> Result<Box<dyn Scorer>, ScoreError> {
    let cfg = |default: &str| config.unwrap_or(default).to_string();
    match name {
        "math" => Ok(Box::new(MathScorer)),
        "format" => {
            let c: FormatConfig = serde_json::from_str(&cfg("{}")).map_err(|e| ScoreError::BadRequest(format!("format config: {e}")))?;
            Ok(Box::new(FormatScorer::new(c)?))
        }
        "env" => {
            let c: EnvConfig = serde_json::from_str(&cfg("{}")).map_err(|e| ScoreError::BadRequest(format!("env config: {e}")))?;
            Ok(Box::new(EnvScorer(c)))
        }
        "code" => {
            let c: crate::code::CodeConfig = serde_json::from_str(&cfg("{}")).map_err(|e| ScoreError::BadRequest(format!("code config: {e}")))?;
            Ok(Box::new(crate::code::CodeScorer::new(c)?))
        }
        "judge" => {
            let c: crate::judge::JudgeConfig = serde_json::from_str(&cfg("{}")).map_err(|e| ScoreError::BadRequest(format!("judge config: {e}")))?;
            Ok(Box::new(crate::judge::JudgeScorer::new(c, &infra::env::ProcessEnv)?))
        }
        other => Err(ScoreError::BadRequest(format!("unknown function {other:?}: math, format, env, code or judge"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{PROTOCOL_VERSION, ScoredItem};

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
                .map(|(i, (t, r))| ScoredItem { trajectory_id: format!("t{i}"), text: t.to_string(), token_ids: vec![], env_reward: *r })
                .collect(),
        }
    }

    fn run(s: &dyn Scorer, r: &ScoreRequest) -> Result<Vec<f64>, ScoreError> {
        let rt = tokio::runtime::Builder::new_current_thread().build().map_err(|e| ScoreError::Failed(e.to_string()))?;
        Ok(rt.block_on(s.score(r))?.into_iter().map(|s| s.score).collect())
    }

    #[test]
    fn every_builtin_on_its_table() {
        let math = builtin("math", None).unwrap();
        assert_eq!(run(math.as_ref(), &req(&[("\\boxed{12}", 0.0), ("11", 0.0)], Some(serde_json::json!("12")))).unwrap(), vec![1.0, 0.0]);
        assert_eq!(run(math.as_ref(), &req(&[("0.5", 0.0)], Some(serde_json::json!({ "answer": "1/2" })))).unwrap(), vec![1.0]);
        assert!(run(math.as_ref(), &req(&[("1", 0.0)], None)).is_err(), "math without a reference is a bad request");
        let fmt = builtin("format", Some(r#"{"pattern": "^(left|right|up|down)$", "max_chars": 5}"#)).unwrap();
        assert_eq!(run(fmt.as_ref(), &req(&[("left", 0.0), ("north", 0.0), ("right", 0.0)], None)).unwrap(), vec![1.0, 0.0, 1.0]);
        assert!(builtin("format", Some(r#"{"pattern": "("}"#)).is_err());
        assert!(builtin("format", Some(r#"{"bogus": 1}"#)).is_err());
        let env = builtin("env", Some(r#"{"scale": 2.0, "offset": -0.5, "min": -1.0, "max": 1.0}"#)).unwrap();
        assert_eq!(run(env.as_ref(), &req(&[("", 0.0), ("", 1.0), ("", -5.0)], None)).unwrap(), vec![-0.5, 1.0, -1.0]);
        assert!(run(env.as_ref(), &req(&[("", f64::NAN)], None)).is_err());
        assert!(builtin("judge9", None).is_err());
    }

    #[test]
    fn code_and_judge_are_built_in() {
        let code = builtin("code", Some(r#"{"sandbox": "none", "timeout_s": 5}"#)).unwrap();
        assert_eq!(code.name(), "code");
        let judge = builtin("judge", Some(r#"{"endpoint": "http://127.0.0.1:9", "model": "m", "rubric": "r", "mode": "group"}"#)).unwrap();
        assert_eq!(judge.name(), "judge");
        let msg = |r: Result<Box<dyn Scorer>, ScoreError>| r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg(builtin("judge", None)).contains("judge config"), "a judge needs an endpoint, a model and a rubric");
        assert!(msg(builtin("code", Some(r#"{"sandbox": "docker"}"#))).contains("code config"));
        assert!(msg(builtin("judge9", None)).contains("math, format, env, code or judge"));
    }
}
