//! What a router counts: calls, tries, retries, hedges, ejections, queueing, per-instance
//! load and busy time (and the OpenTelemetry instruments it reports to).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

/// Counters of one router (monotonic unless noted).
#[derive(Debug, Default)]
pub struct RouterStats {
    pub calls: AtomicU64,
    pub tries: AtomicU64,
    pub retries: AtomicU64,
    pub hedges: AtomicU64,
    pub budget_exhausted: AtomicU64,
    pub deduplicated: AtomicU64,
    pub overloaded: AtomicU64,
    pub failures: AtomicU64,
    pub ejections: AtomicU64,
    pub oversized: AtomicU64,
    /// Tries per instance id.
    pub per_instance: Mutex<BTreeMap<u64, u64>>,
    /// Busy time per instance id (time with at least one try in flight), for utilisation
    /// timelines.
    pub busy: Mutex<BTreeMap<u64, InstanceBusy>>,
    /// Calls inside the router now / at most (waiting in the activator buffer, backing off, or
    /// at an instance); with every instance at its container concurrency, the excess over
    /// `instances × concurrency` is the activator queue.
    pub queued: AtomicU64,
    pub peak_queued: AtomicU64,
}

#[derive(Clone, Debug, Serialize)]
pub struct RouterSnapshot {
    pub calls: u64,
    pub tries: u64,
    pub retries: u64,
    pub hedges: u64,
    pub budget_exhausted: u64,
    pub deduplicated: u64,
    pub overloaded: u64,
    pub failures: u64,
    pub ejections: u64,
    pub oversized: u64,
    pub peak_queued: u64,
    pub per_instance: BTreeMap<u64, u64>,
    /// Seconds each instance has had at least one try in flight, up to the snapshot.
    pub busy_s: BTreeMap<u64, f64>,
}

/// In-flight accounting of one instance.
#[derive(Clone, Copy, Debug)]
pub struct InstanceBusy {
    in_flight: u32,
    since: Instant,
    busy: Duration,
}

impl InstanceBusy {
    fn busy_until(&self, now: Instant) -> Duration {
        if self.in_flight > 0 {
            self.busy + now.saturating_duration_since(self.since)
        } else {
            self.busy
        }
    }
}

impl RouterStats {
    /// One try starts (+1) or ends (−1) at an instance.
    pub(super) fn in_flight(&self, id: u64, delta: i32) {
        let now = Instant::now();
        let Ok(mut m) = self.busy.lock() else { return };
        let b = m.entry(id).or_insert(InstanceBusy {
            in_flight: 0,
            since: now,
            busy: Duration::ZERO,
        });
        if b.in_flight > 0 {
            b.busy += now.saturating_duration_since(b.since);
        }
        b.since = now;
        b.in_flight = b.in_flight.saturating_add_signed(delta);
    }

    pub fn snapshot(&self) -> RouterSnapshot {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RouterSnapshot {
            calls: l(&self.calls),
            tries: l(&self.tries),
            retries: l(&self.retries),
            hedges: l(&self.hedges),
            budget_exhausted: l(&self.budget_exhausted),
            deduplicated: l(&self.deduplicated),
            overloaded: l(&self.overloaded),
            failures: l(&self.failures),
            ejections: l(&self.ejections),
            oversized: l(&self.oversized),
            peak_queued: l(&self.peak_queued),
            per_instance: self
                .per_instance
                .lock()
                .map(|m| m.clone())
                .unwrap_or_default(),
            busy_s: {
                let now = Instant::now();
                self.busy
                    .lock()
                    .map(|m| {
                        m.iter()
                            .map(|(&id, b)| (id, b.busy_until(now).as_secs_f64()))
                            .collect()
                    })
                    .unwrap_or_default()
            },
        }
    }
}

pub(super) struct RouterMetrics {
    pub(super) calls: opentelemetry::metrics::Counter<u64>,
    pub(super) tries: opentelemetry::metrics::Counter<u64>,
    pub(super) ejections: opentelemetry::metrics::Counter<u64>,
    pub(super) latency: opentelemetry::metrics::Histogram<f64>,
}

pub(super) fn router_metrics() -> &'static RouterMetrics {
    static M: std::sync::OnceLock<RouterMetrics> = std::sync::OnceLock::new();
    M.get_or_init(|| {
        let meter = crate::telemetry::Metrics::global().meter();
        RouterMetrics {
            calls: meter
                .u64_counter("rollarc_router_calls")
                .with_description("Function calls by outcome")
                .build(),
            tries: meter
                .u64_counter("rollarc_router_tries")
                .with_description("HTTP tries (first tries, retries, hedges)")
                .build(),
            ejections: meter
                .u64_counter("rollarc_router_ejections")
                .with_description("Instances ejected as outliers")
                .build(),
            latency: meter
                .f64_histogram("rollarc_router_call_duration")
                .with_description("Call latency including queueing and retries")
                .with_unit("s")
                // Seconds, from a fast local function (ms) to a slow judge (a minute).
                .with_boundaries(vec![
                    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0,
                ])
                .build(),
        }
    })
}
