//! The shard pools: every shard of every pool spawned under the job supervisor and started on
//! the run's initial weights, each with the engine factory its backend needs (simulated,
//! built-in model, checkpoint, inference server).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use actors::error::SharedError;
use actors::generation::GenError;
use actors::generation::shard::{EngineFactory, ShardActor, ShardArgs, ShardHandle};
use actors::generation::sim::SimEngine;
use actors::generation::{InFlightPolicy, LoopPlacement};
use actors::model::runtime::FailedEngine;
use ractor::{Actor, ActorCell};

use super::server::server_factory;
use super::trainer::ShardStart;
use crate::runtime::JobError;
use crate::runtime::metrics::PoolShards;
use crate::runtime::protocol::install;
use crate::runtime::scheduler::PoolView;
use crate::spec::ModelChoice;
use crate::wiring::{EnginePlan, PoolPlan};
use actors::generation::remote::elastic::ElasticPool;

/// Spawns every shard of every pool, then installs the run's initial weights on each; returns
/// the scheduler's views and the shards' actors.
pub(super) async fn spawn_pools(
    plans: &[PoolPlan],
    seed: u64,
    epoch: u64,
    cell: &ActorCell,
    start: &ShardStart,
    restarts: &Arc<AtomicU64>,
) -> Result<(Vec<PoolView>, Vec<PoolShards>), JobError> {
    let mut views = Vec::with_capacity(plans.len());
    let mut all = Vec::with_capacity(plans.len());
    let mut elastic = Vec::with_capacity(plans.len());
    for (pi, p) in plans.iter().enumerate() {
        let mut handles = Vec::with_capacity(p.shards);
        let mut actors = Vec::with_capacity(p.shards);
        let pool = elastic_pool(p);
        for i in 0..p.shards {
            let (factory, placement) =
                engine_factory(seed, epoch, (pi, i), p, start, restarts, pool.as_ref());
            let (tx, rx) = tokio::sync::oneshot::channel::<ShardHandle>();
            let args = ShardArgs {
                pool: p.name.clone(),
                index: i,
                device: p.device.clone(),
                factory,
                placement,
                frozen_after: Duration::from_secs_f64(p.frozen_after_s),
                restarts: restarts.clone(),
            };
            let (a, _) = Actor::spawn_linked(None, ShardActor, (args, tx), cell.clone())
                .await
                .map_err(JobError::spawn(format!("shard {}[{i}]", p.name)))?;
            let h = rx.await.map_err(|_| JobError::Call {
                what: "shard",
                source: actors::call::CallError::Dropped,
            })?;
            handles.push(h);
            actors.push(a);
        }
        views.push(PoolView {
            name: p.name.clone(),
            device: p.device.clone(),
            model: p.model.clone(),
            max_batch: p.max_batch,
            shards: handles,
            prefill_from: p.prefill_from,
            prefill_only: p.prefill_only,
        });
        all.push(PoolShards {
            name: p.name.clone(),
            device: p.device.name.clone(),
            actors,
        });
        elastic.push(pool);
    }
    // Shards start at the resumed version.
    for p in &all {
        for (i, a) in p.actors.iter().enumerate() {
            install(a, start.initial.clone(), InFlightPolicy::Abort, &p.name, i).await?;
        }
    }
    // An elastic pool takes trajectories once one of its servers serves: placed before,
    // they would wait on slots that may never get one.
    for (v, pool) in views.iter().zip(&elastic) {
        if let Some(pool) = pool {
            first_server(v, pool).await?;
        }
    }
    Ok((views, all))
}

/// How long an elastic pool may take to find its first server and have it serve.
const FIRST_SERVER_WITHIN: Duration = Duration::from_secs(300);

