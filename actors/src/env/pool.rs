//! The pool a task's episodes lease environments from: environment objects called directly
//! by the episode that holds one, and the pool's actor, which builds, replaces and closes them.

use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::{DynEnvironment, EnvCounters, EnvError, EnvFactory, Observation, Record, StepOutcome};

/// A pooled environment and its place in the pool (a replacement takes the place of the
/// environment it replaces).
struct Pooled {
    slot: usize,
    env: Box<dyn DynEnvironment>,
}

/// A call's answer.
enum Reply {
    Reset(Result<Observation, EnvError>),
    Step(Result<StepOutcome, EnvError>),
}

impl Reply {
    fn failed(&self) -> bool {
        match self {
            Reply::Reset(r) => r.is_err(),
            Reply::Step(r) => r.is_err(),
        }
    }
}

/// A call in flight. It owns the environment until it hands it back with the answer, so an
/// episode cancelled mid-call leaves a call that can still end (see [`EnvLease`]'s `Drop`).
type Call = Pin<Box<dyn Future<Output = (Box<dyn DynEnvironment>, Reply)> + Send>>;

/// `f`, with a panic of the environment's code turned into [`EnvError::Panicked`] (the
/// environment is then replaced, as a failed one is).
async fn guarded<T>(f: BoxFuture<'_, Result<T, EnvError>>) -> Result<T, EnvError> {
    match AssertUnwindSafe(f).catch_unwind().await {
        Ok(r) => r,
        Err(p) => Err(EnvError::Panicked(
            p.downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into()),
        )),
    }
}

/// Runs `f` on the current tokio runtime; with none (a lease dropped while a runtime shuts
/// down), drops it: what it held is dropped with it (a program is killed by its guard).
fn spawn_or_drop(f: impl Future<Output = ()> + Send + 'static) {
    if let Ok(h) = tokio::runtime::Handle::try_current() {
        h.spawn(f);
    }
}

/// What the pool's actor is told.
pub enum PoolMsg {
    /// The environment of `slot` failed, hung or panicked: close what is left of it (a hung
    /// one is already gone) and build a new one after the pool's backoff.
    Replace(usize, Option<Box<dyn DynEnvironment>>),
    /// The backoff is over: build `slot`'s new environment.
    Build(usize),
}

/// Owns a task's environments: builds them (at the start and to replace a failed one) and
/// closes them when it stops. Episodes call a leased environment directly, not through this
/// actor: a lease costs no messages, and an environment no task or mailbox of its own.
pub struct EnvPoolActor;

/// The pool actor's state: what building, replacing and closing environments needs.
pub struct PoolCore {
    pool: EnvPool,
    factory: EnvFactory,
    next_index: u64,
}

impl Actor for EnvPoolActor {
    type Msg = PoolMsg;
    type State = PoolCore;
    type Arguments = PoolCore;

    async fn pre_start(
        &self,
        _me: ActorRef<Self::Msg>,
        core: PoolCore,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(core)
    }

    async fn post_stop(
        &self,
        _me: ActorRef<Self::Msg>,
        core: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        core.pool.close().await;
        Ok(())
    }

    async fn handle(
        &self,
        me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        core: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let pool = &core.pool;
        match msg {
            PoolMsg::Replace(slot, old) => {
                pool.counters.restarts.fetch_add(1, Ordering::Relaxed);
                if let Some(mut env) = old {
                    // A broken environment may not answer its close: bounded, and off this
                    // actor so that other replacements go on.
                    let t = pool.call_timeout;
                    tokio::spawn(async move {
                        let _ = tokio::time::timeout(t, env.close_boxed()).await;
                    });
                }
                me.send_after(pool.restart_backoff, move || PoolMsg::Build(slot));
            }
            PoolMsg::Build(slot) => {
                let index = core.next_index;
                core.next_index += 1;
                // A factory that panics fails this actor: the job's supervisor counts it
                // against its restart policy. The slot stays empty, as a failed spawn of an
                // environment actor left it.
                let env = (core.factory)(index);
                pool.put(slot, env);
            }
        }
        Ok(())
    }
}

/// A bounded pool of environments for one task. Episodes lease one for the whole trajectory
/// and call it directly; the lease returns it on drop. Its capacity caps the task's concurrent
/// episodes (and so its environment step concurrency): a lease request waits while all are
/// taken. The pool's actor ([`EnvPoolActor`], linked to the job's supervisor) owns the
/// environments' lifetimes.
#[derive(Clone)]
pub struct EnvPool(Arc<PoolShared>);

