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

use std::hash::{BuildHasher, Hasher};
use std::os::unix::process::ExitStatusExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use serde::Deserialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

use crate::protocol::{Score, ScoreRequest, ScoredItem};
use crate::scorers::{ScoreError, Scorer};

/// Where candidate programs run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxMode {
    /// prlimit → bubblewrap → setpriv (see `infra::sandbox`).
    #[default]
    Bwrap,
    /// A plain child process: no isolation at all (trusted code, or hosts without bubblewrap).
    None,
}

/// Configuration of `code`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CodeConfig {
    #[serde(default)]
    pub sandbox: SandboxMode,
    /// Wall-clock limit per item (the whole program: loading and every test).
    #[serde(default = "default_timeout_s")]
    pub timeout_s: f64,
    /// The interpreter (looked up on `PATH` inside the sandbox, where `/root` and `/home` are
    /// hidden: an interpreter installed there needs its install in `readable_paths`).
    #[serde(default = "default_python")]
    pub python: String,
    /// At most this many bytes of each of stdout and stderr are kept; the rest is discarded.
    #[serde(default = "default_max_output_bytes")]
    pub max_output_bytes: usize,
    /// Host paths bound read-only into the sandbox (e.g. an interpreter's install).
    #[serde(default)]
    pub readable_paths: Vec<String>,
    /// Programs run at once by this function, across all requests.
    #[serde(default = "default_concurrency")]
    pub max_concurrency: usize,
}

fn default_timeout_s() -> f64 {
    10.0
}
fn default_python() -> String {
    "python3".into()
}
fn default_max_output_bytes() -> usize {
    65_536
}
fn default_concurrency() -> usize {
    4
}

impl Default for CodeConfig {
    fn default() -> Self {
        Self {
            sandbox: SandboxMode::Bwrap,
            timeout_s: default_timeout_s(),
            python: default_python(),
            max_output_bytes: default_max_output_bytes(),
            readable_paths: Vec::new(),
            max_concurrency: default_concurrency(),
        }
    }
}

/// Longest excerpt of the program's stderr kept in the details.
const STDERR_EXCERPT_CHARS: usize = 2000;
/// How long the output readers may still run once the program is gone.
const DRAIN_GRACE: Duration = Duration::from_secs(1);

/// The `code` scorer.
pub struct CodeScorer {
    cfg: CodeConfig,
    timeout: Duration,
    permits: Arc<tokio::sync::Semaphore>,
}

impl CodeScorer {
    /// Validates the configuration; with the bubblewrap sandbox, checks that it can be set up.
    pub fn new(cfg: CodeConfig) -> Result<Self, ScoreError> {
        if !(cfg.timeout_s.is_finite() && cfg.timeout_s > 0.0 && cfg.timeout_s <= 86_400.0) {
            return Err(ScoreError::BadRequest(format!("code config: timeout_s must be in (0, 86400], got {}", cfg.timeout_s)));
        }
        let timeout = Duration::try_from_secs_f64(cfg.timeout_s).map_err(|e| ScoreError::BadRequest(format!("code config: timeout_s: {e}")))?;
        if cfg.max_output_bytes < 1024 {
            return Err(ScoreError::BadRequest(format!("code config: max_output_bytes must be at least 1024, got {}", cfg.max_output_bytes)));
        }
        if cfg.max_concurrency == 0 {
            return Err(ScoreError::BadRequest("code config: max_concurrency must be at least 1".into()));
        }
        if cfg.python.trim().is_empty() {
            return Err(ScoreError::BadRequest("code config: python must name an interpreter".into()));
        }
        if cfg.sandbox == SandboxMode::Bwrap {
            infra::sandbox::check_sandbox().map_err(|e| ScoreError::BadRequest(format!("code: the sandbox cannot be set up: {e}")))?;
        }
        probe_python(&cfg).map_err(|e| ScoreError::BadRequest(format!("code: {e}")))?;
        let permits = Arc::new(tokio::sync::Semaphore::new(cfg.max_concurrency));
        Ok(Self { cfg, timeout, permits })
    }

