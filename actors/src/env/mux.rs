//! Environments served by a multiplexed program (protocol version 3, see [`super::protocol`]):
//! one process serves many episodes at once, each message naming its episode. A task's
//! environments share a [`MuxGroup`] of `processes` programs (started on first use, restarted
//! after a failure); environment `i` uses program `i mod processes`.
//!
//! Failure semantics:
//! - A call that gets no reply within the call timeout fails its episode
//!   ([`EnvError::Timeout`]). If the program answered nothing at all since that call was sent,
//!   it is wedged: it is killed, and every episode it held fails.
//! - A program that exits, closes its output or writes a line that is not a reply naming a
//!   waiting episode breaks the stream: it is killed, every episode it held fails
//!   ([`EnvError::ProcessLost`], with the tail of its stderr), and the next `reset` starts a
//!   new one. An episode never continues on another incarnation than the one it was reset on.
//! - A reply naming an episode nobody waits for (a call that already timed out, a `close`
//!   sent without waiting) is dropped.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use infra::process::{Spawned, describe_status};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::process::{ChildStdin, ChildStdout};
use tokio::sync::oneshot;

use super::external::{read_line_capped, spawn_piped, tail_text};
use super::protocol::{self, PROTOCOL_V3, Request, Response};
use super::starts::{Start, StartCaps, StartPermit};
use super::{EnvError, Environment, Observation, Record, StepOutcome};

/// How long a call whose request could not be written waits for the reader to report why
/// the program stopped, before failing it with the write error.
const WRITE_FAILURE_GRACE: Duration = Duration::from_secs(2);

/// How to start and bound a task's multiplexed programs.
#[derive(Clone, Debug, PartialEq)]
pub struct MuxConfig {
    /// Program and arguments (already wrapped by the sandbox, if any).
    pub command: Vec<String>,
    pub call_timeout: Duration,
    pub max_message_bytes: usize,
    pub workdir: Option<std::path::PathBuf>,
    /// Programs serving the task's episodes (at least 1).
    pub processes: usize,
}

/// The programs serving one task's episodes, shared by its environments.
pub struct MuxGroup {
    cfg: MuxConfig,
    slots: Vec<tokio::sync::Mutex<Option<Arc<Incarnation>>>>,
    /// Programs started so far (restarts included).
    started: AtomicU64,
    /// Caps on programs starting at once (a start holds them until its first reply).
    caps: StartCaps,
}

type Waiter = oneshot::Sender<Result<Response, EnvError>>;

/// One run of one program.
struct Incarnation {
    stdin: tokio::sync::Mutex<ChildStdin>,
    child: Mutex<Option<Spawned>>,
    stderr: Arc<Mutex<VecDeque<u8>>>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    waiting: HashMap<String, Waiter>,
    /// Why the program stopped serving, once it has.
    dead: Option<String>,
    /// Reply lines read so far (a program that answers nothing while calls wait is wedged).
    replies: u64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Incarnation {
    fn stderr_tail(&self) -> Option<String> {
        tail_text(&self.stderr)
    }

    fn is_dead(&self) -> bool {
        lock(&self.state).dead.is_some()
    }

    /// Marks the program dead for `why`, kills its process group and fails every waiting
    /// episode. Idempotent: the first reason stays.
    fn fail_all(&self, why: String) {
        let waiting = {
            let mut st = lock(&self.state);
            if st.dead.is_some() {
                return;
            }
            st.dead = Some(why.clone());
            std::mem::take(&mut st.waiting)
        };
        if let Some(child) = lock(&self.child).take() {
            child.kill_in_background();
        }
        for (_, w) in waiting {
            let _ = w.send(Err(EnvError::ProcessLost(why.clone())));
        }
    }

    /// Routes one reply line to the episode waiting for it; `Err` breaks the stream.
    fn route(&self, line: &str) -> Result<(), String> {
        let resp = match protocol::parse_response_v(line, PROTOCOL_V3) {
            Ok(r) => r,
            Err(e) => return Err(infra::error_chain(&e)),
        };
        let Some(episode) = resp.episode.clone() else {
            // A failure that could not name its episode: the program could not read a request.
            return Err(format!(
                "the program failed a request it could not read: {}",
                resp.error.as_deref().unwrap_or("no reason given")
            ));
        };
        let waiter = {
            let mut st = lock(&self.state);
            st.replies += 1;
            st.waiting.remove(&episode)
        };
        match waiter {
            Some(w) => {
                let _ = w.send(Ok(resp));
            }
            None => tracing::debug!(%episode, "a reply no call waits for (timed out or closed)"),
        }
        Ok(())
    }
}

/// Reads replies until the stream ends or breaks, then fails whatever still waits.
async fn read_replies(inc: Arc<Incarnation>, stdout: ChildStdout, limit: usize) {
    let mut r = BufReader::new(stdout);
    let why = loop {
        match read_line_capped(&mut r, limit).await {
            Ok(Ok(Some(line))) => {
                if line.trim().is_empty() {
                    continue;
                }
                if let Err(why) = inc.route(&line) {
                    break why;
                }
            }
            Ok(Ok(None)) => {
                // Give the exit status a moment (up to a second) to be known, and stderr
                // its last words.
                let mut status = None;
                for _ in 0..50 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    let mut child = lock(&inc.child);
                    let Some(c) = child.as_mut() else {
                        break; // already killed and handed to the reaper
                    };
                    status = c.try_wait().ok().flatten().map(|s| describe_status(&s));
                    if status.is_some() {
                        break;
                    }
                }
                break format!(
                    "the program exited ({})",
                    status.as_deref().unwrap_or("status not yet known")
                );
            }
            Ok(Err(e)) => break infra::error_chain(&e),
            Err(e) => break format!("reading its output: {e}"),
        }
    };
    let why = match inc.stderr_tail() {
        Some(tail) => format!("{why}; its stderr ends with:\n{tail}"),
        None => why,
    };
    inc.fail_all(why);
}