pub struct PoolShared {
    pub task: String,
    pub size: usize,
    pub counters: Arc<EnvCounters>,
    /// Per-call wall-clock timeout; a call past it fails the trajectory and the environment is
    /// replaced.
    pub call_timeout: Duration,
    /// Backoff before a failed environment's replacement is built.
    pub restart_backoff: Duration,
    free_tx: flume::Sender<Pooled>,
    free_rx: flume::Receiver<Pooled>,
    /// Set when the pool closes: environments coming back are closed, not pooled.
    closed: AtomicBool,
    owner: std::sync::OnceLock<ActorRef<PoolMsg>>,
}

impl std::ops::Deref for EnvPool {
    type Target = PoolShared;
    fn deref(&self) -> &PoolShared {
        &self.0
    }
}

/// One leased environment.
pub struct EnvLease {
    pool: EnvPool,
    slot: usize,
    state: Leased,
    failed: bool,
}

enum Leased {
    Idle(Box<dyn DynEnvironment>),
    /// A call in flight owns the environment.
    Busy(Call),
    /// A call timed out: its future, and the environment with it, were dropped.
    Lost,
}

impl EnvPool {
    /// Builds `size` environments and the pool's actor, linked to `supervisor` when one is
    /// given.
    pub async fn spawn(
        task: &str,
        size: usize,
        factory: EnvFactory,
        call_timeout: Duration,
        restart_backoff: Duration,
        supervisor: Option<ractor::ActorCell>,
    ) -> Result<Self, ractor::SpawnErr> {
        // Capacity = number of environments: every one is always free, leased or being
        // replaced.
        let (free_tx, free_rx) = flume::bounded(size.max(1));
        for slot in 0..size {
            let _ = free_tx.try_send(Pooled {
                slot,
                env: factory(slot as u64),
            });
        }
        let pool = EnvPool(Arc::new(PoolShared {
            task: task.to_string(),
            size,
            counters: Arc::new(EnvCounters::with_slots(size)),
            call_timeout,
            restart_backoff,
            free_tx,
            free_rx,
            closed: AtomicBool::new(false),
            owner: std::sync::OnceLock::new(),
        }));
        let core = PoolCore {
            pool: pool.clone(),
            factory,
            next_index: size as u64,
        };
        let (owner, _) = match supervisor {
            Some(s) => Actor::spawn_linked(None, EnvPoolActor, core, s).await?,
            None => Actor::spawn(None, EnvPoolActor, core).await?,
        };
        let _ = pool.owner.set(owner);
        Ok(pool)
    }

    pub async fn lease(&self) -> Option<EnvLease> {
        let Pooled { slot, env } = self.free_rx.recv_async().await.ok()?;
        self.counters.hold(slot, true);
        Some(EnvLease {
            pool: self.clone(),
            slot,
            state: Leased::Idle(env),
            failed: false,
        })
    }

    pub fn available(&self) -> usize {
        self.free_rx.len()
    }

    /// Stops the pool's actor and waits while it closes the free environments (leased ones
    /// are closed as their episodes give them back). A job's pools stop with its supervisor.
    pub async fn stop(&self) {
        if let Some(a) = self.owner.get() {
            let _ = a.stop_and_wait(None, None).await;
        }
    }

    /// Closes the pool: the free environments now, each bounded by the call timeout, and
    /// every leased one when its episode gives it back.
    async fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let mut closing = Vec::new();
        while let Ok(Pooled { mut env, .. }) = self.free_rx.try_recv() {
            let t = self.call_timeout;
            closing.push(async move {
                let _ = tokio::time::timeout(t, env.close_boxed()).await;
            });
        }
        futures::future::join_all(closing).await;
    }

    /// Puts `env` in the pool at `slot`, or closes it if the pool is closed.
    fn put(&self, slot: usize, mut env: Box<dyn DynEnvironment>) {
        if self.closed.load(Ordering::SeqCst) {
            let t = self.call_timeout;
            spawn_or_drop(async move {
                let _ = tokio::time::timeout(t, env.close_boxed()).await;
            });
            return;
        }
        // Never full: the capacity is the number of slots.
        let _ = self.free_tx.try_send(Pooled { slot, env });
    }

    /// An episode is done with `env`: it frees what it holds for the episode elsewhere
    /// ([`super::Environment::release`]) before the next lease can reset it — at once when that
    /// needs no waiting (in-process environments), else on a task of its own.
    fn give_back(&self, slot: usize, mut env: Box<dyn DynEnvironment>) {
        let mut release = Box::pin(async move {
            env.release_boxed().await;
            env
        });
        match (&mut release).now_or_never() {
            Some(env) => self.put(slot, env),
            None => {
                let pool = self.clone();
                spawn_or_drop(async move {
                    let env = release.await;
                    pool.put(slot, env);
                });
            }
        }
    }

    /// Hands a failed environment (or the news that it is gone) to the pool's actor, which
    /// replaces it.
    fn replace(&self, slot: usize, old: Option<Box<dyn DynEnvironment>>) {
        if let Some(a) = self.owner.get() {
            let _ = a.cast(PoolMsg::Replace(slot, old));
        }
    }
}

