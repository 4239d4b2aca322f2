//! Child processes that take everything they start with them.
//!
//! [`spawn`] starts a command as the leader of its own process group; the [`Spawned`] handle
//! owns a [`GroupGuard`] that SIGKILLs the whole group when it is dropped, so an abandoned
//! request, a cancelled task or a panic leaves no process behind. On top of it:
//! - [`Spawned::terminate`]: SIGTERM to the group, a grace period for the leader to exit,
//!   SIGKILL to the group after it;
//! - [`Spawned::output_capped`] (and [`run_capped`], [`run_capped_blocking`]): feeds stdin,
//!   keeps at most a byte cap of stdout and stderr (discarding the rest, so a chatty program
//!   never blocks on a full pipe, and counting what was dropped), and kills the group at a
//!   timeout;
//! - [`signal_group`] / [`kill_group`] for a group known only by its leader's pid.
//!
//! Domain-free: environments, the code scorer, the function runtime and the benchmarks use it.

use std::io;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use nix::sys::signal::Signal;

mod capture;
mod ledger;
mod spawner;
mod tree;
use capture::drain;
pub use capture::{Capped, truncation_marker};
use ledger::LEDGER;
pub use ledger::{SANDBOX_MARK_VAR, sandbox_mark, use_ledger};
use tokio::io::AsyncWriteExt;
use tokio::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command};
pub use tree::descendants;

/// How long the output readers may still run once the program is gone (a straggler outside
/// the group may hold a pipe open: what was read so far is kept).
pub const DRAIN_GRACE: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("empty command line")]
    EmptyCommand,
    #[error("cannot start {program}")]
    Spawn {
        program: String,
        #[source]
        source: io::Error,
    },
    #[error("waiting for {program}")]
    Wait {
        program: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot build a runtime to run {program}")]
    Runtime {
        program: String,
        #[source]
        source: io::Error,
    },
    #[error("the thread running {program} panicked")]
    Panicked { program: String },
}

/// Sends `sig` to the process group led by `pid`; false when no such group exists (or `pid`
/// is not a valid leader: 0 would mean our own group).
pub fn signal_group(pid: u32, sig: Signal) -> bool {
    match i32::try_from(pid) {
        Ok(p) if p > 0 => nix::sys::signal::killpg(nix::unistd::Pid::from_raw(p), sig).is_ok(),
        _ => false,
    }
}

/// SIGKILLs the process group led by `pid`.
pub fn kill_group(pid: u32) -> bool {
    signal_group(pid, Signal::SIGKILL)
}

/// Kills a process group once: when asked, or when dropped. While it guards a group, the
/// group is listed in the process ledger (when one is in use, see [`use_ledger`]).
#[derive(Debug)]
pub struct GroupGuard {
    pgid: Option<u32>,
    listed: Option<std::path::PathBuf>,
}

impl GroupGuard {
    /// Guards the group led by `pgid` (`None`: nothing to guard).
    pub fn new(pgid: Option<u32>) -> Self {
        let listed = pgid.and_then(|p| LEDGER.get().and_then(|l| l.record(p)));
        Self { pgid, listed }
    }

    /// The guarded group, until it has been killed or disarmed.
    pub fn pgid(&self) -> Option<u32> {
        self.pgid
    }

    /// Sends `sig` to the group (if still guarded).
    pub fn signal(&self, sig: Signal) -> bool {
        self.pgid.is_some_and(|p| signal_group(p, sig))
    }

