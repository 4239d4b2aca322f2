//! The ledger of process groups (see [`use_ledger`]).

use std::io;

use super::kill_group;

/// The process groups this process started and still guards, one file per group in a
/// directory (named by the leader's pid, holding its start time), so that the next start can
/// end the groups a crash of this process left behind (a SIGKILLed service cannot kill its
/// children). The start time tells a leftover from an unrelated process that reused the pid.
#[derive(Debug)]
pub(super) struct Ledger {
    dir: std::path::PathBuf,
    /// The directory, open: a child lists itself through it before it runs its program
    /// ([`list_in_child`]).
    dir_fd: std::os::fd::OwnedFd,
    /// The mark of this ledger's sandboxes ([`sandbox_mark`]).
    mark: String,
}

/// The variable that marks a sandbox as started by the owner of a ledger: bubblewrap is given
/// `--setenv ROLLARC_SANDBOX <mark> --unsetenv ROLLARC_SANDBOX`, so the mark stands on the
/// command line of each of its processes, which the sandboxed program cannot rewrite, and
/// not in the program's environment.
pub const SANDBOX_MARK_VAR: &str = "ROLLARC_SANDBOX";

/// The mark of the sandboxes started under the ledger in use (`None`: no ledger).
///
/// A sandbox that bubblewrap was still setting up when its parent was SIGKILLed has left the
/// group (`setsid`) and never asked to die with a parent that is already gone: it runs on
/// unlisted. The mark, derived from the ledger's directory, lets the next start on the same
/// directory find and end it.
pub fn sandbox_mark() -> Option<&'static str> {
    LEDGER.get().map(|l| l.mark.as_str())
}

/// The mark of the ledger in `dir`: FNV-1a of its canonical path (stable across builds).
fn mark_for(dir: &std::path::Path) -> String {
    let path = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in path.as_os_str().as_encoded_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("rollarc-{h:016x}")
}

/// SIGKILLs every process whose command line carries `--setenv ROLLARC_SANDBOX <mark>`
/// (bubblewrap's processes of the sandboxes a previous run started); returns how many.
fn kill_marked(mark: &str) -> usize {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let me = std::process::id();
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                let args: Vec<&[u8]> = c.split(|b| *b == 0).collect();
                args.windows(3).any(|w| {
                    w[0] == b"--setenv"
                        && w[1] == SANDBOX_MARK_VAR.as_bytes()
                        && w[2] == mark.as_bytes()
                })
            })
        })
        .filter(|&pid| {
            i32::try_from(pid).is_ok_and(|p| {
                nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(p),
                    nix::sys::signal::Signal::SIGKILL,
                )
                .is_ok()
            })
        })
        .count()
}

pub(super) static LEDGER: std::sync::OnceLock<Ledger> = std::sync::OnceLock::new();

/// Field `n` (1-based, as in proc(5)) of `/proc/{pid}/stat`, from field 3 on.
fn stat_field(pid: u32, n: usize) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name (which may hold spaces and parentheses) come fields 3, 4, …
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace()
        .nth(n.checked_sub(3)?)
        .map(str::to_string)
}

/// The start time of process `pid` (clock ticks since boot), from `/proc`.
fn start_time(pid: u32) -> Option<u64> {
    stat_field(pid, 22)?.parse().ok()
}

/// Whether any live process is in process group `pgid`.
fn group_has_members(pgid: u32) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return false;
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .any(|pid| {
            stat_field(pid, 5).and_then(|g| g.parse::<u32>().ok()) == Some(pgid)
                && stat_field(pid, 3).as_deref() != Some("Z")
        })
}

impl Ledger {
    pub(super) fn record(&self, pgid: u32) -> Option<std::path::PathBuf> {
        let f = self.dir.join(pgid.to_string());
        let Some(t) = start_time(pgid) else {
            // Gone already: drop the entry the child wrote.
            let _ = std::fs::remove_file(&f);
            return None;
        };
        std::fs::write(&f, t.to_string()).ok()?;
        Some(f)
    }

