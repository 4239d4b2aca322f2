//! An environment served by another program over the protocol (see [`super::protocol`]),
//! optionally inside a sandbox. Every call has a wall-clock timeout; a reply line has a size
//! cap; on timeout, protocol error or close the whole process group is killed.

use std::process::Stdio;
use std::time::Duration;

use infra::process::{Spawned, describe_status};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{ChildStdin, ChildStdout};

use super::protocol::{self, ProtocolError, Request, Response};
use super::starts::{Start, StartCaps, StartPermit};
use super::{EnvError, Environment, Observation, Record, StepOutcome};

/// Bytes of an environment program's stderr kept for error messages (its tail).
pub const STDERR_TAIL_BYTES: usize = 4096;

/// How to start and bound an external environment.
#[derive(Clone, Debug, PartialEq)]
pub struct ExternalConfig {
    /// Program and arguments (already wrapped by the sandbox, if any).
    pub command: Vec<String>,
    pub call_timeout: Duration,
    pub max_message_bytes: usize,
    /// Working directory of the program.
    pub workdir: Option<std::path::PathBuf>,
    /// Protocol version spoken (1, or 2 for dataset rows on reset).
    pub protocol: u32,
}

/// An external environment; its program (and everything it started, its whole process group)
/// is killed when this is dropped.
pub struct ExternalEnv {
    cfg: ExternalConfig,
    proc: Option<Running>,
    /// The task's start caps and warm pool, if it has them.
    starts: Option<std::sync::Arc<ExternalStarts>>,
    /// Held while the program this environment started has not answered yet.
    boot: Option<StartPermit>,
    last_start: Option<Start>,
}

/// Programs started ahead and ready, and those starting.
#[derive(Default)]
struct WarmPool {
    ready: Vec<Running>,
    filling: usize,
}

/// A task's program starts: the caps every start passes and a warm pool of `warm` programs
/// started ahead. A warm program has been started (under the caps) and has answered one
/// request, a reset with seed 0 and no dataset row, so it has booted; its answer is thrown
/// away (`ok: false` counts too: the program is up). The environment that takes it resets
/// it for its own episode. The pool refills in the background after each take; a program
/// that fails its warm-up is killed and not replaced until the next reset asks.
pub struct ExternalStarts {
    cfg: ExternalConfig,
    caps: StartCaps,
    warm: usize,
    pool: std::sync::Mutex<WarmPool>,
    /// Warm-ups that failed (the program did not answer).
    failed: std::sync::atomic::AtomicU64,
}

impl ExternalStarts {
    /// The starts of a task running `cfg`'s program; with `warm > 0` the pool begins to fill
    /// now (inside a tokio runtime).
    pub fn new(cfg: ExternalConfig, caps: StartCaps, warm: usize) -> std::sync::Arc<Self> {
        let me = std::sync::Arc::new(Self {
            cfg,
            caps,
            warm,
            pool: std::sync::Mutex::default(),
            failed: Default::default(),
        });
        me.refill();
        me
    }

    fn pool(&self) -> std::sync::MutexGuard<'_, WarmPool> {
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Started programs ready to be taken.
    pub fn ready(&self) -> usize {
        self.pool().ready.len()
    }

