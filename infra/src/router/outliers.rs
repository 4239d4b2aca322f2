//! Outlier ejection: consecutive failures or a high failure rate take an instance out of the
//! balancer for a while.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::stats::{RouterStats, router_metrics};

pub(super) struct Outliers {
    cfg_after: u32,
    cfg_base: Duration,
    cfg_max_percent: u32,
    state: Mutex<OutState>,
    /// Notified when an instance is ejected.
    pub(super) changed: Notify,
    stats: Arc<RouterStats>,
}

#[derive(Default)]
struct OutState {
    consecutive: HashMap<u64, u32>,
    /// Outcomes of the last `RATE_WINDOW` tries per instance (true = failed).
    recent: HashMap<u64, VecDeque<bool>>,
    ejected: HashMap<u64, Instant>,
    times: HashMap<u64, u32>,
    instances: usize,
}

/// Failure-rate ejection (Envoy's `failure_percentage`): over the last `RATE_WINDOW` tries of
/// an instance, at least `RATE_MIN` of them, a failure share ≥ `RATE_THRESHOLD` ejects it, so a
/// 50 %-failing instance goes even when its failures never come five in a row.
pub const RATE_WINDOW: usize = 20;
pub const RATE_MIN: usize = 10;
pub const RATE_THRESHOLD: f64 = 0.5;

fn push_outcome(s: &mut OutState, id: u64, failed: bool) -> f64 {
    let r = s.recent.entry(id).or_default();
    r.push_back(failed);
    while r.len() > RATE_WINDOW {
        r.pop_front();
    }
    if r.len() < RATE_MIN {
        0.0
    } else {
        r.iter().filter(|f| **f).count() as f64 / r.len() as f64
    }
}

impl Outliers {
    /// Ejects an instance after `after` consecutive failures (or a failure rate at or above
    /// `RATE_THRESHOLD`) for `base` × its ejection count, never more than `max_percent` of
    /// the instances (at least one).
    pub(super) fn new(
        after: u32,
        base: Duration,
        max_percent: u32,
        stats: Arc<RouterStats>,
    ) -> Self {
        Self {
            cfg_after: after.max(1),
            cfg_base: base,
            cfg_max_percent: max_percent,
            state: Mutex::new(OutState::default()),
            changed: Notify::new(),
            stats,
        }
    }

    pub(super) fn success(&self, id: u64) {
        if let Ok(mut s) = self.state.lock() {
            s.consecutive.insert(id, 0);
            push_outcome(&mut s, id, false);
        }
    }

    pub(super) fn failure(&self, id: u64, function: &str) {
        let Ok(mut s) = self.state.lock() else { return };
        let now = Instant::now();
        s.ejected.retain(|_, until| *until > now);
        let rate = push_outcome(&mut s, id, true);
        let c = s.consecutive.entry(id).or_insert(0);
        *c += 1;
        if (*c < self.cfg_after && rate < RATE_THRESHOLD) || s.ejected.contains_key(&id) {
            return;
        }
        let cap = ((s.instances as u64 * self.cfg_max_percent as u64) / 100).max(1) as usize;
        if s.ejected.len() >= cap {
            return;
        }
        s.consecutive.insert(id, 0);
        s.recent.remove(&id);
        let n = {
            let t = s.times.entry(id).or_insert(0);
            *t += 1;
            *t
        };
        let until = now + self.cfg_base * n;
        s.ejected.insert(id, until);
        self.stats.ejections.fetch_add(1, Ordering::Relaxed);
        router_metrics().ejections.add(
            1,
            &[opentelemetry::KeyValue::new(
                "function",
                function.to_string(),
            )],
        );
        tracing::warn!(
            function,
            instance = id,
            for_s = (self.cfg_base * n).as_secs_f64(),
            "instance ejected after consecutive failures"
        );
        drop(s);
        self.changed.notify_one();
    }

    /// Ejected ids now, and the earliest instant one comes back.
    pub(super) fn ejected(&self) -> (Vec<u64>, Option<Instant>) {
        let Ok(mut s) = self.state.lock() else {
            return (Vec::new(), None);
        };
        let now = Instant::now();
        s.ejected.retain(|_, until| *until > now);
        (
            s.ejected.keys().copied().collect(),
            s.ejected.values().min().copied(),
        )
    }

    pub(super) fn set_instances(&self, n: usize) {
        if let Ok(mut s) = self.state.lock() {
            s.instances = n;
        }
    }
}
