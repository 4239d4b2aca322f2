//! A job's env pool: its workers, what a probe each second learns of them, and the HTTP/2
//! calls to them.

use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use super::super::EnvError;
use super::super::protocol::{Request, Response};
use super::PROBE_EVERY;
use crate::discovery::Membership;

/// Most workers a pool follows (what discovery finds beyond them is left out, with a
/// warning): the bound of a listed pool too.
pub(super) const MAX_MEMBERS: usize = 256;

/// How long the first placements wait for a Kubernetes membership's first list.
/// The header of a worker's reply to a reset saying how it found its sandbox (`warm` or
/// `cold`, see [`crate::env::starts`]).
pub const START_HEADER: &str = "x-rollarc-start";

const FIRST_LIST_WAIT: Duration = Duration::from_secs(12);

/// How to reach a pool's workers.
#[derive(Clone, Debug)]
pub struct WorkerPoolConfig {
    /// The pool's name (in errors and metrics).
    pub name: String,
    /// Where its workers come from.
    pub membership: Membership,
    /// The workers' shared bearer token.
    pub token: Option<String>,
}

/// A job's env pool: its workers and what it knows of them.
pub struct WorkerPool {
    pub(super) name: String,
    token: Option<String>,
    client: reqwest::Client,
    workers: RwLock<Vec<Arc<Worker>>>,
    prober: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// The watch of a Kubernetes membership.
    follower: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Set once the first probe of every worker has answered or failed.
    first_probe: tokio::sync::OnceCell<()>,
    /// Woken when a probe ends or an episode closes: a slot may have opened.
    pub(super) changed: tokio::sync::Notify,
    membership: Membership,
    /// Why the last look for members failed (the members found before stay).
    discovery_error: Mutex<Option<String>>,
}

/// One worker as the pool sees it.
pub(super) struct Worker {
    pub(super) url: String,
    pub(super) st: Mutex<WorkerState>,
}

/// What a probe or a call last learnt of a worker.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkerState {
    /// It answered its last probe or call.
    pub up: bool,
    /// It has answered at least once.
    pub seen: bool,
    pub draining: bool,
    pub slots: usize,
    /// Episodes open on it, all clients together (as of the last probe).
    pub open: usize,
    /// Episodes this pool has open on it now (counted as it places and closes them).
    pub mine: usize,
    /// What `mine` was when the last probe read `open`.
    pub mine_at_probe: usize,
    /// It refused an episode (full, draining) since the last probe: skipped until the next.
    pub refused: bool,
    pub last_error: Option<String>,
}

impl WorkerState {
    /// Episodes open on it now: other clients' as of the last probe, and this pool's own.
    pub fn load(&self) -> usize {
        self.open.saturating_sub(self.mine_at_probe) + self.mine
    }

    fn takes_episodes(&self) -> bool {
        self.up && !self.draining && !self.refused && self.load() < self.slots
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a worker answered a call with, when it was not a protocol reply.
#[derive(Debug)]
pub(super) enum CallError {
    /// Not reached, or the connection broke.
    Unreachable(String),
    /// 503: draining or full.
    Refused(String),
    /// 404: the task is not registered there (the worker restarted).
    UnknownTask,
    /// 404: the episode is not open there.
    UnknownEpisode(String),
    Timeout,
    /// Anything else (a 4xx naming what was wrong).
    Other(String),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unreachable(e) => write!(f, "unreachable: {e}"),
            Self::Refused(e) => write!(f, "refused: {e}"),
            Self::UnknownTask => write!(f, "does not know the task"),
            Self::UnknownEpisode(e) => write!(f, "{e}"),
            Self::Timeout => write!(f, "no answer in time"),
            Self::Other(e) => write!(f, "{e}"),
        }
    }
}

impl WorkerPool {
    pub fn new(cfg: WorkerPoolConfig) -> Result<Arc<Self>, EnvError> {
        let client = reqwest::Client::builder()
            .http2_prior_knowledge()
            .connect_timeout(Duration::from_secs(3))
            .build()
            .map_err(|e| EnvError::Worker(format!("env pool {}: HTTP client: {e}", cfg.name)))?;
        let pool = Arc::new(Self {
            name: cfg.name,
            token: cfg.token,
            client,
            workers: RwLock::new(Vec::new()),
            prober: Mutex::new(None),
            follower: Mutex::new(None),
            first_probe: tokio::sync::OnceCell::new(),
            changed: tokio::sync::Notify::new(),
            membership: cfg.membership.clone(),
            discovery_error: Mutex::new(None),
        });
        if let Membership::Urls(urls) = &cfg.membership {
            pool.set_members(urls);
        }
        Ok(pool)
    }

    /// The pool's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Makes `urls` the pool's workers: new ones are added (unprobed until the next probe),
    /// those not listed leave (their open episodes finish there; no new ones go there).
    pub fn set_members(&self, urls: &[String]) {
        let mut ws = self.workers.write().unwrap_or_else(|p| p.into_inner());
        let mut want: Vec<String> = urls
            .iter()
            .map(|u| u.trim_end_matches('/').to_string())
            .collect();
        if want.len() > MAX_MEMBERS {
            tracing::warn!(pool = %self.name, found = want.len(), "an env pool follows its first {MAX_MEMBERS} workers only");
            want.truncate(MAX_MEMBERS);
        }
        ws.retain(|w| want.contains(&w.url));
        for u in want {
            if !ws.iter().any(|w| w.url == u) {
                ws.push(Arc::new(Worker {
                    url: u,
                    st: Mutex::new(WorkerState::default()),
                }));
            }
        }
    }

