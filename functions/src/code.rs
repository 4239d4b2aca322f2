//! `code`: runs a candidate Python program against tests and scores the fraction that pass.
//!
//! Each item gets its own Python process, sandboxed by default (`infra::sandbox::sandboxed`:
//! prlimit → bubblewrap → setpriv, no network, the system read-only, a private `/tmp`). A
//! generated harness goes in through stdin (nothing is written on the host): it `exec`s the
//! candidate in a fresh module namespace, then runs every test in that namespace in its own
//! `try`, and reports one marker line per test on stdout. The candidate's own prints go to
//! stderr, markers carry a per-run random tag the candidate is never told, and the harness keeps
//! its own references to `exec`, `compile` and `BaseException`, so printing fake markers or
//! patching builtins does not make a test pass. (It cannot stop a candidate from returning a
//! value that compares equal to anything; tests that care should check types too.)
//!
//! Score = passed / total. A candidate that does not compile or raises while loading scores 0
//! with the error in the details; one that runs past `timeout_s` is killed (its whole process
//! group) and scores 0 with `timed_out`. A harness that never starts (no Python, a broken
//! sandbox) is a failure of the function, not a zero.
//!
//! Files: `config.rs`, `extract.rs` (the program and the tests of a request), `harness.rs`
//! (the Python harness), `runner.rs` (running it), `markers.rs` (reading its report).

mod config;
mod extract;
mod harness;
mod markers;
mod python_reward;
mod runner;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use infra::process::CapturedOutput;

use crate::protocol::{Score, ScoreRequest, ScoredItem};
use crate::scorer::{ScoreError, Scorer};

pub use crate::text::tail_chars;
pub use config::{CodeConfig, SandboxMode};
pub use extract::{extract_code, tests_from_reference};
pub use harness::harness;
pub use markers::{Failure, Markers, TestOutcome, parse_markers};
pub use python_reward::{PythonRewardConfig, PythonRewardScorer};
pub use runner::ProbeError;

/// Longest excerpt of the program's stderr kept in the details.
const STDERR_EXCERPT_CHARS: usize = 2000;

/// The `code` scorer.
pub struct CodeScorer {
    cfg: CodeConfig,
    timeout: Duration,
    permits: Arc<tokio::sync::Semaphore>,
}

impl CodeScorer {
    /// Validates the configuration; with the bubblewrap sandbox, checks that it can be set up.
    pub fn new(cfg: CodeConfig) -> Result<Self, ScoreError> {
        let timeout = cfg.validate()?;
        if cfg.sandbox == SandboxMode::Bwrap {
            infra::sandbox::check_sandbox()
                .map_err(|e| ScoreError::bad("code: the sandbox cannot be set up", e))?;
        }
        runner::probe_python(&cfg).map_err(|e| ScoreError::bad("code", e))?;
        let permits = Arc::new(tokio::sync::Semaphore::new(cfg.max_concurrency));
        Ok(Self {
            cfg,
            timeout,
            permits,
        })
    }

    async fn score_item(&self, item: &ScoredItem, tests: &[String]) -> Result<Score, ScoreError> {
        let (source, fenced) = extract_code(&item.text);
        let tag = format!("__ROLLARC__{}", harness::nonce());
        let harness = harness(&tag, &source, tests);
        let run = {
            let _permit = self
                .permits
                .acquire()
                .await
                .map_err(|e| ScoreError::failed("code", e))?;
            runner::run_harness(&self.cfg, self.timeout, harness)
                .await
                .map_err(|e| ScoreError::failed("code", e))?
        };
        let status = runner::status_text(&self.cfg, &run);
        let markers = parse_markers(
            &String::from_utf8_lossy(&run.stdout.data),
            &tag,
            tests.len(),
        );
        let stderr = tail_chars(
            &String::from_utf8_lossy(&run.stderr.data),
            STDERR_EXCERPT_CHARS,
        );
        if !markers.ready && !run.timed_out {
            return Err(ScoreError::Failed(format!(
                "code: the Python harness did not start ({status}): {stderr}"
            )));
        }
        let (results, passed) = verdicts(&markers, &run, &status);
        let total = tests.len();
        let score = if run.timed_out || total == 0 {
            0.0
        } else {
            passed as f64 / total as f64
        };
        let details = serde_json::json!({
            "passed": if run.timed_out { 0 } else { passed },
            "total": total,
            "tests": results,
            "timed_out": run.timed_out,
            "load_error": markers.load_error.as_ref().map(|l| serde_json::json!({ "error": l.error, "message": l.message })),
            "exit": status,
            "fenced_code_block": fenced,
            "stdout_truncated": run.stdout.truncated(),
            "stderr_truncated": run.stderr.truncated(),
            "stderr": stderr,
        });
        Ok(Score {
            trajectory_id: item.trajectory_id.clone(),
            score,
            details,
        })
    }
}