    /// Drops the empty entries of processes that no longer run: children that listed
    /// themselves and then failed to run their program.
    pub(super) fn forget_failed(&self) {
        let Ok(dir) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for e in dir.flatten() {
            let pid = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok());
            let empty = e.metadata().is_ok_and(|m| m.len() == 0);
            if let Some(pid) = pid
                && empty
                && start_time(pid).is_none()
            {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }

    /// Kills every listed group whose leader is still the process that was recorded; empties
    /// the ledger. Returns how many groups were killed.
    fn reap(&self) -> io::Result<usize> {
        let mut killed = 0;
        for entry in std::fs::read_dir(&self.dir)? {
            let path = entry?.path();
            let recorded = std::fs::read_to_string(&path).ok();
            let pgid = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.parse::<u32>().ok());
            // Ours: the leader is the recorded process, or it is gone and members of its group
            // remain (a pid is not reused while a group of that id exists).
            // An empty entry is one a child wrote itself before its parent recorded the start
            // time: its leader died with the parent, so only a leaderless group is ours.
            if let (Some(pgid), Some(t)) = (pgid, recorded) {
                let ours = match start_time(pgid) {
                    Some(now) => t.trim().parse::<u64>().ok() == Some(now),
                    None => group_has_members(pgid),
                };
                if ours && kill_group(pgid) {
                    killed += 1;
                }
            }
            let _ = std::fs::remove_file(&path);
        }
        Ok(killed)
    }
}

/// The open ledger directory, for [`list_in_child`] (`None`: no ledger in use).
pub(super) fn ledger_dir() -> Option<std::os::fd::BorrowedFd<'static>> {
    use std::os::fd::AsFd;
    LEDGER.get().map(|l| l.dir_fd.as_fd())
}

/// Lists the calling process, a child between fork and exec that leads a new group, in the
/// ledger open as `dir`: an empty entry named by its pid, which the parent fills in with the
/// start time once the spawn returns. Without it a parent killed in between would leave the
/// group unlisted, and whatever the child had started meanwhile (a sandbox that had not yet
/// asked to die with its parent) would outlive the next start's sweep. Async-signal-safe:
/// system calls on stack buffers only; best effort (a failure leaves the parent's entry).
pub(super) fn list_in_child(dir: std::os::fd::BorrowedFd<'_>) {
    let mut name = [0u8; 10];
    let mut pid = nix::unistd::getpid().as_raw().unsigned_abs();
    let mut i = name.len();
    loop {
        i -= 1;
        name[i] = b'0' + (pid % 10) as u8;
        pid /= 10;
        if pid == 0 || i == 0 {
            break;
        }
    }
    let _ = nix::fcntl::openat(
        dir,
        &name[i..],
        nix::fcntl::OFlag::O_CREAT | nix::fcntl::OFlag::O_WRONLY | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    );
}

