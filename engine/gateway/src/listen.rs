//! The gateway served on its own listeners, for agents that cannot reach the service's
//! port: a unix socket in a directory of its own (a sandboxed agent reaches it through a
//! forwarder inside its network namespace) and a loopback port (unsandboxed agents, jobs run
//! outside the service).

use std::path::PathBuf;
use std::sync::Arc;

use super::Gateway;

/// The listeners, stopped (and the socket's directory removed) when dropped.
pub struct Listeners {
    /// The unix socket, if one was asked for.
    pub socket: Option<PathBuf>,
    /// `http://127.0.0.1:PORT`, if a loopback port was asked for.
    pub loopback: Option<String>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    dir: Option<PathBuf>,
}

impl Drop for Listeners {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        if let Some(d) = &self.dir {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

impl Listeners {
    /// Serves `gateway` on a new unix socket (`unix`) and a new loopback port (`tcp`).
    pub async fn start(gateway: &Arc<Gateway>, unix: bool, tcp: bool) -> std::io::Result<Self> {
        let mut me = Self {
            socket: None,
            loopback: None,
            tasks: Vec::new(),
            dir: None,
        };
        if unix {
            let dir = infra::sandbox::shared_dir("rollarc-gateway")?;
            me.dir = Some(dir.clone());
            let path = dir.join("gateway.sock");
            let listener = tokio::net::UnixListener::bind(&path)?;
            // Sandboxes run under other uids: they may connect. The socket serves only the
            // gateway's routes, and each call needs an open episode's key.
            {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))?;
            }
            me.tasks.push(super::http::serve(listener, gateway.clone()));
            me.socket = Some(path);
        }
        if tcp {
            let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
            me.loopback = Some(format!("http://{}", listener.local_addr()?));
            me.tasks.push(super::http::serve(listener, gateway.clone()));
        }
        Ok(me)
    }
}
