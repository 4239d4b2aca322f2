//! Admission: the staleness quota, the multi-task mix (smooth weighted round-robin), waves
//! for the barrier baselines, and the dispatch of a group's episodes to the least-loaded
//! shards of the pool its task is mapped to.

use std::sync::Arc;

use actors::episode::{self, EpisodeParams, WaveBarrier};
use futures::FutureExt;
use rand::Rng;

use actors::buffer::BufferMsg;
use actors::types::PolicyVersion;

use super::{EpisodeRun, GroupRun, SchedMsg, SchedState};
use crate::spec::Barrier;

impl SchedState {
    /// Groups that may still be admitted: a group admitted now (at version n) is consumed at
    /// step ≥ c + ⌊open / batch⌋, and must be consumed by step n + α.
    fn quota(&self) -> usize {
        let k = &self.a.knobs;
        let horizon = (self.version + k.alpha + 1).saturating_sub(self.consumed) as usize;
        (k.batch_size * horizon).saturating_sub(self.open_groups)
    }

    pub(super) fn try_admit(&mut self) {
        if self.stopped
            || self.shared.is_none()
            || (self.training && !self.a.knobs.overlap_training)
        {
            return;
        }
        let mut quota = self.quota();
        if quota == 0 {
            return;
        }
        let max_active = self.a.knobs.max_concurrent_episodes;
        if self.a.knobs.barrier == Barrier::None {
            while quota > 0 {
                let Some(task) = self.peek_task() else {
                    break;
                };
                let eps = self.a.tasks[task].group_size + self.a.tasks[task].redundancy;
                if self.episodes.len() + eps > max_active && !self.episodes.is_empty() {
                    break;
                }
                self.admit_group(None);
                quota -= 1;
            }
        } else {
            // Waves: the next wave starts when the previous one has fully ended.
            if !self.episodes.is_empty() {
                return;
            }
            // Over-provisioned: `overprovision` groups more than the batch; the stragglers
            // are cancelled once the batch is full (they never train, so never go stale).
            let n = quota.min(self.a.knobs.batch_size) + self.a.knobs.overprovision;
            self.wave += 1;
            let mut plan = Vec::new();
            let mut total = 0;
            for _ in 0..n {
                let Some(t) = self.next_task() else {
                    break;
                };
                let eps = self.a.tasks[t].group_size + self.a.tasks[t].redundancy;
                if total + eps > max_active && total > 0 {
                    break;
                }
                total += eps;
                plan.push(t);
            }
            // A plain wave has no barrier inside: its trajectories advance on their own. An
            // over-provisioned batch barrier ends once `batch_size` groups are whole.
            let k = &self.a.knobs;
            let barrier = match k.barrier {
                Barrier::Wave | Barrier::None => None,
                Barrier::Batch if k.overprovision > 0 => {
                    let first = self.next_group;
                    let sizes: Vec<(u64, usize)> = plan
                        .iter()
                        .enumerate()
                        .map(|(i, &t)| (first + i as u64, self.a.tasks[t].group_size))
                        .collect();
                    Some(Arc::new(WaveBarrier::with_quorum(
                        total,
                        k.batch_size.min(plan.len()),
                        sizes,
                    )))
                }
                Barrier::Turn | Barrier::Batch => Some(Arc::new(WaveBarrier::new(total))),
            };
            let before = self.snap.dispatched_episodes;
            for t in plan {
                self.admit_task_group(t, barrier.clone());
            }
            // A group that could not start (its dataset used up) never joins the barrier.
            if let Some(b) = &barrier {
                let joined = (self.snap.dispatched_episodes - before) as usize;
                for _ in joined..total {
                    b.leave();
                }
            }
        }
    }

    /// Whether task `i` can still start a group: it has no dataset, or rows are left (to
    /// re-issue, or not yet drawn in any epoch).
    pub(super) fn live(&self, i: usize) -> bool {
        match &self.a.tasks[i].dataset {
            None => true,
            Some(d) => !self.requeue[i].is_empty() || self.positions[i] < d.positions(),
        }
    }

