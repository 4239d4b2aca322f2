//! The sandbox for untrusted programs (environment processes, code under test): prlimit →
//! bubblewrap → setpriv. Domain-free: it wraps a command line.

/// Resource limits of sandboxed environment programs (applied with `prlimit`; the process
/// count is per uid, and every sandbox runs under its own uid, so it caps a fork bomb without
/// starving the other sandboxes).
pub const SANDBOX_LIMITS: [&str; 4] = [
    "--nproc=512",
    "--as=4294967296",
    "--fsize=104857600",
    "--nofile=256",
];
/// CPU seconds a sandboxed program may use (`prlimit --cpu`), per environment it serves.
pub const SANDBOX_CPU_S: u64 = 600;
/// Sandboxes run as unprivileged uids (and gids) `SANDBOX_UID_BASE + k`, k cycling through
/// `SANDBOX_UIDS` values from a per-process offset: no account, no files on the host, one uid
/// per live sandbox.
pub const SANDBOX_UID_BASE: u32 = 2_000_000;
pub const SANDBOX_UIDS: u32 = 65_536;
static NEXT_SANDBOX: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Host directories a sandboxed program sees, read-only (those that exist): the system's
/// programs, libraries and configuration. Not `/`: the service's data directory, other
/// users' files and host sockets (`/run`, `/var`) stay out of sight.
pub const SANDBOX_SYSTEM_DIRS: [&str; 9] = [
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt",
];

/// Directories no sandbox may see (the service's data directory), resolved.
static PROTECTED: std::sync::Mutex<Vec<std::path::PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Keeps `dir` (e.g. the service's data directory, with every job's spec and trajectories)
/// out of every sandbox: a bind that is `dir`, lies inside it or contains it is dropped. Fails
/// when `dir` lies in a system directory that every sandbox sees read-only.
pub fn protect(dir: &std::path::Path) -> std::io::Result<()> {
    let d = std::fs::canonicalize(dir)?;
    if let Some(sys) = SANDBOX_SYSTEM_DIRS.iter().find(|s| d.starts_with(s)) {
        return Err(std::io::Error::other(format!(
            "{} lies in {sys}, which every sandbox sees read-only: put the data directory elsewhere",
            d.display()
        )));
    }
    let mut p = PROTECTED.lock().unwrap_or_else(|e| e.into_inner());
    if !p.contains(&d) {
        p.push(d);
    }
    Ok(())
}

/// A path the sandbox may bind read-only, resolved (`..`, `//` and symlinks): not the root,
/// not already visible (a system directory), and not a protected directory, inside one or
/// holding one.
fn bindable(p: &std::path::Path) -> Option<String> {
    let c = std::fs::canonicalize(p).ok()?;
    if c.parent().is_none() || SANDBOX_SYSTEM_DIRS.iter().any(|s| c.starts_with(s)) {
        return None;
    }
    let protected = PROTECTED.lock().unwrap_or_else(|e| e.into_inner());
    if protected
        .iter()
        .any(|d| c.starts_with(d) || d.starts_with(&c))
    {
        return None;
    }
    Some(c.to_string_lossy().into_owned())
}

/// The only environment variables a sandboxed program gets (besides `HOME=/tmp`): the
/// service's own environment (tokens, keys, paths) is cleared.
pub const SANDBOX_ENV: [(&str, &str); 4] = [
    ("PATH", "/usr/local/bin:/usr/bin:/bin"),
    ("LANG", "C.UTF-8"),
    ("OPENBLAS_NUM_THREADS", "1"),
    ("PYTHONDONTWRITEBYTECODE", "1"),
];

/// Wraps a command in bubblewrap and setpriv: new network, PID, IPC and UTS namespaces (no
/// network at all), a new session (no terminal to inject into), an empty environment but
/// for [`SANDBOX_ENV`], only the system directories ([`SANDBOX_SYSTEM_DIRS`]) read-only, a
/// private writable `/tmp` as working directory, the directories of the command's absolute
/// paths and `readable` paths bound read-only (e.g. a script's directory, an interpreter's
/// install), killed with its parent; then the uid drops to an unprivileged one with no new
/// privileges; rlimits on processes, address space, CPU time, file size and open files.
pub fn sandboxed(command: &[String], readable: &[String]) -> Vec<String> {
    wrapped(command, readable, true, SANDBOX_CPU_S)
}

/// [`sandboxed`] for a program that serves `slots` environments at once (a multiplexed
/// environment, protocol 3): its CPU-time limit is [`SANDBOX_CPU_S`] per slot, so it lasts
/// as long as that many programs of their own would.
pub fn sandboxed_shared(command: &[String], readable: &[String], slots: usize) -> Vec<String> {
    let cpu = SANDBOX_CPU_S.saturating_mul(slots.max(1) as u64);
    wrapped(command, readable, true, cpu)
}

