//! Managed agents: the task's program, started once per episode with the dataset row on
//! stdin (and in `$ROLLARC_ROW`) and the gateway's base URLs and the episode's key in its
//! environment; in the sandbox its only way out is a forwarder from a loopback port of its
//! own network namespace to the gateway's unix socket. The episode ends when the program
//! exits or its time is up (its process group is killed).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;

use actors::agent::{
    AgentEpisode, AgentOutcome, AgentReport, AgentRunner, AgentSummary, Message, Renderer, Role,
};
use futures::future::BoxFuture;

use super::{AgentHost, SANDBOX_GATEWAY_PORT, episode_options, secs};
use crate::resolve::EnvProgram;
use crate::spec::{AgentEnv, EnvSandbox};

/// Bytes kept of the end of the program's stdout (its last line is its report) and stderr
/// (the failure reason quotes it).
pub const OUTPUT_TAIL_BYTES: usize = 16 << 10;
/// Characters of stderr quoted in a failure reason.
const STDERR_QUOTED: usize = 2000;

/// Starts the gateway forwarder inside the sandbox, waits until it listens (its port in
/// `/proc/net/tcp`), then becomes the agent. `$0`: socat; `$1`: the socket; `$2`: the port;
/// `$3`: the port in hex.
const FORWARDER: &str = r#"socat="$0"; sock="$1"; port="$2"; hex="$3"; shift 3
"$socat" "TCP-LISTEN:$port,bind=127.0.0.1,fork,reuseaddr" "UNIX-CONNECT:$sock" </dev/null 2>/dev/null &
i=0
until grep -q ":$hex 00000000:0000 0A" /proc/net/tcp 2>/dev/null; do
  i=$((i+1))
  if [ "$i" -gt 1000 ]; then echo "rollarc: the gateway forwarder did not start" >&2; exit 125; fi
  sleep 0.01
done
exec "$@""#;

/// A program's whole environment, as name-value pairs.
type Environ = Vec<(String, String)>;