    async fn score_item(&self, item: &ScoredItem, tests: &[String]) -> Result<Score, ScoreError> {
        let (source, fenced) = extract_code(&item.text);
        let tag = format!("__ROLLARC__{}", nonce());
        let harness = harness(&tag, &source, tests);
        let run = {
            let _permit = self.permits.acquire().await.map_err(|e| ScoreError::Failed(format!("code: {e}")))?;
            self.run(harness).await?
        };
        let markers = parse_markers(&String::from_utf8_lossy(&run.stdout), &tag, tests.len());
        let stderr = tail_chars(&String::from_utf8_lossy(&run.stderr), STDERR_EXCERPT_CHARS);
        if !markers.ready && !run.timed_out {
            return Err(ScoreError::Failed(format!("code: the Python harness did not start ({}): {stderr}", run.status)));
        }
        let early = format!("no result: the program ended before this test reported ({})", run.status);
        let mut results = Vec::with_capacity(tests.len());
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
                (Some(TestOutcome::Fail(f)), None) => serde_json::json!({ "test": i, "passed": false, "error": f.error, "message": f.message }),
                (None, None) if run.timed_out => {
                    serde_json::json!({ "test": i, "passed": false, "error": "Timeout", "message": "no result before the timeout" })
                }
                (None, None) => serde_json::json!({ "test": i, "passed": false, "error": "NoResult", "message": early }),
            };
            results.push(v);
        }
        let total = tests.len();
        let score = if run.timed_out || total == 0 { 0.0 } else { passed as f64 / total as f64 };
        let details = serde_json::json!({
            "passed": if run.timed_out { 0 } else { passed },
            "total": total,
            "tests": results,
            "timed_out": run.timed_out,
            "load_error": markers.load_error.as_ref().map(|l| serde_json::json!({ "error": l.error, "message": l.message })),
            "exit": run.status,
            "fenced_code_block": fenced,
            "stdout_truncated": run.stdout_truncated,
            "stderr_truncated": run.stderr_truncated,
            "stderr": stderr,
        });
        Ok(Score { trajectory_id: item.trajectory_id.clone(), score, details })
    }

    /// Runs one harness under the sandbox (or not), with the timeout and the output caps.
    async fn run(&self, harness: String) -> Result<RunOutput, ScoreError> {
        let mut cmd = tokio::process::Command::from(python_command(&self.cfg, &["-"]));
        cmd.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).process_group(0).kill_on_drop(true);
        let program = cmd.as_std().get_program().to_string_lossy().into_owned();
        let mut child = cmd.spawn().map_err(|e| ScoreError::Failed(format!("code: cannot start {program}: {e}")))?;
        let mut guard = GroupGuard(child.id().and_then(|p| i32::try_from(p).ok()));
        let out = Arc::new(Mutex::new(Capped::new(self.cfg.max_output_bytes)));
        let err = Arc::new(Mutex::new(Capped::new(self.cfg.max_output_bytes)));
        let readers = [child.stdout.take().map(|r| tokio::spawn(drain(r, out.clone()))), child.stderr.take().map(|r| tokio::spawn(drain(r, err.clone())))];
        if let Some(mut stdin) = child.stdin.take() {
            // The harness reads all of stdin before it runs anything; a program that dies early
            // only makes this write fail, which the exit status already tells.
            tokio::spawn(async move {
                let _ = stdin.write_all(harness.as_bytes()).await;
                let _ = stdin.shutdown().await;
            });
        }
        let (status, timed_out) = match tokio::time::timeout(self.timeout, child.wait()).await {
            Ok(Ok(s)) => (Some(s), false),
            Ok(Err(e)) => return Err(ScoreError::Failed(format!("code: waiting for the program: {e}"))),
            Err(_) => (None, true),
        };
        // Kill what is left of the group (everything on a timeout; stragglers otherwise).
        guard.kill();
        let status = match status {
            Some(s) => s,
            None => child.wait().await.map_err(|e| ScoreError::Failed(format!("code: waiting for the killed program: {e}")))?,
        };
        for r in readers.into_iter().flatten() {
            // A straggler outside the group may still hold the pipe: keep what was read so far.
            let abort = r.abort_handle();
            if tokio::time::timeout(DRAIN_GRACE, r).await.is_err() {
                abort.abort();
            }
        }
        let describe = |s: std::process::ExitStatus| match (s.code(), s.signal()) {
            (Some(c), _) => format!("exit status {c}"),
            (None, Some(sig)) => format!("killed by signal {sig}"),
            _ => s.to_string(),
        };
        let take = |c: &Arc<Mutex<Capped>>| {
            let c = c.lock().unwrap_or_else(|p| p.into_inner());
            (c.data.clone(), c.truncated)
        };
        let (stdout, stdout_truncated) = take(&out);
        let (stderr, stderr_truncated) = take(&err);
        Ok(RunOutput {
            stdout,
            stderr,
            stdout_truncated,
            stderr_truncated,
            timed_out,
            status: if timed_out { format!("timed out after {} s, killed", self.cfg.timeout_s) } else { describe(status) },
        })
    }
}