    /// Warm-ups that failed so far.
    pub fn failed_warmups(&self) -> u64 {
        self.failed.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A ready program that still runs (one that exited while it waited is dropped).
    fn take(&self) -> Option<Running> {
        let mut pool = self.pool();
        while let Some(mut p) = pool.ready.pop() {
            if matches!(p.child.try_wait(), Ok(None)) {
                return Some(p);
            }
        }
        None
    }

    /// Starts programs in the background until `warm` are ready or starting.
    fn refill(self: &std::sync::Arc<Self>) {
        use std::sync::atomic::Ordering::Relaxed;
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        loop {
            // Counted and claimed under the pool's lock, so concurrent refills and finishing
            // starts never overshoot `warm`.
            {
                let mut pool = self.pool();
                if pool.ready.len() + pool.filling >= self.warm {
                    return;
                }
                pool.filling += 1;
            }
            let me = std::sync::Arc::clone(self);
            rt.spawn(async move {
                let _permit = me.caps.acquire().await;
                let mut env = ExternalEnv::new(me.cfg.clone());
                let r = env
                    .call(&Request::Reset {
                        v: me.cfg.protocol,
                        episode: None,
                        seed: 0,
                        record: None,
                    })
                    .await;
                let started = match (r, env.proc.take()) {
                    (Ok(_) | Err(EnvError::Reported(_)), Some(p)) => Some(p),
                    (r, _) => {
                        me.failed.fetch_add(1, Relaxed);
                        if let Err(e) = r {
                            tracing::warn!(error = %infra::error_chain(&e), "a warm environment program failed to start");
                        }
                        None
                    }
                };
                let mut pool = me.pool();
                pool.filling -= 1;
                pool.ready.extend(started);
            });
        }
    }
}

struct Running {
    child: Spawned,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// The last [`STDERR_TAIL_BYTES`] the program wrote to stderr (read in the background).
    stderr: std::sync::Arc<std::sync::Mutex<std::collections::VecDeque<u8>>>,
}

/// An environment program started with piped stdio.
pub(super) struct Piped {
    pub(super) child: Spawned,
    pub(super) stdin: ChildStdin,
    pub(super) stdout: ChildStdout,
    /// The last [`STDERR_TAIL_BYTES`] it wrote to stderr (read in the background).
    pub(super) stderr: std::sync::Arc<std::sync::Mutex<std::collections::VecDeque<u8>>>,
}

/// Starts `command` (in `workdir`) in its own process group, so that a kill reaches every
/// process it started, with its stdin and stdout piped and its stderr's tail kept.
pub(super) fn spawn_piped(
    command: &[String],
    workdir: Option<&std::path::Path>,
) -> Result<Piped, EnvError> {
    let Ok(mut cmd) = infra::process::command(command) else {
        return Err(EnvError::EmptyCommand);
    };
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(d) = workdir {
        cmd.current_dir(d);
    }
    let mut child = infra::process::spawn(cmd).map_err(EnvError::Spawn)?;
    let stdin = child.take_stdin().ok_or(EnvError::NoPipe("stdin"))?;
    let stdout = child.take_stdout().ok_or(EnvError::NoPipe("stdout"))?;
    let stderr = std::sync::Arc::default();
    if let Some(e) = child.take_stderr() {
        collect_stderr_tail(e, std::sync::Arc::clone(&stderr));
    }
    Ok(Piped {
        child,
        stdin,
        stdout,
        stderr,
    })
}

/// A kept stderr tail as text (lossy UTF-8, trimmed), if the program wrote any.
pub(super) fn tail_text(tail: &std::sync::Mutex<std::collections::VecDeque<u8>>) -> Option<String> {
    let t = tail.lock().unwrap_or_else(|p| p.into_inner());
    let (a, b) = t.as_slices();
    let text = String::from_utf8_lossy(&[a, b].concat()).trim().to_string();
    (!text.is_empty()).then_some(text)
}

/// Keeps the tail of a program's stderr until it closes it.
fn collect_stderr_tail(
    mut err: tokio::process::ChildStderr,
    tail: std::sync::Arc<std::sync::Mutex<std::collections::VecDeque<u8>>>,
) {
    use tokio::io::AsyncReadExt;
    tokio::spawn(async move {
        let mut buf = [0u8; 1024];
        while let Ok(n) = err.read(&mut buf).await {
            if n == 0 {
                break;
            }
            let mut t = tail.lock().unwrap_or_else(|p| p.into_inner());
            t.extend(&buf[..n]);
            let excess = t.len().saturating_sub(STDERR_TAIL_BYTES);
            t.drain(..excess);
        }
    });
}

impl ExternalEnv {
    pub fn new(cfg: ExternalConfig) -> Self {
        Self {
            cfg,
            proc: None,
            starts: None,
            boot: None,
            last_start: None,
        }
    }

    /// An environment of a task whose starts `starts` controls (its program from the task's
    /// warm pool when one is ready, else started under the task's caps).
    pub fn with_starts(starts: std::sync::Arc<ExternalStarts>) -> Self {
        let mut me = Self::new(starts.cfg.clone());
        me.starts = Some(starts);
        me
    }

    /// Before a reset: how it finds its program (running, from the warm pool, or to be
    /// started under the caps, whose slots are then held until the program answers).
    async fn prepare_start(&mut self) -> Start {
        if self.proc.is_some() {
            return Start::Warm;
        }
        let Some(starts) = self.starts.clone() else {
            return Start::Cold;
        };
        let taken = starts.take();
        starts.refill();
        if let Some(p) = taken {
            self.proc = Some(p);
            return Start::Warm;
        }
        if starts.caps.is_capped() {
            self.boot = Some(starts.caps.acquire().await);
        }
        Start::Cold
    }

