//! Elastic server pools: a pool of inference servers that follows a Deployment's replicas
//! (a DNS name or Kubernetes EndpointSlices) instead of a fixed list. The pool has `count`
//! shard slots ([`ElasticEngine`]s); a follower ([`follow`]) assigns each server it finds to
//! a free slot and takes leaving ones back.
//!
//! A slot's life:
//! - **Empty:** no server; the shard takes no trajectories ([`GenerationEngine::accepting`]
//!   is false, so the scheduler places none there while another shard has a server).
//! - **Joining:** a server was assigned; a [`RemoteEngine`] waits for it to be healthy, then
//!   gets the policy version the job serves now (the last one installed on the slot, shared
//!   by the pool) before the shard accepts work. A server that cannot take that version (an
//!   attached llama.cpp once the policy has moved on) never serves: the slot stays closed
//!   and says why.
//! - **Serving:** like any server shard; installs go to its server and are remembered.
//! - **Leaving:** the server left the membership: the shard takes no new trajectories,
//!   finishes the turns it holds and the trajectories placed on it (their sessions), then
//!   lets the server go; after `drain_within` whatever is left fails (generation failure:
//!   masked or retried) and the server goes anyway.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{RemoteConfig, RemoteEngine, ServerClient};
use crate::discovery::Membership;
use crate::error::SharedError;
use crate::generation::{
    GenError, GenOutput, GenRequest, GenerationEngine, InFlightPolicy, LoadReport, StepReport,
};
use crate::types::PolicyVersion;
use crate::weights::Weights;

/// Makes the client of the server at a base URL.
pub type ClientFor = Arc<dyn Fn(&str) -> Arc<dyn ServerClient> + Send + Sync>;

/// The policy the pool serves now: the last version installed and its weights (every slot
/// installs it on a joining server).
#[derive(Default)]
pub struct Current {
    pub version: PolicyVersion,
    pub weights: Option<Arc<Weights>>,
}

/// One slot of an elastic pool, shared by the follower (which assigns it a server) and its
/// engine.
#[derive(Default)]
pub struct Slot {
    /// The server assigned to the slot (`None`: it has none, or its server left).
    want: Mutex<Option<String>>,
    /// The server the engine holds (joining, serving or leaving): the follower assigns a new
    /// server only to a slot that holds none.
    held: Mutex<Option<String>>,
    /// Wakes the slot's engine loop.
    wake: Arc<tokio::sync::Notify>,
    /// Why the last server could not serve, for the shard's errors.
    refused: Mutex<Option<String>>,
}

impl Slot {
    /// The server the follower assigned the slot (`None`: none, or its server left).
    pub fn assigned(&self) -> Option<String> {
        lock(&self.want).clone()
    }

    /// The server the slot's engine holds now.
    pub fn held(&self) -> Option<String> {
        lock(&self.held).clone()
    }

    fn assign(&self, url: Option<String>) {
        *lock(&self.want) = url;
        self.wake.notify_one();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// An elastic pool: its slots and the policy it serves.
pub struct ElasticPool {
    pub name: String,
    pub slots: Vec<Arc<Slot>>,
    pub current: Arc<Mutex<Current>>,
    /// What the last look for servers found, in words.
    looked: Mutex<String>,
}

impl ElasticPool {
    pub fn new(name: &str, count: usize) -> Arc<Self> {
        Arc::new(Self {
            name: name.to_string(),
            slots: (0..count).map(|_| Arc::new(Slot::default())).collect(),
            current: Arc::new(Mutex::new(Current::default())),
            looked: Mutex::new("no look for servers yet".into()),
        })
    }

    /// Each slot's server and state in words, for an error.
    pub fn describe(&self) -> String {
        let looked = lock(&self.looked).clone();
        let slots: Vec<String> = self
            .slots
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let held = s.held().unwrap_or_else(|| "no server".into());
                match lock(&s.refused).as_ref() {
                    Some(why) => format!("slot {i}: {held}, refused: {why}"),
                    None => format!("slot {i}: {held}"),
                }
            })
            .collect();
        format!("{}; {}", looked, slots.join("; "))
    }