/// Waits until a shard of the elastic pool `v` serves; an error naming the pool and its
/// slots' state after [`FIRST_SERVER_WITHIN`].
async fn first_server(v: &PoolView, pool: &ElasticPool) -> Result<(), JobError> {
    let deadline = tokio::time::Instant::now() + FIRST_SERVER_WITHIN;
    while !v.shards.iter().any(ShardHandle::accepting) {
        if tokio::time::Instant::now() >= deadline {
            return Err(JobError::NoServer {
                pool: v.name.clone(),
                seconds: FIRST_SERVER_WITHIN.as_secs_f64(),
                why: pool.describe(),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// A server pool that follows its servers' membership: its slots, with the follower started
/// (it stops when the pool's shards are gone).
fn elastic_pool(p: &PoolPlan) -> Option<Arc<ElasticPool>> {
    let EnginePlan::Server { server, .. } = &p.engine else {
        return None;
    };
    let membership = server.discover.clone()?;
    let pool = ElasticPool::new(&p.name, p.shards);
    tokio::spawn(actors::generation::remote::elastic::follow(
        Arc::downgrade(&pool),
        membership,
    ));
    Some(pool)
}

/// The engine factory of shard `i` of pool `pi` (called again for every restart).
fn engine_factory(
    seed: u64,
    epoch: u64,
    (pi, i): (usize, usize),
    p: &PoolPlan,
    start: &ShardStart,
    restarts: &Arc<AtomicU64>,
    elastic: Option<&Arc<ElasticPool>>,
) -> (EngineFactory, LoopPlacement) {
    match &p.engine {
        EnginePlan::Sim { config, faults } => {
            let mut cfg = (**config).clone();
            cfg.seed = seed ^ ((pi as u64) << 40) ^ ((i as u64) << 20) ^ epoch;
            let counter = restarts.clone();
            // An injected fault fires in the shard's first engine only.
            let fault = std::sync::Mutex::new(faults.iter().find(|f| f.0 == i).map(|f| f.1));
            let f: EngineFactory = Arc::new(move || {
                let mut c = cfg.clone();
                // A restarted engine gets a fresh RNG stream (and so does not hang again at once).
                c.seed = c
                    .seed
                    .wrapping_add(counter.load(Ordering::Relaxed).wrapping_mul(0x9e37_79b9));
                c.hang_after_steps = fault.lock().map(|mut f| f.take()).unwrap_or(None);
                Box::new(SimEngine::new(c))
            });
            (f, LoopPlacement::Task)
        }
        EnginePlan::Builtin {
            model: ModelChoice::Tiny(config),
        } => {
            let (cfg, w, mb) = (*config, start.initial.clone(), p.max_batch);
            let f: EngineFactory = Arc::new(
                move || match actors::model::engine::BuiltinEngine::new(cfg, &w, mb) {
                    Ok(e) => Box::new(e),
                    Err(e) => Box::new(FailedEngine::new(e)),
                },
            );
            (f, LoopPlacement::Thread)
        }
        EnginePlan::Server { model, server } => (
            server_factory(i, model, server, start, elastic),
            LoopPlacement::Thread,
        ),
        EnginePlan::Builtin {
            model: ModelChoice::Checkpoint { precision, .. },
        } => {
            let (policy, mb, precision) = (start.policy.clone(), p.max_batch, *precision);
            // Every (re)started engine serves the loaded weights; the shard then installs the
            // job's current version.
            let f: EngineFactory = Arc::new(move || {
                let built = match &policy {
                    Some(p) => p
                        .engine(mb, precision)
                        .map_err(|e| GenError::Backend(SharedError::new(e))),
                    None => Err(GenError::Backend(SharedError::new(NoPolicy))),
                };
                match built {
                    Ok(e) => Box::new(e),
                    Err(e) => Box::new(FailedEngine::new(e)),
                }
            });
            (f, LoopPlacement::Thread)
        }
    }
}

/// A checkpoint pool without a loaded checkpoint (the trainer plan always loads one).
#[derive(Debug, thiserror::Error)]
#[error("no checkpoint was loaded for this pool")]
struct NoPolicy;