    /// SIGKILLs the group, once; later calls and the drop do nothing. The group is frozen
    /// first (SIGSTOP: no member forks meanwhile) and the leader's descendants that left it
    /// (`setsid`, as bubblewrap's sandbox init does right after it is cloned) are killed with
    /// it: a group kill alone misses a child that left before it landed and had not yet asked
    /// to die with its parent.
    pub fn kill(&mut self) {
        if let Some(p) = self.pgid.take() {
            signal_group(p, Signal::SIGSTOP);
            for d in descendants(p) {
                if let Ok(d) = i32::try_from(d) {
                    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(d), Signal::SIGKILL);
                }
            }
            kill_group(p);
        }
        if let Some(f) = self.listed.take() {
            let _ = std::fs::remove_file(f);
        }
    }

    /// Stops guarding: the group outlives the guard.
    pub fn disarm(&mut self) -> Option<u32> {
        self.pgid.take()
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A command line (program, then arguments) as a command.
pub fn command(argv: &[String]) -> Result<Command, ProcessError> {
    let (program, args) = argv.split_first().ok_or(ProcessError::EmptyCommand)?;
    let mut cmd = Command::new(program);
    cmd.args(args);
    Ok(cmd)
}

/// Starts `cmd` as the leader of a new process group. Its stdio is as `cmd` says.
///
/// The child dies with this process, even when this process is SIGKILLed and never
/// restarted (no ledger sweep then): it asks for SIGKILL on its parent's death before it
/// runs the program. The kernel sends that signal when the *thread* that forked it exits,
/// so every child is forked by one thread that lives as long as the process ([`spawner`]),
/// never by a tokio blocking thread that exits when idle. (A sandboxed program dies too:
/// bubblewrap's `--die-with-parent` ends its PID namespace. Not a sandbox caught starting,
/// though: bubblewrap's child asks for its death signal only after its setup, and waits in
/// that setup for a parent that is gone. The child lists its group in the ledger before it
/// runs its program, so the next start ends such a group whatever the moment of the crash.)
pub fn spawn(mut cmd: Command) -> Result<Spawned, ProcessError> {
    cmd.process_group(0).kill_on_drop(true);
    let parent = std::process::id();
    let ledger = ledger::ledger_dir();
    // SAFETY: the closure runs between fork and exec and makes system calls only (prctl,
    // getppid, getpid, openat, close), all async-signal-safe, on stack buffers; it allocates
    // nothing on success.
    #[allow(unsafe_code)]
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                .map_err(io::Error::from)?;
            // The parent may have died between fork and prctl: then nothing would signal.
            if nix::unistd::getppid().as_raw() as u32 != parent {
                return Err(io::Error::other("the parent process exited"));
            }
            if let Some(dir) = ledger {
                ledger::list_in_child(dir);
            }
            Ok(())
        });
    }
    let program = cmd.as_std().get_program().to_string_lossy().into_owned();
    match spawner::spawn(cmd) {
        Ok(child) => Ok(Spawned {
            guard: GroupGuard::new(child.id()),
            child,
            program,
        }),
        Err(source) => {
            if let Some(l) = LEDGER.get() {
                l.forget_failed();
            }
            Err(ProcessError::Spawn { program, source })
        }
    }
}

/// A running child, leader of its own process group; the group dies with this handle.
#[derive(Debug)]
pub struct Spawned {
    child: Child,
    program: String,
    guard: GroupGuard,
}

/// How a [`Spawned::terminate`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Terminated {
    pub status: ExitStatus,
    /// The leader outlived the grace period and was SIGKILLed.
    pub killed_after_grace: bool,
}

impl Spawned {
    /// The leader's pid, which is also the group id.
    pub fn id(&self) -> Option<u32> {
        self.guard.pgid()
    }

    /// The program as started.
    pub fn program(&self) -> &str {
        &self.program
    }

    pub fn take_stdin(&mut self) -> Option<ChildStdin> {
        self.child.stdin.take()
    }

    pub fn take_stdout(&mut self) -> Option<ChildStdout> {
        self.child.stdout.take()
    }

    pub fn take_stderr(&mut self) -> Option<ChildStderr> {
        self.child.stderr.take()
    }

    fn wait_error(&self, source: io::Error) -> ProcessError {
        ProcessError::Wait {
            program: self.program.clone(),
            source,
        }
    }

