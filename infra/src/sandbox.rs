//! The sandbox for untrusted programs (environment processes, code under test): prlimit →
//! bubblewrap → setpriv. Domain-free: it wraps a command line.

/// Resource limits of sandboxed environment programs (applied with `prlimit`; the process
/// count is per uid, and every sandbox runs under its own uid, so it caps a fork bomb without
/// starving the other sandboxes).
pub const SANDBOX_LIMITS: [&str; 5] = [
    "--nproc=512",
    "--as=4294967296",
    "--cpu=600",
    "--fsize=104857600",
    "--nofile=256",
];
/// Sandboxes run as unprivileged uids (and gids) `SANDBOX_UID_BASE + k`, k cycling through
/// `SANDBOX_UIDS` values: no account, no files on the host, one uid per live sandbox.
pub const SANDBOX_UID_BASE: u32 = 2_000_000;
pub const SANDBOX_UIDS: u32 = 65_536;
static NEXT_SANDBOX: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Wraps a command in bubblewrap and setpriv: new network, PID, IPC and UTS namespaces (no
/// network at all), the system read-only, a private writable `/tmp` as working directory, host
/// homes hidden except `readable` paths (bound read-only, e.g. an interpreter's install),
/// killed with its parent; then the uid drops to an unprivileged one with no new privileges;
/// rlimits on processes, address space, CPU time, file size and open files.
pub fn sandboxed(command: &[String], readable: &[String]) -> Vec<String> {
    let mut v: Vec<String> = vec!["prlimit".into()];
    v.extend(SANDBOX_LIMITS.iter().map(|s| s.to_string()));
    v.push("--".into());
    let s = |x: &str| x.to_string();
    v.extend(
        [
            "bwrap",
            "--unshare-net",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent",
            "--new-session",
            "--ro-bind",
            "/",
            "/",
            "--dev",
            "/dev",
            "--proc",
            "/proc",
            "--perms",
            "1777",
            "--tmpfs",
            "/tmp",
            "--tmpfs",
            "/root",
            "--tmpfs",
            "/home",
        ]
        .map(s),
    );
    for p in readable {
        v.extend([s("--ro-bind"), p.clone(), p.clone()]);
    }
    v.extend(
        [
            "--chdir",
            "/tmp",
            "--setenv",
            "HOME",
            "/tmp",
            "--setenv",
            "OPENBLAS_NUM_THREADS",
            "1",
            "--",
        ]
        .map(s),
    );
    let uid = SANDBOX_UID_BASE
        + NEXT_SANDBOX.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % SANDBOX_UIDS;
    v.extend(
        [
            "setpriv",
            &format!("--reuid={uid}"),
            &format!("--regid={uid}"),
            "--clear-groups",
            "--no-new-privs",
            "--",
        ]
        .map(s),
    );
    v.extend(command.iter().cloned());
    v
}

/// Why the sandbox cannot be set up here.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error(
        "bubblewrap cannot create its namespaces here ({status}); set sandbox = \"none\" to run without isolation"
    )]
    Namespaces { status: std::process::ExitStatus },
    #[error(
        "the sandbox needs prlimit, bubblewrap and setpriv; install them (make setup does) or set sandbox = \"none\""
    )]
    Missing(#[source] crate::process::ProcessError),
    #[error("the sandbox probe did not finish within {0:?}")]
    Hung(std::time::Duration),
}

/// The longest the probe may take.
const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Whether the sandbox can be set up here: `bwrap` and `prlimit` are installed and bubblewrap
/// can create its namespaces.
pub fn check_sandbox() -> Result<(), SandboxError> {
    let probe = sandboxed(&["true".to_string()], &[]);
    let mut cmd = std::process::Command::new(&probe[0]);
    cmd.args(&probe[1..]);
    let out = crate::process::run_capped_blocking(cmd, None, 4096, PROBE_TIMEOUT)
        .map_err(SandboxError::Missing)?;
    if out.timed_out {
        return Err(SandboxError::Hung(PROBE_TIMEOUT));
    }
    if !out.status.success() {
        return Err(SandboxError::Namespaces { status: out.status });
    }
    Ok(())
}
