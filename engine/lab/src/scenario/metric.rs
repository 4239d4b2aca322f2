//! What a scenario's runs are measured by.

use serde::{Deserialize, Serialize};

use job::runtime::JobSummary;

/// What a run is measured by.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// Mean training-step time after the warm-up steps (virtual seconds).
    #[default]
    StepS,
    /// Trained trajectories per second after the warm-up steps.
    Throughput,
    /// Idle fraction of generation capacity over the run.
    Bubble,
    /// Fraction of the step the trainer trains (the rest it waits for data).
    TrainerBusy,
    /// Total virtual time of the run.
    ElapsedS,
    /// GPU-seconds held by the simulated reward models on GPUs (every deployment, cold
    /// starts included).
    RewardGpuS,
    /// Busy share of the GPU-seconds those reward models held.
    RewardGpuUtil,
    /// Mean rollout span: a step's first trajectory start to its last one's end.
    RolloutS,
    /// Share of the steps' time the trainer waited for its batch, and its largest share in
    /// one step.
    TrainerWaitShare,
    TrainerWaitShareMax,
    /// Mean share of the critical trajectory's span (the one each step's rollout waited on
    /// last) spent resetting, generating, stepping the environment and scoring; and the
    /// largest reset share of a step (a failure's re-reset shows there).
    CriticalResetShare,
    CriticalResetShareMax,
    CriticalGenerateShare,
    CriticalEnvStepShare,
    CriticalRewardShare,
    /// Share of the looked-up context tokens the prefix caches served, over every pool after
    /// the warm-up.
    PrefixHitRate,
    /// Tokens prefilled per token decoded after the warm-up (every pool: a P/D pair's prefill
    /// side counts its prefills).
    PrefillPerDecode,
    /// The largest share of a step's rollout span that its critical trajectory spent
    /// resetting (RollArt's "reset is 78 % of the failure iteration's rollout").
    ResetRolloutShareMax,
}

