//! The sample buffer: assembles groups from finished trajectories, masks infrastructure
//! failures (and asks for retries), cancels redundant episodes once a group is full, filters
//! all-equal groups (dynamic sampling), commits every trajectory to the durable log before
//! acknowledging it, evicts groups past the staleness bound, and hands batches to the trainer.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::types::{Batch, FailureReason, Group, PolicyVersion, Trajectory, too_stale};

/// Where committed trajectories go. A trajectory is acknowledged only once `commit` returned.
pub trait TrajectorySink: Send + Sync + 'static {
    /// Durably records a trajectory; returns its position in the log.
    fn commit(&self, traj: &Trajectory) -> Result<u64, SinkError>;
}

#[derive(Debug, thiserror::Error)]
#[error("could not commit trajectory {id}: {message}")]
pub struct SinkError {
    pub id: String,
    pub message: String,
}

/// Keeps trajectories in memory (simulations without a store).
#[derive(Default)]
pub struct MemorySink {
    pub log: std::sync::Mutex<Vec<Trajectory>>,
}

impl TrajectorySink for MemorySink {
    fn commit(&self, traj: &Trajectory) -> Result<u64, SinkError> {
        let mut log = self.log.lock().map_err(|_| SinkError {
            id: traj.id.clone(),
            message: "poisoned".into(),
        })?;
        log.push(traj.clone());
        Ok(log.len() as u64)
    }
}

/// Counts trajectories without keeping them (benchmarks).
#[derive(Default)]
pub struct CountingSink {
    pub count: std::sync::atomic::AtomicU64,
}

impl TrajectorySink for CountingSink {
    fn commit(&self, _traj: &Trajectory) -> Result<u64, SinkError> {
        Ok(self
            .count
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1)
    }
}

/// What happened to a group, told to the scheduler.
#[derive(Clone, Debug, PartialEq)]
pub enum BufferEvent {
    /// Dispatch one more episode for this group (a failed one is retried).
    Retry { group: u64 },
    /// The group is full: cancel its episodes still running.
    CancelExtras { group: u64 },
    /// The group closed and waits for the trainer.
    Ready { group: u64 },
    /// The group was dropped: all rewards equal (dynamic sampling), too few valid
    /// trajectories after masking, or evicted as stale.
    Dropped {
        group: u64,
        reason: DropReason,
        /// Why the group's last masked trajectory failed (too few valid ones).
        failure: Option<FailureReason>,
    },
    /// These groups went into the batch of `step`.
    Consumed { step: u64, groups: Vec<u64> },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    AllEqual,
    TooFewValid,
    Stale,
    Aborted,
}

pub type Notify = Arc<dyn Fn(BufferEvent) + Send + Sync>;

pub struct BufferArgs {
    pub batch_size: usize,
    pub alpha: u64,
    pub filter_all_equal: bool,
    /// Retries per group for trajectories that failed for infrastructure reasons.
    pub max_retries_per_group: u32,
    pub sink: Arc<dyn TrajectorySink>,
    pub notify: Notify,
}

pub enum BufferMsg {
    /// A new group was admitted with `dispatched` episodes for `group_size` slots.
    Open {
        group: u64,
        task: String,
        seed: u64,
        start_version: PolicyVersion,
        group_size: usize,
        dispatched: usize,
    },
    /// A finished or failed trajectory. The buffer commits it through the sink before it
    /// counts towards a group (a redundant one, for a group already full, is discarded).
    Record(Box<Trajectory>),
    /// The scheduler aborted the group (stale in flight, or an over-provisioned wave's
    /// straggler): open or ready, it is dropped.
    Abort {
        group: u64,
    },
    /// Blocks until a batch for `step` is ready.
    GetBatch {
        step: u64,
        reply: RpcReplyPort<Batch>,
    },
    Stats(RpcReplyPort<BufferStats>),
}

/// Counters of the sample buffer since the run started (serialised in step metrics as is).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct BufferStats {
    pub committed: u64,
    pub redundant: u64,
    pub masked: u64,
    /// Masked trajectories by failure (`env_failed`, `agent_failed`, …).
    pub masked_by: std::collections::BTreeMap<String, u64>,
    /// Agent episodes the policy failed (non-zero exit, timeout, spent budget): rewarded by
    /// the task's `failure_reward`, not masked.
    pub agent_policy_failures: u64,
    /// Trajectories that reached their context budget (trained or masked per the task).
    pub truncated: u64,
    pub retried: u64,
    pub filtered_all_equal: u64,
    pub dropped_too_few: u64,
    pub evicted_stale: u64,
    pub aborted: u64,
    pub ready_groups: usize,
    pub open_groups: usize,
    pub batches: u64,
}

struct OpenGroup {
    task: String,
    seed: u64,
    start_version: PolicyVersion,
    group_size: usize,
    dispatched: usize,
    valid: Vec<Trajectory>,
    failed: usize,
    /// The failure of the last masked trajectory.
    last_failure: Option<FailureReason>,
    retries_left: u32,
}

pub struct SampleBuffer;

pub struct BufferState {
    args: BufferArgs,
    open: BTreeMap<u64, OpenGroup>,
    ready: VecDeque<Group>,
    waiting: Option<(u64, RpcReplyPort<Batch>)>,
    stats: BufferStats,
}

impl Actor for SampleBuffer {
    type Msg = BufferMsg;
    type State = BufferState;
    type Arguments = BufferArgs;

    async fn pre_start(
        &self,
        _me: ActorRef<Self::Msg>,
        args: BufferArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(BufferState {
            args,
            open: BTreeMap::new(),
            ready: VecDeque::new(),
            waiting: None,
            stats: BufferStats::default(),
        })
    }