impl Scorer for CodeScorer {
    fn name(&self) -> &str {
        "code"
    }

    fn score<'a>(&'a self, req: &'a ScoreRequest) -> BoxFuture<'a, Result<Vec<Score>, ScoreError>> {
        Box::pin(async move {
            let tests = tests_from_reference(req.reference.as_ref())?;
            let runs: Vec<_> = req.items.iter().map(|it| self.score_item(it, &tests)).collect();
            let results: Vec<Result<Score, ScoreError>> = futures::stream::iter(runs).buffered(self.cfg.max_concurrency).collect().await;
            results.into_iter().collect()
        })
    }
}

/// The interpreter's command line, wrapped in the sandbox as configured, with a scrubbed
/// environment (the function's own variables, API keys included, stay out of reach).
fn python_command(cfg: &CodeConfig, args: &[&str]) -> std::process::Command {
    let mut python = vec![cfg.python.clone(), "-I".into(), "-B".into()];
    python.extend(args.iter().map(|a| a.to_string()));
    let argv = match cfg.sandbox {
        SandboxMode::Bwrap => infra::sandbox::sandboxed(&python, &cfg.readable_paths),
        SandboxMode::None => python,
    };
    let mut cmd = std::process::Command::new(&argv[0]);
    cmd.args(&argv[1..]).env_clear().env("PATH", std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into())).env("LC_ALL", "C.UTF-8");
    if cfg.sandbox == SandboxMode::None {
        // No private /tmp here: the system temporary directory, and HOME for version managers'
        // interpreter shims.
        cmd.current_dir(std::env::temp_dir());
        if let Some(home) = std::env::var_os("HOME") {
            cmd.env("HOME", home);
        }
    }
    cmd
}

/// Checks once, at start, that the interpreter runs where candidates will run.
fn probe_python(cfg: &CodeConfig) -> Result<(), String> {
    let out = python_command(cfg, &["-c", "pass"]).stdin(std::process::Stdio::null()).output().map_err(|e| format!("cannot start {}: {e}", cfg.python))?;
    if out.status.success() {
        return Ok(());
    }
    let hint = match cfg.sandbox {
        SandboxMode::Bwrap => " in the sandbox (/root and /home are hidden there: put the interpreter's install in readable_paths)",
        SandboxMode::None => "",
    };
    Err(format!("python {:?} does not run{hint} ({}): {}", cfg.python, out.status, tail_chars(String::from_utf8_lossy(&out.stderr).trim(), 500)))
}

/// What one program run left behind.
struct RunOutput {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    stdout_truncated: bool,
    stderr_truncated: bool,
    timed_out: bool,
    status: String,
}

/// Kills a process group once, when asked or when dropped (the program's, led by the child:
/// a request abandoned mid-run leaves nothing behind).
struct GroupGuard(Option<i32>);

impl GroupGuard {
    fn kill(&mut self) {
        if let Some(pid) = self.0.take() {
            let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The first `cap` bytes of a stream.
struct Capped {
    data: Vec<u8>,
    cap: usize,
    truncated: bool,
}

impl Capped {
    fn new(cap: usize) -> Self {
        Self { data: Vec::new(), cap, truncated: false }
    }
}

/// Reads a stream to its end, keeping at most the cap and discarding the rest (so a chatty
/// program never blocks on a full pipe).
async fn drain<R: AsyncRead + Unpin>(mut r: R, into: Arc<Mutex<Capped>>) {
    let mut buf = vec![0u8; 8192];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                let mut c = into.lock().unwrap_or_else(|p| p.into_inner());
                let room = c.cap.saturating_sub(c.data.len());
                let keep = room.min(n);
                c.data.extend_from_slice(&buf[..keep]);
                if keep < n {
                    c.truncated = true;
                }
            }
        }
    }
}

