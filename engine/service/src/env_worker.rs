//! `rollarc env-worker`: hosts environment sandboxes for services on other machines and
//! serves their episodes over HTTP (HTTP/2 multiplexed, HTTP/1.1 for probes).
//!
//! API (every route but `/healthz` needs `Authorization: Bearer <token>` when the worker
//! has a token; a wrong or missing one gets 401):
//! - `GET /healthz`: `ok` (200), or `draining` (503) once SIGTERM arrived: a readiness probe
//!   takes the worker out of its Service while it drains. `GET /livez`: 200 while it runs.
//! - `GET /v1/worker`: `{slots, open, draining, tasks, calls, starts, agents}`; `starts` counts
//!   the resets since the worker started that found their program running (`warm`) or started
//!   it, with the median and 99th percentile of their wall time (of the latest 100,000);
//!   `agents` the managed agent episodes `running` now, `runs` since start and the gateway
//!   calls forwarded for them (`forwarded_calls`).
//! - `PUT /v1/tasks/{key}` `{env, call_timeout_s, slots?, max_concurrent_starts?, warm?}`:
//!   registers a task's environment (any spec of the job API's `env` table but `sim`,
//!   `prompt`, `chat` and external agents); the worker resolves and sandboxes its program as a service would, starting at
//!   most `max_concurrent_starts` of its programs at once (and at most the worker's
//!   `--max-concurrent-starts` over all tasks), and keeping `warm` started ahead (default
//!   the worker's `--warm`, at most its slots). Registering the same key again with the
//!   same spec is a no-op; with another spec, 409.
//! - `DELETE /v1/tasks/{key}`: closes the task's episodes and stops its programs.
//! - `POST /v1/tasks/{key}/call`: one environment protocol version-3 request
//!   (`reset`/`step`/`close`, an `episode` id on each); the reply is the protocol's. 404
//!   with `code` `unknown_task` or `unknown_episode`; 503 when a `reset` finds the worker
//!   draining or all its slots open. A reset's reply says how it found its program in the
//!   `x-rollarc-start` header (`warm` or `cold`).
//! - `POST /v1/tasks/{key}/agent` `{episode, key, gateway, row}`: runs a managed agent task's
//!   program for one episode in the sandbox, its gateway calls forwarded to the service at
//!   `gateway` with the episode's `key` (`forward`). The headers (200) come once the episode
//!   holds a slot; the body, `{status, timed_out, stdout, stderr, error}` (the raw wait
//!   status, the ends of both streams), when the program ends. 503 when draining or full; a
//!   client that goes away stops the program.
//!
//! Bounds: `slots` open episodes over all tasks (a reset past them gets 503), at most
//! [`MAX_TASKS`] tasks, bodies of at most [`MAX_BODY_BYTES`]. An episode with no call for
//! its task's `episode_idle_s` (default 1 h) is closed (its client is gone), as is a task
//! without episodes or calls for as long.
//!
//! Drain (SIGTERM or SIGINT): resets are refused, running episodes go on until they close
//! or `drain_timeout` passes; then the worker stops its programs and exits.

use std::sync::Arc;
use std::time::Duration;

use actors::env::protocol;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde_json::json;
use tokio::time::Instant;

mod forward;
mod hosted;
use hosted::error;
pub use hosted::{Registration, Worker};

/// Most tasks a worker hosts at once.
pub const MAX_TASKS: usize = 256;
/// Largest request body (a protocol message with a dataset row, a task's spec).
pub const MAX_BODY_BYTES: usize = protocol::MAX_MESSAGE_BYTES + (64 << 10);
/// Default idle limit of an episode (and of a task without episodes).
pub const DEFAULT_IDLE_S: f64 = 3600.0;

/// How a worker runs.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// Episodes open at once over all tasks.
    pub slots: usize,
    /// The shared bearer token (`None`: no authentication, loopback only unless allowed).
    pub token: Option<String>,
    /// Where the bridges' scripts are written.
    pub scratch: std::path::PathBuf,
    /// How long running episodes may go on after SIGTERM.
    pub drain_timeout: Duration,
    /// Programs starting at once over all tasks (`None`: no cap).
    pub max_concurrent_starts: Option<usize>,
    /// Programs kept started ahead per task, unless its registration says.
    pub warm: usize,
}