/// Lists every process group this process starts from now on in `dir`, after killing the
/// groups a previous run left listed there (it died without cleaning up) and the sandboxes
/// that carry the directory's mark ([`sandbox_mark`]). The first call of
/// a process wins. Returns how many leftover groups were killed.
pub fn use_ledger(dir: &std::path::Path) -> io::Result<usize> {
    std::fs::create_dir_all(dir)?;
    let dir_fd = nix::fcntl::open(
        dir,
        nix::fcntl::OFlag::O_DIRECTORY | nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(io::Error::from)?;
    let ledger = Ledger {
        dir: dir.to_path_buf(),
        dir_fd,
        mark: mark_for(dir),
    };
    let killed = ledger.reap()? + kill_marked(&ledger.mark);
    let _ = LEDGER.set(ledger);
    Ok(killed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger(dir: &std::path::Path) -> Ledger {
        let dir_fd = nix::fcntl::open(
            dir,
            nix::fcntl::OFlag::O_DIRECTORY | nix::fcntl::OFlag::O_RDONLY,
            nix::sys::stat::Mode::empty(),
        )
        .unwrap();
        Ledger {
            dir: dir.to_path_buf(),
            dir_fd,
            mark: mark_for(dir),
        }
    }

    fn alive(pid: u32) -> bool {
        stat_field(pid, 3).is_some_and(|s| s != "Z")
    }

    #[test]
    fn a_child_lists_itself_before_it_runs_its_program() {
        use std::os::fd::AsFd;
        use std::os::unix::process::CommandExt;
        let tmp = tempfile::tempdir().unwrap();
        let l = ledger(tmp.path());
        let dir = l.dir_fd.as_fd().try_clone_to_owned().unwrap();
        let mut cmd = std::process::Command::new("true");
        // SAFETY: as in `spawn`: system calls on stack buffers only.
        #[allow(unsafe_code)]
        unsafe {
            cmd.pre_exec(move || {
                list_in_child(dir.as_fd());
                Ok(())
            });
        }
        let mut child = cmd.spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        let entry = tmp.path().join(pid.to_string());
        assert_eq!(
            std::fs::read(&entry).unwrap(),
            b"",
            "an empty entry named {pid}"
        );
        // The process is gone: the entry goes with the next clean-up of failed starts.
        l.forget_failed();
        assert!(!entry.exists());
    }

    #[tokio::test]
    async fn an_empty_entry_of_a_leaderless_group_is_killed_and_one_of_a_live_process_is_not() {
        use std::os::unix::process::CommandExt;
        let tmp = tempfile::tempdir().unwrap();
        let l = ledger(tmp.path());
        // A group whose leader exits and leaves a member behind.
        let mut leader = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & echo $!"])
            .process_group(0)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pgid = leader.id();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(leader.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        let member: u32 = line.trim().parse().unwrap();
        leader.wait().unwrap();
        assert!(alive(member));
        std::fs::write(tmp.path().join(pgid.to_string()), "").unwrap();
        // An empty entry whose pid is a live process: not provably ours, left alone.
        let mut other = std::process::Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .unwrap();
        std::fs::write(tmp.path().join(other.id().to_string()), "").unwrap();
        assert_eq!(l.reap().unwrap(), 1);
        for _ in 0..100 {
            if !alive(member) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert!(!alive(member), "the leftover member was killed");
        assert!(alive(other.id()), "the unrelated process lives");
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
        other.kill().unwrap();
        other.wait().unwrap();
    }

    #[test]
    fn marked_processes_of_the_ledgers_directory_are_killed_and_others_are_not() {
        let tmp = tempfile::tempdir().unwrap();
        let mark = mark_for(tmp.path());
        assert_eq!(
            mark,
            mark_for(&tmp.path().join(".")),
            "one mark per directory"
        );
        let other_dir = tempfile::tempdir().unwrap();
        let other_mark = mark_for(other_dir.path());
        assert_ne!(mark, other_mark);
        let start = |m: &str| {
            use std::os::unix::process::CommandExt;
            std::process::Command::new("sh")
                .args([
                    "-c",
                    "sleep 30; true",
                    "sh",
                    "--setenv",
                    SANDBOX_MARK_VAR,
                    m,
                ])
                .process_group(0)
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap()
        };
        let mut ours = start(&mark);
        let mut theirs = start(&other_mark);
        // `spawn` returns once the child has begun its exec, a moment before the kernel sets
        // up its arguments: until then its `cmdline` reads empty (CI once counted 0 killed).
        for child in [&ours, &theirs] {
            let mut tries = 0;
            while !std::fs::read(format!("/proc/{}/cmdline", child.id())).is_ok_and(|c| {
                c.windows(SANDBOX_MARK_VAR.len())
                    .any(|w| w == SANDBOX_MARK_VAR.as_bytes())
            }) {
                tries += 1;
                assert!(tries < 200_000, "the child never showed its command line");
                std::thread::yield_now();
            }
        }
        // `sh` itself, and its child if caught between fork and exec (until it runs `sleep` it
        // carries `sh`'s command line, mark included: CI once counted it).
        let killed = kill_marked(&mark);
        assert!((1..=2).contains(&killed), "{killed} processes killed");
        assert!(ours.wait().unwrap().code().is_none(), "killed by a signal");
        assert!(alive(theirs.id()), "another directory's sandbox lives");
        kill_group(theirs.id());
        kill_group(ours.id());
        theirs.wait().unwrap();
    }
}
