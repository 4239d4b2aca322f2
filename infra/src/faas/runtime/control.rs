//! The control loop of a deployment: the KPA decides every tick, and the instance set follows.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use super::deployment::{Deployment, Instance, Phase, event};
use super::instance::run_instance;

/// The autoscaler's loop: a decision every tick and on every poke; on cancel, drains every
/// instance.
pub(super) async fn control_loop(dep: Arc<Deployment>, tasks: TaskTracker) {
    let tick = dep.cfg.scaling.tick_interval.0;
    let mut next_tick = Instant::now() + tick;
    reconcile(&dep, &tasks);
    loop {
        tokio::select! {
            _ = dep.cancel.cancelled() => break,
            _ = tokio::time::sleep_until(next_tick) => {
                let now = Instant::now();
                next_tick = now + tick;
                let mut st = dep.lock();
                let (avg, period) = st.meter.take(now);
                st.kpa.record(now, avg, period);
            }
            _ = dep.poke.notified() => {}
        }
        reconcile(&dep, &tasks);
    }
    // Drain everything.
    let mut st = dep.lock();
    st.desired = 0;
    for inst in st.instances.values_mut() {
        if let Some(stop) = inst.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Applies the autoscaler's decision: starts instances, or drains the excess (starting ones
/// first, then the newest ready ones).
fn reconcile(dep: &Arc<Deployment>, tasks: &TaskTracker) {
    let now = Instant::now();
    let mut st = dep.lock();
    let ready = st
        .instances
        .values()
        .filter(|i| i.phase == Phase::Ready)
        .count() as u32;
    let waiting = st.meter.current();
    let was_panicking = st.panicking;
    let d = st.kpa.decide(now, ready, waiting);
    st.desired = d.desired;
    st.panicking = d.panicking;
    if d.panicking && !was_panicking {
        dep.counters.panics.fetch_add(1, Ordering::Relaxed);
        event(dep, "panic");
        tracing::info!(function = %dep.cfg.name, desired = d.desired, avg_panic = d.avg_panic, "autoscaler entered panic mode");
    }
    let active: Vec<u64> = st
        .instances
        .iter()
        .filter(|(_, i)| i.phase != Phase::Draining)
        .map(|(&id, _)| id)
        .collect();
    let active_n = active.len() as u32;
    if active_n < d.desired {
        dep.counters.scale_ups.fetch_add(1, Ordering::Relaxed);
        event(dep, "scale_up");
        tracing::debug!(function = %dep.cfg.name, from = active_n, to = d.desired, "scale up");
        for _ in active_n..d.desired {
            let id = st.next_id;
            st.next_id += 1;
            let (tx, rx) = oneshot::channel();
            st.instances.insert(
                id,
                Instance {
                    phase: Phase::Starting,
                    url: String::new(),
                    pid: None,
                    stop: Some(tx),
                },
            );
            tasks.spawn(run_instance(dep.clone(), id, rx));
        }
    } else if active_n > d.desired {
        dep.counters.scale_downs.fetch_add(1, Ordering::Relaxed);
        event(dep, "scale_down");
        tracing::debug!(function = %dep.cfg.name, from = active_n, to = d.desired, "scale down");
        // Starting instances go first, then the newest ready ones.
        let mut order: Vec<u64> = active.clone();
        order.sort_by_key(|id| {
            (
                st.instances[id].phase == Phase::Ready,
                std::cmp::Reverse(*id),
            )
        });
        for id in order.into_iter().take((active_n - d.desired) as usize) {
            if let Some(inst) = st.instances.get_mut(&id) {
                inst.phase = Phase::Draining;
                if let Some(stop) = inst.stop.take() {
                    let _ = stop.send(());
                }
            }
        }
    }
    dep.publish(&st);
}
