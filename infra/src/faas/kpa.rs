//! The Knative Pod Autoscaler decision, as a pure state machine over explicit instants so it
//! runs the same on the wall clock and on tokio's paused clock.
//!
//! Signal: concurrency (in-flight plus buffered requests), averaged over the stable window and
//! the panic window. Every tick:
//! - `desired_stable = ceil(avg_stable / target)`, `desired_panic = ceil(avg_panic / target)`,
//!   both clamped to `[floor(ready / max-scale-down-rate), ceil(ready × max-scale-up-rate)]`;
//! - panic starts when `desired_panic / ready ≥ panic-threshold` and lasts until a full stable
//!   window passes without a new trigger; while panicking the decision never goes below the
//!   highest value reached in this panic;
//! - `scale-down-delay` holds the maximum decision of that trailing window;
//! - zero is granted only after the stable window saw no traffic *and* the decision has stayed
//!   at zero for `scale-to-zero-grace-period`; `min-scale`, `max-scale` and `activation-scale`
//!   bound the result;
//! - with no ready instance and requests waiting (the activator's poke), the decision is at
//!   least enough instances for them.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use super::config::{LOCAL_MAX_INSTANCES, Scaling};

/// Time-weighted concurrency between two ticks.
#[derive(Debug)]
pub struct ConcurrencyMeter {
    current: u64,
    area: f64,
    since: Instant,
    last: Instant,
}

impl ConcurrencyMeter {
    pub fn new(now: Instant) -> Self {
        Self {
            current: 0,
            area: 0.0,
            since: now,
            last: now,
        }
    }

    fn advance(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.area += self.current as f64 * dt;
        self.last = now.max(self.last);
    }

    pub fn add(&mut self, now: Instant, delta: i64) {
        self.advance(now);
        self.current = (self.current as i64 + delta).max(0) as u64;
    }

    pub fn current(&self) -> u64 {
        self.current
    }

    /// Average concurrency since the previous call, and the length of that period.
    pub fn take(&mut self, now: Instant) -> (f64, Duration) {
        self.advance(now);
        let period = now.saturating_duration_since(self.since);
        let avg = if period.is_zero() {
            self.current as f64
        } else {
            self.area / period.as_secs_f64()
        };
        self.area = 0.0;
        self.since = now;
        (avg, period)
    }
}

/// One autoscaler decision.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decision {
    pub desired: u32,
    pub panicking: bool,
    pub avg_stable: f64,
    pub avg_panic: f64,
}

#[derive(Debug)]
pub struct Kpa {
    cfg: Scaling,
    created: Instant,
    /// (end of period, average concurrency, period length).
    samples: VecDeque<(Instant, f64, Duration)>,
    panic_since: Option<Instant>,
    last_trigger: Option<Instant>,
    max_panic: u32,
    delayed: VecDeque<(Instant, u32)>,
    zero_since: Option<Instant>,
    last: u32,
}

impl Kpa {
    pub fn new(cfg: Scaling, now: Instant) -> Self {
        let last = cfg.initial_scale.max(cfg.min_scale);
        Self {
            cfg,
            created: now,
            samples: VecDeque::new(),
            panic_since: None,
            last_trigger: None,
            max_panic: 0,
            delayed: VecDeque::new(),
            zero_since: None,
            last,
        }
    }

    pub fn config(&self) -> &Scaling {
        &self.cfg
    }

    /// Records the average concurrency of the period that ends at `now`.
    pub fn record(&mut self, now: Instant, avg: f64, period: Duration) {
        if period.is_zero() {
            return;
        }
        self.samples.push_back((now, avg, period));
        let horizon = self.cfg.stable_window.0;
        while let Some(&(t, _, _)) = self.samples.front() {
            if now.saturating_duration_since(t) > horizon {
                self.samples.pop_front()
            } else {
                break;
            };
        }
    }

    fn window_avg(&self, now: Instant, window: Duration) -> f64 {
        // Periods that ended within the window, weighted by their length; the window is never
        // longer than the deployment's life (so a new deployment is not diluted by zeros).
        let span = window
            .min(now.saturating_duration_since(self.created))
            .max(Duration::from_millis(1));
        let mut area = 0.0;
        for &(end, avg, period) in self.samples.iter().rev() {
            let age = now.saturating_duration_since(end);
            if age >= span {
                break;
            }
            let covered = period.min(span - age);
            area += avg * covered.as_secs_f64();
        }
        area / span.as_secs_f64()
    }

    pub fn panicking(&self) -> bool {
        self.panic_since.is_some()
    }