/// The worker's HTTP API.
pub fn router(w: Arc<Worker>) -> Router {
    Router::new()
        .route("/v1/worker", get(state))
        .route("/v1/tasks/{key}", put(register).delete(unregister))
        .route("/v1/tasks/{key}/call", post(call))
        .route("/v1/tasks/{key}/agent", post(agent))
        // The routes above need the token; the probes below do not.
        .route_layer(axum::middleware::from_fn_with_state(
            Arc::clone(&w),
            authenticate,
        ))
        .route("/healthz", get(healthz))
        .route("/livez", get(|| async { "ok" }))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(w)
}

/// Lets a request through when it carries the worker's token (or the worker has none).
async fn authenticate(
    State(w): State<Arc<Worker>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match w.refused(req.headers()) {
        Some(r) => r,
        None => next.run(req).await,
    }
}

async fn healthz(State(w): State<Arc<Worker>>) -> Response {
    if w.is_draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining").into_response()
    } else {
        (StatusCode::OK, "ok").into_response()
    }
}

async fn state(State(w): State<Arc<Worker>>) -> Response {
    Json(w.state()).into_response()
}

async fn register(
    State(w): State<Arc<Worker>>,
    Path(key): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    let raw: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("the body is not JSON: {e}"),
            );
        }
    };
    let reg: Registration = match serde_json::from_value(raw.clone()) {
        Ok(r) => r,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("not a task registration: {e}"),
            );
        }
    };
    w.register(&key, reg, raw)
}

async fn unregister(State(w): State<Arc<Worker>>, Path(key): Path<String>) -> Response {
    let closed = w.unregister(&key).await;
    Json(json!({"closed_episodes": closed})).into_response()
}

async fn call(
    State(w): State<Arc<Worker>>,
    Path(key): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    let text = String::from_utf8_lossy(&body);
    match protocol::parse_request(&text) {
        Ok(req) => w.call(&key, req).await,
        Err(e) => error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            infra::error_chain(&e),
        ),
    }
}

async fn agent(
    State(w): State<Arc<Worker>>,
    Path(key): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    match serde_json::from_slice::<hosted::AgentRun>(&body) {
        Ok(run) => w.run_agent(&key, run).await,
        Err(e) => error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("not an agent episode: {e}"),
        ),
    }
}

/// Why a worker cannot start.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("cannot listen on {addr}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "refusing to serve on {addr} without a token: anyone who reaches it could run programs; give --token-file, or --allow-no-token to accept that"
    )]
    NoToken { addr: String },
}

/// Runs a worker on `addr` until SIGTERM/SIGINT, then drains. `ready` gets the bound
/// address once it listens. Without a token it serves only loopback addresses, unless
/// `allow_no_token`.
pub async fn run(
    addr: &str,
    cfg: WorkerConfig,
    allow_no_token: bool,
    ready: impl FnOnce(std::net::SocketAddr),
) -> Result<(), WorkerError> {
    let signalled = infra::shutdown::signal();
    let listen_err = |source| WorkerError::Listen {
        addr: addr.to_string(),
        source,
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(listen_err)?;
    let local = listener.local_addr().map_err(listen_err)?;
    if cfg.token.is_none() && !local.ip().is_loopback() && !allow_no_token {
        return Err(WorkerError::NoToken {
            addr: local.to_string(),
        });
    }
    let drain_timeout = cfg.drain_timeout;
    let w = Worker::new(cfg);
    let reaper = {
        let w = Arc::clone(&w);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(10));
            loop {
                tick.tick().await;
                w.reap().await;
            }
        })
    };
    let stop = tokio_util::sync::CancellationToken::new();
    let server = {
        let stop = stop.clone();
        let app = router(Arc::clone(&w));
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await;
        })
    };
    tracing::info!(addr = %local, slots = w.slots(), "env worker serving");
    ready(local);
    signalled.await;
    w.drain();
    tracing::info!(
        open = w.open(),
        "draining: no new episodes; waiting for the running ones"
    );
    let deadline = Instant::now() + drain_timeout;
    while w.open() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let left = w.open();
    reaper.abort();
    w.close_all().await;
    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(2), server).await;
    tracing::info!(interrupted = left, "env worker stopped");
    Ok(())
}
