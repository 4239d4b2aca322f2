//! Held-out evaluation: the current policy answers every problem of each evaluation task `n`
//! times (episodes driven like training ones, on the same shards, but returned here instead
//! of going to the sample buffer: nothing trains on them). Reports per task mean reward,
//! pass@1 with its standard error over problems, pass@n (the unbiased estimator), response
//! length and truncation rate.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use actors::env::Record;
use actors::episode::{self, EpisodeParams, EpisodeShared};
use actors::generation::shard::ShardHandle;
use actors::types::{PolicyVersion, Trajectory};
use serde::{Deserialize, Serialize};

/// Episode ids of evaluation episodes start here (shards key their prefix caches by episode
/// id; training episodes count up from 0).
const EVAL_EPISODE_BASE: u64 = 1 << 60;

/// One evaluation task: its problems (a seed, and a dataset row when it has a dataset).
pub(crate) struct EvalTask {
    pub domain: String,
    pub problems: Vec<(u64, Option<Record>)>,
    /// Episodes of this task run at once (its environments).
    pub envs: usize,
}

/// Runs evaluations for a job.
pub(crate) struct Evaluator {
    pub shared: Arc<EpisodeShared>,
    pub tasks: Vec<EvalTask>,
    pub shards: Vec<ShardHandle>,
    pub n: usize,
    pub every: u64,
    pub at_start: bool,
    pub concurrency: Option<usize>,
    pub seed: u64,
    next_episode: AtomicU64,
}

/// The figures of one task in one evaluation.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EvalTaskMetrics {
    pub problems: usize,
    pub samples: usize,
    /// Samples that failed for an infrastructure reason (left out of the figures).
    pub failed: usize,
    pub mean_reward: f64,
    /// Share of samples that succeeded, averaged per problem.
    pub pass_at_1: f64,
    /// Standard error of `pass_at_1` over problems.
    pub pass_at_1_stderr: f64,
    /// k = `n`: the chance that at least one of k samples succeeds (unbiased estimator).
    pub pass_at_k: f64,
    pub k: usize,
    pub mean_response_tokens: f64,
    pub truncation_rate: f64,
    /// Agent tasks: model calls per episode.
    pub mean_model_calls: f64,
    /// Agent tasks: answers that tried to call a tool, per episode.
    pub tool_call_attempts: f64,
    /// Agent tasks: of the answers that tried to call a tool, the share whose calls were
    /// valid (parsed, a declared tool, arguments within its schema); 0 without attempts.
    pub valid_tool_call_rate: f64,
    /// Agent tasks: 1 − `valid_tool_call_rate` where there were attempts.
    pub invalid_tool_call_rate: f64,
}

/// One evaluation: after `step` steps (0: before training), on policy `version`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EvalRecord {
    pub step: u64,
    pub version: PolicyVersion,
    pub seconds: f64,
    pub tasks: BTreeMap<String, EvalTaskMetrics>,
}

/// The unbiased pass@k of one problem with `c` successes in `n` samples:
/// 1 − C(n−c, k) / C(n, k).
pub fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    if k == 0 || n < k {
        return 0.0;
    }
    if n - c < k {
        return 1.0;
    }
    // C(n−c, k) / C(n, k) = Π_{i=n−c+1}^{n} (1 − k / i)
    let mut miss = 1.0;
    for i in (n - c + 1)..=n {
        miss *= 1.0 - k as f64 / i as f64;
    }
    1.0 - miss
}

