//! The environment pool: leases, calls, release, replacement, cancellation, timeouts,
//! panics and closing.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::*;
use std::sync::atomic::Ordering;

/// What the probe environments did, in order ("reset 0", "step 1 ok", "release 0", ...).
type Log = Arc<Mutex<Vec<String>>>;

/// An environment whose step does what its action says: `ok`, `slow` (1 s), `fail`, `panic`
/// or `hang`.
struct Probe {
    id: u64,
    log: Log,
}

impl Probe {
    fn note(&self, what: &str) {
        self.log.lock().unwrap().push(format!("{what} {}", self.id));
    }
}

impl Environment for Probe {
    async fn reset(&mut self, _seed: u64) -> Result<Observation, EnvError> {
        self.note("reset");
        Ok(Observation {
            text: self.id.to_string(),
            ..Observation::default()
        })
    }

    async fn step(
        &mut self,
        action: &str,
        _tokens: &crate::tokens::Tokens,
    ) -> Result<StepOutcome, EnvError> {
        match action {
            "slow" => tokio::time::sleep(Duration::from_secs(1)).await,
            "fail" => return Err(EnvError::Reported("asked to fail".into())),
            "panic" => panic!("asked to panic"),
            "hang" => std::future::pending::<()>().await,
            _ => {}
        }
        self.note(&format!("step {action}"));
        Ok(StepOutcome::default())
    }

    async fn close(&mut self) {
        self.note("close");
    }

    async fn release(&mut self) {
        self.note("release");
    }
}

const TIMEOUT: Duration = Duration::from_secs(5);
const BACKOFF: Duration = Duration::from_millis(100);

async fn pool(size: usize) -> (EnvPool, Log) {
    let log = Log::default();
    let l = log.clone();
    let factory: EnvFactory = Arc::new(move |id| Box::new(Probe { id, log: l.clone() }));
    let p = EnvPool::spawn("t", size, factory, TIMEOUT, BACKOFF, None)
        .await
        .unwrap();
    (p, log)
}

fn taken(log: &Log) -> Vec<String> {
    std::mem::take(&mut *log.lock().unwrap())
}

/// The environment a lease holds, by the text its reset shows.
async fn id_of(lease: &mut EnvLease) -> String {
    lease.reset(0, None).await.unwrap().text
}

#[tokio::test(start_paused = true)]
async fn a_lease_calls_its_environment_and_gives_it_back_released() {
    let (p, log) = pool(1).await;
    assert_eq!(p.available(), 1);
    let mut a = p.lease().await.unwrap();
    assert_eq!(p.available(), 0);
    assert_eq!(id_of(&mut a).await, "0");
    a.step("ok".into(), Vec::new().into()).await.unwrap();
    drop(a);
    assert_eq!(p.available(), 1);
    let mut b = p.lease().await.unwrap();
    assert_eq!(
        id_of(&mut b).await,
        "0",
        "the same environment, not a new one"
    );
    assert_eq!(
        taken(&log),
        ["reset 0", "step ok 0", "release 0", "reset 0"]
    );
    assert_eq!(p.counters.resets.load(Ordering::Relaxed), 2);
    assert_eq!(p.counters.steps.load(Ordering::Relaxed), 1);
    assert_eq!(p.counters.restarts.load(Ordering::Relaxed), 0);
}

#[tokio::test(start_paused = true)]
async fn a_lease_waits_while_every_environment_is_taken() {
    let (p, _log) = pool(1).await;
    let a = p.lease().await.unwrap();
    let p2 = p.clone();
    let waiting = tokio::spawn(async move { p2.lease().await.is_some() });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!waiting.is_finished());
    drop(a);
    assert!(waiting.await.unwrap());
}

