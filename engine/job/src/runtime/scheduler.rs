//! The scheduler: admission of groups under the staleness bound, the multi-task mix,
//! hardware-affinity mapping (declared, cost model, single pool) with sticky shards,
//! redundancy and retries, waves for the barrier baselines, and aborts of stale or extra
//! episodes. It owns the episode tasks; the step driver tells it about versions and batches.
//!
//! Files by part: `admission` admits groups and dispatches their episodes, `mapping` picks
//! each group's pool, `events` handles what the scheduler hears (ended episodes, versions,
//! the buffer's events), `aborts` cancels episodes and counts what that wasted.

use std::collections::BTreeMap;
use std::sync::Arc;

use actors::buffer::{BufferEvent, BufferMsg};
use actors::device::{DeviceProfile, ModelProfile};
use actors::generation::shard::ShardHandle;
use actors::types::PolicyVersion;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use actors::episode::{EpisodeOutcome, EpisodeShared};

pub use crate::cost::PrefillLink;
use crate::cost::{CostModel, PoolCost, Tokens};
pub use crate::wiring::TaskView;

mod aborts;
mod admission;
mod events;
mod mapping;
use crate::spec::Knobs;

pub enum SchedMsg {
    Start(Arc<EpisodeShared>),
    Buffer(BufferEvent),
    /// An episode task this scheduler spawned has ended.
    EpisodeEnded(EpisodeOutcome),
    /// Shards now run `version`: abort groups past the staleness bound, admit more.
    VersionInstalled(PolicyVersion),
    /// Training without overlap has started / ended (no admission meanwhile).
    Training(bool),
    /// Stop admitting and abort every episode.
    Shutdown,
    Snapshot(ractor::RpcReplyPort<SchedSnapshot>),
}

/// Where admission stands: the next group id, each task's count of groups (its position in
/// its seed sequence), the task mix's credit and how many draws the scheduler's RNG has made.
/// Stored with every step (inside the step's metrics), so a resumed run continues the
/// sequence instead of replaying it.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Cursor {
    pub next_group: u64,
    pub task_groups: Vec<u64>,
    pub credit: Vec<f64>,
    pub rng_draws: u64,
    /// Per task: the next dataset position never drawn.
    #[serde(default)]
    pub positions: Vec<u64>,
    /// Per task: dataset positions drawn but not yet used (their groups were open, or
    /// dropped before use); a resumed run issues them first.
    #[serde(default)]
    pub pending: Vec<Vec<u64>>,
}

/// Counters for metrics and tests (serialised in step metrics as is).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SchedSnapshot {
    pub version: PolicyVersion,
    pub consumed: u64,
    pub open_groups: usize,
    pub active_episodes: usize,
    pub admitted_groups: u64,
    pub dispatched_episodes: u64,
    pub cancelled_extras: u64,
    /// Over-provisioned groups of a wave cancelled once its batch was full.
    pub cancelled_groups: u64,
    /// What cancelling extras and over-provisioned groups threw away: tokens prefilled and
    /// generated, and seconds their environments were held.
    pub cancelled_tokens: u64,
    pub cancelled_env_s: f64,
    pub aborted_stale: u64,
    pub retries: u64,
    pub failed_episodes: u64,
    pub dropped_groups: u64,
    /// Admitted groups per pool name.
    pub groups_per_pool: BTreeMap<String, u64>,
    /// Admission's position when the snapshot was taken.
    pub cursor: Cursor,
    /// Peak concurrent episodes.
    pub peak_active_episodes: usize,
}

/// A pool as the scheduler sees it.
pub struct PoolView {
    pub name: String,
    pub device: DeviceProfile,
    pub model: ModelProfile,
    pub max_batch: usize,
    pub shards: Vec<ShardHandle>,
    /// Prefill/decode disaggregation: the pool that prefills for this one, and the KV link.
    pub prefill_from: Option<PrefillLink>,
    /// This pool only prefills for another; no group is mapped to it.
    pub prefill_only: bool,
}

pub struct SchedArgs {
    pub knobs: Knobs,
    pub pools: Vec<PoolView>,
    pub tasks: Vec<TaskView>,
    pub buffer: ActorRef<BufferMsg>,
    pub seed: u64,
    pub start_version: PolicyVersion,
    /// Where a resumed run's admission continues (none: from the start).
    pub resume: Option<Cursor>,
}

struct GroupRun {
    task: usize,
    seed: u64,
    start_version: PolicyVersion,
    pool: usize,
    episodes: Vec<u64>,
    closed: bool,
    /// The dataset position of its row (tasks with a dataset).
    position: Option<u64>,
    record: Option<actors::env::Record>,
    /// The wave it was admitted in (barrier modes).
    wave: Option<u64>,
    /// What its ended episodes took: tokens prefilled and generated, seconds each held its
    /// environment (wasted if the group is cancelled).
    spent: Waste,
}

