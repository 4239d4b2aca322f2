//! `rollarc serve` as a child process, for crash tests: start it on a data directory, kill it
//! without warning, and inspect the process groups it left in the data directory's ledger.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running `rollarc serve`; killed with every process under it when dropped ([`kill_tree`]):
/// no test leaves a process behind.
pub struct ServerProcess {
    pub child: Child,
    /// `http://ADDR` the server logged.
    pub base: String,
    /// Whether dropping it kills the processes under it too (not after [`Self::sigkill`], whose
    /// test starts the service again and expects that start to end them).
    sweep: bool,
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if self.sweep {
            kill_tree(self.child.id());
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl ServerProcess {
    /// Starts `rollarc serve` on an OS-assigned port and reads the bound address from its log.
    pub fn start(dir: &std::path::Path) -> Self {
        Self::start_with(dir, None)
    }

    /// The same, with a service config (TOML, written next to the data directory).
    pub fn start_with(dir: &std::path::Path, config: Option<&str>) -> Self {
        Self::start_env(dir, config, &[])
    }

    /// The same, with more environment variables for the service.
    pub fn start_env(dir: &std::path::Path, config: Option<&str>, env: &[(&str, &str)]) -> Self {
        let mut cmd = Command::new(crate::rollarc_bin());
        cmd.envs(env.iter().copied());
        cmd.args(["serve", "--addr", "127.0.0.1:0", "--data-dir"])
            .arg(dir);
        if let Some(c) = config {
            let path = dir.with_extension("serve.toml");
            std::fs::write(&path, c).expect("write the service config");
            cmd.arg("--config").arg(path);
        }
        let mut child = cmd
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn rollarc serve");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(i) = line.find("addr=") {
                    let addr: String = line[i + 5..]
                        .chars()
                        .take_while(|c| !c.is_whitespace())
                        .collect();
                    let _ = tx.send(addr);
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the server logs its address");
        Self {
            child,
            base: format!("http://{addr}"),
            sweep: true,
        }
    }

    /// SIGKILL: no chance to clean up; what it leaves is for the next start on the same data
    /// directory to end.
    pub fn sigkill(mut self) {
        self.sweep = false;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .expect("kill the server");
        drop(self);
    }
}

/// The process groups the ledger of data directory `dir` lists (those the service was running
/// when it stopped; a group closed normally takes its entry with it).
pub fn ledger_groups(dir: &std::path::Path) -> Vec<i32> {
    std::fs::read_dir(dir.join("processes"))
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Whether any live (not zombie) process is in group `pgid`.
pub fn group_alive(pgid: i32) -> bool {
    !group_pids(pgid).is_empty()
}

/// The live (not zombie) processes of group `pgid` (field 5 of `/proc/PID/stat`).
fn group_pids(pgid: i32) -> Vec<u32> {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                let rest = &s[s.rfind(')').map_or(0, |i| i + 1)..];
                let f: Vec<&str> = rest.split_whitespace().collect();
                f.len() > 2 && f[0] != "Z" && f[2] == pgid.to_string()
            })
        })
        .collect()
}

/// (pid, start time) of a process from `/proc/PID/stat`, with its parent.
fn stat(pid: u32) -> Option<(u32, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields from 3 on: state (3), ppid (4), …, starttime (22).
    if f.first() == Some(&"Z") {
        return None;
    }
    Some((f.get(1)?.parse().ok()?, f.get(19)?.parse().ok()?))
}

/// Every live descendant of `root` as (pid, start time), read from `/proc` — independent of
/// the service's own bookkeeping.
pub fn descendants(root: u32) -> Vec<(u32, u64)> {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let all: Vec<(u32, u32, u64)> = procs
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| stat(pid).map(|(ppid, start)| (pid, ppid, start)))
        .collect();
    let mut out = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for &(pid, ppid, start) in &all {
            if ppid == p {
                out.push((pid, start));
                frontier.push(pid);
            }
        }
    }
    out
}

/// SIGKILLs `root` and every process under it, leaving none a window to escape.
///
/// A plain SIGKILL of a service can leave a sandbox behind: one that bubblewrap was still
/// setting up has left the service's group, and asks to die with a parent that may already be
/// gone. So the tree is frozen first: SIGSTOP to each process, repeated until every one is
/// stopped and no new one appears (a stopped process cannot fork, and its children keep their
/// parent), and only then SIGKILL to all.
pub fn kill_tree(root: u32) {
    use nix::sys::signal::{Signal, kill};
    let signal = |p: u32, s| {
        let _ = kill(nix::unistd::Pid::from_raw(p as i32), s);
    };
    let stopped_or_gone = |p: u32| {
        std::fs::read_to_string(format!("/proc/{p}/stat")).map_or(true, |s| {
            let state = s[s.rfind(')').map_or(0, |i| i + 1)..]
                .split_whitespace()
                .next();
            matches!(state, Some("T" | "t" | "Z" | "X") | None)
        })
    };
    let mut tree = std::collections::BTreeSet::from([root]);
    signal(root, Signal::SIGSTOP);
    // Bounded: a tree that keeps changing after 2 s is killed as far as it was seen.
    for _ in 0..2000 {
        let new: Vec<u32> = descendants(root)
            .into_iter()
            .map(|(p, _)| p)
            .filter(|p| !tree.contains(p))
            .collect();
        for &p in &new {
            signal(p, Signal::SIGSTOP);
            tree.insert(p);
        }
        if new.is_empty() && tree.iter().all(|&p| stopped_or_gone(p)) {
            break;
        }
        // Real processes on the real clock, from a `Drop` (no runtime to sleep on).
        #[allow(clippy::disallowed_methods)]
        std::thread::sleep(Duration::from_millis(1));
    }
    for &p in &tree {
        signal(p, Signal::SIGKILL);
    }
}

/// Those of `procs` that still run (the same pid with the same start time).
pub fn still_running(procs: &[(u32, u64)]) -> Vec<(u32, u64)> {
    procs
        .iter()
        .copied()
        .filter(|(pid, start)| stat(*pid).is_some_and(|(_, s)| s == *start))
        .collect()
}

/// A process for a report: pid, parent and command line.
pub fn describe((pid, _): (u32, u64)) -> String {
    let cmd = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default();
    let parent = stat(pid).map_or(0, |(ppid, _)| ppid);
    format!("pid {pid} (parent {parent}): {}", cmd.trim())
}

/// The live members of process group `pgid`, described.
pub fn group_members(pgid: i32) -> String {
    group_pids(pgid)
        .into_iter()
        .map(|pid| describe((pid, 0)))
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    /// A tree whose children left the root's group and session (as a sandbox does) goes whole.
    #[test]
    // Real processes on the real clock.
    #[allow(clippy::disallowed_methods)]
    fn kill_tree_ends_children_that_left_the_group() {
        let mut root = std::process::Command::new("sh")
            .args([
                "-c",
                "setsid sleep 300 & setsid sh -c 'sleep 300 & wait' & wait",
            ])
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut under = super::descendants(root.id());
        while under.len() < 3 {
            assert!(
                std::time::Instant::now() < deadline,
                "tree not up: {under:?}"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
            under = super::descendants(root.id());
        }
        super::kill_tree(root.id());
        let _ = root.wait();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !super::still_running(&under).is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "left running: {:?}",
                super::still_running(&under)
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}