#[tokio::test(start_paused = true)]
async fn a_failed_environment_is_closed_and_replaced_after_the_backoff() {
    let (p, log) = pool(1).await;
    let mut a = p.lease().await.unwrap();
    id_of(&mut a).await;
    let e = a.step("fail".into(), Vec::new().into()).await.unwrap_err();
    assert!(matches!(e, EnvError::Reported(_)), "{e}");
    drop(a);
    // Replaced, not given back: nothing is free during the backoff.
    tokio::time::sleep(BACKOFF / 2).await;
    assert_eq!(p.available(), 0);
    let mut b = p.lease().await.unwrap();
    assert_eq!(id_of(&mut b).await, "1", "a new environment");
    assert_eq!(taken(&log), ["reset 0", "close 0", "reset 1"]);
    assert_eq!(p.counters.failures.load(Ordering::Relaxed), 1);
    assert_eq!(p.counters.restarts.load(Ordering::Relaxed), 1);
}

#[tokio::test(start_paused = true)]
async fn a_panic_fails_the_call_not_the_caller() {
    let (p, log) = pool(1).await;
    let mut a = p.lease().await.unwrap();
    id_of(&mut a).await;
    let e = a.step("panic".into(), Vec::new().into()).await.unwrap_err();
    assert!(
        matches!(&e, EnvError::Panicked(m) if m == "asked to panic"),
        "{e}"
    );
    drop(a);
    let mut b = p.lease().await.unwrap();
    assert_eq!(id_of(&mut b).await, "1");
    assert_eq!(taken(&log), ["reset 0", "close 0", "reset 1"]);
}

#[tokio::test(start_paused = true)]
async fn a_hung_call_times_out_and_its_environment_is_replaced() {
    let (p, log) = pool(1).await;
    let mut a = p.lease().await.unwrap();
    id_of(&mut a).await;
    let t = tokio::time::Instant::now();
    let e = a.step("hang".into(), Vec::new().into()).await.unwrap_err();
    assert!(matches!(e, EnvError::Timeout(d) if d == TIMEOUT), "{e}");
    assert!(t.elapsed() >= TIMEOUT);
    // The lease has no environment left to call.
    assert!(matches!(a.reset(0, None).await, Err(EnvError::Closed)));
    drop(a);
    let mut b = p.lease().await.unwrap();
    assert_eq!(id_of(&mut b).await, "1");
    // Dropped with its call: not closed (it may never answer).
    assert_eq!(taken(&log), ["reset 0", "reset 1"]);
    assert_eq!(p.counters.timeouts.load(Ordering::Relaxed), 1);
}

#[tokio::test(start_paused = true)]
async fn a_call_cancelled_midway_ends_and_its_environment_comes_back() {
    let (p, log) = pool(1).await;
    let mut a = p.lease().await.unwrap();
    id_of(&mut a).await;
    // The episode is cancelled while its step runs (1 s).
    let step = tokio::spawn(async move {
        let _ = a.step("slow".into(), Vec::new().into()).await;
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    step.abort();
    assert!(step.await.unwrap_err().is_cancelled());
    assert_eq!(p.available(), 0, "back only once its call ends");
    let mut b = p.lease().await.unwrap();
    assert_eq!(
        id_of(&mut b).await,
        "0",
        "the same environment, not replaced"
    );
    assert_eq!(
        taken(&log),
        ["reset 0", "step slow 0", "release 0", "reset 0"]
    );
    assert_eq!(p.counters.restarts.load(Ordering::Relaxed), 0);
}

#[tokio::test(start_paused = true)]
async fn stopping_closes_the_free_environments_and_the_leased_ones_when_given_back() {
    let (p, log) = pool(2).await;
    let mut a = p.lease().await.unwrap();
    id_of(&mut a).await;
    p.stop().await;
    assert_eq!(taken(&log), ["reset 0", "close 1"]);
    assert_eq!(p.available(), 0);
    drop(a);
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(taken(&log), ["release 0", "close 0"]);
    assert_eq!(p.available(), 0, "not pooled again");
}