    /// The task the next group will come from, without consuming the turn (none: every
    /// task's dataset is used up).
    fn peek_task(&self) -> Option<usize> {
        let live: Vec<usize> = (0..self.a.tasks.len()).filter(|&i| self.live(i)).collect();
        let total: f64 = live.iter().map(|&i| self.a.tasks[i].weight).sum();
        let mut best = None;
        let mut best_c = f64::MIN;
        for &i in &live {
            let c = self.credit[i] + self.a.tasks[i].weight / total;
            if c > best_c {
                best_c = c;
                best = Some(i);
            }
        }
        best
    }

    /// Smooth weighted round-robin over the live tasks: deterministic, exact shares over
    /// time.
    fn next_task(&mut self) -> Option<usize> {
        let live: Vec<usize> = (0..self.a.tasks.len()).filter(|&i| self.live(i)).collect();
        let total: f64 = live.iter().map(|&i| self.a.tasks[i].weight).sum();
        for &i in &live {
            self.credit[i] += self.a.tasks[i].weight / total;
        }
        let best = live
            .iter()
            .copied()
            .fold(None, |b: Option<usize>, i| match b {
                Some(b) if self.credit[b] >= self.credit[i] => Some(b),
                _ => Some(i),
            })?;
        self.credit[best] -= 1.0;
        Some(best)
    }

    /// One value of the scheduler's RNG, counted (the count is part of the cursor).
    fn draw(&mut self) -> u64 {
        self.rng_draws += 1;
        self.rng.random()
    }

    pub(super) fn admit_group(&mut self, barrier: Option<Arc<WaveBarrier>>) {
        if let Some(t) = self.next_task() {
            self.admit_task_group(t, barrier);
        }
    }

    /// The next dataset position of task `task`: one to re-issue first, else a fresh one.
    fn take_position(&mut self, task: usize) -> Option<u64> {
        if let Some(p) = self.requeue[task].pop_front() {
            return Some(p);
        }
        let d = self.a.tasks[task].dataset.as_ref()?;
        let p = self.positions[task];
        (p < d.positions()).then(|| {
            self.positions[task] += 1;
            p
        })
    }

    fn admit_task_group(&mut self, task: usize, barrier: Option<Arc<WaveBarrier>>) {
        let gid = self.next_group;
        self.next_group += 1;
        let k = self.task_groups[task];
        self.task_groups[task] += 1;
        // A dataset task's group is one row: its seed is the row's dataset position.
        let (seed, position) = match (&self.a.tasks[task].dataset, self.a.tasks[task].seeds) {
            (Some(_), _) => match self.take_position(task) {
                Some(p) => (p, Some(p)),
                None => return,
            },
            (None, Some((start, count))) => (start + k % count.max(1), None),
            (None, None) => (self.draw(), None),
        };
        let record = match (&self.a.tasks[task].dataset, position) {
            (Some(d), Some(p)) => Some(Arc::new(d.record(p))),
            _ => None,
        };
        let tv = &self.a.tasks[task];
        let (gs, red, domain) = (tv.group_size, tv.redundancy, tv.domain.clone());
        let pool = self.choose_pool(task);
        let dispatched = gs + red;
        let _ = self.a.buffer.cast(BufferMsg::Open {
            group: gid,
            task: domain,
            seed,
            start_version: self.version,
            group_size: gs,
            dispatched,
        });
        self.groups.insert(
            gid,
            GroupRun {
                task,
                seed,
                start_version: self.version,
                pool,
                episodes: Vec::new(),
                closed: false,
                position,
                record,
                wave: (self.a.knobs.barrier != Barrier::None).then_some(self.wave),
                spent: Default::default(),
            },
        );
        self.open_groups += 1;
        self.snap.admitted_groups += 1;
        *self
            .snap
            .groups_per_pool
            .entry(self.a.pools[pool].name.clone())
            .or_default() += 1;
        for _ in 0..dispatched {
            self.spawn_episode(gid, task, seed, self.version, pool, barrier.clone());
        }
    }

