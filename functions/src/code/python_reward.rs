//! `python`: a reward written as one Python function, `compute_score(row, answer,
//! transcript)` in a file of the user's, returning a number or a dict with a `score` (the
//! rest of the dict becomes the score's details).
//!
//! Each item runs in its own interpreter under the same sandbox, caps and timeout as `code`
//! (`runner.rs`): a generated harness (through stdin) loads the file as a module, calls the
//! function with the item's JSON, and prints its result on one line behind a per-run random
//! tag; what the function itself prints goes before it and is ignored. The file's directory
//! is made readable in the sandbox. An exception, a result that is not a finite number, or a
//! run past `timeout_s` refuses the request (a 4xx with the traceback's end, not retried): a
//! job's fault budget sees it, and the item is not scored 0.

use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use serde::Deserialize;

use super::config::CodeConfig;
use crate::protocol::{Score, ScoreRequest, ScoredItem};
use crate::scorer::{ScoreError, Scorer};

/// Configuration of `python`: the file, and the interpreter's settings as for `code`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PythonRewardConfig {
    /// The file that defines `compute_score(row, answer, transcript)`.
    pub file: String,
    #[serde(flatten)]
    pub run: CodeConfig,
}

/// The `python` scorer.
pub struct PythonRewardScorer {
    cfg: CodeConfig,
    file: String,
    timeout: Duration,
    permits: std::sync::Arc<tokio::sync::Semaphore>,
}

impl PythonRewardScorer {
    /// Checks the file (a readable regular file), the settings and the interpreter (in the
    /// sandbox, with the file's directory readable).
    pub fn new(c: PythonRewardConfig) -> Result<Self, ScoreError> {
        let file = std::fs::canonicalize(&c.file).map_err(|e| {
            ScoreError::bad(format!("python: cannot read the file {:?}", c.file), e)
        })?;
        if !file.is_file() {
            return Err(ScoreError::BadRequest(format!(
                "python: {} is not a file",
                file.display()
            )));
        }
        let mut cfg = c.run;
        if let Some(dir) = file.parent() {
            cfg.readable_paths.push(dir.display().to_string());
        }
        let timeout = cfg.validate()?;
        if cfg.sandbox == super::SandboxMode::Bwrap {
            infra::sandbox::check_sandbox()
                .map_err(|e| ScoreError::bad("python: the sandbox cannot be set up", e))?;
        }
        super::runner::probe_python(&cfg).map_err(|e| ScoreError::bad("python", e))?;
        Ok(Self {
            permits: std::sync::Arc::new(tokio::sync::Semaphore::new(cfg.max_concurrency)),
            cfg,
            file: file.display().to_string(),
            timeout,
        })
    }

    async fn score_item(
        &self,
        item: &ScoredItem,
        reference: Option<&serde_json::Value>,
    ) -> Result<Score, ScoreError> {
        // What the user's function did (raised, returned garbage, ran too long) is this
        // request's problem, answered with a 4xx that is not retried; an interpreter that
        // does not run is the function's (5xx).
        let refuse = |why: String| ScoreError::BadRequest(format!("python: {}: {why}", self.file));
        let fail = |why: String| ScoreError::Failed(format!("python: {}: {why}", self.file));
        let data = serde_json::json!({
            "row": item.row.as_ref().or(reference),
            "answer": item.text,
            "transcript": item.transcript,
        });
        let tag = format!("__ROLLARC__{}", super::harness::nonce());
        let harness = harness(&tag, &self.file, &data.to_string());
        let run = {
            let _permit = self
                .permits
                .acquire()
                .await
                .map_err(|e| ScoreError::failed("python", e))?;
            super::runner::run_harness(&self.cfg, self.timeout, harness)
                .await
                .map_err(|e| ScoreError::failed("python", e))?
        };
        if run.timed_out {
            return Err(refuse(format!(
                "compute_score ran past timeout_s = {} s",
                self.cfg.timeout_s
            )));
        }
        let stdout = String::from_utf8_lossy(&run.stdout.data);
        let Some(line) = stdout
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix(tag.as_str()))
        else {
            let stderr = super::tail_chars(&String::from_utf8_lossy(&run.stderr.data), 1500);
            return Err(fail(format!(
                "the harness did not report ({}): {stderr}",
                super::runner::status_text(&self.cfg, &run)
            )));
        };
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| fail(format!("unreadable report: {e}")))?;
        if let Some(err) = v.get("error") {
            return Err(refuse(format!(
                "compute_score raised {}: {}\n{}",
                err.as_str().unwrap_or("an exception"),
                v["message"].as_str().unwrap_or(""),
                v["traceback"].as_str().unwrap_or("")
            )));
        }
        let mut result = v["result"].clone();
        let score = result["score"]
            .as_f64()
            .filter(|s| s.is_finite())
            .ok_or_else(|| {
                refuse(format!(
                    "compute_score must return a finite number or a dict with a numeric \"score\", \
                 got {}",
                    super::tail_chars(&result.to_string(), 200)
                ))
            })?;
        if let Some(m) = result.as_object_mut() {
            m.remove("score");
        }
        Ok(Score {
            trajectory_id: item.trajectory_id.clone(),
            score,
            details: result,
        })
    }
}