impl Metric {
    pub const ALL: [Metric; 18] = [
        Metric::StepS,
        Metric::Throughput,
        Metric::Bubble,
        Metric::TrainerBusy,
        Metric::ElapsedS,
        Metric::RewardGpuS,
        Metric::RewardGpuUtil,
        Metric::RolloutS,
        Metric::TrainerWaitShare,
        Metric::TrainerWaitShareMax,
        Metric::CriticalResetShare,
        Metric::CriticalResetShareMax,
        Metric::CriticalGenerateShare,
        Metric::CriticalEnvStepShare,
        Metric::CriticalRewardShare,
        Metric::PrefixHitRate,
        Metric::PrefillPerDecode,
        Metric::ResetRolloutShareMax,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::StepS => "step_s",
            Self::Throughput => "throughput",
            Self::Bubble => "bubble",
            Self::TrainerBusy => "trainer_busy",
            Self::ElapsedS => "elapsed_s",
            Self::RewardGpuS => "reward_gpu_s",
            Self::RewardGpuUtil => "reward_gpu_util",
            Self::RolloutS => "rollout_s",
            Self::TrainerWaitShare => "trainer_wait_share",
            Self::TrainerWaitShareMax => "trainer_wait_share_max",
            Self::CriticalResetShare => "critical_reset_share",
            Self::CriticalResetShareMax => "critical_reset_share_max",
            Self::CriticalGenerateShare => "critical_generate_share",
            Self::CriticalEnvStepShare => "critical_env_step_share",
            Self::CriticalRewardShare => "critical_reward_share",
            Self::PrefixHitRate => "prefix_hit_rate",
            Self::PrefillPerDecode => "prefill_per_decode",
            Self::ResetRolloutShareMax => "reset_rollout_share_max",
        }
    }

    /// Whether the metric reads the function deployments (shared by a run's jobs) rather than
    /// one job's steps.
    pub fn of_deployments(self) -> bool {
        matches!(self, Self::RewardGpuS | Self::RewardGpuUtil)
    }

    /// A deployment metric of the run's function usage.
    pub fn of_functions(
        self,
        functions: &std::collections::BTreeMap<String, actors::reward::FunctionUsage>,
    ) -> f64 {
        let gpu = functions.values().filter(|u| u.gpus_per_instance > 0);
        let (held, busy) = gpu.fold((0.0, 0.0), |(h, b), u| (h + u.gpu_s(), b + u.busy_gpu_s()));
        match self {
            Self::RewardGpuS => held,
            Self::RewardGpuUtil if held > 0.0 => busy / held,
            _ => 0.0,
        }
    }

    /// The metric of a finished run.
    pub fn of(self, s: &JobSummary, warmup: u64) -> f64 {
        let steps: Vec<_> = s.steps.iter().filter(|m| m.step > warmup).collect();
        let steps = if steps.is_empty() {
            s.steps.iter().collect()
        } else {
            steps
        };
        let n = steps.len().max(1) as f64;
        match self {
            Self::StepS => steps.iter().map(|m| m.step_s).sum::<f64>() / n,
            Self::Throughput => {
                let t: f64 = steps.iter().map(|m| m.step_s).sum();
                steps.iter().map(|m| m.trajectories as f64).sum::<f64>() / t.max(1e-9)
            }
            Self::Bubble => s.bubble_ratio,
            Self::TrainerBusy => {
                steps
                    .iter()
                    .map(|m| (m.train_s / m.step_s.max(1e-9)).min(1.0))
                    .sum::<f64>()
                    / n
            }
            Self::ElapsedS => s.elapsed_s,
            Self::RewardGpuS | Self::RewardGpuUtil => self.of_functions(&s.functions),
            Self::RolloutS => steps.iter().map(|m| m.rollout.rollout_s).sum::<f64>() / n,
            Self::TrainerWaitShare => {
                steps.iter().map(|m| m.wait_batch_s).sum::<f64>()
                    / steps.iter().map(|m| m.step_s).sum::<f64>().max(1e-9)
            }
            Self::TrainerWaitShareMax => steps
                .iter()
                .map(|m| m.wait_batch_s / m.step_s.max(1e-9))
                .fold(0.0, f64::max),
            Self::CriticalResetShare
            | Self::CriticalGenerateShare
            | Self::CriticalEnvStepShare
            | Self::CriticalRewardShare => {
                steps.iter().map(|m| self.critical_share(m)).sum::<f64>() / n
            }
            Self::CriticalResetShareMax => steps
                .iter()
                .map(|m| Self::CriticalResetShare.critical_share(m))
                .fold(0.0, f64::max),
            Self::PrefixHitRate | Self::PrefillPerDecode => self.token_ratio(s, warmup),
            Self::ResetRolloutShareMax => steps
                .iter()
                .filter_map(|m| {
                    let c = m.rollout.critical.as_ref()?;
                    (m.rollout.rollout_s > 0.0)
                        .then(|| (c.stages.reset_s / m.rollout.rollout_s).min(1.0))
                })
                .fold(0.0, f64::max),
        }
    }

    /// A ratio of the pools' cumulative token counters between the end of the warm-up (the
    /// last warm-up step's record) and the run's last record.
    fn token_ratio(self, s: &JobSummary, warmup: u64) -> f64 {
        let counts = |m: Option<&job::runtime::StepMetrics>| {
            m.map_or((0, 0), |m| {
                m.pools.values().fold((0u64, 0u64), |(a, b), p| match self {
                    Self::PrefixHitRate => (a + p.prefix_hit_tokens, b + p.prefix_lookup_tokens),
                    _ => (a + p.prefill_tokens, b + p.decode_tokens),
                })
            })
        };
        let start = counts(s.steps.iter().rfind(|m| m.step <= warmup));
        let end = counts(s.steps.last());
        let (num, den) = (end.0.saturating_sub(start.0), end.1.saturating_sub(start.1));
        if den == 0 {
            0.0
        } else {
            num as f64 / den as f64
        }
    }

    /// The share of a step's critical trajectory's span this metric's stage took (0 for a
    /// step without one).
    fn critical_share(self, m: &job::runtime::StepMetrics) -> f64 {
        let Some(c) = &m.rollout.critical else {
            return 0.0;
        };
        let s = &c.stages;
        let secs = match self {
            Self::CriticalResetShare => s.reset_s,
            Self::CriticalGenerateShare => s.generate_s,
            Self::CriticalEnvStepShare => s.env_step_s,
            Self::CriticalRewardShare => s.reward_s,
            _ => 0.0,
        };
        if c.span_s > 0.0 { secs / c.span_s } else { 0.0 }
    }
}