    /// The shard of `pool` with the fewest trajectories, counting what other clients run on a
    /// shared server (as its shard last reported); ties go to the lowest index. Only shards
    /// that take new trajectories count (an elastic pool's shards without a server, or
    /// whose server is leaving, do not), unless none does (the trajectory then waits on a
    /// shard for a server).
    fn least_loaded(&self, pool: usize) -> usize {
        let shards = &self.a.pools[pool].shards;
        let open = shards
            .iter()
            .any(actors::generation::shard::ShardHandle::accepting);
        (0..self.shard_active[pool].len())
            .filter(|&i| !open || shards[i].accepting())
            .min_by_key(|&i| {
                let external = shards[i].external_load();
                (self.shard_active[pool][i] + external, i)
            })
            .unwrap_or(0)
    }

    pub(super) fn spawn_episode(
        &mut self,
        gid: u64,
        task: usize,
        seed: u64,
        start_version: PolicyVersion,
        pool: usize,
        barrier: Option<Arc<WaveBarrier>>,
    ) {
        let Some(shared) = self.shared.clone() else {
            return;
        };
        let eid = self.next_episode;
        self.next_episode += 1;
        // Least-loaded shard of the pool; the trajectory sticks to it for all its turns.
        let shard = self.least_loaded(pool);
        self.shard_active[pool][shard] += 1;
        // Disaggregated: a prefill shard too (least loaded, sticky for the trajectory).
        let prefill = self.a.pools[pool].prefill_from.map(|link| {
            let p = link.pool;
            let s = self.least_loaded(p);
            self.shard_active[p][s] += 1;
            (
                s,
                episode::PrefillRoute {
                    shard: self.a.pools[p].shards[s].clone(),
                    bandwidth: link.bandwidth,
                    kv_bytes_per_token: link.kv_bytes_per_token,
                    kv_return: link.kv_return,
                },
            )
        });
        self.pool_task_active[pool][task] += 1;
        let tokens = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let params = EpisodeParams {
            id: eid,
            group: gid,
            task,
            seed,
            sample_seed: self.draw(),
            start_version,
            shard: self.a.pools[pool].shards[shard].clone(),
            barrier,
            prefill: prefill.as_ref().map(|p| p.1.clone()),
            record: self.groups.get(&gid).and_then(|g| g.record.clone()),
            progress: Some(tokens.clone()),
        };
        // The episode reports its outcome through this task, so aborting the task also drops
        // the report (an aborted episode is accounted for by whoever aborted it).
        let me = self.me.clone();
        // (A `map`, not an async block around the episode: that would hold `params` twice.)
        let handle = self
            .tasks
            .spawn(episode::run(shared, params).map(move |outcome| {
                // A scheduler that is gone has aborted its episodes already.
                let _ = me.cast(SchedMsg::EpisodeEnded(outcome));
            }));
        self.episodes.insert(
            eid,
            EpisodeRun {
                group: gid,
                pool,
                task,
                shard,
                handle,
                prefill_shard: prefill.map(|p| p.0),
                started: tokio::time::Instant::now(),
                tokens,
            },
        );
        if let Some(g) = self.groups.get_mut(&gid) {
            g.episodes.push(eid);
        }
        self.snap.dispatched_episodes += 1;
        self.snap.peak_active_episodes = self.snap.peak_active_episodes.max(self.episodes.len());
    }

    /// Frees an ended episode's places: its shard, its prefill shard, its task count.
    pub(super) fn release_shards(&mut self, e: &EpisodeRun) {
        self.shard_active[e.pool][e.shard] -= 1;
        self.pool_task_active[e.pool][e.task] -= 1;
        if let (Some(link), Some(ps)) = (self.a.pools[e.pool].prefill_from, e.prefill_shard) {
            self.shard_active[link.pool][ps] -= 1;
        }
    }
}