    /// Waits for the leader to exit (cancel safe). The rest of the group lives on until
    /// [`kill`](Self::kill) or the drop.
    pub async fn wait(&mut self) -> Result<ExitStatus, ProcessError> {
        match self.child.wait().await {
            Ok(s) => Ok(s),
            Err(e) => Err(self.wait_error(e)),
        }
    }

    /// The leader's exit status, if it has exited.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>, ProcessError> {
        match self.child.try_wait() {
            Ok(s) => Ok(s),
            Err(e) => Err(self.wait_error(e)),
        }
    }

    /// Sends `sig` to the whole group.
    pub fn signal(&self, sig: Signal) -> bool {
        self.guard.signal(sig)
    }

    /// SIGKILLs the whole group (and the leader, even if it left the group); does not wait.
    pub fn kill(&mut self) {
        self.guard.kill();
        let _ = self.child.start_kill();
    }

    /// SIGKILLs the whole group and reaps the leader.
    pub async fn kill_and_wait(&mut self) -> Result<ExitStatus, ProcessError> {
        self.kill();
        self.wait().await
    }

    /// SIGKILLs the whole group and reaps the leader in the background (on the current tokio
    /// runtime; without one, tokio reaps it as an orphan).
    pub fn kill_in_background(mut self) {
        self.kill();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = self.child.wait().await;
            });
        }
    }

    /// SIGTERM to the group, up to `grace` for the leader to exit, then SIGKILL to the group
    /// (stragglers included, whether or not the leader went in time).
    pub async fn terminate(&mut self, grace: Duration) -> Result<Terminated, ProcessError> {
        self.signal(Signal::SIGTERM);
        let (status, killed_after_grace) =
            match tokio::time::timeout(grace, self.child.wait()).await {
                Ok(Ok(s)) => (s, false),
                Ok(Err(e)) => return Err(self.wait_error(e)),
                Err(_) => (self.kill_and_wait().await?, true),
            };
        self.kill();
        Ok(Terminated {
            status,
            killed_after_grace,
        })
    }

    /// Writes `input` to stdin (then closes it; `None` closes it at once), keeps at most
    /// `limit` bytes of each of stdout and stderr, and waits up to `timeout` for the leader.
    /// Then the whole group is SIGKILLed (everything on a timeout; stragglers otherwise), and
    /// the output readers get [`DRAIN_GRACE`] to finish. Pipes the command did not set up
    /// come back empty.
    pub async fn output_capped(
        self,
        input: Option<Vec<u8>>,
        limit: usize,
        timeout: Duration,
    ) -> Result<CapturedOutput, ProcessError> {
        self.output_into(input, [Capped::new(limit), Capped::new(limit)], timeout)
            .await
    }

    /// [`Self::output_capped`] keeping the *last* `limit` bytes of each stream (a program's
    /// last line, the end of its error output).
    pub async fn output_tail(
        self,
        input: Option<Vec<u8>>,
        limit: usize,
        timeout: Duration,
    ) -> Result<CapturedOutput, ProcessError> {
        self.output_into(input, [Capped::tail(limit), Capped::tail(limit)], timeout)
            .await
    }

    async fn output_into(
        mut self,
        input: Option<Vec<u8>>,
        [out, err]: [Capped; 2],
        timeout: Duration,
    ) -> Result<CapturedOutput, ProcessError> {
        let out = Arc::new(Mutex::new(out));
        let err = Arc::new(Mutex::new(err));
        let readers = [
            self.take_stdout()
                .map(|r| tokio::spawn(drain(r, out.clone()))),
            self.take_stderr()
                .map(|r| tokio::spawn(drain(r, err.clone()))),
        ];
        if let Some(mut stdin) = self.take_stdin()
            && let Some(input) = input
        {
            // A program that dies early only makes this write fail, which its exit status
            // already tells.
            tokio::spawn(async move {
                let _ = stdin.write_all(&input).await;
                let _ = stdin.shutdown().await;
            });
        }
        let (status, timed_out) = match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(Ok(s)) => (Some(s), false),
            Ok(Err(e)) => return Err(self.wait_error(e)),
            Err(_) => (None, true),
        };
        self.kill();
        let status = match status {
            Some(s) => s,
            None => self.wait().await?,
        };
        for r in readers.into_iter().flatten() {
            let abort = r.abort_handle();
            if tokio::time::timeout(DRAIN_GRACE, r).await.is_err() {
                abort.abort();
            }
        }
        let take = |c: &Arc<Mutex<Capped>>| {
            std::mem::take(&mut *c.lock().unwrap_or_else(|p| p.into_inner()))
        };
        Ok(CapturedOutput {
            status,
            timed_out,
            stdout: take(&out),
            stderr: take(&err),
        })
    }
}