    fn start(&mut self) -> Result<&mut Running, EnvError> {
        if self.proc.is_none() {
            let p = spawn_piped(&self.cfg.command, self.cfg.workdir.as_deref())?;
            self.proc = Some(Running {
                child: p.child,
                stdin: p.stdin,
                stdout: BufReader::new(p.stdout),
                stderr: p.stderr,
            });
        }
        self.proc.as_mut().ok_or(EnvError::Closed)
    }

    /// Kills the program and everything it started (and reaps it in the background).
    pub fn kill(&mut self) {
        if let Some(p) = self.proc.take() {
            p.child.kill_in_background();
        }
    }

    /// The tail of the program's stderr so far, if it wrote any.
    fn stderr_tail(&self) -> Option<String> {
        tail_text(&self.proc.as_ref()?.stderr)
    }

    async fn call(&mut self, req: &Request) -> Result<Response, EnvError> {
        let version = self.cfg.protocol;
        let limit = self.cfg.max_message_bytes;
        let timeout = self.cfg.call_timeout;
        let line = serde_json::to_string(req).map_err(EnvError::Encode)?;
        let p = self.start()?;
        let io = async {
            p.stdin.write_all(line.as_bytes()).await?;
            p.stdin.write_all(b"\n").await?;
            p.stdin.flush().await?;
            read_line_capped(&mut p.stdout, limit).await
        };
        let r = match tokio::time::timeout(timeout, io).await {
            Err(_) => Err(EnvError::Timeout(timeout)),
            Ok(Err(e)) => Err(EnvError::Io(e)),
            Ok(Ok(Err(pe))) => Err(EnvError::Protocol(pe)),
            Ok(Ok(Ok(None))) => Err(EnvError::Exited {
                status: p
                    .child
                    .try_wait()
                    .ok()
                    .flatten()
                    .map(|s| describe_status(&s)),
            }),
            Ok(Ok(Ok(Some(reply)))) => {
                protocol::parse_response_v(&reply, version).map_err(EnvError::Protocol)
            }
        };
        match r {
            Ok(resp) => reported(resp),
            Err(e) => {
                // A crash usually says why on stderr (a traceback): give its end with the
                // error. The program's last words may still be in flight after it exited.
                if matches!(e, EnvError::Exited { .. }) {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                let e = match (self.stderr_tail(), e) {
                    (
                        Some(stderr),
                        e @ (EnvError::Exited { .. } | EnvError::Protocol(_) | EnvError::Io(_)),
                    ) => EnvError::WithStderr {
                        error: Box::new(e),
                        stderr,
                    },
                    (_, e) => e,
                };
                // Timeouts and protocol violations leave the stream in an unknown state.
                self.kill();
                Err(e)
            }
        }
    }
}

/// Reads one line of at most `limit` bytes; `None` at end of stream.
pub(super) async fn read_line_capped<R: tokio::io::AsyncBufRead + Unpin>(
    r: &mut R,
    limit: usize,
) -> std::io::Result<Result<Option<String>, ProtocolError>> {
    let mut buf = Vec::new();
    loop {
        let chunk = r.fill_buf().await?;
        if chunk.is_empty() {
            return Ok(if buf.is_empty() {
                Ok(None)
            } else {
                Ok(Some(String::from_utf8_lossy(&buf).into_owned()))
            });
        }
        if let Some(pos) = chunk.iter().position(|&b| b == b'\n') {
            buf.extend_from_slice(&chunk[..pos]);
            r.consume(pos + 1);
            if buf.len() > limit {
                return Ok(Err(ProtocolError::Oversized {
                    limit,
                    start: protocol::excerpt(&String::from_utf8_lossy(&buf[..200.min(buf.len())])),
                }));
            }
            return Ok(Ok(Some(String::from_utf8_lossy(&buf).into_owned())));
        }
        let n = chunk.len();
        buf.extend_from_slice(chunk);
        r.consume(n);
        if buf.len() > limit {
            return Ok(Err(ProtocolError::Oversized {
                limit,
                start: protocol::excerpt(&String::from_utf8_lossy(&buf[..200.min(buf.len())])),
            }));
        }
    }
}

fn info_flag(r: &Response, key: &str) -> bool {
    r.info
        .as_ref()
        .and_then(|i| i.get(key))
        .and_then(|v| v.as_bool())
        .unwrap_or(false)
}

/// A reply that says `ok`, or the failure it reports.
pub(super) fn reported(resp: Response) -> Result<Response, EnvError> {
    if resp.ok {
        Ok(resp)
    } else {
        Err(EnvError::Reported(resp.error.unwrap_or_default()))
    }
}

/// The observation a reset's reply carries (and the task's reference, from its `info`).
pub(super) fn reset_observation(r: Response) -> Observation {
    Observation {
        reference: r.info.as_ref().and_then(|i| i.get("reference")).cloned(),
        text: r.observation.unwrap_or_default(),
        tokens: None,
        sim_response_len: None,
        messages: None,
    }
}

/// A step's outcome from its reply: reward (finite), flags, the observation (with a
/// reference known only at the end) and the rest of `info`.
pub(super) fn step_outcome(r: &Response) -> Result<StepOutcome, EnvError> {
    let reward = r.reward.unwrap_or(0.0);
    if !reward.is_finite() {
        return Err(EnvError::NonFiniteReward(reward));
    }
    Ok(StepOutcome {
        success: info_flag(r, "success"),
        invalid_action: info_flag(r, "invalid_action"),
        observation: Observation {
            text: r.observation.clone().unwrap_or_default(),
            tokens: None,
            sim_response_len: None,
            reference: r.info.as_ref().and_then(|i| i.get("reference")).cloned(),
            messages: None,
        },
        reward,
        terminated: r.terminated.unwrap_or(false),
        truncated: r.truncated.unwrap_or(false),
        info: verdict_info(r.info.as_ref()),
    })
}

/// A step's `info` less what rollarc reads itself (`success`, `invalid_action`, `reference`),
/// capped at 16 KiB of JSON; `None` when nothing is left.
fn verdict_info(info: Option<&serde_json::Value>) -> Option<serde_json::Value> {
    let mut m = info?.as_object()?.clone();
    for k in ["success", "invalid_action", "reference"] {
        m.remove(k);
    }
    if m.is_empty() {
        return None;
    }
    let v = serde_json::Value::Object(m);
    (v.to_string().len() <= 16 << 10)
        .then_some(v)
        .or_else(|| Some(serde_json::json!({ "truncated": "info over 16 KiB left out" })))
}

impl Environment for ExternalEnv {
    async fn reset(&mut self, seed: u64) -> Result<Observation, EnvError> {
        self.reset_with(seed, None).await
    }

