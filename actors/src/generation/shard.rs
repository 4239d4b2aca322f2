//! The shard actor: owns one generation engine loop, controls it (suspend / install / resume),
//! watches it for freezes and restarts it. Episodes talk to the loop directly through a
//! [`ShardHandle`]; only control goes through the actor.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use super::{
    EngineCommand, EngineHandle, EngineLoopJoin, GenError, GenOutput, GenRequest, GenerationEngine,
    InFlightPolicy, LoadReport, LoopPlacement, spawn_engine,
};
use crate::device::DeviceProfile;
use crate::types::PolicyVersion;
use crate::weights::Weights;

/// Builds a fresh engine (at start and after a restart).
pub type EngineFactory = Arc<dyn Fn() -> Box<dyn GenerationEngine> + Send + Sync>;

/// Stable handle to a shard's engine loop that survives restarts of the loop.
#[derive(Clone)]
pub struct ShardHandle {
    pub pool: String,
    pub index: usize,
    inner: Arc<RwLock<EngineHandle>>,
}

impl ShardHandle {
    /// Generates on the shard's current engine loop. The request comes boxed: each future on
    /// the way to the engine holds a pointer instead of the request (an episode's future is as
    /// large as its deepest await, for the episode's whole life).
    pub async fn generate_boxed(&self, req: Box<GenRequest>) -> Result<GenOutput, GenError> {
        let h = self.current();
        h.generate_boxed(req).await
    }

    // (A send may wait on a full command seam: never under the lock a restart takes.)
    pub fn abort(&self, id: u64) {
        self.current().abort(id);
    }

    pub fn release(&self, session: u64) {
        self.current().release(session);
    }

    /// Leading context tokens of `session` the shard's prefix cache holds.
    pub async fn cached(&self, session: u64) -> u64 {
        let h = self.current();
        h.cached(session).await
    }

    /// Requests other clients run or queue on this shard's backend (a shared inference
    /// server), as its engine loop last saw them; 0 for engines only this job uses.
    pub fn external_load(&self) -> usize {
        // Read on every placement, for every shard of the pool: no clone of the handle.
        self.with_current(EngineHandle::external_load)
    }

    /// Whether the shard takes new trajectories (an elastic pool's shard has a server that
    /// is not leaving), as its engine loop last saw it.
    pub fn accepting(&self) -> bool {
        self.with_current(EngineHandle::accepting)
    }

    fn current(&self) -> EngineHandle {
        self.with_current(EngineHandle::clone)
    }

    /// `f` of the current loop's handle, under the read lock: `f` must not wait (no await, no
    /// send on the command seam).
    fn with_current<R>(&self, f: impl FnOnce(&EngineHandle) -> R) -> R {
        match self.inner.read() {
            Ok(g) => f(&g),
            Err(p) => f(&p.into_inner()),
        }
    }
}

pub enum ShardMsg {
    Suspend(RpcReplyPort<()>),
    Install(
        Arc<Weights>,
        InFlightPolicy,
        RpcReplyPort<Result<(), GenError>>,
    ),
    Resume,
    Load(RpcReplyPort<LoadReport>),
    /// Periodic frozen-engine check.
    Watchdog,
}

pub struct ShardArgs {
    pub pool: String,
    pub index: usize,
    pub device: DeviceProfile,
    pub factory: EngineFactory,
    pub placement: LoopPlacement,
    /// An engine with work that takes no step for this long is frozen and restarted.
    pub frozen_after: Duration,
    /// Shared restart counter (exported as a metric by the job).
    pub restarts: Arc<std::sync::atomic::AtomicU64>,
}

pub struct ShardActor;

pub struct ShardState {
    args: ShardArgs,
    handle: ShardHandle,
    join: EngineLoopJoin,
    version: PolicyVersion,
    weights: Option<Arc<Weights>>,
    suspended: bool,
    last_steps: u64,
    stalled_since: Option<tokio::time::Instant>,
    /// Busy seconds of engine loops that were restarted (so utilisation stays monotonic).
    busy_before: f64,
    tokens_before: (u64, u64),
    /// Prefix-cache lookups and hits of restarted loops.
    cache_before: (u64, u64),
    last_load: LoadReport,
}

async fn query_load(h: &EngineHandle) -> Option<LoadReport> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    if !h.send(EngineCommand::Load(tx)) {
        return None;
    }
    tokio::time::timeout(Duration::from_secs(5), rx)
        .await
        .ok()?
        .ok()
}

impl Actor for ShardActor {
    type Msg = ShardMsg;
    type State = ShardState;
    type Arguments = (ShardArgs, tokio::sync::oneshot::Sender<ShardHandle>);