/// A fresh unguessable tag: 128 bits from the standard library's hasher, whose keys are random
/// per process (and advance with every use).
fn nonce() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let part = |salt: u64| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(n);
        h.write_u64(salt);
        h.finish()
    };
    format!("{:016x}{:016x}", part(1), part(2))
}

/// The tests a request carries in its reference: `{"tests": ["assert …", …]}`, a list of test
/// strings, or one string of test code (one test).
pub fn tests_from_reference(reference: Option<&serde_json::Value>) -> Result<Vec<String>, ScoreError> {
    const EXPECTED: &str = "code needs tests in the reference: {\"tests\": [\"assert …\", …]}, a list of test strings, or one string of test code";
    let strings = |v: &serde_json::Value| -> Option<Vec<String>> { v.as_array()?.iter().map(|t| t.as_str().map(str::to_string)).collect() };
    let tests = match reference {
        Some(serde_json::Value::String(s)) => vec![s.clone()],
        Some(v @ serde_json::Value::Array(_)) => strings(v).ok_or_else(|| ScoreError::BadRequest(format!("{EXPECTED}; the list holds a non-string")))?,
        Some(serde_json::Value::Object(o)) => match o.get("tests") {
            Some(v) => strings(v).ok_or_else(|| ScoreError::BadRequest(format!("{EXPECTED}; \"tests\" is not a list of strings")))?,
            None => return Err(ScoreError::BadRequest(format!("{EXPECTED}; the object has no \"tests\""))),
        },
        Some(other) => return Err(ScoreError::BadRequest(format!("{EXPECTED}; got {}", json_kind(other)))),
        None => return Err(ScoreError::BadRequest(format!("{EXPECTED}; got none"))),
    };
    if tests.is_empty() || tests.iter().all(|t| t.trim().is_empty()) {
        return Err(ScoreError::BadRequest(format!("{EXPECTED}; got no tests")));
    }
    Ok(tests)
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "an object",
    }
}

/// The candidate program in a response: the last fenced code block that is Python or
/// unlabelled (an unclosed last block runs to the end), else the whole text. The flag says
/// whether a block was found. Blocks indented as a whole (e.g. inside a list) are dedented.
pub fn extract_code(text: &str) -> (String, bool) {
    let mut last: Option<String> = None;
    let mut open: Option<(usize, bool, Vec<&str>)> = None; // (indent, is python, lines)
    for line in text.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        match open.take() {
            None => {
                if let Some(info) = trimmed.strip_prefix("```") {
                    let lang = info.split_whitespace().next().unwrap_or("").to_ascii_lowercase();
                    let python = matches!(lang.as_str(), "" | "python" | "py" | "python3" | "py3");
                    open = Some((indent, python, Vec::new()));
                }
            }
            Some((ind, python, mut lines)) => {
                if trimmed.starts_with("```") && trimmed.trim_end().chars().all(|c| c == '`') {
                    if python {
                        last = Some(dedent(&lines, ind));
                    }
                } else {
                    lines.push(line);
                    open = Some((ind, python, lines));
                }
            }
        }
    }
    if let Some((ind, true, lines)) = open {
        last = Some(dedent(&lines, ind));
    }
    match last {
        Some(code) => (code, true),
        None => (text.to_string(), false),
    }
}

/// Removes up to `indent` leading spaces (the fence's own indentation) from every line.
fn dedent(lines: &[&str], indent: usize) -> String {
    let mut s = String::new();
    for l in lines {
        let strip = l.bytes().take(indent).take_while(|b| *b == b' ').count();
        s.push_str(&l[strip..]);
        s.push('\n');
    }
    s
}

/// The harness for one item: Python source, fed to `python -I -B -`. Strings go in as JSON
/// literals, which are valid Python string literals.
pub fn harness(tag: &str, source: &str, tests: &[String]) -> String {
    let lit = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
    let tests_lit = format!("[{}]", tests.iter().map(|t| lit(t)).collect::<Vec<_>>().join(", "));
    format!("{HARNESS}\n__rollarc_harness({}, {}, {})\n", lit(tag), lit(source), tests_lit)
}

const HARNESS: &str = r#"import os, sys, types