    /// Makes `urls` the pool's servers: a server no longer listed leaves its slot; a new one
    /// takes a slot that holds no server (one still letting a server go is not free), or
    /// waits for the next look when none is free.
    pub fn set_members(&self, urls: &[String]) {
        let want: Vec<String> = urls
            .iter()
            .map(|u| u.trim_end_matches('/').to_string())
            .collect();
        *lock(&self.looked) = format!(
            "found {}",
            if want.is_empty() {
                "no server".to_string()
            } else {
                want.join(", ")
            }
        );
        for s in &self.slots {
            let keep = lock(&s.want).as_ref().is_some_and(|u| want.contains(u));
            if !keep && lock(&s.want).is_some() {
                s.assign(None);
            }
        }
        for u in want {
            let placed = self
                .slots
                .iter()
                .any(|s| lock(&s.want).as_deref() == Some(u.as_str()));
            if placed {
                continue;
            }
            let free = self
                .slots
                .iter()
                .find(|s| lock(&s.want).is_none() && lock(&s.held).is_none());
            match free {
                Some(s) => s.assign(Some(u)),
                None => tracing::warn!(pool = %self.name, server = %u,
                    "every shard slot of the pool holds a server: this one waits (raise count)"),
            }
        }
    }
}

/// Follows `membership` for `pool` until the pool is dropped: a DNS name looked up every
/// `membership.every()`, or Kubernetes EndpointSlices listed and watched. A failed look keeps
/// the servers found before.
pub async fn follow(pool: std::sync::Weak<ElasticPool>, membership: Membership) {
    if let Membership::Kubernetes(target) = &membership {
        target
            .follow(|found| {
                let Some(p) = pool.upgrade() else {
                    return false;
                };
                match found {
                    Ok(urls) => p.set_members(&urls),
                    Err(e) => {
                        tracing::warn!(pool = %p.name, error = %e,
                            "cannot follow the pool's inference servers");
                        *lock(&p.looked) = format!("cannot follow its servers: {e}");
                    }
                }
                true
            })
            .await;
        return;
    }
    let every = membership.every().unwrap_or(Duration::from_secs(2));
    loop {
        let Some(p) = pool.upgrade() else { return };
        match membership.resolve().await {
            Ok(urls) => p.set_members(&urls),
            Err(e) => {
                tracing::warn!(pool = %p.name, error = %e,
                    "cannot look up the pool's inference servers");
                *lock(&p.looked) = format!("cannot look up its servers: {e}");
            }
        }
        drop(p);
        tokio::time::sleep(every).await;
    }
}

/// The server a slot holds, and where it is in its life.
struct Held {
    url: String,
    engine: RemoteEngine,
    /// It serves the pool's version and takes work.
    serving: bool,
    /// Its server left: since when.
    leaving: Option<tokio::time::Instant>,
    /// It cannot serve (never healthy, or unable to take the version): it goes at once.
    refused: bool,
}

/// The engine of one slot of an elastic pool.
pub struct ElasticEngine {
    slot: Arc<Slot>,
    current: Arc<Mutex<Current>>,
    client_for: ClientFor,
    rt: tokio::runtime::Handle,
    cfg: RemoteConfig,
    drain_within: Duration,
    held: Option<Held>,
    /// Requests that came while the slot had no serving server (placed here when no shard
    /// of the pool had one, or the next turns of trajectories whose server left), and when.
    waiting: VecDeque<(tokio::time::Instant, GenRequest)>,
    /// Trajectories placed on the slot that have not ended.
    sessions: HashSet<u64>,
    failed: Vec<(u64, Result<GenOutput, GenError>)>,
    paused: bool,
    /// A server refused lately, and when it may be tried again.
    retry: Option<(String, tokio::time::Instant)>,
}

/// How long a slot waits before it tries again a server that could not serve.
pub const RETRY_REFUSED: Duration = Duration::from_secs(30);

impl ElasticEngine {
    /// The engine of `slot` of `pool`, reaching its servers through `client_for`; each
    /// server's engine runs on `rt` with `cfg`; a leaving server's work is failed after
    /// `drain_within`.
    pub fn new(
        pool: &ElasticPool,
        slot: usize,
        client_for: ClientFor,
        rt: tokio::runtime::Handle,
        cfg: RemoteConfig,
        drain_within: Duration,
    ) -> Self {
        let s = Arc::clone(&pool.slots[slot]);
        // A restarted shard starts empty: the follower's assignment still holds.
        *lock(&s.held) = None;
        Self {
            slot: s,
            current: Arc::clone(&pool.current),
            client_for,
            rt,
            cfg,
            drain_within,
            held: None,
            waiting: VecDeque::new(),
            sessions: HashSet::new(),
            failed: Vec::new(),
            paused: false,
            retry: None,
        }
    }