    async fn pre_start(
        &self,
        me: ActorRef<Self::Msg>,
        (args, handle_tx): Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        let (h, join) = spawn_engine((args.factory)(), args.placement);
        let handle = ShardHandle {
            pool: args.pool.clone(),
            index: args.index,
            inner: Arc::new(RwLock::new(h)),
        };
        let _ = handle_tx.send(handle.clone());
        if !args.frozen_after.is_zero() {
            me.send_interval(args.frozen_after / 2, || ShardMsg::Watchdog);
        }
        Ok(ShardState {
            args,
            handle,
            join,
            version: 0,
            weights: None,
            suspended: false,
            last_steps: 0,
            stalled_since: None,
            busy_before: 0.0,
            tokens_before: (0, 0),
            cache_before: (0, 0),
            last_load: LoadReport::default(),
        })
    }

    async fn post_stop(
        &self,
        _me: ActorRef<Self::Msg>,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        st.handle.current().send(EngineCommand::Stop);
        st.join.kill();
        Ok(())
    }

    async fn handle(
        &self,
        _me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ShardMsg::Suspend(reply) => {
                let (tx, rx) = tokio::sync::oneshot::channel();
                if st.handle.current().send(EngineCommand::Suspend(tx)) {
                    let _ = rx.await;
                }
                st.suspended = true;
                let _ = reply.send(());
            }
            ShardMsg::Install(w, policy, reply) => {
                let (tx, rx) = tokio::sync::oneshot::channel();
                let r = if st.handle.current().send(EngineCommand::Install(
                    w.version,
                    w.clone(),
                    policy,
                    tx,
                )) {
                    rx.await.unwrap_or(Err(GenError::ShardStopped))
                } else {
                    Err(GenError::ShardStopped)
                };
                if r.is_ok() {
                    st.version = w.version;
                    st.weights = Some(w);
                }
                let _ = reply.send(r);
            }
            ShardMsg::Resume => {
                st.handle.current().send(EngineCommand::Resume);
                st.suspended = false;
            }
            ShardMsg::Load(reply) => {
                let mut l = query_load(&st.handle.current())
                    .await
                    .unwrap_or_else(|| st.last_load.clone());
                l.busy_s += st.busy_before;
                l.prefill_tokens += st.tokens_before.0;
                l.decode_tokens += st.tokens_before.1;
                l.cache_lookup_tokens += st.cache_before.0;
                l.cache_hit_tokens += st.cache_before.1;
                let _ = reply.send(l);
            }
            ShardMsg::Watchdog => {
                let Some(l) = query_load(&st.handle.current()).await else {
                    return Ok(());
                };
                let has_work = l.running + l.waiting > 0 && !l.suspended;
                if has_work && l.steps == st.last_steps {
                    let now = tokio::time::Instant::now();
                    let since = *st.stalled_since.get_or_insert(now);
                    if now - since >= st.args.frozen_after {
                        tracing::warn!(pool = %st.args.pool, shard = st.args.index, "generation engine is frozen; restarting it");
                        restart_engine(st).await;
                    }
                } else {
                    st.stalled_since = None;
                }
                st.last_steps = l.steps;
                st.last_load = l;
            }
        }
        Ok(())
    }
}

/// Kills the engine loop (its in-flight requests fail with `ShardStopped`) and starts a fresh
/// one with the installed weights.
async fn restart_engine(st: &mut ShardState) {
    st.join.kill();
    st.handle.current().send(EngineCommand::Stop);
    st.busy_before += st.last_load.busy_s;
    st.tokens_before.0 += st.last_load.prefill_tokens;
    st.tokens_before.1 += st.last_load.decode_tokens;
    st.cache_before.0 += st.last_load.cache_lookup_tokens;
    st.cache_before.1 += st.last_load.cache_hit_tokens;
    let (h, join) = spawn_engine((st.args.factory)(), st.args.placement);
    if let Some(w) = st.weights.clone() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if h.send(EngineCommand::Install(
            w.version,
            w,
            InFlightPolicy::Abort,
            tx,
        )) {
            let _ = rx.await;
        }
    }
    if st.suspended {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if h.send(EngineCommand::Suspend(tx)) {
            let _ = rx.await;
        }
    }
    match st.handle.inner.write() {
        Ok(mut g) => *g = h,
        Err(p) => *p.into_inner() = h,
    }
    st.join = join;
    st.stalled_since = None;
    st.last_steps = 0;
    st.last_load = LoadReport::default();
    st.args
        .restarts
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}
