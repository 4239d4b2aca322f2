//! The cost model of hardware-affinity mapping, pure: shard-seconds and tail latency of a
//! trajectory on a pool from the roofline, the static split of tasks over pools that
//! minimises a step's estimated rollout time, and the earliest-finish fallback. The scheduler
//! feeds it observed token counts and current decode batches; nothing here has state.

use actors::device::{
    DeviceProfile, Efficiency, ModelProfile, decode_step_seconds, prefill_seconds,
};

/// Where a disaggregated pool's prefills run and how its KV cache travels.
#[derive(Clone, Copy, Debug)]
pub struct PrefillLink {
    pub pool: usize,
    /// KV transfer bandwidth, bytes/s.
    pub bandwidth: f64,
    pub kv_bytes_per_token: f64,
    /// The decode side hands each turn's KV back to the prefill side.
    pub kv_return: bool,
}

/// Largest number of task → pool assignments the split search scores.
pub const MAX_ASSIGNMENTS: f64 = 4096.0;

/// A pool as the cost model sees it.
#[derive(Clone, Debug)]
pub struct PoolCost {
    pub device: DeviceProfile,
    pub model: ModelProfile,
    pub max_batch: usize,
    pub shards: usize,
    /// Disaggregated: where this pool's prefills run (an index into the same pool list).
    pub prefill_from: Option<PrefillLink>,
    /// This pool only prefills for another; it takes no groups.
    pub prefill_only: bool,
}

/// Tokens of one trajectory as the cost model sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Tokens {
    /// Prefilled over all its turns: a `rewrite` context re-prefills its whole history each
    /// turn, so this grows with the square of the turns.
    pub prefill: f64,
    /// Generated.
    pub decode: f64,
    /// The mean context a generated token attends to (what a decode step reads of its KV):
    /// the context's length, however often it was prefilled.
    pub context: f64,
}

impl Tokens {
    /// A trajectory whose context was prefilled once (`append`): prefill, then decode, so a
    /// generated token attends on average to half of everything.
    pub fn new(prefill: f64, decode: f64) -> Self {
        Self {
            prefill,
            decode,
            context: (prefill + decode) / 2.0,
        }
    }
}

/// A task's load as the cost model sees it.
#[derive(Clone, Copy, Debug)]
pub struct TaskLoad {
    /// Share of the batch (relative to the other tasks' weights).
    pub weight: f64,
    /// Episodes per group (group size plus redundancy).
    pub group: usize,
    /// Mean tokens per trajectory.
    pub tokens: Tokens,
    /// 95th-percentile tokens per trajectory.
    pub tail: Tokens,
}

/// The pools of a job, for cost estimates.
#[derive(Clone, Debug)]
pub struct CostModel {
    pub pools: Vec<PoolCost>,
}

impl CostModel {
    /// Seconds to prefill `tokens` for pool `p`: on its own device, or, disaggregated, on its
    /// prefill pool's device plus the KV transfer.
    pub fn prefill_s(&self, p: usize, tokens: f64) -> f64 {
        let e = Efficiency::default();
        let pool = &self.pools[p];
        match pool.prefill_from {
            None => prefill_seconds(&pool.device, &pool.model, e, tokens),
            Some(link) => {
                let pp = &self.pools[link.pool];
                prefill_seconds(&pp.device, &pp.model, e, tokens)
                    + tokens * link.kv_bytes_per_token / link.bandwidth.max(1.0)
            }
        }
    }

    /// Shard-seconds one trajectory of `t` tokens takes on pool `p` at decode batch `batch`:
    /// its prefill, and each decode token a decode step's share (a step serves every
    /// sequence of the batch).
    pub fn trajectory_cost(&self, p: usize, t: Tokens, batch: f64) -> f64 {
        self.prefill_s(p, t.prefill) + t.decode * self.decode_step_s(p, t, batch) / batch
    }

    /// Seconds of one decode step of pool `p` at `batch` sequences, each reading the KV of
    /// the context its tokens attend to (`t.context`, not the prefill count: a `rewrite`
    /// context re-prefills its history every turn but attention reads it once per step).
    fn decode_step_s(&self, p: usize, t: Tokens, batch: f64) -> f64 {
        let pool = &self.pools[p];
        let context = t.context;
        decode_step_seconds(
            &pool.device,
            &pool.model,
            Efficiency::default(),
            batch,
            batch * context,
        )
    }

