//! The built-in scorers that need no model and run no program: `math`, `format`, `env`.

use futures::future::BoxFuture;
use serde::Deserialize;

use crate::math;
use crate::protocol::{Score, ScoreRequest};
use crate::scorer::{ScoreError, Scorer};

fn reference_text(req: &ScoreRequest) -> Result<String, ScoreError> {
    match &req.reference {
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(serde_json::Value::Number(n)) => Ok(n.to_string()),
        Some(serde_json::Value::Object(o)) => o
            .get("answer")
            .map(|a| {
                a.as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| a.to_string())
            })
            .ok_or_else(|| ScoreError::BadRequest("reference has no \"answer\"".into())),
        _ => Err(ScoreError::BadRequest(
            "math needs a reference answer (string, number or {\"answer\": …})".into(),
        )),
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
        let re = cfg
            .pattern
            .as_deref()
            .map(regex::Regex::new)
            .transpose()
            .map_err(|e| ScoreError::bad("pattern", e))?;
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
                    if self
                        .cfg
                        .max_chars
                        .is_some_and(|m| it.text.chars().count() > m)
                    {
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
        Self {
            scale: 1.0,
            offset: 0.0,
            min: f64::MIN,
            max: f64::MAX,
        }
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
                        return Err(ScoreError::BadRequest(format!(
                            "env_reward of {} is not finite",
                            it.trajectory_id
                        )));
                    }
                    let s = (self.0.scale * it.env_reward + self.0.offset)
                        .clamp(self.0.min, self.0.max);
                    Ok(Score {
                        trajectory_id: it.trajectory_id.clone(),
                        score: s,
                        details: serde_json::json!({ "env_reward": it.env_reward }),
                    })
                })
                .collect()
        })
    }
}