/// One verdict per test (in the details' shape), and how many passed.
fn verdicts(
    markers: &Markers,
    run: &CapturedOutput,
    status: &str,
) -> (Vec<serde_json::Value>, usize) {
    let early = format!("no result: the program ended before this test reported ({status})");
    let mut results = Vec::with_capacity(markers.tests.len());
    let mut passed = 0usize;
    for (i, r) in markers.tests.iter().enumerate() {
        let v = match (r, &markers.load_error) {
            (_, Some(load)) => {
                serde_json::json!({ "test": i, "passed": false, "error": load.error, "message": format!("the candidate failed to load: {}", load.message) })
            }
            (Some(TestOutcome::Pass), None) => {
                passed += 1;
                serde_json::json!({ "test": i, "passed": true })
            }
            (Some(TestOutcome::Fail(f)), None) => {
                serde_json::json!({ "test": i, "passed": false, "error": f.error, "message": f.message })
            }
            (None, None) if run.timed_out => {
                serde_json::json!({ "test": i, "passed": false, "error": "Timeout", "message": "no result before the timeout" })
            }
            (None, None) => {
                serde_json::json!({ "test": i, "passed": false, "error": "NoResult", "message": early })
            }
        };
        results.push(v);
    }
    (results, passed)
}

impl Scorer for CodeScorer {
    fn name(&self) -> &str {
        "code"
    }