/// [`sandboxed`], but the program inherits the environment of the process that runs this
/// command line instead of [`SANDBOX_ENV`]: the caller clears that process's environment and
/// sets exactly what the program may see (its `HOME` too). For secrets (an episode's key):
/// a command line is readable by every local user (`/proc/PID/cmdline`), an environment only
/// by its owner.
pub fn sandboxed_inheriting_env(command: &[String], readable: &[String]) -> Vec<String> {
    wrapped(command, readable, false, SANDBOX_CPU_S)
}

fn wrapped(command: &[String], readable: &[String], clear_env: bool, cpu_s: u64) -> Vec<String> {
    let mut v: Vec<String> = vec!["prlimit".into()];
    v.extend(SANDBOX_LIMITS.iter().map(|s| s.to_string()));
    v.push(format!("--cpu={cpu_s}"));
    v.push("--".into());
    // bubblewrap reads the seccomp filter from a descriptor: a shell opens the filter file as
    // descriptor 9 and becomes bubblewrap. (`check_sandbox` fails when the file cannot be
    // written, so a job never runs without the filter.)
    let Ok(filter) = crate::seccomp::filter_file() else {
        // Never without the filter: the program does not run at all.
        return [
            "sh",
            "-c",
            "echo 'rollarc: the sandbox seccomp filter cannot be written' >&2; exit 126",
        ]
        .map(str::to_string)
        .to_vec();
    };
    v.extend(bwrap_args(
        &filter,
        &read_only_binds(command, readable),
        clear_env,
    ));
    v.push("--".into());
    v.extend(setpriv_args());
    v.extend(command.iter().cloned());
    v
}

