//! Hardware-affinity mapping: which pool a task's next group goes to (single pool, declared,
//! or the cost model's split followed by smooth weighted round-robin), and the loads the cost
//! model is fed with.

use super::{REPLAN_EVERY, SchedState};
use crate::cost::{TaskLoad, Tokens};
use crate::spec::MappingMode;

impl SchedState {
    pub(super) fn choose_pool(&mut self, task: usize) -> usize {
        match self.a.knobs.mapping {
            MappingMode::SinglePool => self
                .a
                .pools
                .iter()
                .position(|p| !p.prefill_only)
                .unwrap_or(0),
            MappingMode::Declared => self.a.tasks[task].declared_pool.unwrap_or(0),
            MappingMode::CostModel => {
                // Re-plan from fresh observations every few dozen finished trajectories.
                if self.ended_since_plan >= REPLAN_EVERY {
                    self.split = self.cost.plan_split(
                        &self.task_loads(),
                        self.a.knobs.batch_size,
                        self.a.knobs.alpha,
                        &self.pool_batches(),
                    );
                    self.ended_since_plan = 0;
                    tracing::debug!(split = ?self.split, "cost model re-planned the split of tasks over pools");
                }
                match &self.split {
                    Some(split) => {
                        let row = &split[task];
                        let credit = &mut self.pool_credit[task];
                        for (c, x) in credit.iter_mut().zip(row) {
                            *c += x;
                        }
                        let best = (0..row.len())
                            .fold(0, |b, p| if credit[p] > credit[b] { p } else { b });
                        credit[best] -= 1.0;
                        best
                    }
                    None => self.cost.earliest_finish(
                        task,
                        &self.task_loads(),
                        &self.pool_task_active,
                        &self.pool_batches(),
                    ),
                }
            }
        }
    }

    fn pool_batch(&self, p: usize) -> f64 {
        let pool = &self.a.pools[p];
        // Other clients' requests on shared servers occupy the batch too.
        let external: usize = pool.shards.iter().map(|s| s.external_load()).sum();
        let active = self.shard_active[p].iter().sum::<usize>() + external;
        (active as f64 / pool.shards.len().max(1) as f64).clamp(1.0, pool.max_batch.max(1) as f64)
    }

    /// Each pool's current decode batch per shard (at least 1, at most its max batch).
    fn pool_batches(&self) -> Vec<f64> {
        (0..self.a.pools.len())
            .map(|p| self.pool_batch(p))
            .collect()
    }

    /// Each task's load for the cost model: token counts observed (EWMA of finished
    /// trajectories, re-prefills after weight updates included) or the spec's prior; the tail
    /// is the 95th percentile of the last `TAIL_WINDOW` trajectories (a step waits for its
    /// slowest), or twice the mean before 8 were seen.
    fn task_loads(&self) -> Vec<TaskLoad> {
        self.a
            .tasks
            .iter()
            .enumerate()
            .map(|(t, tv)| {
                let tokens = self.observed[t].unwrap_or(tv.estimate);
                let r = &self.recent[t];
                let tail = if r.len() >= 8 {
                    let q = |f: fn(&Tokens) -> f64| {
                        let mut v: Vec<f64> = r.iter().map(f).collect();
                        v.sort_by(f64::total_cmp);
                        v[(v.len() * 95 / 100).min(v.len() - 1)]
                    };
                    Tokens {
                        prefill: q(|x| x.prefill),
                        decode: q(|x| x.decode),
                        context: q(|x| x.context),
                    }
                } else {
                    Tokens {
                        prefill: 2.0 * tokens.prefill,
                        decode: 2.0 * tokens.decode,
                        context: 2.0 * tokens.context,
                    }
                };
                TaskLoad {
                    weight: tv.weight,
                    group: tv.group_size + tv.redundancy,
                    tokens,
                    tail,
                }
            })
            .collect()
    }
}