/// Runs `cmd` with piped stdio: [`Spawned::output_capped`] on a fresh group.
pub async fn run_capped(
    mut cmd: Command,
    input: Option<Vec<u8>>,
    limit: usize,
    timeout: Duration,
) -> Result<CapturedOutput, ProcessError> {
    cmd.stdin(if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    spawn(cmd)?.output_capped(input, limit, timeout).await
}

/// [`run_capped`] for synchronous callers (start-up probes): runs on a thread of its own with
/// its own runtime, so it works inside and outside a tokio runtime alike.
pub fn run_capped_blocking(
    cmd: std::process::Command,
    input: Option<Vec<u8>>,
    limit: usize,
    timeout: Duration,
) -> Result<CapturedOutput, ProcessError> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let name = program.clone();
    let worker = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| ProcessError::Runtime {
                program: name,
                source,
            })?;
        rt.block_on(run_capped(Command::from(cmd), input, limit, timeout))
    });
    worker
        .join()
        .unwrap_or(Err(ProcessError::Panicked { program }))
}

/// What a capped run left behind.
#[derive(Clone, Debug)]
pub struct CapturedOutput {
    pub status: ExitStatus,
    /// The run hit its timeout and the group was killed.
    pub timed_out: bool,
    pub stdout: Capped,
    pub stderr: Capped,
}