def __rollarc_harness(tag, src, tests):
    # Our own references, taken before the candidate can patch builtins.
    _exec, _compile, _BE, _type, _str, _enum, _exit = exec, compile, BaseException, type, str, enumerate, os._exit
    out = sys.stdout
    write, flush = out.write, out.flush

    def emit(line):
        write(tag + " " + line + "\n")
        flush()

    def describe(e):
        name = _type(e).__name__.replace(" ", "_") or "Exception"
        try:
            m = _str(e)
        except _BE:
            m = "<unprintable>"
        m = m[:300].replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
        return name + " " + m

    def finish():
        emit("DONE")
        try:
            sys.__stderr__.flush()
        except _BE:
            pass
        _exit(0)

    emit("READY")
    sys.stdout = sys.stderr
    mod = types.ModuleType("solution")
    sys.modules["solution"] = mod
    ns = mod.__dict__
    try:
        _exec(_compile(src, "<candidate>", "exec"), ns)
    except _BE as e:
        emit("LOAD_FAIL " + describe(e))
        finish()
    for i, t in _enum(tests):
        try:
            _exec(_compile(t, "<test %d>" % i, "exec"), ns)
        except _BE as e:
            emit("TEST %d FAIL " % i + describe(e))
        else:
            emit("TEST %d PASS" % i)
    finish()
"#;

/// A failure as the harness reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct Failure {
    pub error: String,
    pub message: String,
}

/// One test's outcome.
#[derive(Clone, Debug, PartialEq)]
pub enum TestOutcome {
    Pass,
    Fail(Failure),
}

/// What the harness reported.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Markers {
    /// The harness started (before the candidate ran).
    pub ready: bool,
    /// The candidate failed to compile or raised while loading.
    pub load_error: Option<Failure>,
    /// Per test, in order; `None` where nothing was reported.
    pub tests: Vec<Option<TestOutcome>>,
    /// The harness finished every test.
    pub done: bool,
}

/// Reads the marker lines carrying `tag` (anything else is ignored; the first report of a test
/// counts; indices outside `0..total` are ignored).
pub fn parse_markers(stdout: &str, tag: &str, total: usize) -> Markers {
    let mut m = Markers { tests: vec![None; total], ..Markers::default() };
    let failure = |rest: &str| {
        let (error, message) = rest.split_once(' ').unwrap_or((rest, ""));
        Failure { error: error.to_string(), message: message.replace("\\n", "\n").replace("\\r", "\r").replace("\\\\", "\\") }
    };
    for line in stdout.lines() {
        let Some(rest) = line.strip_prefix(tag).and_then(|r| r.strip_prefix(' ')) else { continue };
        let (kind, rest) = rest.split_once(' ').unwrap_or((rest, ""));
        match kind {
            "READY" => m.ready = true,
            "DONE" => m.done = true,
            "LOAD_FAIL" if m.load_error.is_none() => m.load_error = Some(failure(rest)),
            "TEST" => {
                let (idx, rest) = rest.split_once(' ').unwrap_or((rest, ""));
                let Some(slot) = idx.parse::<usize>().ok().and_then(|i| m.tests.get_mut(i)) else { continue };
                if slot.is_some() {
                    continue;
                }
                let (verdict, rest) = rest.split_once(' ').unwrap_or((rest, ""));
                *slot = match verdict {
                    "PASS" => Some(TestOutcome::Pass),
                    "FAIL" => Some(TestOutcome::Fail(failure(rest))),
                    _ => None,
                };
            }
            _ => {}
        }
    }
    m
}