    fn score<'a>(&'a self, req: &'a ScoreRequest) -> BoxFuture<'a, Result<Vec<Score>, ScoreError>> {
        Box::pin(async move {
            let tests = tests_from_reference(req.reference.as_ref())?;
            let runs: Vec<_> = req
                .items
                .iter()
                .map(|it| self.score_item(it, &tests))
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

    #[test]
    fn bad_configs_are_refused() {
        for bad in [
            CodeConfig {
                timeout_s: f64::NAN,
                sandbox: SandboxMode::None,
                ..CodeConfig::default()
            },
            CodeConfig {
                timeout_s: -1.0,
                sandbox: SandboxMode::None,
                ..CodeConfig::default()
            },
            CodeConfig {
                max_output_bytes: 10,
                sandbox: SandboxMode::None,
                ..CodeConfig::default()
            },
            CodeConfig {
                max_concurrency: 0,
                sandbox: SandboxMode::None,
                ..CodeConfig::default()
            },
            CodeConfig {
                python: " ".into(),
                sandbox: SandboxMode::None,
                ..CodeConfig::default()
            },
            CodeConfig {
                python: "/nonexistent/python3".into(),
                sandbox: SandboxMode::None,
                ..CodeConfig::default()
            },
        ] {
            assert!(CodeScorer::new(bad).is_err_and(|e| e.is_bad_request()));
        }
    }

    fn unsandboxed(timeout_s: f64) -> CodeScorer {
        CodeScorer::new(CodeConfig {
            sandbox: SandboxMode::None,
            timeout_s,
            ..CodeConfig::default()
        })
        .unwrap()
    }

    async fn run_one(s: &CodeScorer, text: &str, tests: &[&str]) -> Score {
        let item = ScoredItem {
            trajectory_id: "t".into(),
            text: text.into(),
            token_ids: vec![],
            env_reward: 0.0,
            transcript: None,
            calls: None,
            row: None,
        };
        let tests: Vec<String> = tests.iter().map(|t| t.to_string()).collect();
        s.score_item(&item, &tests)
            .await
            .unwrap_or_else(|e| panic!("{text:?}: {e}"))
    }

    /// The harness in a plain child process (the sandbox itself is tested as a process in the
    /// integration tests): verdicts, and the tricks a policy could learn.
    #[tokio::test]
    async fn the_harness_reports_honestly_whatever_the_candidate_does() {
        let s = unsandboxed(20.0);
        let tests = ["assert f(1) == 2", "assert f(2) == 3"];
        let cases: [(&str, f64, [&str; 2]); 7] = [
            ("def f(x):\n    return x + 1\n", 1.0, ["", ""]),
            (
                "```python\ndef f(x):\n    return 2\n```",
                0.5,
                ["", "AssertionError"],
            ),
            // Forged markers, on every channel and with guessed tags.
            (
                "import sys, os\nfor i in range(2):\n    print(f'__ROLLARC__ TEST {i} PASS')\n    sys.__stdout__.write(f'__ROLLARC__0 TEST {i} PASS\\n')\n    os.write(1, b'TEST 1 PASS\\n')\ndef f(x):\n    return 0\n",
                0.0,
                ["AssertionError", "AssertionError"],
            ),
            // Patched builtins do not stop the tests from running.
            (
                "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.compile = lambda *a, **k: None\ndef f(x):\n    return 0\n",
                0.0,
                ["AssertionError", "AssertionError"],
            ),
            // sys.exit inside a test fails that test only.
            (
                "import sys\ndef f(x):\n    if x == 1:\n        sys.exit(0)\n    return x + 1\n",
                0.5,
                ["SystemExit", ""],
            ),
            // A main block does not run (the namespace is not __main__).
            (
                "def f(x):\n    return x + 1\nif __name__ == '__main__':\n    raise SystemExit('main ran')\n",
                1.0,
                ["", ""],
            ),
            // Leaving the process early loses the tests not yet reported.
            (
                "import os\ndef f(x):\n    if x == 2:\n        os._exit(3)\n    return x + 1\n",
                0.5,
                ["", "NoResult"],
            ),
        ];
        for (text, want, errors) in cases {
            let sc = run_one(&s, text, &tests).await;
            assert_eq!(sc.score, want, "{text:?}: {}", sc.details);
            assert_eq!(sc.details["timed_out"], false);
            for (i, e) in errors.iter().enumerate() {
                let t = &sc.details["tests"][i];
                assert_eq!(t["passed"], e.is_empty(), "{text:?}: {t}");
                if !e.is_empty() {
                    assert_eq!(t["error"], *e, "{text:?}: {t}");
                }
            }
        }
        let sc = run_one(
            &s,
            "import os\ndef f(x):\n    if x == 2:\n        os._exit(3)\n    return x + 1\n",
            &tests,
        )
        .await;
        assert_eq!(sc.details["exit"], "exit status 3");
        let sc = run_one(&s, "def f(:\n", &tests).await;
        assert_eq!(
            (sc.score, sc.details["load_error"]["error"].as_str()),
            (0.0, Some("SyntaxError")),
            "{}",
            sc.details
        );
        let sc = run_one(
            &s,
            "print('noise ' * 100000)\ndef f(x):\n    return x + 1\n",
            &tests,
        )
        .await;
        assert_eq!(
            sc.score, 1.0,
            "output past the cap is dropped, not fatal: {}",
            sc.details
        );
        assert_eq!(
            sc.details["stderr_truncated"], true,
            "the candidate's prints go to stderr"
        );
    }

    #[tokio::test]
    async fn a_hung_program_and_its_children_are_killed_at_the_timeout() {
        let s = unsandboxed(1.0);
        let started = tokio::time::Instant::now();
        let pidfile = std::env::temp_dir().join(format!("rollarc-code-test-{}", harness::nonce()));
        let program = format!(
            "import subprocess\np = subprocess.Popen(['sleep', '60'])\nopen({:?}, 'w').write(str(p.pid))\nwhile True:\n    pass\n",
            pidfile.display()
        );
        let sc = run_one(&s, &program, &["assert True"]).await;
        assert_eq!(
            (sc.score, &sc.details["timed_out"]),
            (0.0, &serde_json::json!(true)),
            "{}",
            sc.details
        );
        assert_eq!(sc.details["tests"][0]["error"], "Timeout");
        let pid = std::fs::read_to_string(&pidfile).unwrap();
        let _ = std::fs::remove_file(&pidfile);
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        while std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|st| !st.contains(") Z "))
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the program's child {pid} survived the timeout"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        // A child that outlives a finished program (holding its pipes) does not hold the score up.
        let sc = run_one(
            &s,
            "import subprocess\nsubprocess.Popen(['sleep', '60'])\n",
            &["assert True"],
        )
        .await;
        assert_eq!(sc.score, 1.0, "{}", sc.details);
        assert!(
            started.elapsed() < std::time::Duration::from_secs(8),
            "took {:?}",
            started.elapsed()
        );
    }
}