/// `exit status N` or `killed by signal N`.
pub fn describe_status(s: &ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;
    use tokio::io::AsyncBufReadExt;
    use tokio::time::Instant;

    fn sh(script: &str) -> Command {
        let mut c = Command::new("sh");
        c.args(["-c", script]);
        c
    }

    /// Whether `pid` is gone (or a zombie, i.e. dead but not yet reaped by its new parent).
    fn dead(pid: u32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |st| st.contains(") Z "))
    }

    async fn assert_dies(pid: u32) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !dead(pid) {
            assert!(Instant::now() < deadline, "process {pid} survived");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn first_line(p: &mut Spawned) -> String {
        let out = p.take_stdout().expect("piped stdout");
        let mut line = String::new();
        tokio::io::BufReader::new(out)
            .read_line(&mut line)
            .await
            .expect("a line");
        line.trim().to_string()
    }

    #[tokio::test]
    async fn a_kill_reaches_a_descendant_that_left_the_group() {
        // `setsid` puts the sleeper in a session (and group) of its own, as bubblewrap does
        // with its sandbox init; the group kill alone would miss it.
        let mut cmd = sh("setsid sleep 300 & echo $!; wait");
        cmd.stdout(Stdio::piped());
        let mut p = spawn(cmd).unwrap();
        let escaped: u32 = first_line(&mut p).await.parse().unwrap();
        let leader = p.id().unwrap();
        assert!(descendants(leader).contains(&escaped));
        assert!(!descendants(escaped).contains(&leader), "only downwards");
        p.kill_and_wait().await.unwrap();
        assert_dies(escaped).await;
    }

    #[tokio::test]
    async fn a_child_that_ignores_sigterm_is_killed_after_the_grace() {
        let mut cmd = sh("trap '' TERM; echo ready; while :; do sleep 1; done");
        cmd.stdout(Stdio::piped());
        let mut p = spawn(cmd).unwrap();
        assert_eq!(first_line(&mut p).await, "ready");
        let t = Instant::now();
        let grace = Duration::from_millis(200);
        let done = p.terminate(grace).await.unwrap();
        assert!(done.killed_after_grace);
        assert_eq!(done.status.signal(), Some(Signal::SIGKILL as i32));
        assert!(t.elapsed() >= grace && t.elapsed() < Duration::from_secs(5));
        assert_eq!(describe_status(&done.status), "killed by signal 9");

        let mut p = spawn(sh("sleep 30")).unwrap();
        let done = p.terminate(Duration::from_secs(5)).await.unwrap();
        assert!(!done.killed_after_grace, "sleep obeys SIGTERM");
        assert_eq!(done.status.signal(), Some(Signal::SIGTERM as i32));
    }

    #[tokio::test]
    async fn a_grandchild_dies_with_the_group_when_the_handle_drops() {
        let mut cmd = sh("sleep 30 & echo $!; wait");
        cmd.stdout(Stdio::piped());
        let mut p = spawn(cmd).unwrap();
        let grandchild: u32 = first_line(&mut p).await.parse().unwrap();
        let leader = p.id().unwrap();
        assert!(!dead(grandchild));
        drop(p);
        assert_dies(grandchild).await;
        assert_dies(leader).await;

        let mut guard = GroupGuard::new(None);
        guard.kill();
        assert_eq!(guard.disarm(), None, "an empty guard does nothing");
        assert!(!signal_group(0, Signal::SIGKILL), "never our own group");
    }

    #[tokio::test]
    async fn output_over_the_cap_is_cut_and_marked() {
        let out = run_capped(
            sh("head -c 5000 /dev/zero | tr '\\0' a; echo err >&2"),
            None,
            1024,
            Duration::from_secs(10),
        )
        .await
        .unwrap();
        assert!(out.status.success() && !out.timed_out);
        assert_eq!(out.stdout.data, vec![b'a'; 1024]);
        assert_eq!(out.stdout.dropped, 5000 - 1024);
        assert!(out.stdout.truncated());
        assert!(
            out.stdout.text().ends_with(
                "\n[… output truncated: 3976 more bytes past the 1024-byte cap were discarded]"
            ),
            "{}",
            out.stdout.text()
        );
        assert_eq!(out.stderr.text(), "err\n", "under the cap: no marker");

        let echo = run_capped(
            sh("cat; exit 3"),
            Some(b"fed through stdin".to_vec()),
            1024,
            Duration::from_secs(10),
        )
        .await
        .unwrap();
        assert_eq!(echo.stdout.text(), "fed through stdin");
        assert_eq!(describe_status(&echo.status), "exit status 3");
    }

    #[tokio::test]
    async fn a_timeout_kills_the_whole_group() {
        let t = Instant::now();
        let out = run_capped(
            sh("sleep 30 & echo $!; sleep 30"),
            None,
            1024,
            Duration::from_millis(300),
        )
        .await
        .unwrap();
        assert!(out.timed_out);
        assert_eq!(out.status.signal(), Some(Signal::SIGKILL as i32));
        let grandchild: u32 = out.stdout.text().trim().parse().unwrap();
        assert_dies(grandchild).await;
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }

    #[test]
    fn blocking_runs_work_outside_a_runtime_and_failures_are_typed() {
        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", "echo hi"]);
        let out = run_capped_blocking(cmd, None, 64, Duration::from_secs(10)).unwrap();
        assert_eq!(out.stdout.text(), "hi\n");
        let e = run_capped_blocking(
            std::process::Command::new("/nonexistent/program"),
            None,
            64,
            Duration::from_secs(10),
        )
        .unwrap_err();
        assert!(matches!(e, ProcessError::Spawn { .. }), "{e:?}");
        assert!(matches!(command(&[]), Err(ProcessError::EmptyCommand)));
    }
}