/// How an agent program reaches the gateway.
#[derive(Clone, Copy, Debug)]
pub enum GatewayWay<'a> {
    /// A unix socket, which a forwarder in the sandbox's network namespace connects to
    /// (sandboxed programs).
    Socket(&'a Path),
    /// A base URL, `http://127.0.0.1:PORT` (unsandboxed programs).
    Url(&'a str),
}

/// A task's agent program, run once per episode: by the service's managed runner, or by an
/// env worker.
#[derive(Clone, Debug)]
pub struct AgentProgram {
    spec: AgentEnv,
    program: EnvProgram,
    /// The host's `socat` (sandboxed programs).
    socat: Option<PathBuf>,
}

impl AgentProgram {
    pub fn new(spec: AgentEnv, program: EnvProgram) -> Result<Self, String> {
        let socat = match program.sandbox {
            EnvSandbox::Bwrap => Some(socat_path().ok_or(
                "a sandboxed agent reaches the gateway through socat, which is not \
                 installed (make setup installs it)",
            )?),
            EnvSandbox::None => None,
        };
        Ok(Self {
            spec,
            program,
            socat,
        })
    }

    /// Whether it runs in the sandbox (and so reaches the gateway through a unix socket).
    pub fn sandboxed(&self) -> bool {
        self.socat.is_some()
    }

    /// The program's time limit.
    pub fn timeout(&self) -> std::time::Duration {
        secs(self.spec.timeout_s)
    }

    /// Runs the program for one episode (`episode`, its key `key`, its `row` on stdin and in
    /// a file), reaching the gateway by `way`, to its end or its time limit.
    pub async fn run(
        &self,
        key: &str,
        episode: &str,
        row: Vec<u8>,
        way: GatewayWay<'_>,
    ) -> Result<infra::process::CapturedOutput, String> {
        let dir = EpisodeDir::new(&row).map_err(|e| format!("cannot write the row file: {e}"))?;
        let (argv, env) = self.command(key, episode, &dir.0, way)?;
        run(&argv, &env, &dir.0, row, self.timeout())
            .await
            .map_err(|e| format!("cannot start the agent: {e}"))
    }

    /// The program's command line and its whole environment for one episode (key `key`, row
    /// file in `dir`). The key goes in the environment, never on a command line (which every
    /// local user can read).
    fn command(
        &self,
        key: &str,
        episode: &str,
        dir: &Path,
        way: GatewayWay<'_>,
    ) -> Result<(Vec<String>, Environ), String> {
        let origin = match (way, &self.socat) {
            (GatewayWay::Socket(_), Some(_)) => format!("http://127.0.0.1:{SANDBOX_GATEWAY_PORT}"),
            (GatewayWay::Url(u), None) => u.trim_end_matches('/').to_string(),
            (GatewayWay::Socket(_), None) => {
                return Err("an unsandboxed agent reaches the gateway by URL".into());
            }
            (GatewayWay::Url(_), Some(_)) => {
                return Err("a sandboxed agent reaches the gateway through a socket".into());
            }
        };
        let mut env: Vec<(String, String)> = infra::sandbox::SANDBOX_ENV
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect();
        env.extend([
            ("OPENAI_BASE_URL".into(), format!("{origin}/gateway/v1")),
            ("OPENAI_API_KEY".into(), key.into()),
            ("ANTHROPIC_BASE_URL".into(), format!("{origin}/gateway")),
            ("ANTHROPIC_API_KEY".into(), key.into()),
            ("ROLLARC_EPISODE".into(), episode.to_string()),
            (
                "ROLLARC_ROW".into(),
                dir.join("row.json").to_string_lossy().into_owned(),
            ),
        ]);
        env.extend(self.spec.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        match (way, &self.socat) {
            (GatewayWay::Socket(sock), Some(socat)) => {
                env.push(("HOME".into(), "/tmp".into()));
                let mut inner = vec![
                    "sh".to_string(),
                    "-c".into(),
                    FORWARDER.into(),
                    socat.to_string_lossy().into_owned(),
                    sock.to_string_lossy().into_owned(),
                    SANDBOX_GATEWAY_PORT.to_string(),
                    format!("{SANDBOX_GATEWAY_PORT:04X}"),
                ];
                inner.extend(self.program.command.iter().cloned());
                let mut readable = self.program.readable.clone();
                readable.push(dir.to_string_lossy().into_owned());
                for p in [sock.parent(), socat.parent()].into_iter().flatten() {
                    readable.push(p.to_string_lossy().into_owned());
                }
                Ok((
                    infra::sandbox::sandboxed_inheriting_env(&inner, &readable),
                    env,
                ))
            }
            _ => {
                // Outside the sandbox the same variables, and only those, are set.
                env.push(("HOME".into(), dir.to_string_lossy().into_owned()));
                Ok((self.program.command.clone(), env))
            }
        }
    }
}

/// Runs a task's agent program per episode, on this machine.
#[derive(Clone)]
pub struct ManagedRunner {
    agent: AgentProgram,
    renderer: Arc<Renderer>,
    gateway: Arc<gateway::Gateway>,
    /// The gateway's unix socket (sandboxed programs) or loopback base URL.
    socket: Option<PathBuf>,
    origin: Option<String>,
}

impl ManagedRunner {
    pub fn new(
        spec: AgentEnv,
        program: EnvProgram,
        renderer: Arc<Renderer>,
        host: &AgentHost,
    ) -> Result<Self, String> {
        let agent = AgentProgram::new(spec, program)?;
        let (socket, origin) = if agent.sandboxed() {
            let s = host
                .listeners
                .socket
                .clone()
                .ok_or("the gateway's socket is not open")?;
            (Some(s), None)
        } else {
            let u = host
                .listeners
                .loopback
                .clone()
                .ok_or("the gateway's loopback port is not open")?;
            (None, Some(u))
        };
        Ok(Self {
            agent,
            renderer,
            gateway: host.access.gateway.clone(),
            socket,
            origin,
        })
    }

    async fn play(&self, ep: AgentEpisode) -> AgentOutcome {
        let started = tokio::time::Instant::now();
        let spec = &self.agent.spec;
        let opts = episode_options(spec, &self.renderer, &ep);
        let opened = match self.gateway.open(opts, Arc::new(ep.shard.clone())) {
            Ok(o) => o,
            Err(e) => return AgentOutcome::Infra(format!("cannot open the episode: {e}")),
        };
        // The key stops working whatever happens next (also when this future is dropped).
        let _finish = super::FinishOnDrop(self.gateway.clone(), Some(opened.key.clone()));
        let way = match (&self.socket, &self.origin) {
            (Some(s), _) => GatewayWay::Socket(s),
            (None, Some(u)) => GatewayWay::Url(u),
            (None, None) => return AgentOutcome::Infra("the gateway is not served".into()),
        };
        let out = match self
            .agent
            .run(
                &opened.key,
                &ep.id.to_string(),
                row_line(&row_value(&ep)),
                way,
            )
            .await
        {
            Ok(o) => o,
            Err(e) => return AgentOutcome::Infra(e),
        };
        let finished = self.gateway.finish(&opened.key).await.unwrap_or_default();
        judge(spec, out, finished, started.elapsed().as_secs_f64(), &ep)
    }
}

impl AgentRunner for ManagedRunner {
    fn run(&self, ep: AgentEpisode) -> BoxFuture<'static, AgentOutcome> {
        let me = self.clone();
        Box::pin(async move { me.play(ep).await })
    }
}

/// The episode's directory (the row file), removed when dropped.
struct EpisodeDir(PathBuf);

impl EpisodeDir {
    fn new(row: &[u8]) -> std::io::Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        let me = Self(infra::sandbox::shared_dir("rollarc-agent")?);
        let file = me.0.join("row.json");
        std::fs::write(&file, row)?;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644))?;
        Ok(me)
    }
}