/// The last `max` characters of `s`, marked when cut.
pub fn tail_chars(s: &str, max: usize) -> String {
    let n = s.chars().count();
    if n <= max {
        return s.to_string();
    }
    let tail: String = s.chars().skip(n - max).collect();
    format!("…{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_python_or_plain_block_is_the_program() {
        let cases: [(&str, &str, bool); 8] = [
            ("def f(x):\n    return x\n", "def f(x):\n    return x\n", false),
            ("Here:\n```python\ndef f(): return 1\n```\nDone.", "def f(): return 1\n", true),
            ("```\nx = 1\n```\nthen\n```py\nx = 2\n```\n", "x = 2\n", true),
            ("```python\nx = 1\n```\n```bash\nrm -rf /\n```\n", "x = 1\n", true),
            ("1. step\n   ```python\n   def f():\n       return 3\n   ```\n", "def f():\n    return 3\n", true),
            ("```python\ndef f():\n    return 4", "def f():\n    return 4\n", true),
            ("```bash\nls\n```", "```bash\nls\n```", false),
            ("", "", false),
        ];
        for (text, want, fenced) in cases {
            assert_eq!(extract_code(text), (want.to_string(), fenced), "{text:?}");
        }
    }

    #[test]
    fn markers_are_read_only_with_the_tag() {
        let tag = "__ROLLARC__abc";
        let out = "__ROLLARC__abc READY\n\
                   __ROLLARC__xyz TEST 1 PASS\n\
                   __ROLLARC__abc TEST 0 PASS\n\
                   __ROLLARC__abc TEST 1 FAIL AssertionError line\\nnext \\\\ end\n\
                   __ROLLARC__abc TEST 1 PASS\n\
                   __ROLLARC__abc TEST 7 PASS\n\
                   __ROLLARC__abc TEST x PASS\n\
                   __ROLLARC__abcd TEST 2 PASS\n\
                   garbage\n\
                   __ROLLARC__abc DONE\n";
        let m = parse_markers(out, tag, 3);
        assert!(m.ready && m.done && m.load_error.is_none());
        assert_eq!(m.tests[0], Some(TestOutcome::Pass));
        assert_eq!(m.tests[1], Some(TestOutcome::Fail(Failure { error: "AssertionError".into(), message: "line\nnext \\ end".into() })));
        assert_eq!(m.tests[2], None, "another tag or a longer one does not count");
        let m = parse_markers("__ROLLARC__abc READY\n__ROLLARC__abc LOAD_FAIL SyntaxError invalid syntax (<candidate>, line 1)\n", tag, 2);
        assert_eq!(m.load_error.map(|f| f.error), Some("SyntaxError".to_string()));
        assert!(!m.done);
        assert_eq!(parse_markers("", tag, 2), Markers { tests: vec![None, None], ..Markers::default() });
    }

    #[test]
    fn references_carry_tests_in_three_shapes() {
        let j = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap();
        assert_eq!(tests_from_reference(Some(&j(r#"{"tests": ["assert 1", "assert 2"]}"#))).unwrap(), vec!["assert 1", "assert 2"]);
        assert_eq!(tests_from_reference(Some(&j(r#"["assert 1"]"#))).unwrap(), vec!["assert 1"]);
        assert_eq!(tests_from_reference(Some(&j(r#""assert f(1) == 2\nassert f(2) == 3""#))).unwrap().len(), 1);
        for bad in [r#"{"answer": 1}"#, r#"{"tests": "assert 1"}"#, "[1, 2]", "[]", "3", "null", r#""  ""#] {
            let e = tests_from_reference(Some(&j(bad))).unwrap_err();
            assert!(matches!(&e, ScoreError::BadRequest(m) if m.contains("code needs tests")), "{bad}: {e}");
        }
        assert!(tests_from_reference(None).is_err());
    }

    #[test]
    fn the_harness_embeds_arbitrary_text_as_literals() {
        let h = harness("__ROLLARC__t", "s = \"\"\"'\\\0\u{1F600}\"\"\"\n", &["assert '\\n' != \"\\t\"".to_string()]);
        assert!(h.contains(r#"__rollarc_harness("__ROLLARC__t", "s = \"\"\"'\\\u0000😀\"\"\"\n", ["assert '\\n' != \"\\t\""])"#), "{h}");
    }

    #[test]
    fn tags_differ_and_tails_are_bounded() {
        assert_ne!(nonce(), nonce());
        assert_eq!(nonce().len(), 32);
        assert_eq!(tail_chars("abcdef", 3), "…def");
        assert_eq!(tail_chars("äöü", 5), "äöü");
    }

    #[test]
    fn bad_configs_are_refused() {
        for bad in [
            CodeConfig { timeout_s: f64::NAN, sandbox: SandboxMode::None, ..CodeConfig::default() },
            CodeConfig { timeout_s: -1.0, sandbox: SandboxMode::None, ..CodeConfig::default() },
            CodeConfig { max_output_bytes: 10, sandbox: SandboxMode::None, ..CodeConfig::default() },
            CodeConfig { max_concurrency: 0, sandbox: SandboxMode::None, ..CodeConfig::default() },
            CodeConfig { python: " ".into(), sandbox: SandboxMode::None, ..CodeConfig::default() },
            CodeConfig { python: "/nonexistent/python3".into(), sandbox: SandboxMode::None, ..CodeConfig::default() },
        ] {
            assert!(matches!(CodeScorer::new(bad), Err(ScoreError::BadRequest(_))));
        }
    }

    fn unsandboxed(timeout_s: f64) -> CodeScorer {
        CodeScorer::new(CodeConfig { sandbox: SandboxMode::None, timeout_s, ..CodeConfig::default() }).unwrap()
    }

    async fn run_one(s: &CodeScorer, text: &str, tests: &[&str]) -> Score {
        let item = ScoredItem { trajectory_id: "t".into(), text: text.into(), token_ids: vec![], env_reward: 0.0 };
        let tests: Vec<String> = tests.iter().map(|t| t.to_string()).collect();
        s.score_item(&item, &tests).await.unwrap_or_else(|e| panic!("{text:?}: {e}"))
    }

    /// The harness in a plain child process (the sandbox itself is tested as a process in the
    /// integration tests): verdicts, and the tricks a policy could learn.
    #[tokio::test]
    async fn the_harness_reports_honestly_whatever_the_candidate_does() {
        let s = unsandboxed(20.0);
        let tests = ["assert f(1) == 2", "assert f(2) == 3"];
        let cases: [(&str, f64, [&str; 2]); 7] = [
            ("def f(x):\n    return x + 1\n", 1.0, ["", ""]),
            ("```python\ndef f(x):\n    return 2\n```", 0.5, ["", "AssertionError"]),
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
            ("import sys\ndef f(x):\n    if x == 1:\n        sys.exit(0)\n    return x + 1\n", 0.5, ["SystemExit", ""]),
            // A main block does not run (the namespace is not __main__).
            ("def f(x):\n    return x + 1\nif __name__ == '__main__':\n    raise SystemExit('main ran')\n", 1.0, ["", ""]),
            // Leaving the process early loses the tests not yet reported.
            ("import os\ndef f(x):\n    if x == 2:\n        os._exit(3)\n    return x + 1\n", 0.5, ["", "NoResult"]),
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
        let sc = run_one(&s, "import os\ndef f(x):\n    if x == 2:\n        os._exit(3)\n    return x + 1\n", &tests).await;
        assert_eq!(sc.details["exit"], "exit status 3");
        let sc = run_one(&s, "def f(:\n", &tests).await;
        assert_eq!((sc.score, sc.details["load_error"]["error"].as_str()), (0.0, Some("SyntaxError")), "{}", sc.details);
        let sc = run_one(&s, "print('noise ' * 100000)\ndef f(x):\n    return x + 1\n", &tests).await;
        assert_eq!(sc.score, 1.0, "output past the cap is dropped, not fatal: {}", sc.details);
        assert_eq!(sc.details["stderr_truncated"], true, "the candidate's prints go to stderr");
    }

    #[tokio::test]
    async fn a_hung_program_and_its_children_are_killed_at_the_timeout() {
        let s = unsandboxed(1.0);
        let started = tokio::time::Instant::now();
        let pidfile = std::env::temp_dir().join(format!("rollarc-code-test-{}", nonce()));
        let program =
            format!("import subprocess\np = subprocess.Popen(['sleep', '60'])\nopen({:?}, 'w').write(str(p.pid))\nwhile True:\n    pass\n", pidfile.display());
        let sc = run_one(&s, &program, &["assert True"]).await;
        assert_eq!((sc.score, &sc.details["timed_out"]), (0.0, &serde_json::json!(true)), "{}", sc.details);
        assert_eq!(sc.details["tests"][0]["error"], "Timeout");
        let pid = std::fs::read_to_string(&pidfile).unwrap();
        let _ = std::fs::remove_file(&pidfile);
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        while std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|st| !st.contains(") Z ")) {
            assert!(tokio::time::Instant::now() < deadline, "the program's child {pid} survived the timeout");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        // A child that outlives a finished program (holding its pipes) does not hold the score up.
        let sc = run_one(&s, "import subprocess\nsubprocess.Popen(['sleep', '60'])\n", &["assert True"]).await;
        assert_eq!(sc.score, 1.0, "{}", sc.details);
        assert!(started.elapsed() < std::time::Duration::from_secs(8), "took {:?}", started.elapsed());
    }
}