    /// Follows the slot's assignment: starts a new server's engine, brings a joining one to
    /// the pool's version once healthy, lets a leaving one go once it holds nothing.
    fn track(&mut self) {
        let want = lock(&self.slot.want).clone();
        if let Some(h) = &mut self.held
            && h.leaving.is_none()
            && want.as_deref() != Some(h.url.as_str())
        {
            tracing::info!(server = %h.url, "an inference server left the pool: draining it");
            h.leaving = Some(tokio::time::Instant::now());
            // Woken at the drain time, whatever happens before.
            let (wake, due) = (Arc::clone(&self.slot.wake), self.drain_within);
            self.rt.spawn(async move {
                tokio::time::sleep(due).await;
                wake.notify_one();
            });
        }
        self.let_go();
        if self.held.is_none()
            && let Some(url) = want
            && !self.waits_to_retry(&url)
        {
            self.join(url);
        }
        self.bring_to_version();
        let queued: Vec<(tokio::time::Instant, GenRequest)> = self.waiting.drain(..).collect();
        match self.serving() {
            Some(e) => queued.into_iter().for_each(|(_, r)| e.add(r)),
            None => {
                // No server for `drain_within`: they fail (generation failures).
                let now = tokio::time::Instant::now();
                for (at, r) in queued {
                    if now.duration_since(at) >= self.drain_within {
                        self.failed
                            .push((r.id, Err(no_server_error(self.drain_within))));
                    } else {
                        self.waiting.push_back((at, r));
                    }
                }
            }
        }
    }

    /// Whether `url` was refused lately and waits before it is tried again.
    fn waits_to_retry(&self, url: &str) -> bool {
        self.retry
            .as_ref()
            .is_some_and(|(u, at)| u == url && tokio::time::Instant::now() < *at)
    }

    fn join(&mut self, url: String) {
        tracing::info!(server = %url, "an inference server joined the pool");
        // A server that is not healthy within `ready_within` is let go (and tried again later).
        let engine = RemoteEngine::start_woken(
            (self.client_for)(&url),
            self.rt.clone(),
            self.cfg.clone(),
            Arc::clone(&self.slot.wake),
        );
        *lock(&self.slot.held) = Some(url.clone());
        *lock(&self.slot.refused) = None;
        self.held = Some(Held {
            url,
            engine,
            serving: false,
            leaving: None,
            refused: false,
        });
    }

    /// A joining server, healthy now, gets the pool's version before it serves.
    fn bring_to_version(&mut self) {
        let Some(h) = &mut self.held else { return };
        if h.serving || h.leaving.is_some() {
            return;
        }
        if let Some(why) = h.engine.broken() {
            let why = why.to_string();
            tracing::warn!(server = %h.url, error = %why, "a joining inference server never became healthy");
            *lock(&self.slot.refused) = Some(why);
            h.leaving = Some(tokio::time::Instant::now());
            h.refused = true;
            return;
        }
        if h.engine.info().is_none() {
            return;
        }
        let (version, weights) = {
            let c = lock(&self.current);
            (c.version, c.weights.clone())
        };
        if h.engine.serving() != Some(version) {
            let installed = match weights {
                Some(w) => h
                    .engine
                    .install(version, &w, InFlightPolicy::Abort)
                    .map_err(|e| infra::error_chain(&e)),
                None => Err(format!(
                    "the pool has no weights of version {version} to give it"
                )),
            };
            if let Err(why) = installed {
                tracing::warn!(server = %h.url, version, error = %why,
                    "a joining inference server cannot serve the policy's version: it takes no work");
                *lock(&self.slot.refused) = Some(why);
                h.leaving = Some(tokio::time::Instant::now());
                h.refused = true;
                return;
            }
        }
        if self.paused {
            h.engine.suspend();
        }
        h.serving = true;
        tracing::info!(server = %h.url, version, "an inference server serves in the pool");
    }

    /// Whether the leaving server `h` (since `since`) may go: it holds no request and no
    /// trajectory, or its drain time is up.
    fn may_let_go(&self, h: &Held, since: tokio::time::Instant) -> bool {
        let idle = !h.engine.busy() && (self.sessions.is_empty() || !h.serving);
        h.refused || idle || since.elapsed() >= self.drain_within
    }

    /// Lets a leaving server go once it may (what it still holds fails).
    fn let_go(&mut self) {
        let Some(h) = &self.held else { return };
        let Some(since) = h.leaving else { return };
        if !self.may_let_go(h, since) {
            return;
        }
        let Some(h) = &mut self.held else { return };
        let mut left = h.engine.step().finished;
        left.extend(h.engine.fail_all(&left_error(&h.url)));
        self.failed.append(&mut left);
        let url = h.url.clone();
        // A server refused (never healthy, or unable to take the version) is tried again
        // only after a pause.
        if lock(&self.slot.refused).is_some() {
            let again = tokio::time::Instant::now() + RETRY_REFUSED;
            self.retry = Some((url.clone(), again));
            let wake = Arc::clone(&self.slot.wake);
            self.rt.spawn(async move {
                tokio::time::sleep_until(again).await;
                wake.notify_one();
            });
        }
        self.held = None;
        *lock(&self.slot.held) = None;
        // Requests it still held, and trajectories placed on it, fail: their server is gone.
        self.sessions.clear();
        tracing::info!(server = %url, "an inference server left its shard slot");
        self.slot.wake.notify_one();
    }

