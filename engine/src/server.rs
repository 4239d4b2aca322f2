//! `rollarc serve`: the HTTP server with graceful shutdown (signal → stop intake → drain
//! under a grace deadline → interrupt the rest, which resume at the next start).

use std::time::Duration;

use crate::service::{Service, ServiceConfig, ServiceError};

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
}

pub async fn serve(addr: &str, cfg: ServiceConfig, grace: Duration) -> Result<(), ServerError> {
    // Handlers first: a signal that arrives during start-up still stops the server cleanly.
    let signalled = infra::shutdown::signal();
    let service = Service::open(&cfg)?;
    let resumed = service.recover()?;
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
    let app = crate::api::router(service.clone());
    let stop = tokio_util::sync::CancellationToken::new();
    let stop2 = stop.clone();
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop2.cancelled().await })
            .await
    });
    signalled.await;
    tracing::info!(
        grace_s = grace.as_secs_f64(),
        "stopping intake and draining running jobs"
    );
    let forced = service.shutdown(grace).await;
    stop.cancel();
    // Open event streams would hold the server: give it a moment, then go.
    let _ = tokio::time::timeout(Duration::from_secs(2), server).await;
    tracing::info!(interrupted = forced.len(), "rollarc stopped");
    Ok(())
}