struct EpisodeRun {
    group: u64,
    pool: usize,
    task: usize,
    /// The prefill shard of a disaggregated pool.
    prefill_shard: Option<usize>,
    shard: usize,
    handle: tokio::task::AbortHandle,
    /// When it was dispatched, and the tokens it has prefilled and generated so far (what
    /// a cancellation wastes).
    started: tokio::time::Instant,
    tokens: Arc<std::sync::atomic::AtomicU64>,
}

/// Work thrown away by cancelling episodes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Waste {
    episodes: usize,
    tokens: u64,
    env_s: f64,
}

/// Groups that fail one after another before the first batch, after which a job gives up
/// with the last failure (a broken environment, model or reward).
const FAILED_GROUPS_BEFORE_GIVING_UP: u32 = 8;

/// Finished trajectories between two re-plans of the cost model's split.
const REPLAN_EVERY: u32 = 32;
/// Finished trajectories per task the latency bound looks at.
const TAIL_WINDOW: usize = 128;

pub struct Scheduler;

pub struct SchedState {
    a: SchedArgs,
    /// This scheduler, for the episode tasks to report back.
    me: ActorRef<SchedMsg>,
    shared: Option<Arc<EpisodeShared>>,
    version: PolicyVersion,
    consumed: u64,
    training: bool,
    stopped: bool,
    groups: BTreeMap<u64, GroupRun>,
    episodes: BTreeMap<u64, EpisodeRun>,
    open_groups: usize,
    next_group: u64,
    next_episode: u64,
    /// Waves admitted so far (barrier modes).
    wave: u64,
    /// Smooth weighted round-robin credit per task.
    credit: Vec<f64>,
    task_groups: Vec<u64>,
    /// Values drawn from `rng` so far (a resumed run skips as many).
    rng_draws: u64,
    /// Per task: the next fresh dataset position, and positions to issue again first (their
    /// groups were dropped before their row was used, or were open when the run stopped).
    positions: Vec<u64>,
    requeue: Vec<std::collections::VecDeque<u64>>,
    /// The last failure a dropped group reported, and groups dropped for failures in a row
    /// before any batch.
    last_failure: Option<String>,
    failed_in_a_row: u32,
    /// Observed tokens per trajectory (prefill, decode), EWMA per task.
    observed: Vec<Option<Tokens>>,
    shard_active: Vec<Vec<usize>>,
    /// Active episodes per pool and task (the cost model's backlog).
    pool_task_active: Vec<Vec<usize>>,
    /// The cost model's split of each task over the pools ([task][pool], rows sum to 1), or
    /// none when the search space is too large (then: earliest finish per group).
    split: Option<Vec<Vec<f64>>>,
    /// The last `TAIL_WINDOW` finished trajectories' tokens per task: the
    /// latency bound uses their 95th percentile (a step waits for its slowest trajectories).
    recent: Vec<std::collections::VecDeque<Tokens>>,
    /// Smooth weighted round-robin credit per task and pool, for following `split`.
    pool_credit: Vec<Vec<f64>>,
    ended_since_plan: u32,
    /// The roofline cost model over this job's pools.
    cost: CostModel,
    /// The episode tasks; dropping the set (when the scheduler stops) aborts any left.
    tasks: tokio::task::JoinSet<()>,
    rng: SmallRng,
    snap: SchedSnapshot,
}

impl Actor for Scheduler {
    type Msg = SchedMsg;
    type State = SchedState;
    type Arguments = SchedArgs;