    fn serving(&mut self) -> Option<&mut RemoteEngine> {
        self.held
            .as_mut()
            .filter(|h| h.serving)
            .map(|h| &mut h.engine)
    }
}

impl GenerationEngine for ElasticEngine {
    fn add(&mut self, req: GenRequest) {
        self.sessions.insert(req.session);
        self.track();
        match self.serving() {
            Some(e) => e.add(req),
            None => {
                let wake = Arc::clone(&self.slot.wake);
                let due = self.drain_within;
                self.rt.spawn(async move {
                    tokio::time::sleep(due).await;
                    wake.notify_one();
                });
                self.waiting.push_back((tokio::time::Instant::now(), req));
            }
        }
    }

    fn abort(&mut self, id: u64) -> bool {
        let before = self.waiting.len();
        self.waiting.retain(|(_, r)| r.id != id);
        if before != self.waiting.len() {
            return true;
        }
        self.held.as_mut().is_some_and(|h| h.engine.abort(id))
    }

    fn release(&mut self, session: u64) {
        self.sessions.remove(&session);
        if let Some(h) = &mut self.held {
            h.engine.release(session);
        }
    }

    fn install(
        &mut self,
        version: PolicyVersion,
        weights: &Weights,
        policy: InFlightPolicy,
    ) -> Result<Duration, GenError> {
        {
            let mut c = lock(&self.current);
            if c.version != version || c.weights.is_none() {
                c.version = version;
                c.weights = Some(Arc::new(weights.clone()));
            }
        }
        match &mut self.held {
            Some(h) if h.serving && h.leaving.is_none() => {
                h.engine.install(version, weights, policy)
            }
            // A joining server gets the version when it is healthy; a leaving one keeps its
            // own for the trajectories it finishes.
            _ => Ok(Duration::ZERO),
        }
    }

    fn suspend(&mut self) {
        self.paused = true;
        if let Some(e) = self.serving() {
            e.suspend();
        }
    }

    fn resume(&mut self) {
        self.paused = false;
        if let Some(e) = self.serving() {
            e.resume();
        }
    }

    fn has_work(&self) -> bool {
        let want = lock(&self.slot.want).clone();
        let changed = want.as_deref() != self.held.as_ref().map(|h| h.url.as_str())
            && !want.as_deref().is_some_and(|u| self.waits_to_retry(u));
        let overdue = self
            .waiting
            .front()
            .is_some_and(|(at, _)| at.elapsed() >= self.drain_within);
        changed
            || overdue
            || !self.failed.is_empty()
            || self.held.as_ref().is_some_and(|h| {
                h.engine.has_work()
                    || h.leaving.is_some_and(|since| self.may_let_go(h, since))
                    || (h.leaving.is_none() && !h.serving && h.engine.info().is_some())
            })
    }

    fn step(&mut self) -> StepReport {
        self.track();
        let mut report = match &mut self.held {
            Some(h) => h.engine.step(),
            None => StepReport::default(),
        };
        report.finished.append(&mut self.failed);
        // Requests waiting on a slot without a server (placed here when no shard of the pool
        // had one) wait for one; the episode's own deadlines bound them.
        report
    }

    fn load(&self) -> LoadReport {
        let l = match &self.held {
            Some(h) => h.engine.load(),
            None => LoadReport {
                version: lock(&self.current).version,
                ..Default::default()
            },
        };
        // Requests waiting for a server are not counted: the shard's watchdog would take
        // the wait for a frozen engine (they are bounded by `drain_within`).
        l
    }

    fn external_load(&self) -> usize {
        self.held.as_ref().map_or(0, |h| h.engine.external_load())
    }

    fn accepting(&self) -> bool {
        self.held
            .as_ref()
            .is_some_and(|h| h.serving && h.leaving.is_none())
    }

    fn progress(&self, id: u64) -> Option<usize> {
        self.held.as_ref().and_then(|h| h.engine.progress(id))
    }

    fn waker(&self) -> Option<Arc<tokio::sync::Notify>> {
        Some(Arc::clone(&self.slot.wake))
    }
}

/// The error of a request that found no server in the pool for `waited`.
fn no_server_error(waited: Duration) -> GenError {
    GenError::Backend(SharedError::new(super::ServerError::Other(format!(
        "no inference server of the pool took the request within {:.0} s",
        waited.as_secs_f64()
    ))))
}

/// The error of a request whose server left before it finished.
fn left_error(server: &str) -> GenError {
    GenError::Backend(SharedError::new(super::ServerError::Other(format!(
        "{server} left the pool before the request finished"
    ))))
}

#[cfg(test)]
mod tests;