impl MuxGroup {
    pub fn new(cfg: MuxConfig) -> Arc<Self> {
        Self::with_caps(cfg, StartCaps::default())
    }

    /// A group whose program starts pass `caps`.
    pub fn with_caps(cfg: MuxConfig, caps: StartCaps) -> Arc<Self> {
        let n = cfg.processes.max(1);
        Arc::new(Self {
            cfg,
            slots: (0..n).map(|_| tokio::sync::Mutex::new(None)).collect(),
            started: AtomicU64::new(0),
            caps,
        })
    }

    /// Environment number `index` of the task (served by program `index mod processes`).
    pub fn env(self: &Arc<Self>, index: u64) -> MuxEnv {
        MuxEnv {
            group: Arc::clone(self),
            slot: (index % self.slots.len() as u64) as usize,
            name: index,
            resets: 0,
            current: None,
            last_start: None,
        }
    }

    /// Programs started so far, restarts included.
    pub fn started(&self) -> u64 {
        self.started.load(Ordering::Relaxed)
    }

    /// The live program of `slot`, started if it has none or its last one stopped. A new one
    /// comes with its start slots, for the caller to hold until it answers.
    async fn live(&self, slot: usize) -> Result<(Arc<Incarnation>, Option<StartPermit>), EnvError> {
        let mut cur = self.slots[slot].lock().await;
        if let Some(inc) = cur.as_ref().filter(|i| !i.is_dead()) {
            return Ok((Arc::clone(inc), None));
        }
        let permit = self.caps.acquire().await;
        let inc = self.start()?;
        *cur = Some(Arc::clone(&inc));
        Ok((inc, Some(permit)))
    }

    fn start(&self) -> Result<Arc<Incarnation>, EnvError> {
        let p = spawn_piped(&self.cfg.command, self.cfg.workdir.as_deref())?;
        let (child, stdin, stdout, stderr) = (p.child, p.stdin, p.stdout, p.stderr);
        self.started.fetch_add(1, Ordering::Relaxed);
        let inc = Arc::new(Incarnation {
            stdin: tokio::sync::Mutex::new(stdin),
            child: Mutex::new(Some(child)),
            stderr,
            state: Mutex::new(State::default()),
        });
        tokio::spawn(read_replies(
            Arc::clone(&inc),
            stdout,
            self.cfg.max_message_bytes,
        ));
        Ok(inc)
    }
}

impl Drop for MuxGroup {
    fn drop(&mut self) {
        for s in &mut self.slots {
            if let Some(inc) = s.get_mut().take() {
                inc.fail_all("the task's environments were closed".into());
            }
        }
    }
}

/// One environment of a task, served by a shared multiplexed program.
pub struct MuxEnv {
    group: Arc<MuxGroup>,
    slot: usize,
    /// This environment's number in its task; episode ids are `{name}.{reset count}`.
    name: u64,
    resets: u64,
    /// The episode in progress and the program it was reset on.
    current: Option<(String, Arc<Incarnation>)>,
    last_start: Option<Start>,
}

