//! A managed inference server: a child process, in its own process group, that the shard
//! starts on a free port, restarts when it dies (with backoff) or when new weights need a new
//! model file, and kills when it is dropped (with the shard, the job, or the service).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::ServerError;

/// How to launch a server. Arguments may hold `{model}`, `{port}`, `{host}`, `{slots}` and
/// `{context}`, replaced at each start.
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchSpec {
    /// Program, then arguments.
    pub command: Vec<String>,
    pub env: Vec<(String, String)>,
    /// Ports to choose from (inclusive); `None`: any free port.
    pub ports: Option<(u16, u16)>,
    /// `CUDA_VISIBLE_DEVICES` for the server (GPUs assigned to this shard), if any.
    pub gpus: Option<String>,
    pub slots: usize,
    /// Context tokens per slot.
    pub context: usize,
    /// Where the server's stdout and stderr go (appended); `None`: discarded.
    pub log: Option<PathBuf>,
}

impl LaunchSpec {
    fn argv(&self, model: &std::path::Path, port: u16) -> Vec<String> {
        let total = (self.slots * self.context).to_string();
        self.command
            .iter()
            .map(|a| {
                a.replace("{model}", &model.to_string_lossy())
                    .replace("{port}", &port.to_string())
                    .replace("{host}", "127.0.0.1")
                    .replace("{slots}", &self.slots.to_string())
                    .replace("{context}", &self.context.to_string())
                    .replace("{total_context}", &total)
            })
            .collect()
    }
}

struct Proc {
    child: Option<infra::process::Spawned>,
    model: PathBuf,
    url: String,
    /// Consecutive starts that died; sets the backoff.
    crashes: u32,
    next_start: Option<tokio::time::Instant>,
}

/// A server process the shard owns.
pub struct ManagedServer {
    spec: LaunchSpec,
    proc: tokio::sync::Mutex<Proc>,
    url: Mutex<String>,
    restarts: std::sync::atomic::AtomicU64,
}

/// Where a server is: a fixed address, or a managed process's current one (it changes when
/// the process restarts).
#[derive(Clone)]
pub enum Endpoint {
    Fixed(String),
    Managed(Arc<ManagedServer>),
}

impl Endpoint {
    pub fn url(&self) -> String {
        match self {
            Self::Fixed(u) => u.trim_end_matches('/').to_string(),
            Self::Managed(s) => s.url(),
        }
    }

    pub fn managed(&self) -> Option<&Arc<ManagedServer>> {
        match self {
            Self::Managed(s) => Some(s),
            Self::Fixed(_) => None,
        }
    }
}

/// Longest wait between restarts of a crashing server.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

impl ManagedServer {
    /// Starts the server on `model`; it is not healthy yet (the client waits for that).
    pub fn start(spec: LaunchSpec, model: PathBuf) -> Result<Arc<Self>, ServerError> {
        let s = Arc::new(Self {
            spec,
            proc: tokio::sync::Mutex::new(Proc {
                child: None,
                model: model.clone(),
                url: String::new(),
                crashes: 0,
                next_start: None,
            }),
            url: Mutex::new(String::new()),
            restarts: Default::default(),
        });
        {
            let mut p = s.proc.try_lock().expect("new");
            s.launch(&mut p)?;
        }
        Ok(s)
    }

    /// The server's base URL (it changes when the server restarts).
    pub fn url(&self) -> String {
        self.url.lock().map(|u| u.clone()).unwrap_or_default()
    }

    /// The server's process id (its process group), while it runs.
    pub async fn pid(&self) -> Option<u32> {
        self.proc.lock().await.child.as_ref().and_then(|c| c.id())
    }