/// The harness: loads `file` as a module, calls `compute_score` on `data` (a JSON text), and
/// prints `tag` + its result (or its exception) as JSON on the last line.
fn harness(tag: &str, file: &str, data: &str) -> String {
    // JSON string literals are Python string literals.
    let lit = |s: &str| serde_json::Value::String(s.to_string()).to_string();
    format!(
        r#"import importlib.util as _u, json as _j, math as _m, sys as _s, traceback as _t
_tag = {tag}
def _report(v):
    _s.stdout.flush()
    _line = _j.dumps(v, default=str, allow_nan=False)
    _s.stdout.write("\n" + _tag + _line + "\n")
    _s.stdout.flush()
try:
    _d = _j.loads({data})
    _spec = _u.spec_from_file_location("reward_module", {file})
    _mod = _u.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
    _r = _mod.compute_score(_d["row"], _d["answer"], _d["transcript"])
    if isinstance(_r, bool) or not isinstance(_r, (int, float, dict)):
        raise TypeError("compute_score returned %s, not a number or a dict" % type(_r).__name__)
    _v = _r.get("score") if isinstance(_r, dict) else _r
    if isinstance(_v, (int, float)) and not isinstance(_v, bool) and not _m.isfinite(_v):
        raise ValueError("compute_score returned %r, not a finite number" % (_v,))
    _report({{"result": _r if isinstance(_r, dict) else {{"score": float(_r)}}}})
except BaseException as _e:
    _report({{"error": type(_e).__name__, "message": str(_e), "traceback": _t.format_exc()[-1500:]}})
"#,
        tag = lit(tag),
        data = lit(data),
        file = lit(file),
    )
}

impl Scorer for PythonRewardScorer {
    fn name(&self) -> &str {
        "python"
    }

    fn score<'a>(&'a self, req: &'a ScoreRequest) -> BoxFuture<'a, Result<Vec<Score>, ScoreError>> {
        Box::pin(async move {
            let runs: Vec<_> = req
                .items
                .iter()
                .map(|it| self.score_item(it, req.reference.as_ref()))
                .collect();
            let results: Vec<Result<Score, ScoreError>> = futures::stream::iter(runs)
                .buffered(self.cfg.max_concurrency)
                .collect()
                .await;
            results.into_iter().collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::PROTOCOL_VERSION;

    fn scorer(src: &str, timeout_s: f64) -> (tempfile::TempDir, PythonRewardScorer) {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("my_reward.py");
        std::fs::write(&file, src).unwrap();
        let cfg: PythonRewardConfig = serde_json::from_value(serde_json::json!({
            "file": file.display().to_string(),
            "sandbox": "none",
            "timeout_s": timeout_s,
        }))
        .unwrap();
        (dir, PythonRewardScorer::new(cfg).unwrap())
    }

    fn request(answer: &str, reference: serde_json::Value) -> ScoreRequest {
        ScoreRequest {
            protocol: PROTOCOL_VERSION.into(),
            idempotency_key: "k".into(),
            reward: "r@1".into(),
            reference: Some(reference),
            deadline_ms: 10_000,
            items: vec![ScoredItem {
                trajectory_id: "t1".into(),
                text: answer.into(),
                token_ids: Vec::new(),
                env_reward: 0.0,
                transcript: None,
                calls: None,
                row: None,
            }],
        }
    }

    #[tokio::test]
    async fn compute_score_scores_an_item_and_its_dict_becomes_the_details() {
        let (_d, s) = scorer(
            "def compute_score(row, answer, transcript):\n    print('noise that is ignored')\n    ok = answer.strip() == str(row['answer'])\n    return {'score': 1.0 if ok else 0.0, 'parsed': answer.strip()}\n",
            10.0,
        );
        let got = s
            .score(&request(" 11 ", serde_json::json!({"answer": 11})))
            .await
            .unwrap();
        assert_eq!(got[0].score, 1.0);
        assert_eq!(got[0].details["parsed"], "11");
        let got = s
            .score(&request("12", serde_json::json!({"answer": 11})))
            .await
            .unwrap();
        assert_eq!(got[0].score, 0.0);
    }

    #[tokio::test]
    async fn exceptions_bad_results_and_timeouts_fail_the_function_not_the_item() {
        let (_d, s) = scorer(
            "import time\ndef compute_score(row, answer, transcript):\n    if answer == 'raise': raise ValueError('no answer key')\n    if answer == 'nan': return float('nan')\n    if answer == 'str': return 'high'\n    time.sleep(30)\n",
            1.0,
        );
        for (answer, want) in [
            ("raise", "ValueError: no answer key"),
            ("nan", "finite number"),
            ("str", "TypeError"),
            ("sleep", "ran past timeout_s"),
        ] {
            let e = s
                .score(&request(answer, serde_json::json!({})))
                .await
                .unwrap_err();
            assert!(
                matches!(&e, ScoreError::BadRequest(m) if m.contains(want)),
                "{answer}: {e}"
            );
        }
    }
}
