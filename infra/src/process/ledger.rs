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
        std::fs::write(&f, start_time(pgid)?.to_string()).ok()?;
        Some(f)
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

/// Lists every process group this process starts from now on in `dir`, after killing the
/// groups a previous run left listed there (it died without cleaning up). The first call of
/// a process wins. Returns how many leftover groups were killed.
pub fn use_ledger(dir: &std::path::Path) -> io::Result<usize> {
    std::fs::create_dir_all(dir)?;
    let ledger = Ledger {
        dir: dir.to_path_buf(),
    };
    let killed = ledger.reap()?;
    let _ = LEDGER.set(ledger);
    Ok(killed)
}
