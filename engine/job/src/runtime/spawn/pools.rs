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
    for (pi, p) in plans.iter().enumerate() {
        let mut handles = Vec::with_capacity(p.shards);
        let mut actors = Vec::with_capacity(p.shards);
        for i in 0..p.shards {
            let (factory, placement) = engine_factory(seed, epoch, pi, i, p, start, restarts);
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
    }
    // Shards start at the resumed version.
    for p in &all {
        for (i, a) in p.actors.iter().enumerate() {
            install(a, start.initial.clone(), InFlightPolicy::Abort, &p.name, i).await?;
        }
    }
    Ok((views, all))
}

/// The engine factory of shard `i` of pool `pi` (called again for every restart).
fn engine_factory(
    seed: u64,
    epoch: u64,
    pi: usize,
    i: usize,
    p: &PoolPlan,
    start: &ShardStart,
    restarts: &Arc<AtomicU64>,
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
            server_factory(i, model, server, start),
            LoopPlacement::Thread,
        ),
        EnginePlan::Builtin {
            model: ModelChoice::Checkpoint { .. },
        } => {
            let (policy, mb) = (start.policy.clone(), p.max_batch);
            // Every (re)started engine serves the loaded weights; the shard then installs the
            // job's current version.
            let f: EngineFactory = Arc::new(move || {
                let built = match &policy {
                    Some(p) => p
                        .engine(mb)
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
