//! `rollarc serve`: the HTTP server with graceful shutdown (signal → stop intake → drain
//! under a grace deadline → interrupt the rest, which resume at the next start).

use std::sync::Arc;
use std::time::Duration;

use http_body::Body as _;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::access::Access;
use crate::service::{Service, ServiceConfig, ServiceError};

pub mod conns;

pub use conns::ClientAddr;
use conns::{ConnTable, HeldBody, TrackedBody};

/// Limits of the HTTP edge.
#[derive(Clone, Copy, Debug)]
pub struct EdgeLimits {
    /// A client must send a request's headers within this (slow-header clients, idle
    /// keep-alive connections are closed after it).
    pub header_read_timeout: Duration,
    /// A request body must be complete within this from its headers (bodies are at most a
    /// few MiB: 30 s is a rate of at least 35 kB/s for the largest); past it the connection
    /// is closed.
    pub body_read_timeout: Duration,
    /// Connections open at once. Past it a new connection evicts the one that has waited
    /// longest for its client (see [`conns`]), or is closed when every one is busy.
    pub max_connections: usize,
    /// Connections one client address may hold at once, under the same rule.
    pub max_connections_per_address: usize,
}

impl Default for EdgeLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            max_connections: 1024,
            max_connections_per_address: 256,
        }
    }
}

/// Serves `app` on `listener` until `stop` is cancelled: HTTP/1.1 connections with a
/// header-read timeout and a body deadline, bounded in number overall and per client
/// address (see [`conns`]); each request carries its [`ClientAddr`]. On stop, the listener
/// closes, every connection finishes its current request, and connections still open after
/// `drain` (event streams) are dropped.
pub async fn serve_on(
    listener: TcpListener,
    app: axum::Router,
    limits: EdgeLimits,
    stop: CancellationToken,
    drain: Duration,
) {
    let table = ConnTable::new(limits.max_connections, limits.max_connections_per_address);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let (stream, peer) = tokio::select! {
            _ = stop.cancelled() => break,
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Some(conn) = table.admit(peer.ip()) else {
            // Every connection in the way is busy serving: this one is closed unanswered.
            continue;
        };
        let conn = Arc::new(conn);
        let svc = {
            let (conn, app) = (conn.clone(), app.clone());
            hyper::service::service_fn(move |req: axum::http::Request<Incoming>| {
                let (conn, app) = (conn.clone(), app.clone());
                async move {
                    let busy = conn.request(!req.body().is_end_stream());
                    let mut req =
                        req.map(|b| axum::body::Body::new(TrackedBody::new(b, conn.clone())));
                    req.extensions_mut().insert(conn.client());
                    let resp = tower::ServiceExt::oneshot(app, req).await?;
                    Ok::<_, std::convert::Infallible>(
                        resp.map(|b| axum::body::Body::new(HeldBody::new(b, busy))),
                    )
                }
            })
        };
        let served = http.serve_connection(TokioIo::new(stream), svc);
        let stop = stop.clone();
        let body_limit = limits.body_read_timeout;
        conns.spawn(async move {
            let mut served = std::pin::pin!(served);
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = served.as_mut() => break,
                    // Evicted: dropping the connection closes it.
                    _ = conn.killed().cancelled() => break,
                    _ = tick.tick() => if conn.body_overdue(body_limit) {
                        break;
                    },
                    _ = stop.cancelled() => {
                        served.as_mut().graceful_shutdown();
                        let _ = served.await;
                        break;
                    }
                }
            }
        });
        while conns.try_join_next().is_some() {}
    }
    drop(listener);
    let _ = tokio::time::timeout(drain, async { while conns.join_next().await.is_some() {} }).await;
    conns.abort_all();
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Service(#[from] ServiceError),
    #[error("cannot listen on {addr}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "refusing to listen on {addr} (not a loopback address) without access tokens: anyone \
         who reaches it could run programs here. Configure [access] tokens, or pass \
         --insecure-public / set insecure_public = true to accept that"
    )]
    PublicWithoutTokens { addr: String },
}

/// Refuses a listen address that other machines can reach when the service has no tokens,
/// unless `insecure_public`.
pub async fn check_exposure(
    addr: &str,
    access: &Access,
    insecure_public: bool,
) -> Result<(), ServerError> {
    if access.enabled() || insecure_public {
        return Ok(());
    }
    let addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host(addr)
        .await
        .map_err(|source| ServerError::Listen {
            addr: addr.to_string(),
            source,
        })?
        .collect();
    if addrs.is_empty() || addrs.iter().any(|a| !a.ip().is_loopback()) {
        return Err(ServerError::PublicWithoutTokens {
            addr: addr.to_string(),
        });
    }
    Ok(())
}

/// Runs the service on `addr` until SIGTERM/SIGINT, behind `access`.
pub async fn serve(
    addr: &str,
    cfg: ServiceConfig,
    grace: Duration,
    access: Access,
) -> Result<(), ServerError> {
    // Handlers first: a signal that arrives during start-up still stops the server cleanly.
    let signalled = infra::shutdown::signal();
    let service = Service::open(&cfg)?;
    let resumed = service.recover_with(&|spec| access.check_programs(spec))?;
    if resumed > 0 {
        tracing::info!(
            jobs = resumed,
            "resuming jobs that were running before the restart"
        );
    }
    let listen_err = |source| ServerError::Listen {
        addr: addr.to_string(),
        source,
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(listen_err)?;
    let local = listener.local_addr().map_err(listen_err)?;
    tracing::info!(addr = %local, data_dir = %cfg.data_dir.display(), "rollarc serving");
    let app = crate::api::router_with(service.clone(), Arc::new(access));
    let stop = CancellationToken::new();
    // Open event streams would hold the server: give them a moment, then go.
    let server = tokio::spawn(serve_on(
        listener,
        app,
        EdgeLimits::default(),
        stop.clone(),
        Duration::from_secs(2),
    ));
    signalled.await;
    tracing::info!(
        grace_s = grace.as_secs_f64(),
        "stopping intake and draining running jobs"
    );
    let forced = service.shutdown(grace).await;
    stop.cancel();
    let _ = server.await;
    tracing::info!(interrupted = forced.len(), "rollarc stopped");
    Ok(())
}