    /// Decides the instance count. `ready` counts instances serving now; `waiting` the requests
    /// in flight or buffered at this instant.
    pub fn decide(&mut self, now: Instant, ready: u32, waiting: u64) -> Decision {
        let target = self.cfg.per_instance_target();
        let avg_stable = self.window_avg(now, self.cfg.stable_window.0);
        let avg_panic = self.window_avg(now, self.cfg.panic_window());
        let ready_f = ready.max(1) as f64;
        let max_up = (ready_f * self.cfg.max_scale_up_rate).ceil();
        let max_down = (ready_f / self.cfg.max_scale_down_rate).floor();
        let raw_stable = (avg_stable / target).ceil();
        let raw_panic = (avg_panic / target).ceil();
        let desired_stable = raw_stable.clamp(max_down, max_up) as u32;
        let desired_panic = raw_panic.clamp(max_down, max_up) as u32;

        // Panic mode.
        if raw_panic / ready_f >= self.cfg.panic_threshold_percentage / 100.0 && raw_panic > 0.0 {
            if self.panic_since.is_none() {
                self.panic_since = Some(now);
            }
            self.last_trigger = Some(now);
        } else if let Some(t) = self.last_trigger
            && now.saturating_duration_since(t) >= self.cfg.stable_window.0
        {
            self.panic_since = None;
            self.last_trigger = None;
            self.max_panic = 0;
        }
        let mut desired = if self.panic_since.is_some() {
            self.max_panic = self.max_panic.max(desired_panic).max(desired_stable);
            self.max_panic
        } else {
            desired_stable
        };

        // Not enough history yet: hold the initial scale for one stable window.
        if now.saturating_duration_since(self.created) < self.cfg.stable_window.0
            && self.panic_since.is_none()
        {
            desired = desired.max(
                self.last
                    .min(self.cfg.initial_scale.max(self.cfg.min_scale)),
            );
        }

        // Scale-down delay: the maximum over the trailing window.
        if !self.cfg.scale_down_delay.0.is_zero() {
            self.delayed.push_back((now, desired));
            while let Some(&(t, _)) = self.delayed.front() {
                if now.saturating_duration_since(t) > self.cfg.scale_down_delay.0 {
                    self.delayed.pop_front()
                } else {
                    break;
                };
            }
            desired = self
                .delayed
                .iter()
                .map(|&(_, d)| d)
                .max()
                .unwrap_or(desired);
        }

        // Activator poke: requests are waiting and nothing serves them.
        if ready == 0 && waiting > 0 {
            desired = desired
                .max((waiting as f64 / target).ceil() as u32)
                .max(self.cfg.activation_scale);
        }

        // Zero only after the grace period.
        if desired == 0 {
            let since = *self.zero_since.get_or_insert(now);
            if self.last > 0
                && now.saturating_duration_since(since) < self.cfg.scale_to_zero_grace_period.0
            {
                desired = 1;
            }
        } else {
            self.zero_since = None;
        }
        if self.last == 0 && desired > 0 {
            desired = desired.max(self.cfg.activation_scale);
        }
        let max = if self.cfg.max_scale == 0 {
            LOCAL_MAX_INSTANCES
        } else {
            self.cfg.max_scale.min(LOCAL_MAX_INSTANCES)
        };
        desired = desired.clamp(self.cfg.min_scale.min(max), max);
        self.last = desired;
        Decision {
            desired,
            panicking: self.panic_since.is_some(),
            avg_stable,
            avg_panic,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::faas::config::Dur;

    /// Drives the KPA tick by tick with a concurrency function of time; the instance count
    /// follows the decision at once (instances "start" instantly here).
    struct Drive {
        kpa: Kpa,
        now: Instant,
        ready: u32,
        log: Vec<(f64, Decision)>,
    }

    impl Drive {
        fn new(cfg: Scaling) -> Self {
            let now = Instant::now();
            let ready = cfg.initial_scale;
            Self {
                kpa: Kpa::new(cfg, now),
                now,
                ready,
                log: Vec::new(),
            }
        }

        fn run(&mut self, secs: f64, load: impl Fn(f64) -> f64) {
            let tick = self.kpa.config().tick_interval.0;
            let t0 = self.log.last().map(|l| l.0).unwrap_or(0.0);
            let steps = (secs / tick.as_secs_f64()).round() as usize;
            for i in 1..=steps {
                self.now += tick;
                let t = t0 + i as f64 * tick.as_secs_f64();
                let c = load(t);
                self.kpa.record(self.now, c, tick);
                let d = self.kpa.decide(self.now, self.ready, c.round() as u64);
                self.ready = d.desired;
                self.log.push((t, d));
            }
        }
    }

    fn cfg() -> Scaling {
        Scaling {
            container_concurrency: 10,
            ..Scaling::default()
        }
    }

    #[test]
    fn steady_load_settles_at_concurrency_over_target() {
        let mut d = Drive::new(cfg());
        d.run(180.0, |_| 35.0);
        // target = 10 × 0.7 = 7 → ceil(35 / 7) = 5.
        assert_eq!(d.ready, 5);
        assert!(d.log.iter().all(|(_, x)| x.desired <= 5 || x.panicking));
    }

    #[test]
    fn a_tenfold_spike_panics_and_never_scales_down_while_panicking() {
        let mut d = Drive::new(cfg());
        d.run(120.0, |_| 7.0);
        assert_eq!(d.ready, 1);
        let spike_at = 120.0;
        d.run(30.0, |_| 70.0);
        d.run(200.0, |_| 7.0);
        let entered = d
            .log
            .iter()
            .find(|(t, x)| *t > spike_at && x.panicking)
            .expect("never panicked")
            .0;
        assert!(
            entered - spike_at <= 2.0 + 1e-9,
            "panic entered {:.0}s after the spike",
            entered - spike_at
        );
        // While panicking, the decision never decreases.
        let panic_ticks: Vec<&(f64, Decision)> =
            d.log.iter().filter(|(_, x)| x.panicking).collect();
        for w in panic_ticks.windows(2) {
            assert!(
                w[1].1.desired >= w[0].1.desired,
                "scaled down in panic: {:?} → {:?}",
                w[0],
                w[1]
            );
        }
        assert!(panic_ticks.iter().map(|p| p.1.desired).max().unwrap() >= 10);
        // Panic ends a full stable window after the last trigger (not before), then it scales back down.
        let left = d.log.iter().rev().find(|(_, x)| x.panicking).unwrap().0;
        assert!(
            left >= entered + 60.0 - 2.0 && left < spike_at + 30.0 + 60.0,
            "entered panic at {entered}, left at {left}"
        );
        assert_eq!(d.ready, 1);
    }

    #[test]
    fn scale_to_zero_waits_for_the_window_and_the_grace_period() {
        let mut d = Drive::new(cfg());
        d.run(60.0, |_| 7.0);
        d.run(200.0, |_| 0.0);
        let zero_at = d
            .log
            .iter()
            .find(|(_, x)| x.desired == 0)
            .expect("never reached zero")
            .0;
        // Traffic stopped at 60 s: the stable window must drain (60 s) and then the grace (30 s).
        assert!((148.0..=154.0).contains(&zero_at), "zero at {zero_at}");
        // min-scale keeps it up.
        let mut d = Drive::new(Scaling {
            min_scale: 2,
            ..cfg()
        });
        d.run(300.0, |_| 0.0);
        assert_eq!(d.ready, 2);
    }

    #[test]
    fn scale_down_is_at_most_halving_per_tick_and_delay_holds_the_peak() {
        let mut d = Drive::new(cfg());
        d.run(70.0, |_| 140.0);
        assert_eq!(d.ready, 20);
        d.run(200.0, |_| 0.0);
        let downs: Vec<u32> = d.log.iter().map(|(_, x)| x.desired).collect();
        for w in downs.windows(2) {
            assert!(
                w[1] * 2 >= w[0] || w[1] == 0,
                "dropped from {} to {} in one tick",
                w[0],
                w[1]
            );
        }
        let mut d = Drive::new(Scaling {
            scale_down_delay: Dur::secs(30),
            ..cfg()
        });
        d.run(70.0, |_| 35.0);
        let peak_end = 70.0;
        d.run(120.0, |_| 7.0);
        // The stable average takes 60 s to fall; with a 30 s delay the first decrease comes ≥ 30 s
        // after the decision first fell.
        let first_drop = d
            .log
            .iter()
            .find(|(t, x)| *t > peak_end && x.desired < 5)
            .unwrap()
            .0;
        let mut nodelay = Drive::new(cfg());
        nodelay.run(70.0, |_| 35.0);
        nodelay.run(120.0, |_| 7.0);
        let nd_drop = nodelay
            .log
            .iter()
            .find(|(t, x)| *t > peak_end && x.desired < 5)
            .unwrap()
            .0;
        assert!(
            (first_drop - nd_drop - 30.0).abs() <= 2.0 + 1e-9,
            "delay {first_drop} vs {nd_drop}"
        );
    }

    #[test]
    fn from_zero_the_poke_scales_at_once_and_max_scale_caps() {
        let c = Scaling {
            initial_scale: 0,
            max_scale: 3,
            ..cfg()
        };
        let now = Instant::now();
        let mut k = Kpa::new(c, now);
        assert_eq!(k.decide(now, 0, 0).desired, 0);
        let d = k.decide(now + Duration::from_millis(10), 0, 100);
        assert_eq!(
            d.desired, 3,
            "100 waiting / 7 per instance, capped at max-scale 3"
        );
    }

    #[test]
    fn the_meter_is_time_weighted() {
        let t = Instant::now();
        let mut m = ConcurrencyMeter::new(t);
        m.add(t, 4);
        m.add(t + Duration::from_secs(1), -4);
        let (avg, period) = m.take(t + Duration::from_secs(2));
        assert_eq!(period, Duration::from_secs(2));
        assert!((avg - 2.0).abs() < 1e-9);
    }
}