impl Drop for EpisodeDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The row handed to the agent: the dataset row's fields (`{"row": …}` of the record), or the
/// seed alone for tasks without a dataset.
pub(crate) fn row_value(ep: &AgentEpisode) -> serde_json::Value {
    ep.record
        .as_ref()
        .and_then(|r| r.get("row").cloned())
        .unwrap_or_else(|| serde_json::json!({ "seed": ep.seed }))
}

/// [`row_value`] as the program reads it: one line of JSON.
pub fn row_line(row: &serde_json::Value) -> Vec<u8> {
    let mut v = serde_json::to_vec(row).unwrap_or_default();
    v.push(b'\n');
    v
}

/// Runs the program to its end or its timeout.
async fn run(
    argv: &[String],
    env: &[(String, String)],
    dir: &std::path::Path,
    input: Vec<u8>,
    timeout: std::time::Duration,
) -> Result<infra::process::CapturedOutput, infra::process::ProcessError> {
    let mut cmd = infra::process::command(argv)?;
    cmd.env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .current_dir(dir);
    infra::process::spawn(cmd)?
        .output_tail(Some(input), OUTPUT_TAIL_BYTES, timeout)
        .await
}

/// What the program's last stdout line reports: `{answer, reward?, info?}`.
#[derive(Debug, Default, PartialEq, serde::Deserialize)]
struct LastLine {
    #[serde(default)]
    answer: Option<serde_json::Value>,
    #[serde(default)]
    reward: Option<f64>,
    #[serde(default)]
    info: Option<serde_json::Value>,
}

fn last_line(stdout: &str) -> Option<LastLine> {
    let line = stdout.lines().rev().find(|l| !l.trim().is_empty())?;
    let v: serde_json::Value = serde_json::from_str(line.trim()).ok()?;
    let o = v.as_object()?;
    if !(o.contains_key("answer") || o.contains_key("reward") || o.contains_key("info")) {
        return None;
    }
    serde_json::from_value(v).ok()
}