    async fn pre_start(
        &self,
        me: ActorRef<Self::Msg>,
        a: SchedArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let n_tasks = a.tasks.len();
        let shard_active = a.pools.iter().map(|p| vec![0; p.shards.len()]).collect();
        let pool_task_active = vec![vec![0; n_tasks]; a.pools.len()];
        let n_pools = a.pools.len();
        let mut rng = SmallRng::seed_from_u64(a.seed ^ 0x5eed_5c4e_d01e);
        // A cursor of another task list (the spec changed) is not continued.
        let resume = a
            .resume
            .clone()
            .filter(|c| c.task_groups.len() == n_tasks && c.credit.len() == n_tasks);
        if let Some(c) = &resume {
            for _ in 0..c.rng_draws {
                let _: u64 = rng.random();
            }
        }
        let mut cursor = resume.unwrap_or_else(|| Cursor {
            task_groups: vec![0; n_tasks],
            credit: vec![0.0; n_tasks],
            ..Cursor::default()
        });
        // Group ids stay above every stored group, even when the sequences start afresh.
        if let Some(c) = &a.resume {
            cursor.next_group = cursor.next_group.max(c.next_group);
        }
        let version = a.start_version;
        let cost = CostModel {
            pools: a
                .pools
                .iter()
                .map(|p| PoolCost {
                    device: p.device.clone(),
                    model: p.model.clone(),
                    max_batch: p.max_batch,
                    shards: p.shards.len(),
                    prefill_from: p.prefill_from,
                    prefill_only: p.prefill_only,
                })
                .collect(),
        };
        Ok(SchedState {
            a,
            me,
            shared: None,
            version,
            consumed: version,
            training: false,
            stopped: false,
            groups: BTreeMap::new(),
            episodes: BTreeMap::new(),
            open_groups: 0,
            next_group: cursor.next_group,
            next_episode: 0,
            wave: 0,
            credit: cursor.credit.clone(),
            task_groups: cursor.task_groups.clone(),
            rng_draws: cursor.rng_draws,
            positions: (0..n_tasks)
                .map(|i| cursor.positions.get(i).copied().unwrap_or(0))
                .collect(),
            last_failure: None,
            failed_in_a_row: 0,
            requeue: (0..n_tasks)
                .map(|i| {
                    cursor
                        .pending
                        .get(i)
                        .map(|p| p.iter().copied().collect())
                        .unwrap_or_default()
                })
                .collect(),
            observed: vec![None; n_tasks],
            shard_active,
            pool_task_active,
            split: None,
            recent: vec![std::collections::VecDeque::new(); n_tasks],
            pool_credit: vec![vec![0.0; n_pools]; n_tasks],
            ended_since_plan: u32::MAX,
            cost,
            tasks: tokio::task::JoinSet::new(),
            rng,
            snap: SchedSnapshot {
                version,
                consumed: version,
                ..SchedSnapshot::default()
            },
        })
    }

    async fn post_stop(
        &self,
        _me: ActorRef<Self::Msg>,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        st.abort_all();
        Ok(())
    }

    async fn handle(
        &self,
        _me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SchedMsg::Start(shared) => {
                st.shared = Some(shared);
                st.try_admit();
            }
            SchedMsg::Buffer(ev) => st.on_buffer(ev)?,
            SchedMsg::EpisodeEnded(outcome) => st.on_episode_ended(outcome),
            SchedMsg::VersionInstalled(v) => st.on_version_installed(v),
            SchedMsg::Training(on) => {
                st.training = on;
                st.try_admit();
            }
            SchedMsg::Shutdown => {
                st.stopped = true;
                st.abort_all();
            }
            SchedMsg::Snapshot(reply) => {
                let mut s = st.snap.clone();
                s.cursor = Cursor {
                    next_group: st.next_group,
                    task_groups: st.task_groups.clone(),
                    credit: st.credit.clone(),
                    rng_draws: st.rng_draws,
                    positions: st.positions.clone(),
                    pending: st.pending_positions(),
                };
                s.open_groups = st.open_groups;
                s.active_episodes = st.episodes.len();
                let _ = reply.send(s);
            }
        }
        // Nothing left to admit, nothing open, steps to go: the job would wait forever.
        if let Some(e) = st.exhausted() {
            return Err(e.into());
        }
        Ok(())
    }
}

impl SchedState {
    /// Per task: the dataset positions drawn but not used yet, in the order they are issued
    /// again on resume (the re-issue queue, then open groups by id).
    fn pending_positions(&self) -> Vec<Vec<u64>> {
        let mut out: Vec<Vec<u64>> = self
            .requeue
            .iter()
            .map(|q| q.iter().copied().collect())
            .collect();
        for g in self.groups.values() {
            if let Some(p) = g.position {
                out[g.task].push(p);
            }
        }
        out
    }

    /// An error when no group can be admitted any more and none is open, before the job's
    /// steps are done: every task's dataset is used up.
    fn exhausted(&self) -> Option<String> {
        let all_used = (0..self.a.tasks.len()).all(|i| !self.live(i));
        (all_used
            && self.open_groups == 0
            && !self.stopped
            && self.consumed < self.a.knobs.steps)
            .then(|| {
                let used: Vec<String> = self
                    .a
                    .tasks
                    .iter()
                    .filter_map(|t| {
                        t.dataset.as_ref().map(|d| {
                            format!("{} ({} rows × {} epochs)", t.domain, d.len(), d.epochs)
                        })
                    })
                    .collect();
                format!(
                    "every task's dataset is used up after {} of {} steps: {}; raise tasks[].dataset.epochs or lower trainer.steps",
                    self.consumed,
                    self.a.knobs.steps,
                    used.join(", ")
                )
            })
    }
}
