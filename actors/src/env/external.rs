//! An environment served by another program over the protocol (see [`super::protocol`]),
//! optionally inside a sandbox. Every call has a wall-clock timeout; a reply line has a size
//! cap; on timeout, protocol error or close the whole process group is killed.

use std::process::Stdio;
use std::time::Duration;

use infra::process::{Spawned, describe_status};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{ChildStdin, ChildStdout};

use super::protocol::{self, PROTOCOL_VERSION, ProtocolError, Request, Response};
use super::{EnvError, Environment, Observation, StepOutcome};

/// How to start and bound an external environment.
#[derive(Clone, Debug, PartialEq)]
pub struct ExternalConfig {
    /// Program and arguments (already wrapped by the sandbox, if any).
    pub command: Vec<String>,
    pub call_timeout: Duration,
    pub max_message_bytes: usize,
    /// Working directory of the program.
    pub workdir: Option<std::path::PathBuf>,
}

/// An external environment; its program (and everything it started, its whole process group)
/// is killed when this is dropped.
pub struct ExternalEnv {
    cfg: ExternalConfig,
    proc: Option<Running>,
}

struct Running {
    child: Spawned,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl ExternalEnv {
    pub fn new(cfg: ExternalConfig) -> Self {
        Self { cfg, proc: None }
    }

    fn start(&mut self) -> Result<&mut Running, EnvError> {
        if self.proc.is_none() {
            let Ok(mut cmd) = infra::process::command(&self.cfg.command) else {
                return Err(EnvError::EmptyCommand);
            };
            cmd.stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::null());
            if let Some(d) = &self.cfg.workdir {
                cmd.current_dir(d);
            }
            // Its own process group, so a kill reaches every process it started.
            let mut child = infra::process::spawn(cmd).map_err(EnvError::Spawn)?;
            let stdin = child.take_stdin().ok_or(EnvError::NoPipe("stdin"))?;
            let stdout = BufReader::new(child.take_stdout().ok_or(EnvError::NoPipe("stdout"))?);
            self.proc = Some(Running {
                child,
                stdin,
                stdout,
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

    async fn call(&mut self, req: &Request) -> Result<Response, EnvError> {
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
            Ok(Ok(Ok(Some(reply)))) => protocol::parse_response(&reply).map_err(EnvError::Protocol),
        };
        match r {
            Ok(resp) if resp.ok => Ok(resp),
            Ok(resp) => Err(EnvError::Reported(resp.error.unwrap_or_default())),
            Err(e) => {
                // Timeouts and protocol violations leave the stream in an unknown state.
                self.kill();
                Err(e)
            }
        }
    }
}

/// Reads one line of at most `limit` bytes; `None` at end of stream.
async fn read_line_capped(
    r: &mut BufReader<ChildStdout>,
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

impl Environment for ExternalEnv {
    async fn reset(&mut self, seed: u64) -> Result<Observation, EnvError> {
        let r = self
            .call(&Request::Reset {
                v: PROTOCOL_VERSION,
                seed,
            })
            .await?;
        let reference = r.info.as_ref().and_then(|i| i.get("reference")).cloned();
        Ok(Observation {
            text: r.observation.unwrap_or_default(),
            tokens: None,
            sim_response_len: None,
            reference,
        })
    }

    async fn step(&mut self, action: &str, _tokens: &[u32]) -> Result<StepOutcome, EnvError> {
        let r = self
            .call(&Request::Step {
                v: PROTOCOL_VERSION,
                action: action.to_string(),
            })
            .await?;
        let reward = r.reward.unwrap_or(0.0);
        if !reward.is_finite() {
            return Err(EnvError::NonFiniteReward(reward));
        }
        Ok(StepOutcome {
            success: info_flag(&r, "success"),
            invalid_action: info_flag(&r, "invalid_action"),
            observation: Observation {
                text: r.observation.clone().unwrap_or_default(),
                tokens: None,
                sim_response_len: None,
                reference: None,
            },
            reward,
            terminated: r.terminated.unwrap_or(false),
            truncated: r.truncated.unwrap_or(false),
        })
    }

    async fn close(&mut self) {
        if self.proc.is_some() {
            let _ = tokio::time::timeout(
                Duration::from_secs(1),
                self.call(&Request::Close {
                    v: PROTOCOL_VERSION,
                }),
            )
            .await;
        }
        self.kill();
    }
}