/// The figures of one task from its samples, grouped by problem.
pub fn task_metrics(by_problem: &[Vec<Trajectory>], n: usize) -> EvalTaskMetrics {
    let mut m = EvalTaskMetrics {
        problems: by_problem.len(),
        k: n,
        ..EvalTaskMetrics::default()
    };
    let mut per_problem = Vec::new();
    let mut pass_k = Vec::new();
    let (mut reward, mut tokens, mut truncated, mut counted) = (0.0, 0usize, 0usize, 0usize);
    let mut tools = ToolCounts::default();
    for samples in by_problem {
        m.samples += samples.len();
        let ok: Vec<&Trajectory> = samples
            .iter()
            .filter(|t| t.failure.is_none() || t.truncated)
            .collect();
        m.failed += samples.len() - ok.len();
        if ok.is_empty() {
            continue;
        }
        let c = ok.iter().filter(|t| t.success).count();
        per_problem.push(c as f64 / ok.len() as f64);
        pass_k.push(pass_at_k(ok.len(), c, n.min(ok.len())));
        for t in &ok {
            reward += t.reward.unwrap_or(0.0);
            tokens += t.response_tokens();
            truncated += usize::from(t.truncated);
            counted += 1;
            tools.add(t);
        }
    }
    let p = per_problem.len();
    if p > 0 {
        m.pass_at_1 = per_problem.iter().sum::<f64>() / p as f64;
        m.pass_at_k = pass_k.iter().sum::<f64>() / p as f64;
        if p > 1 {
            let var = per_problem
                .iter()
                .map(|x| (x - m.pass_at_1).powi(2))
                .sum::<f64>()
                / (p - 1) as f64;
            m.pass_at_1_stderr = (var / p as f64).sqrt();
        }
    }
    if counted > 0 {
        m.mean_reward = reward / counted as f64;
        m.mean_response_tokens = tokens as f64 / counted as f64;
        m.truncation_rate = truncated as f64 / counted as f64;
        tools.into(&mut m, counted);
    }
    m
}

/// Model calls and tool-call attempts of agent episodes.
#[derive(Default)]
struct ToolCounts {
    calls: usize,
    attempts: usize,
    valid: usize,
}

impl ToolCounts {
    fn add(&mut self, t: &Trajectory) {
        for c in t.turns.iter().filter_map(|u| u.call.as_ref()) {
            self.calls += 1;
            let invalid = c.invalid_tool_call.is_some();
            if invalid || !c.tool_calls.is_empty() {
                self.attempts += 1;
                self.valid += usize::from(!invalid);
            }
        }
    }

    fn into(self, m: &mut EvalTaskMetrics, episodes: usize) {
        m.mean_model_calls = self.calls as f64 / episodes as f64;
        m.tool_call_attempts = self.attempts as f64 / episodes as f64;
        if self.attempts > 0 {
            m.valid_tool_call_rate = self.valid as f64 / self.attempts as f64;
            m.invalid_tool_call_rate = 1.0 - m.valid_tool_call_rate;
        }
    }
}