    async fn reset_with(
        &mut self,
        seed: u64,
        record: Option<Record>,
    ) -> Result<Observation, EnvError> {
        let v = self.cfg.protocol;
        let record = if v >= protocol::PROTOCOL_V2 {
            record.map(|r| (*r).clone())
        } else {
            None
        };
        let start = self.prepare_start().await;
        let r = self
            .call(&Request::Reset {
                v,
                episode: None,
                seed,
                record,
            })
            .await;
        self.boot = None;
        self.last_start = Some(start);
        Ok(reset_observation(r?))
    }

    async fn step(
        &mut self,
        action: &str,
        _tokens: &crate::tokens::Tokens,
    ) -> Result<StepOutcome, EnvError> {
        let r = self
            .call(&Request::Step {
                v: self.cfg.protocol,
                episode: None,
                action: action.to_string(),
            })
            .await?;
        step_outcome(&r)
    }

    async fn close(&mut self) {
        if self.proc.is_some() {
            let _ = tokio::time::timeout(
                Duration::from_secs(1),
                self.call(&Request::Close {
                    v: self.cfg.protocol,
                    episode: None,
                }),
            )
            .await;
        }
        self.kill();
    }

    fn last_start(&self) -> Option<Start> {
        self.last_start
    }
}

#[cfg(test)]
mod tests {
    use super::verdict_info;
    use serde_json::json;

    #[test]
    fn the_verdict_keeps_what_rollarc_does_not_read_itself() {
        let info = json!({"success": true, "invalid_action": false, "reference": {"answer": "7"},
            "extracted": "7", "checks": [1, 2]});
        assert_eq!(
            verdict_info(Some(&info)),
            Some(json!({"extracted": "7", "checks": [1, 2]}))
        );
        assert_eq!(verdict_info(Some(&json!({"success": false}))), None);
        assert_eq!(verdict_info(None), None);
        let big = json!({"log": "x".repeat(20_000)});
        assert_eq!(
            verdict_info(Some(&big)).unwrap()["truncated"],
            "info over 16 KiB left out"
        );
    }
}