impl MuxEnv {
    /// Writes `req` and waits for its reply (at most the call timeout).
    async fn call(
        inc: &Arc<Incarnation>,
        req: &Request,
        timeout: Duration,
    ) -> Result<Response, EnvError> {
        let episode = protocol::request_episode(req)
            .unwrap_or_default()
            .to_string();
        let mut line = serde_json::to_string(req).map_err(EnvError::Encode)?;
        line.push('\n');
        let (tx, rx) = oneshot::channel();
        let replies_before = {
            let mut st = lock(&inc.state);
            if let Some(why) = &st.dead {
                return Err(EnvError::ProcessLost(why.clone()));
            }
            st.waiting.insert(episode.clone(), tx);
            st.replies
        };
        let io = async {
            let written = {
                let mut w = inc.stdin.lock().await;
                async {
                    w.write_all(line.as_bytes()).await?;
                    w.flush().await
                }
                .await
            };
            match written {
                Ok(()) => rx.await,
                Err(e) => {
                    // A closed pipe usually means the program is exiting: give the reader a
                    // moment to see its output end and report the exit status and stderr,
                    // which say more than the broken pipe does.
                    let mut rx = rx;
                    // Within the call's own timeout, which would otherwise fire first.
                    let grace = WRITE_FAILURE_GRACE.min(timeout / 2);
                    match tokio::time::timeout(grace, &mut rx).await {
                        Ok(r) => r,
                        Err(_) => {
                            let why = match inc.stderr_tail() {
                                Some(t) => format!(
                                    "writing to the program: {e}; its stderr ends with:\n{t}"
                                ),
                                None => format!("writing to the program: {e}"),
                            };
                            inc.fail_all(why);
                            rx.await
                        }
                    }
                }
            }
        };
        match tokio::time::timeout(timeout, io).await {
            Ok(Ok(r)) => r,
            // The reader failed every waiter before it dropped them; a sender dropped
            // otherwise means the program is gone.
            Ok(Err(_)) => Err(EnvError::ProcessLost(
                lock(&inc.state)
                    .dead
                    .clone()
                    .unwrap_or_else(|| "the program stopped".into()),
            )),
            Err(_) => {
                let wedged = {
                    let mut st = lock(&inc.state);
                    st.waiting.remove(&episode);
                    st.replies == replies_before
                };
                if wedged {
                    inc.fail_all(format!(
                        "the program answered nothing for {timeout:?} while episodes waited; killed"
                    ));
                }
                Err(EnvError::Timeout(timeout))
            }
        }
    }

    /// Sends `close` for the episode in progress, if any, without waiting for the reply
    /// (the reader drops it).
    fn close_in_background(&mut self) {
        let Some((episode, inc)) = self.current.take() else {
            return;
        };
        if inc.is_dead() {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        handle.spawn(async move {
            let req = Request::Close {
                v: PROTOCOL_V3,
                episode: Some(episode),
            };
            if let Ok(mut line) = serde_json::to_string(&req) {
                line.push('\n');
                let mut w = inc.stdin.lock().await;
                let _ = w.write_all(line.as_bytes()).await;
                let _ = w.flush().await;
            }
        });
    }
}

impl Drop for MuxEnv {
    fn drop(&mut self) {
        self.close_in_background();
    }
}

impl Environment for MuxEnv {
    async fn reset(&mut self, seed: u64) -> Result<Observation, EnvError> {
        self.reset_with(seed, None).await
    }

    async fn reset_with(
        &mut self,
        seed: u64,
        record: Option<Record>,
    ) -> Result<Observation, EnvError> {
        // The previous episode ends first (its close is written before this reset).
        self.close_in_background();
        let (inc, boot) = self.group.live(self.slot).await?;
        self.resets += 1;
        let episode = format!("{}.{}", self.name, self.resets);
        let req = Request::Reset {
            v: PROTOCOL_V3,
            episode: Some(episode.clone()),
            seed,
            record: record.map(|r| (*r).clone()),
        };
        let r = Self::call(&inc, &req, self.group.cfg.call_timeout).await;
        self.last_start = Some(if boot.is_some() {
            Start::Cold
        } else {
            Start::Warm
        });
        drop(boot);
        // Even a failed reset may have created state in the program: close it later.
        self.current = Some((episode, inc));
        let r = super::external::reported(r?)?;
        Ok(super::external::reset_observation(r))
    }

    async fn step(
        &mut self,
        action: &str,
        _tokens: &crate::tokens::Tokens,
    ) -> Result<StepOutcome, EnvError> {
        let Some((episode, inc)) = self.current.clone() else {
            return Err(EnvError::NotReset);
        };
        let req = Request::Step {
            v: PROTOCOL_V3,
            episode: Some(episode),
            action: action.to_string(),
        };
        let r =
            super::external::reported(Self::call(&inc, &req, self.group.cfg.call_timeout).await?)?;
        super::external::step_outcome(&r)
    }

    async fn release(&mut self) {
        self.close_in_background();
    }

    async fn close(&mut self) {
        // Not waited for: a slow program must not hold up the pool, and a close that was
        // never answered must not count as the program being wedged.
        self.close_in_background();
    }

    fn last_start(&self) -> Option<Start> {
        self.last_start
    }
}