impl Evaluator {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        shared: Arc<EpisodeShared>,
        tasks: Vec<EvalTask>,
        shards: Vec<ShardHandle>,
        n: usize,
        every: u64,
        at_start: bool,
        concurrency: Option<usize>,
        seed: u64,
    ) -> Self {
        Self {
            shared,
            tasks,
            shards,
            n,
            every,
            at_start,
            concurrency,
            seed,
            next_episode: AtomicU64::new(EVAL_EPISODE_BASE),
        }
    }

    /// Whether to evaluate after `done` of `steps` steps (0: before the first).
    pub(crate) fn due(&self, done: u64, steps: u64) -> bool {
        match done {
            0 => self.at_start,
            d if d == steps => true,
            d => self.every > 0 && d % self.every == 0,
        }
    }

    /// Evaluates the policy the shards serve now (`version`) after `step` steps.
    pub(crate) async fn run(&self, step: u64, version: PolicyVersion) -> EvalRecord {
        use futures::StreamExt;
        let t0 = tokio::time::Instant::now();
        let mut tasks = BTreeMap::new();
        for (ti, task) in self.tasks.iter().enumerate() {
            // Every (problem, sample) pair as an episode; the same sampling seeds at every
            // evaluation, so evaluations differ only by the policy.
            let jobs: Vec<(usize, usize)> = (0..task.problems.len())
                .flat_map(|p| (0..self.n).map(move |s| (p, s)))
                .collect();
            let width = self.concurrency.unwrap_or(task.envs).max(1);
            let results: Vec<(usize, Trajectory)> = futures::stream::iter(jobs)
                .map(|(p, s)| {
                    let (seed, record) = task.problems[p].clone();
                    let id = self.next_episode.fetch_add(1, Ordering::Relaxed);
                    let shard = self.shards[(p * self.n + s) % self.shards.len().max(1)].clone();
                    let params = EpisodeParams {
                        id,
                        group: u64::MAX - p as u64,
                        task: ti,
                        seed,
                        sample_seed: self.seed
                            ^ (ti as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
                            ^ ((p as u64) << 20)
                            ^ s as u64,
                        start_version: version,
                        shard,
                        barrier: None,
                        prefill: None,
                        record,
                        progress: None,
                    };
                    let shared = self.shared.clone();
                    async move { (p, episode::run_detached(&shared, &params).await) }
                })
                .buffer_unordered(width)
                .collect()
                .await;
            let mut by_problem: Vec<Vec<Trajectory>> = vec![Vec::new(); task.problems.len()];
            for (p, t) in results {
                by_problem[p].push(t);
            }
            tasks.insert(task.domain.clone(), task_metrics(&by_problem, self.n));
        }
        EvalRecord {
            step,
            version,
            seconds: t0.elapsed().as_secs_f64(),
            tasks,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pass_at_k_is_the_unbiased_estimator() {
        // No success, all successes, and k = 1 (the success share).
        assert_eq!(pass_at_k(4, 0, 4), 0.0);
        assert_eq!(pass_at_k(4, 4, 1), 1.0);
        assert!((pass_at_k(4, 1, 1) - 0.25).abs() < 1e-12);
        // 1 of 4 samples right: pass@2 = 1 − C(3,2)/C(4,2) = 1 − 3/6.
        assert!((pass_at_k(4, 1, 2) - 0.5).abs() < 1e-12);
        // 2 of 5, k = 3: 1 − C(3,3)/C(5,3) = 1 − 1/10.
        assert!((pass_at_k(5, 2, 3) - 0.9).abs() < 1e-12);
        // Fewer samples than k: undefined, reported as 0; n − c < k: certain.
        assert_eq!(pass_at_k(2, 1, 3), 0.0);
        assert_eq!(pass_at_k(4, 3, 2), 1.0);
    }

    fn traj(success: bool, reward: f64, tokens: usize) -> Trajectory {
        Trajectory {
            id: String::new(),
            group_id: 0,
            task: "t".into(),
            seed: 0,
            start_version: 0,
            pool: String::new(),
            shard: 0,
            turns: vec![actors::types::Turn {
                response_tokens: vec![1; tokens].into(),
                ..Default::default()
            }],
            reward: Some(reward),
            success,
            invalid_actions: 0,
            failure: None,
            timings: Default::default(),
            reference: None,
            final_text: String::new(),
            allowed_tokens: None,
            truncated: false,
            agent: None,
            verdict: None,
        }
    }

    #[test]
    fn task_metrics_average_per_problem_with_a_standard_error() {
        // Problem A: 2 of 2 right; problem B: 0 of 2; problem C: 1 of 2 (one failed sample
        // of C is left out).
        let mut failed = traj(false, 0.0, 9);
        failed.failure = Some(actors::types::FailureReason::EnvTimeout);
        let a = vec![traj(true, 1.0, 4), traj(true, 1.0, 6)];
        let b = vec![traj(false, 0.0, 2), traj(false, 0.0, 2)];
        let c = vec![traj(true, 1.0, 4), traj(false, 0.0, 2), failed];
        let m = task_metrics(&[a, b, c], 2);
        assert_eq!((m.problems, m.samples, m.failed), (3, 7, 1));
        assert!((m.pass_at_1 - 0.5).abs() < 1e-12, "{m:?}");
        // Per-problem shares 1, 0, 0.5: sd 0.5, stderr 0.5 / √3.
        assert!((m.pass_at_1_stderr - 0.5 / 3f64.sqrt()).abs() < 1e-12);
        // pass@2: 1, 0, 1 (one of two right is enough).
        assert!((m.pass_at_k - 2.0 / 3.0).abs() < 1e-12);
        assert!((m.mean_reward - 0.5).abs() < 1e-12);
        assert!((m.mean_response_tokens - 20.0 / 6.0).abs() < 1e-12);
        assert_eq!(m.truncation_rate, 0.0);
    }
}