/// The episode's outcome from how the program ended and what the gateway recorded.
pub(crate) fn judge(
    spec: &AgentEnv,
    out: infra::process::CapturedOutput,
    finished: gateway::Finished,
    wall_s: f64,
    ep: &AgentEpisode,
) -> AgentOutcome {
    use std::os::unix::process::ExitStatusExt;
    let ended = if out.timed_out {
        format!("timed out after {} s", spec.timeout_s)
    } else {
        infra::process::describe_status(&out.status)
    };
    let stderr = quoted_tail(&out.stderr.text());
    let with_stderr = |what: String| match &stderr {
        Some(e) => format!("{what}; its stderr ends with:\n{e}"),
        None => what,
    };
    if !out.status.success() && finished.infra_errors > 0 {
        return AgentOutcome::GenerationFailed(with_stderr(format!(
            "the agent {ended} after the gateway failed {} of its calls",
            finished.infra_errors
        )));
    }
    if finished.turns.is_empty() {
        return AgentOutcome::Infra(with_stderr(format!(
            "the agent {ended} before its first model call"
        )));
    }
    // bubblewrap reports its program's death by signal N as exit status 128 + N.
    let signalled = out.status.signal().is_some()
        || (spec.sandbox == EnvSandbox::Bwrap && out.status.code().is_some_and(|c| c > 128));
    if !out.timed_out && signalled {
        return AgentOutcome::Infra(with_stderr(format!("the agent was {ended}")));
    }
    let reported = last_line(&out.stdout.text()).unwrap_or_default();
    let policy_failure = if out.timed_out || !out.status.success() {
        Some(with_stderr(format!("the agent {ended}")))
    } else {
        finished
            .budget_spent
            .clone()
            .map(|b| format!("the episode's budget was spent: {b}"))
    };
    report(spec, finished, reported, policy_failure, ended, wall_s, ep)
}

/// The report of an agent that ran: its answer and reward (the spec's `failure_reward` for a
/// policy failure, the agent's own where trusted).
fn report(
    spec: &AgentEnv,
    finished: gateway::Finished,
    reported: LastLine,
    policy_failure: Option<String>,
    ended: String,
    wall_s: f64,
    ep: &AgentEpisode,
) -> AgentOutcome {
    let answer = match reported.answer {
        Some(serde_json::Value::String(s)) => s,
        Some(other) => other.to_string(),
        None => last_answer(&finished.transcript),
    };
    let reward = if policy_failure.is_some() {
        Some(spec.failure_reward)
    } else if spec.trust_agent_reward {
        reported.reward.filter(|r| r.is_finite())
    } else {
        None
    };
    AgentOutcome::Done(Box::new(AgentReport {
        turns: finished.turns,
        reward,
        summary: AgentSummary {
            answer,
            transcript: finished.transcript,
            row: ep.record.as_ref().and_then(|r| r.get("row").cloned()),
            info: reported.info,
            policy_failure,
            ended,
            refused_calls: finished.refused,
            wall_s,
            success_above: spec.success_threshold,
        },
    }))
}

/// The last assistant message's text.
pub(crate) fn last_answer(transcript: &[Message]) -> String {
    transcript
        .iter()
        .rev()
        .find(|m| m.role == Role::Assistant)
        .map(|m| m.content.clone())
        .unwrap_or_default()
}

/// The end of a program's stderr, at most [`STDERR_QUOTED`] characters; none when empty.
fn quoted_tail(stderr: &str) -> Option<String> {
    let t = stderr.trim();
    if t.is_empty() {
        return None;
    }
    let n = t.chars().count();
    Some(t.chars().skip(n.saturating_sub(STDERR_QUOTED)).collect())
}

/// The host's `socat` (resolved: the sandbox binds its directory when it lies outside the
/// system directories every sandbox sees).
fn socat_path() -> Option<PathBuf> {
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths)
        .map(|d| d.join("socat"))
        .find(|p| p.is_file())
        .and_then(|p| std::fs::canonicalize(p).ok())
}