    /// Times the process was started again (crashes and installs).
    pub fn restarts(&self) -> u64 {
        self.restarts.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn describe(&self) -> String {
        self.spec.command.first().cloned().unwrap_or_default()
    }

    fn launch(&self, p: &mut Proc) -> Result<(), ServerError> {
        if let Some(c) = p.child.take() {
            c.kill_in_background();
        }
        let port = free_port(self.spec.ports).ok_or_else(|| {
            ServerError::Other(format!(
                "no free port for {} in {:?}",
                self.describe(),
                self.spec.ports
            ))
        })?;
        let argv = self.spec.argv(&p.model, port);
        let mut cmd = infra::process::command(&argv).map_err(|e| {
            ServerError::Other(format!("launch command: {}", infra::error_chain(&e)))
        })?;
        for (k, v) in &self.spec.env {
            cmd.env(k, v);
        }
        if let Some(g) = &self.spec.gpus {
            cmd.env("CUDA_VISIBLE_DEVICES", g);
        }
        cmd.stdin(std::process::Stdio::null());
        match &self.spec.log {
            Some(path) => {
                let f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|e| {
                        ServerError::Other(format!("server log {}: {e}", path.display()))
                    })?;
                let f2 = f.try_clone().map_err(|e| {
                    ServerError::Other(format!("server log {}: {e}", path.display()))
                })?;
                cmd.stdout(f).stderr(f2);
            }
            None => {
                cmd.stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null());
            }
        }
        let child =
            infra::process::spawn(cmd).map_err(|e| ServerError::Other(infra::error_chain(&e)))?;
        tracing::info!(command = ?argv, pid = ?child.id(), "inference server started");
        p.child = Some(child);
        p.url = format!("http://127.0.0.1:{port}");
        if let Ok(mut u) = self.url.lock() {
            u.clone_from(&p.url);
        }
        Ok(())
    }

    /// Restarts the server on `model` (new weights); it is not healthy yet.
    pub async fn restart_on(&self, model: PathBuf) -> Result<(), ServerError> {
        let mut p = self.proc.lock().await;
        if let Some(mut c) = p.child.take() {
            let _ = c.terminate(Duration::from_secs(5)).await;
        }
        p.model = model;
        p.crashes = 0;
        p.next_start = None;
        self.restarts
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.launch(&mut p)
    }

    /// Whether the process runs; a dead one is started again, after a backoff that doubles
    /// with each crash in a row (1 s, 2 s, … 30 s). Returns false while it is down.
    pub async fn ensure_running(&self) -> bool {
        let mut p = self.proc.lock().await;
        let exited = match p.child.as_mut() {
            Some(c) => match c.try_wait() {
                Ok(None) => return true,
                Ok(Some(status)) => Some(infra::process::describe_status(&status)),
                Err(_) => Some("unknown status".into()),
            },
            None => None,
        };
        let now = tokio::time::Instant::now();
        if let Some(status) = exited {
            p.child = None;
            p.crashes += 1;
            let backoff =
                Duration::from_secs(1u64 << p.crashes.min(5).saturating_sub(1)).min(MAX_BACKOFF);
            tracing::warn!(server = %self.describe(), %status, ?backoff, "inference server exited; restarting it");
            if let Some(log) = &self.spec.log {
                use std::io::Write;
                let _ = std::fs::OpenOptions::new()
                    .append(true)
                    .open(log)
                    .and_then(|mut f| {
                        writeln!(
                            f,
                            "rollarc: the server exited ({status}); restarting it in {backoff:?}"
                        )
                    });
            }
            p.next_start = Some(now + backoff);
        }
        match p.next_start {
            Some(t) if now < t => false,
            _ => {
                p.next_start = None;
                self.restarts
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if let Err(e) = self.launch(&mut p) {
                    tracing::warn!(error = %e, "inference server could not be restarted");
                    p.next_start = Some(now + MAX_BACKOFF);
                }
                false
            }
        }
    }

    /// A healthy answer resets the crash count (the backoff starts again at 1 s).
    pub async fn mark_healthy(&self) {
        self.proc.lock().await.crashes = 0;
    }
}

/// A port nobody listens on, from `range` (inclusive) or any.
fn free_port(range: Option<(u16, u16)>) -> Option<u16> {
    let bind = |port: u16| {
        std::net::TcpListener::bind(("127.0.0.1", port))
            .ok()
            .and_then(|l| l.local_addr().ok())
            .map(|a| a.port())
    };
    match range {
        None => bind(0),
        Some((lo, hi)) => {
            // Start at a different place each time so restarts do not reuse a port in
            // TIME_WAIT first.
            let n = u32::from(hi.saturating_sub(lo)) + 1;
            let off = (std::process::id() ^ rand::random::<u32>()) % n;
            (0..n).map(|i| lo + ((off + i) % n) as u16).find_map(bind)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_filled() {
        let s = LaunchSpec {
            command: vec![
                "srv".into(),
                "-m".into(),
                "{model}".into(),
                "--port={port}".into(),
                "-np".into(),
                "{slots}".into(),
                "-c".into(),
                "{total_context}".into(),
            ],
            env: vec![],
            ports: None,
            gpus: None,
            slots: 4,
            context: 512,
            log: None,
        };
        assert_eq!(
            s.argv(std::path::Path::new("/m.gguf"), 9000),
            vec![
                "srv",
                "-m",
                "/m.gguf",
                "--port=9000",
                "-np",
                "4",
                "-c",
                "2048"
            ]
        );
    }

    #[test]
    fn free_ports_come_from_the_range() {
        let p = free_port(Some((41000, 41010))).unwrap();
        assert!((41000..=41010).contains(&p));
        let held = std::net::TcpListener::bind(("127.0.0.1", 41020)).unwrap();
        assert_eq!(free_port(Some((41020, 41020))), None);
        drop(held);
    }
}
