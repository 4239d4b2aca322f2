//! The server's health as the engine sees it: waiting for the server to become ready, and
//! the probe task whose health checks are the engine's heartbeats (and its view of the
//! server's own load).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use super::{ServerClient, ServerError, ServerInfo};

/// Health shared between the engine and its probe task.
#[derive(Default)]
pub(super) struct Health {
    /// Successful probes so far.
    pub(super) beats: AtomicU64,
    /// Milliseconds (of the job's clock) since the server last answered; 0 while it does.
    pub(super) down_since_ms: AtomicU64,
    pub(super) up: AtomicBool,
    /// What the server last said it runs and queues (all clients' requests), +1 (0: unknown).
    pub(super) server_running: AtomicU64,
    pub(super) server_waiting: AtomicU64,
}

/// Waits until the server answers its health check, then asks for its slots and context.
pub(super) async fn wait_ready(
    client: &dyn ServerClient,
    within: Duration,
) -> Result<ServerInfo, ServerError> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let answer = tokio::time::timeout(left.max(Duration::from_millis(100)), client.health())
            .await
            .unwrap_or_else(|_| {
                Err(ServerError::NotHealthy {
                    server: client.describe(),
                    seconds: within.as_secs_f64(),
                })
            });
        match answer {
            Ok(()) => return client.info().await,
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(match e {
                    ServerError::Unreachable { .. } => ServerError::NotHealthy {
                        server: client.describe(),
                        seconds: within.as_secs_f64(),
                    },
                    other => other,
                });
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Asks the server for its own load (all clients' requests) within `within` and records it
/// in `health`; a server without a load endpoint, or one that does not answer, leaves the
/// last figure.
pub(super) async fn read_load(client: &dyn ServerClient, health: &Health, within: Duration) {
    if let Ok(Some(l)) = tokio::time::timeout(within, client.server_load()).await {
        health
            .server_running
            .store(l.running as u64 + 1, Ordering::Relaxed);
        health
            .server_waiting
            .store(l.waiting as u64 + 1, Ordering::Relaxed);
    }
}

/// Checks the server's health every `every` until dropped, recording beats, outages and the
/// server's load in `health` and waking the engine after each check.
pub(super) async fn probe(
    client: Arc<dyn ServerClient>,
    health: Arc<Health>,
    wake: Arc<tokio::sync::Notify>,
    every: Duration,
    started: tokio::time::Instant,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let ok = matches!(
            tokio::time::timeout(every.max(Duration::from_secs(5)), client.health()).await,
            Ok(Ok(()))
        );
        if ok {
            health.down_since_ms.store(0, Ordering::Relaxed);
            health.up.store(true, Ordering::Relaxed);
            read_load(&*client, &health, every.max(Duration::from_secs(5))).await;
            health.beats.fetch_add(1, Ordering::Relaxed);
        } else if health.up.swap(false, Ordering::Relaxed) {
            let ms = started.elapsed().as_millis().max(1) as u64;
            health.down_since_ms.store(ms, Ordering::Relaxed);
            tracing::warn!(server = %client.describe(), "inference server does not answer its health check");
        }
        wake.notify_one();
    }
}
