//! Shutdown: signal → stop intake → drain under a grace deadline → force.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Resolves on SIGTERM or SIGINT (Ctrl-C).
pub async fn signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    biased;
                    _ = term.recv() => tracing::info!("received SIGTERM"),
                    _ = int.recv() => tracing::info!("received SIGINT"),
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Outcome of a drain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drain {
    /// Everything finished within the grace period.
    Clean,
    /// The grace period ran out; the rest was forced.
    Forced,
}

/// Cancels `intake`, then waits for `drained` up to `grace`; past it, cancels `force`.
pub async fn drain<F: Future<Output = ()>>(intake: &CancellationToken, force: &CancellationToken, grace: Duration, drained: F) -> Drain {
    intake.cancel();
    match tokio::time::timeout(grace, drained).await {
        Ok(()) => Drain::Clean,
        Err(_) => {
            force.cancel();
            Drain::Forced
        }
    }
}