/// The bubblewrap part of the command line (shell that opens the seccomp `filter`, then
/// `bwrap` and its options): namespaces, the system directories, `/dev`, `/proc`, a private
/// `/tmp`, the `binds` read-only (and the directories above them), the environment.
fn bwrap_args(filter: &std::path::Path, binds: &[String], clear_env: bool) -> Vec<String> {
    let s = |x: &str| x.to_string();
    let mut v = vec![
        s("sh"),
        s("-c"),
        s(r#"exec "$@" 9<"$0""#),
        filter.to_string_lossy().into_owned(),
        s("bwrap"),
        s("--seccomp"),
        s("9"),
    ];
    v.extend(
        [
            "--unshare-net",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent",
            "--new-session",
        ]
        .map(s),
    );
    if clear_env {
        v.push(s("--clearenv"));
    }
    for d in SANDBOX_SYSTEM_DIRS {
        v.extend([s("--ro-bind-try"), s(d), s(d)]);
    }
    v.extend(
        [
            "--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--tmpfs", "/tmp",
        ]
        .map(s),
    );
    for a in traversable_dirs(binds) {
        v.extend([s("--perms"), s("0755"), s("--dir"), a]);
    }
    for p in binds {
        v.extend([s("--ro-bind"), p.clone(), p.clone()]);
    }
    v.extend(["--chdir", "/tmp"].map(s));
    if clear_env {
        v.extend(["--setenv", "HOME", "/tmp"].map(s));
        for (k, val) in SANDBOX_ENV {
            v.extend([s("--setenv"), s(k), s(val)]);
        }
    }
    // The owner's mark, on bubblewrap's command line only (set, then unset: the program's
    // environment stays as above): the next start of a crashed service ends a sandbox that
    // was still being set up when it died (see `process::sandbox_mark`).
    if let Some(mark) = crate::process::sandbox_mark() {
        let var = crate::process::SANDBOX_MARK_VAR;
        v.extend([s("--setenv"), s(var), s(mark), s("--unsetenv"), s(var)]);
    }
    v
}

/// The paths bound read-only, sorted and without repeats: the program's own files (the
/// directory of every absolute path on its command line) and `readable`, those that
/// [`bindable`] allows.
fn read_only_binds(command: &[String], readable: &[String]) -> Vec<String> {
    let own = command.iter().filter_map(|a| own_dir(a));
    let mut binds: Vec<String> = own
        .chain(readable.iter().map(std::path::PathBuf::from))
        .filter_map(|p| bindable(&p))
        .collect();
    binds.sort();
    binds.dedup();
    binds
}

/// The directory an absolute command-line argument makes readable: itself when it is a
/// directory, else its parent.
fn own_dir(arg: &str) -> Option<std::path::PathBuf> {
    if !arg.starts_with('/') {
        return None;
    }
    let p = std::path::Path::new(arg);
    if p.is_dir() {
        Some(p.to_path_buf())
    } else {
        p.parent().filter(|d| d.is_dir()).map(|d| d.to_path_buf())
    }
}

/// The host directory (resolved) that the sandbox binds read-only for one argument of a
/// command line, if any: what a program policy must check for every argument, not only the
/// program (`python3 ok/script.py /home/x/private/notes.txt` exposes `/home/x/private`).
pub fn bound_by_argument(arg: &str) -> Option<String> {
    own_dir(arg).and_then(|d| bindable(&d))
}

/// The directories above each bind, made traversable: bubblewrap would create them with
/// the host's modes, and a hidden home (mode 0700) would keep the unprivileged uid out of
/// an interpreter installed under it (its own shared library is then not found).
fn traversable_dirs(binds: &[String]) -> Vec<String> {
    let mut above: Vec<String> = binds
        .iter()
        .flat_map(|p| {
            std::path::Path::new(p)
                .ancestors()
                .skip(1)
                .map(|a| a.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
        })
        .filter(|a| {
            a != "/"
                && !SANDBOX_SYSTEM_DIRS
                    .iter()
                    .any(|d| std::path::Path::new(a).starts_with(d))
                && a != "/tmp"
                && a != "/dev"
                && a != "/proc"
        })
        .collect();
    above.sort();
    above.dedup();
    above
}

/// The `setpriv` part of the command line: the next sandbox uid (and gid), no supplementary
/// groups, no new privileges.
fn setpriv_args() -> Vec<String> {
    // Each process starts its cycle at its own offset, so that the sandboxes of several
    // processes on one host (a service and its env workers, tests side by side) do not share
    // uids, and with them one process-count limit.
    static OFFSET: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    let offset = *OFFSET.get_or_init(|| std::process::id().wrapping_mul(4099) % SANDBOX_UIDS);
    let k = NEXT_SANDBOX.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let uid = SANDBOX_UID_BASE + offset.wrapping_add(k) % SANDBOX_UIDS;
    [
        "setpriv",
        &format!("--reuid={uid}"),
        &format!("--regid={uid}"),
        "--clear-groups",
        "--no-new-privs",
        "--",
    ]
    .map(str::to_string)
    .to_vec()
}

/// A new directory under the system's temporary directory, named `PREFIX-<pid>-<random>`,
/// that sandboxes (other uids) may read and traverse but only this process writes to: where a
/// sandboxed program's input files and the gateway's socket go. The caller removes it. The
/// first call for a prefix in a process also removes the `PREFIX-<pid>-…` directories of
/// processes that no longer run (a service killed with SIGKILL cannot remove its own).
pub fn shared_dir(prefix: &str) -> std::io::Result<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    static SWEPT: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let tmp = std::env::temp_dir();
    {
        let mut swept = SWEPT.lock().unwrap_or_else(|p| p.into_inner());
        if !swept.iter().any(|p| p == prefix) {
            swept.push(prefix.to_string());
            sweep_orphans(&tmp, prefix);
        }
    }
    let tag = crate::secret::new_token("").map_err(|e| std::io::Error::other(e.to_string()))?;
    let dir = tmp.join(format!("{prefix}-{}-{}", std::process::id(), &tag[..16]));
    std::fs::create_dir(&dir)?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
    Ok(dir)
}

/// Removes `tmp/PREFIX-<pid>-<tag>` directories owned by this user whose process is gone
/// (no `/proc/<pid>`). A recycled pid keeps its directory: only certain orphans go. Assumes
/// the processes writing such directories here share this pid namespace (a host's, or a
/// container's own temporary directory, as the manifests give each container).
fn sweep_orphans(tmp: &std::path::Path, prefix: &str) {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    // Our own uid: the owner of our /proc entry.
    let Ok(me) = std::fs::metadata("/proc/self").map(|m| m.uid()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name
            .to_str()
            .and_then(|n| n.strip_prefix(prefix))
            .and_then(|n| n.strip_prefix('-'))
        else {
            continue;
        };
        let Some((pid, tag)) = rest.split_once('-') else {
            continue;
        };
        let ours = e
            .path()
            .symlink_metadata()
            .is_ok_and(|m| m.is_dir() && m.uid() == me);
        if !ours || tag.len() != 16 || pid.parse::<u32>().is_err() {
            continue;
        }
        if !std::path::Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Why the sandbox cannot be set up here.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("the sandbox's seccomp filter cannot be written to the temporary directory")]
    Seccomp(#[source] std::io::Error),
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
    crate::seccomp::filter_file().map_err(SandboxError::Seccomp)?;
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

#[cfg(test)]
mod tests {
    #[test]
    fn only_the_directories_of_gone_processes_are_swept() {
        let root = std::env::temp_dir().join(format!("rollarc-sweep-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let tag = "0123456789abcdef";
        // No process has pid 999999999 (above the kernel's pid_max).
        let gone = root.join(format!("p-999999999-{tag}"));
        let alive = root.join(format!("p-{}-{tag}", std::process::id()));
        let other = root.join("p-notapid-x");
        let file = root.join(format!("p-999999999-{tag}x"));
        for d in [&gone, &alive, &other] {
            std::fs::create_dir(d).unwrap();
        }
        std::fs::write(gone.join("row.json"), b"{}").unwrap();
        std::fs::write(&file, b"").unwrap();
        super::sweep_orphans(&root, "p");
        assert!(!gone.exists(), "an orphan stayed");
        assert!(alive.exists() && other.exists() && file.exists());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
