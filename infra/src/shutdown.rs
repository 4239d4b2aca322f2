//! Shutdown: signal → stop intake → drain under a grace deadline → force.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Resolves on SIGTERM or SIGINT (Ctrl-C). The handlers are installed when this is called
/// (not when first polled), so a signal that arrives right after start-up is not lost. Call
/// it inside a tokio runtime.
pub fn signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let term = signal(SignalKind::terminate());
        let int = signal(SignalKind::interrupt());
        async move {
            match (term, int) {
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
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
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
pub async fn drain<F: Future<Output = ()>>(
    intake: &CancellationToken,
    force: &CancellationToken,
    grace: Duration,
    drained: F,
) -> Drain {
    intake.cancel();
    match tokio::time::timeout(grace, drained).await {
        Ok(()) => Drain::Clean,
        Err(_) => {
            force.cancel();
            Drain::Forced
        }
    }
}