    /// Seconds one trajectory of `t` tokens takes on one shard of pool `p`: prefill, then
    /// each decode token a whole step at the pool's batch.
    pub fn trajectory_latency(&self, p: usize, t: Tokens, batch: f64) -> f64 {
        self.prefill_s(p, t.prefill) + t.decode * self.decode_step_s(p, t, batch)
    }

    /// Pools that take groups.
    fn eligible(&self) -> Vec<usize> {
        (0..self.pools.len())
            .filter(|&p| !self.pools[p].prefill_only)
            .collect()
    }

    /// The estimated rollout time of a step under split `x` (`[task][pool]`): the larger of
    /// the throughput bound (each pool's shard-seconds per step over its shards, at the
    /// decode batch the split implies) and the latency bound (the slowest task's tail
    /// trajectory on a pool it uses). Prefill and decode share a pool's engine steps (chunked
    /// prefill), so a pool that spends a share ρ of the step prefilling stretches every decode
    /// step by 1 / (1 − ρ); as ρ is the pool's prefill seconds over the step time, the
    /// estimate is the fixed point `T = max(throughput, latency(T))`.
    pub fn estimate_step_s(
        &self,
        tasks: &[TaskLoad],
        batch_size: usize,
        alpha: u64,
        x: &[Vec<f64>],
    ) -> f64 {
        let (nt, np) = (tasks.len(), self.pools.len());
        let demand = demand(tasks, batch_size);
        // Trajectories in flight per step: up to α + 1 batches.
        let in_flight = (alpha + 1) as f64;
        // Per pool: its decode batch, and its shard-seconds per step in all and prefilling on
        // its own shards (a disaggregated pool prefills elsewhere).
        let mut batch = vec![1.0; np];
        let mut prefill = vec![0.0; np];
        let mut throughput: f64 = 0.0;
        for p in 0..np {
            let shards = self.pools[p].shards.max(1) as f64;
            batch[p] = ((0..nt).map(|t| x[t][p] * demand[t]).sum::<f64>() * in_flight / shards)
                .clamp(1.0, self.pools[p].max_batch.max(1) as f64);
            let mut load = 0.0;
            for t in (0..nt).filter(|&t| x[t][p] > 0.0) {
                let n = x[t][p] * demand[t] / shards;
                load += n * self.trajectory_cost(p, tasks[t].tokens, batch[p]);
                if self.pools[p].prefill_from.is_none() {
                    prefill[p] += n * self.prefill_s(p, tasks[t].tokens.prefill);
                }
            }
            throughput = throughput.max(load);
        }
        // Each task's tail trajectory on each pool it uses: its prefill seconds, and its
        // decode seconds before the stretch.
        let mut tails: Vec<(usize, f64, f64)> = Vec::new();
        for p in 0..np {
            for t in (0..nt).filter(|&t| x[t][p] > 1e-9) {
                let tail = tasks[t].tail;
                let decode = tail.decode * self.decode_step_s(p, tail, batch[p]);
                tails.push((p, self.prefill_s(p, tail.prefill), decode));
            }
        }
        let latency = |step: f64| {
            tails
                .iter()
                .fold(0.0_f64, |worst, &(p, prefill_s, decode_s)| {
                    let share = (prefill[p] / step.max(1e-9)).min(0.95);
                    worst.max(prefill_s + decode_s / (1.0 - share))
                })
        };
        // latency(T) falls as T grows: bisect between the throughput bound and latency there.
        let (mut lo, mut hi) = (throughput, latency(throughput));
        if hi <= lo {
            return lo;
        }
        for _ in 0..40 {
            let mid = 0.5 * (lo + hi);
            if latency(mid) > mid {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        hi
    }

    /// The static split of every task over the pools (`[task][pool]`, rows sum to 1): every
    /// way of giving each task a pool, each also improved by splitting one task between two
    /// pools to balance their loads, scored by [`Self::estimate_step_s`]. A rule of thumb
    /// such as "multi-turn to compute-rich, math to bandwidth-rich" is one candidate, chosen
    /// only when it is best. `None` when there are more than [`MAX_ASSIGNMENTS`] assignments.
    /// `batch_now`: each pool's current decode batch (for the balancing costs).
    pub fn plan_split(
        &self,
        tasks: &[TaskLoad],
        batch_size: usize,
        alpha: u64,
        batch_now: &[f64],
    ) -> Option<Vec<Vec<f64>>> {
        let (nt, np) = (tasks.len(), self.pools.len());
        let eligible = self.eligible();
        let ne = eligible.len().max(1);
        if (ne as f64).powi(nt as i32) > MAX_ASSIGNMENTS {
            return None;
        }
        let demand = demand(tasks, batch_size);
        let shards: Vec<f64> = self.pools.iter().map(|p| p.shards.max(1) as f64).collect();
        let score = |x: &[Vec<f64>]| self.estimate_step_s(tasks, batch_size, alpha, x);
        let cost: Vec<Vec<f64>> = tasks
            .iter()
            .map(|t| {
                (0..np)
                    .map(|p| self.trajectory_cost(p, t.tokens, batch_now[p]))
                    .collect()
            })
            .collect();
        let mut best: Option<(f64, Vec<Vec<f64>>)> = None;
        let mut consider = |x: Vec<Vec<f64>>| {
            let s = score(&x);
            if best.as_ref().is_none_or(|(b, _)| s < *b - 1e-12) {
                best = Some((s, x));
            }
        };
        let load = |x: &Vec<Vec<f64>>, r: usize| {
            (0..nt)
                .map(|u| x[u][r] * demand[u] * cost[u][r])
                .sum::<f64>()
                / shards[r]
        };
        for code in 0..ne.pow(nt as u32) {
            let mut x = vec![vec![0.0; np]; nt];
            let mut c = code;
            for row in x.iter_mut() {
                row[eligible.get(c % ne).copied().unwrap_or(0)] = 1.0;
                c /= ne;
            }
            // One task split between its pool and another, balancing the two pools' loads.
            for t in 0..nt {
                let p = (0..np).find(|&p| x[t][p] == 1.0).unwrap_or(0);
                for q in eligible.iter().copied().filter(|&q| q != p) {
                    let (lp, lq) = (load(&x, p), load(&x, q));
                    let kp = demand[t] * cost[t][p] / shards[p];
                    let kq = demand[t] * cost[t][q] / shards[q];
                    let f = ((lp - lq) / (kp + kq).max(1e-12)).clamp(0.0, 1.0);
                    if f > 1e-6 && f < 1.0 - 1e-6 {
                        let mut y = x.clone();
                        y[t][p] = 1.0 - f;
                        y[t][q] = f;
                        consider(y);
                    }
                }
            }
            consider(x);
        }
        if let Some((s, x)) = &best {
            tracing::debug!(estimate_s = s, ?cost, ?demand, ?x, "cost model plan");
        }
        best.map(|(_, x)| x)
    }

    /// Without a split: the pool where a group of `task` would finish first. Each pool's
    /// backlog is the shard-seconds of the trajectories it runs (`active[pool][task]`, each
    /// counted half done) over its shards; a trajectory finishes after that queue and its own
    /// time on one shard. A faster pool wins until its queue makes another finish sooner, so
    /// no pool idles while another is overloaded.
    pub fn earliest_finish(
        &self,
        task: usize,
        tasks: &[TaskLoad],
        active: &[Vec<usize>],
        batch_now: &[f64],
    ) -> usize {
        let group = tasks[task].group.max(1) as f64;
        let mut best = 0;
        let mut best_finish = f64::INFINITY;
        for p in self.eligible() {
            let cost = |t: usize| self.trajectory_cost(p, tasks[t].tokens, batch_now[p]);
            let backlog: f64 = active[p]
                .iter()
                .enumerate()
                .filter(|(_, n)| **n > 0)
                .map(|(t, n)| *n as f64 * 0.5 * cost(t))
                .sum();
            let shards = self.pools[p].shards.max(1) as f64;
            let finish = (backlog + group * cost(task)) / shards + cost(task);
            if finish < best_finish {
                best_finish = finish;
                best = p;
            }
        }
        best
    }
}

/// Episodes of each task per step: its share of the batch's groups times its group.
fn demand(tasks: &[TaskLoad], batch_size: usize) -> Vec<f64> {
    let total_w: f64 = tasks.iter().map(|t| t.weight).sum::<f64>().max(1e-9);
    tasks
        .iter()
        .map(|t| batch_size as f64 * t.weight / total_w * t.group as f64)
        .collect()
}

#[cfg(test)]
mod tests;