    /// Each worker's URL and state, in membership order.
    pub fn snapshot(&self) -> Vec<(String, WorkerState)> {
        self.members()
            .iter()
            .map(|w| (w.url.clone(), lock(&w.st).clone()))
            .collect()
    }

    fn members(&self) -> Vec<Arc<Worker>> {
        self.workers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub(super) fn request(&self, method: reqwest::Method, url: String) -> reqwest::RequestBuilder {
        let r = self.client.request(method, url);
        match &self.token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }

    /// Asks every worker for its state once (at most `timeout` each, concurrently).
    pub async fn probe(&self, timeout: Duration) {
        let probes = self.members().into_iter().map(|w| async move {
            let r = self
                .request(reqwest::Method::GET, format!("{}/v1/worker", w.url))
                .timeout(timeout)
                .send()
                .await;
            let got = match r {
                Ok(resp) if resp.status().is_success() => resp
                    .json::<serde_json::Value>()
                    .await
                    .map_err(|e| format!("unreadable state: {e}")),
                Ok(resp) => Err(format!("answered {}", resp.status())),
                Err(e) => Err(infra::error_chain(&e)),
            };
            let mut st = lock(&w.st);
            match got {
                Ok(v) => {
                    st.up = true;
                    st.seen = true;
                    st.draining = v["draining"].as_bool().unwrap_or(false);
                    st.slots = v["slots"].as_u64().unwrap_or(0) as usize;
                    st.open = v["open"].as_u64().unwrap_or(0) as usize;
                    st.mine_at_probe = st.mine;
                    st.refused = false;
                    st.last_error = None;
                }
                Err(e) => {
                    st.up = false;
                    st.last_error = Some(e);
                }
            }
        });
        futures::future::join_all(probes).await;
        self.changed.notify_waiters();
    }

    /// Looks for the pool's members again (DNS); on failure the members found before stay.
    pub async fn discover(&self) {
        match self.membership.resolve().await {
            Ok(urls) => {
                self.set_members(&urls);
                *lock(&self.discovery_error) = None;
            }
            Err(e) => {
                tracing::warn!(pool = %self.name, error = %e, "cannot look up the env pool's workers");
                *lock(&self.discovery_error) = Some(e);
            }
        }
    }

    /// Starts the probe loop once (it ends when the pool is dropped): a probe of every worker
    /// each [`PROBE_EVERY`], and a look for members each `every` of a DNS membership. Every
    /// caller waits for the first of both, so the first placements know the workers.
    pub(super) async fn started(self: &Arc<Self>) {
        self.first_probe
            .get_or_init(|| async {
                let weak: Weak<Self> = Arc::downgrade(self);
                let every = self.membership.every();
                // A first call dropped while it waited leaves the cell empty: the next one
                // starts again, and the loops the dropped one started stop here.
                let prober = tokio::spawn(async move {
                    let mut tick = tokio::time::interval(PROBE_EVERY);
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    // The first tick is now: the first probe below is it.
                    tick.tick().await;
                    let mut looked = tokio::time::Instant::now();
                    loop {
                        tick.tick().await;
                        let Some(pool) = weak.upgrade() else { return };
                        if every.is_some_and(|e| looked.elapsed() >= e) {
                            looked = tokio::time::Instant::now();
                            pool.discover().await;
                        }
                        pool.probe(Duration::from_secs(2)).await;
                    }
                });
                if let Some(old) = lock(&self.prober).replace(prober) {
                    old.abort();
                }
                if every.is_some() {
                    self.discover().await;
                }
                if let Membership::Kubernetes(k) = &self.membership {
                    self.follow(k.clone()).await;
                }
                self.probe(Duration::from_secs(2)).await;
            })
            .await;
    }

    /// Starts following a Kubernetes membership (list, then watch) and waits for the first
    /// list's answer or failure (at most [`FIRST_LIST_WAIT`]).
    async fn follow(self: &Arc<Self>, target: crate::discovery::KubeTarget) {
        let weak: Weak<Self> = Arc::downgrade(self);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let mut first = Some(tx);
        let task = tokio::spawn(async move {
            target
                .follow(|found| {
                    let Some(pool) = weak.upgrade() else {
                        return false;
                    };
                    match found {
                        Ok(urls) => {
                            pool.set_members(&urls);
                            *lock(&pool.discovery_error) = None;
                        }
                        Err(e) => {
                            tracing::warn!(pool = %pool.name, error = %e, "cannot follow the env pool's workers");
                            *lock(&pool.discovery_error) = Some(e);
                        }
                    }
                    pool.changed.notify_waiters();
                    if let Some(tx) = first.take() {
                        let _ = tx.send(());
                    }
                    true
                })
                .await
        });
        if let Some(old) = lock(&self.follower).replace(task) {
            old.abort();
        }
        let _ = tokio::time::timeout(FIRST_LIST_WAIT, rx).await;
    }

    /// An episode placed on `w` closed: its slot is free before the next probe says so.
    pub(super) fn closed_on(&self, w: &Worker) {
        {
            let mut st = lock(&w.st);
            st.mine = st.mine.saturating_sub(1);
        }
        self.changed.notify_waiters();
    }

    /// Whether a slot may open soon: a worker answered its last probe or call (full or
    /// draining ones count: a slot will open there), or one just discovered awaits its first
    /// probe.
    pub(super) fn any_hope(&self) -> bool {
        self.members().iter().any(|w| {
            let st = lock(&w.st);
            st.up || (!st.seen && st.last_error.is_none())
        })
    }

    /// Each worker's state in words, for an error.
    pub(super) fn describe(&self) -> String {
        let states: Vec<String> = self
            .snapshot()
            .into_iter()
            .map(|(u, st)| match (st.up, st.draining, &st.last_error) {
                (false, _, Some(e)) => format!("{u}: down ({e})"),
                (false, _, None) => format!("{u}: not reached"),
                (true, true, _) => format!("{u}: draining"),
                (true, false, _) => format!("{u}: all {} slots taken", st.slots),
            })
            .collect();
        if states.is_empty() {
            match lock(&self.discovery_error).as_ref() {
                Some(e) => format!("it has no workers ({e})"),
                None => format!("it has no workers ({})", self.membership.describe()),
            }
        } else {
            states.join("; ")
        }
    }

    /// The least-loaded worker (open ÷ slots) that takes episodes now, with a slot reserved
    /// on it for the episode being placed (`mine` counted now, before the call, so that
    /// concurrent resets spread instead of all choosing the same worker); the caller gives
    /// the slot back if the placement fails.
    pub(super) fn reserve(&self) -> Option<Arc<Worker>> {
        let members = self.members();
        let mut best: Option<(f64, std::sync::MutexGuard<'_, WorkerState>, &Arc<Worker>)> = None;
        let guards: Vec<_> = members.iter().map(|w| (lock(&w.st), w)).collect();
        for (st, w) in guards {
            if !st.takes_episodes() {
                continue;
            }
            let ratio = st.load() as f64 / st.slots.max(1) as f64;
            if best.as_ref().is_none_or(|(r, _, _)| ratio < *r) {
                best = Some((ratio, st, w));
            }
        }
        let (_, mut st, w) = best?;
        st.mine += 1;
        Some(Arc::clone(w))
    }

    pub(super) async fn call(
        &self,
        w: &Worker,
        key: &str,
        req: &Request,
        timeout: Duration,
    ) -> Result<Response, CallError> {
        Ok(self.call_start(w, key, req, timeout).await?.0)
    }

    /// [`Self::call`], with how a reset found its sandbox on the worker (its
    /// [`START_HEADER`]).
    pub(super) async fn call_start(
        &self,
        w: &Worker,
        key: &str,
        req: &Request,
        timeout: Duration,
    ) -> Result<(Response, Option<crate::env::starts::Start>), CallError> {
        let resp = self.post(w, key, "call", req, timeout).await?;
        let start = resp
            .headers()
            .get(START_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(crate::env::starts::Start::parse);
        resp.json::<Response>()
            .await
            .map(|r| (r, start))
            .map_err(|e| CallError::Other(format!("an unreadable reply: {e}")))
    }

    /// POSTs `body` to the task route `what` (`call`, `agent`) of task `key` on `w`: the
    /// reply if it succeeded, else what the worker said.
    pub(super) async fn post(
        &self,
        w: &Worker,
        key: &str,
        what: &str,
        body: &impl serde::Serialize,
        timeout: Duration,
    ) -> Result<reqwest::Response, CallError> {
        let r = self
            .request(
                reqwest::Method::POST,
                format!("{}/v1/tasks/{key}/{what}", w.url),
            )
            .json(body)
            .timeout(timeout)
            .send()
            .await;
        let resp = match r {
            Ok(r) => r,
            Err(e) if e.is_timeout() => return Err(CallError::Timeout),
            Err(e) => return Err(CallError::Unreachable(infra::error_chain(&e))),
        };
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let body: serde_json::Value = resp.json().await.unwrap_or_default();
        let msg = body["error"].as_str().unwrap_or("").to_string();
        Err(match (status.as_u16(), body["code"].as_str()) {
            (503, _) => CallError::Refused(msg),
            (404, Some("unknown_task")) => CallError::UnknownTask,
            (404, _) => CallError::UnknownEpisode(msg),
            (s, _) => CallError::Other(format!("answered {s}: {msg}")),
        })
    }

    pub(super) fn mark_down(&self, w: &Worker, why: &str) {
        let mut st = lock(&w.st);
        st.up = false;
        st.last_error = Some(why.to_string());
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        if let Some(p) = lock(&self.prober).take() {
            p.abort();
        }
        if let Some(f) = lock(&self.follower).take() {
            f.abort();
        }
    }
}