impl EnvLease {
    /// Runs the call `make` builds on the leased environment, bounded by the call timeout.
    /// The call is kept in the lease while it runs, so that dropping the lease mid-call (an
    /// episode cancelled) lets it end in the background.
    async fn call(
        &mut self,
        make: impl FnOnce(Box<dyn DynEnvironment>) -> Call,
    ) -> Result<Reply, EnvError> {
        let env = match std::mem::replace(&mut self.state, Leased::Lost) {
            Leased::Idle(env) => env,
            other => {
                self.state = other;
                return Err(EnvError::Closed);
            }
        };
        self.state = Leased::Busy(make(env));
        let Leased::Busy(call) = &mut self.state else {
            return Err(EnvError::Closed);
        };
        let t = self.pool.call_timeout;
        let r = tokio::time::timeout(t, call.as_mut()).await;
        match r {
            Ok((env, reply)) => {
                self.state = Leased::Idle(env);
                if reply.failed() {
                    self.failed = true;
                    self.pool.counters.failures.fetch_add(1, Ordering::Relaxed);
                }
                Ok(reply)
            }
            Err(_) => {
                // A hung call never returns: drop it, and the environment with it.
                self.state = Leased::Lost;
                self.failed = true;
                self.pool.counters.timeouts.fetch_add(1, Ordering::Relaxed);
                Err(EnvError::Timeout(t))
            }
        }
    }

    pub async fn reset(
        &mut self,
        seed: u64,
        record: Option<Record>,
    ) -> Result<Observation, EnvError> {
        self.pool.counters.resets.fetch_add(1, Ordering::Relaxed);
        let began = tokio::time::Instant::now();
        let reply = self
            .call(move |mut env| {
                Box::pin(async move {
                    let r = guarded(env.reset_boxed(seed, record)).await;
                    (env, Reply::Reset(r))
                })
            })
            .await?;
        let Reply::Reset(r) = reply else {
            // Never: the call made is the one answered.
            return Err(EnvError::Closed);
        };
        if r.is_ok()
            && let Leased::Idle(env) = &self.state
            && let Some(s) = env.last_start_dyn()
        {
            self.pool.counters.starts.record(s, began.elapsed());
        }
        r
    }

    pub async fn step(
        &mut self,
        action: String,
        tokens: crate::tokens::Tokens,
    ) -> Result<StepOutcome, EnvError> {
        self.pool.counters.steps.fetch_add(1, Ordering::Relaxed);
        let reply = self
            .call(move |mut env| {
                Box::pin(async move {
                    let r = guarded(env.step_boxed(&action, &tokens)).await;
                    (env, Reply::Step(r))
                })
            })
            .await?;
        match reply {
            Reply::Step(r) => r,
            // Never: the call made is the one answered.
            Reply::Reset(_) => Err(EnvError::Closed),
        }
    }
}

impl Drop for EnvLease {
    fn drop(&mut self) {
        let (pool, slot) = (self.pool.clone(), self.slot);
        pool.counters.hold(slot, false);
        match std::mem::replace(&mut self.state, Leased::Lost) {
            Leased::Idle(env) if !self.failed => pool.give_back(slot, env),
            Leased::Idle(env) => pool.replace(slot, Some(env)),
            // The episode was cancelled mid-call (its group filled, or it was aborted): the
            // call ends in the background, as it did on an environment actor, and the
            // environment goes back to the pool, or is replaced if the call fails or hangs.
            Leased::Busy(call) => spawn_or_drop(async move {
                match tokio::time::timeout(pool.call_timeout, call).await {
                    Ok((env, reply)) if !reply.failed() => pool.give_back(slot, env),
                    Ok((env, _)) => pool.replace(slot, Some(env)),
                    Err(_) => pool.replace(slot, None),
                }
            }),
            Leased::Lost => pool.replace(slot, None),
        }
    }
}