    async fn handle(
        &self,
        _me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            BufferMsg::Open {
                group,
                task,
                seed,
                start_version,
                group_size,
                dispatched,
            } => {
                let retries_left = st.args.max_retries_per_group;
                st.open.insert(
                    group,
                    OpenGroup {
                        task,
                        seed,
                        start_version,
                        group_size,
                        dispatched,
                        valid: Vec::new(),
                        failed: 0,
                        last_failure: None,
                        retries_left,
                    },
                );
            }
            BufferMsg::Record(traj) => {
                st.record(*traj)?;
                st.try_fulfil();
            }
            BufferMsg::Abort { group } => {
                let was_ready = st.ready.len();
                st.ready.retain(|g| g.id != group);
                if st.open.remove(&group).is_some() || st.ready.len() < was_ready {
                    st.stats.aborted += 1;
                    (st.args.notify)(BufferEvent::Dropped {
                        group,
                        reason: DropReason::Aborted,
                        failure: None,
                    });
                }
            }
            BufferMsg::GetBatch { step, reply } => {
                st.waiting = Some((step, reply));
                st.try_fulfil();
            }
            BufferMsg::Stats(reply) => {
                let mut s = st.stats.clone();
                s.ready_groups = st.ready.len();
                s.open_groups = st.open.len();
                let _ = reply.send(s);
            }
        }
        Ok(())
    }
}

impl BufferState {
    /// Commits a trajectory and counts it towards its group (a redundant one is discarded).
    fn record(&mut self, traj: Trajectory) -> Result<(), ActorProcessingErr> {
        let gid = traj.group_id;
        let Some(g) = self.open.get_mut(&gid) else {
            self.stats.redundant += 1;
            return Ok(());
        };
        if g.valid.len() >= g.group_size {
            self.stats.redundant += 1;
            return Ok(());
        }
        self.args.sink.commit(&traj)?;
        self.stats.committed += 1;
        self.stats.truncated += u64::from(traj.truncated);
        self.stats.agent_policy_failures += u64::from(
            traj.agent
                .as_ref()
                .is_some_and(|a| a.policy_failure.is_some()),
        );
        if let Some(f) = &traj.failure {
            g.failed += 1;
            *self
                .stats
                .masked_by
                .entry(f.code().to_string())
                .or_default() += 1;
            g.last_failure.clone_from(&traj.failure);
            self.stats.masked += 1;
            // A truncation would happen again: no retry.
            let retry = !matches!(traj.failure, Some(FailureReason::Truncated(_)));
            if retry && g.retries_left > 0 {
                g.retries_left -= 1;
                g.dispatched += 1;
                self.stats.retried += 1;
                (self.args.notify)(BufferEvent::Retry { group: gid });
            }
        } else {
            g.valid.push(traj);
        }
        let full = g.valid.len() >= g.group_size;
        let all_done = g.valid.len() + g.failed >= g.dispatched;
        if full || all_done {
            if full && g.valid.len() + g.failed < g.dispatched {
                (self.args.notify)(BufferEvent::CancelExtras { group: gid });
            }
            self.close(gid);
        }
        Ok(())
    }

    fn close(&mut self, gid: u64) {
        let Some(g) = self.open.remove(&gid) else {
            return;
        };
        let min_valid = g.group_size.min(2);
        if g.valid.len() < min_valid {
            self.stats.dropped_too_few += 1;
            (self.args.notify)(BufferEvent::Dropped {
                group: gid,
                reason: DropReason::TooFewValid,
                failure: g.last_failure,
            });
            return;
        }
        let rewards: Vec<f64> = g.valid.iter().map(|t| t.reward.unwrap_or(0.0)).collect();
        let all_equal = rewards.windows(2).all(|w| (w[0] - w[1]).abs() < 1e-12);
        if self.args.filter_all_equal && all_equal && rewards.len() > 1 {
            self.stats.filtered_all_equal += 1;
            (self.args.notify)(BufferEvent::Dropped {
                group: gid,
                reason: DropReason::AllEqual,
                failure: None,
            });
            return;
        }
        self.ready.push_back(Group {
            id: gid,
            task: g.task,
            seed: g.seed,
            start_version: g.start_version,
            masked: g.failed as u32,
            trajectories: g.valid,
        });
        (self.args.notify)(BufferEvent::Ready { group: gid });
    }

    fn try_fulfil(&mut self) {
        let Some((step, _)) = &self.waiting else {
            return;
        };
        let step = *step;
        // Evict groups that would exceed the staleness bound at this step.
        let alpha = self.args.alpha;
        let mut kept = VecDeque::with_capacity(self.ready.len());
        for g in self.ready.drain(..) {
            if too_stale(step, g.start_version, alpha) {
                self.stats.evicted_stale += 1;
                (self.args.notify)(BufferEvent::Dropped {
                    group: g.id,
                    reason: DropReason::Stale,
                    failure: None,
                });
            } else {
                kept.push_back(g);
            }
        }
        self.ready = kept;
        if self.ready.len() < self.args.batch_size {
            return;
        }
        let groups: Vec<Group> = self.ready.drain(..self.args.batch_size).collect();
        let ids = groups.iter().map(|g| g.id).collect();
        self.stats.batches += 1;
        (self.args.notify)(BufferEvent::Consumed { step, groups: ids });
        if let Some((_, reply)) = self.waiting.take() {
            let _ = reply.send(Batch { step, groups });
        }
    }
}
