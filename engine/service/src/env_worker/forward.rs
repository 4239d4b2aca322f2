//! The gateway forwarder of one managed agent episode on a worker: a listener of its own (a
//! unix socket that the sandbox's in-namespace forwarder connects to, or a loopback port for
//! unsandboxed programs) that passes the program's `/gateway/…` calls to the service's
//! gateway with the episode's key, whatever key the program sent, and streams the answers
//! back. It forwards nothing else, and stops (its socket removed) when dropped.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// A running forwarder.
pub(super) struct Forwarder {
    /// The socket (sandboxed programs).
    pub socket: Option<PathBuf>,
    /// `http://127.0.0.1:PORT` (unsandboxed programs).
    pub url: Option<String>,
    task: tokio::task::JoinHandle<()>,
    dir: Option<PathBuf>,
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.task.abort();
        if let Some(d) = &self.dir {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

struct Route {
    client: reqwest::Client,
    /// The service's base URL.
    base: String,
    key: String,
    calls: Arc<AtomicU64>,
}

/// Headers not passed on: the caller's credentials (replaced by the episode's key), and
/// those of one hop's connection.
fn passed(name: &HeaderName) -> bool {
    !matches!(
        name.as_str(),
        "authorization"
            | "x-api-key"
            | "host"
            | "connection"
            | "keep-alive"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "content-length"
    )
}

/// Starts a forwarder to the gateway of the service at `base` for the episode's `key`,
/// counting the calls it forwards in `calls`: on a unix socket (`unix`) or a loopback port.
pub(super) async fn start(
    client: reqwest::Client,
    base: &str,
    key: &str,
    unix: bool,
    calls: Arc<AtomicU64>,
) -> std::io::Result<Forwarder> {
    let route = Arc::new(Route {
        client,
        base: base.trim_end_matches('/').to_string(),
        key: key.to_string(),
        calls,
    });
    let app = axum::Router::new().fallback(forward).with_state(route);
    if unix {
        use std::os::unix::fs::PermissionsExt;
        let dir = infra::sandbox::shared_dir("rollarc-forward")?;
        let path = dir.join("gateway.sock");
        let listener = match tokio::net::UnixListener::bind(&path) {
            Ok(l) => l,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        // The sandbox runs under another uid; the socket reaches only this episode's calls.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))?;
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Forwarder {
            socket: Some(path),
            url: None,
            task,
            dir: Some(dir),
        })
    } else {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let url = format!("http://{}", listener.local_addr()?);
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Forwarder {
            socket: None,
            url: Some(url),
            task,
            dir: None,
        })
    }
}

/// An error in the shape both SDKs read (`{"error": {"message", "type"}}`).
fn refuse(status: StatusCode, message: String) -> Response {
    (
        status,
        axum::Json(json!({"error": {"message": message, "type": "forwarder_error"}})),
    )
        .into_response()
}

async fn forward(State(r): State<Arc<Route>>, req: axum::extract::Request) -> Response {
    let (parts, body) = req.into_parts();
    if !parts.uri.path().starts_with("/gateway/") {
        return refuse(
            StatusCode::NOT_FOUND,
            format!(
                "{}: only the gateway's routes (/gateway/…) are forwarded",
                parts.uri.path()
            ),
        );
    }
    let body = match axum::body::to_bytes(body, gateway::http::DEFAULT_BODY_CAP).await {
        Ok(b) => b,
        Err(_) => {
            return refuse(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "a request body is at most {} bytes",
                    gateway::http::DEFAULT_BODY_CAP
                ),
            );
        }
    };
    let target = format!(
        "{}{}",
        r.base,
        parts.uri.path_and_query().map_or("/", |p| p.as_str())
    );
    let mut call = r.client.request(parts.method, target);
    for (k, v) in &parts.headers {
        if passed(k) {
            call = call.header(k, v);
        }
    }
    r.calls.fetch_add(1, Ordering::Relaxed);
    let answer = match call
        .bearer_auth(&r.key)
        .header("x-api-key", &r.key)
        .body(body)
        .send()
        .await
    {
        Ok(a) => a,
        Err(e) => {
            return refuse(
                StatusCode::BAD_GATEWAY,
                format!(
                    "the service's gateway cannot be reached: {}",
                    infra::error_chain(&e)
                ),
            );
        }
    };
    let mut resp = Response::builder().status(answer.status());
    for (k, v) in answer.headers() {
        if passed(k) {
            resp = resp.header(k, v);
        }
    }
    resp.body(Body::from_stream(answer.bytes_stream()))
        .unwrap_or_else(|e| refuse(StatusCode::BAD_GATEWAY, e.to_string()))
}

/// The reqwest client forwarders share: no overall timeout (an answer may stream for as long
/// as the program runs; the program's time limit bounds it).
pub(super) fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .connect_timeout(std::time::Duration::from_secs(5))
        .build()
        .unwrap_or_default()
}
