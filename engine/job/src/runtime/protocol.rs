//! The weight-update protocol on the job's shards: suspend every shard, install the newest
//! finished version (in-flight turns follow the job's abort / recompute policy), resume, and
//! tell the scheduler which version now generates.

use std::sync::Arc;

use actors::call::call;
use actors::generation::InFlightPolicy;
use actors::generation::shard::ShardMsg;
use actors::trainer::{TrainStats, TrainerMsg};
use actors::types::{Batch, PolicyVersion};
use actors::weights::{WeightStoreMsg, Weights};
use ractor::ActorRef;
use tokio_util::sync::CancellationToken;

use super::metrics::PoolShards;
use super::scheduler::SchedMsg;
use super::{CONTROL_TIMEOUT, JobError};

/// Installs `w` on one shard.
pub(super) async fn install(
    a: &ActorRef<ShardMsg>,
    w: Arc<Weights>,
    policy: InFlightPolicy,
    pool: &str,
    index: usize,
) -> Result<(), JobError> {
    call(
        a,
        |reply| ShardMsg::Install(w, policy, reply),
        CONTROL_TIMEOUT,
    )
    .await
    .map_err(JobError::call("shard"))?
    .map_err(|source| JobError::Install {
        pool: pool.to_string(),
        index,
        source,
    })
}

/// Suspends every shard (in-flight requests stay queued).
pub(super) async fn suspend_all(pools: &[PoolShards]) -> Result<(), JobError> {
    let calls = pools
        .iter()
        .flat_map(|p| &p.actors)
        .map(|a| call(a, ShardMsg::Suspend, CONTROL_TIMEOUT));
    for r in futures::future::join_all(calls).await {
        r.map_err(JobError::call("shard"))?;
    }
    Ok(())
}

fn resume_all(pools: &[PoolShards]) {
    for a in pools.iter().flat_map(|p| &p.actors) {
        // A shard that is gone is restarted by its supervisor; nothing to resume.
        let _ = a.cast(ShardMsg::Resume);
    }
}

/// Suspend → install the newest finished version → resume, on every shard at once. Returns
/// the version the shards now run.
pub(super) async fn update_weights(
    pools: &[PoolShards],
    store: &ActorRef<WeightStoreMsg>,
    installed: PolicyVersion,
    policy: InFlightPolicy,
    sched: &ActorRef<SchedMsg>,
) -> Result<PolicyVersion, JobError> {
    let latest = call(store, WeightStoreMsg::Latest, CONTROL_TIMEOUT)
        .await
        .map_err(JobError::call("weight store"))?;
    let Some(latest) = latest else {
        return Ok(installed);
    };
    if latest.version == installed {
        resume_all(pools);
        return Ok(installed);
    }
    suspend_all(pools).await?;
    let calls = pools.iter().flat_map(|p| {
        let latest = latest.clone();
        p.actors.iter().enumerate().map(move |(i, a)| {
            let latest = latest.clone();
            async move { install(a, latest, policy, &p.name, i).await }
        })
    });
    for r in futures::future::join_all(calls).await {
        r?;
    }
    resume_all(pools);
    // The scheduler is critical: if it is gone the job is failing already.
    let _ = sched.cast(SchedMsg::VersionInstalled(latest.version));
    Ok(latest.version)
}

/// One training step on `batch`, unless the job is cancelled first.
pub(super) async fn train(
    trainer: &ActorRef<TrainerMsg>,
    batch: Arc<Batch>,
    cancel: &CancellationToken,
    limit: std::time::Duration,
) -> Result<TrainStats, JobError> {
    tokio::select! {
        biased;
        _ = cancel.cancelled() => Err(JobError::Cancelled),
        r = call(trainer, |reply| TrainerMsg::Train(batch, reply), limit) => {
            r.map_err(JobError::call("trainer"))?.map_err(JobError::Train)
        }
    }
}
