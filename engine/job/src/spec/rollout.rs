//! The `preset` and `rollout` sections: barriers, staleness α, overlap, batch and step counts,
//! and their resolution against a preset into the concrete [`Knobs`] a job runs with.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::pool::MappingMode;
use super::reward::RewardPlacement;
use super::sim::Clock;
use super::{JobSpec, Problems};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Preset {
    /// Synchronous: batch barrier, on-policy, no overlap, local reward, one pool.
    Sync,
    /// Sync with asynchronous environment interaction and reward (no turn barrier),
    /// serverless reward, still synchronous training.
    SyncPlus,
    /// Rollout one step ahead of training: a batch is generated as a wave while the previous
    /// one trains.
    OneOff,
    /// Trajectory-level asynchrony, α = 1, overlap, serverless reward, affinity mapping.
    Rollarc,
    /// AReaL-style: fully asynchronous with interruptible generation (in-flight turns keep
    /// their tokens and recompute KV under new weights), one hardware type, local reward.
    Areal,
}

/// The knob values a preset stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PresetKnobs {
    pub barrier: Barrier,
    pub alpha: u64,
    pub overlap: bool,
    pub placement: RewardPlacement,
    pub mapping: MappingMode,
    pub on_weight_update: OnWeightUpdate,
}

impl Preset {
    pub const ALL: [Preset; 5] = [
        Preset::Sync,
        Preset::SyncPlus,
        Preset::OneOff,
        Preset::Areal,
        Preset::Rollarc,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Sync => "sync",
            Self::SyncPlus => "sync_plus",
            Self::OneOff => "one_off",
            Self::Rollarc => "rollarc",
            Self::Areal => "areal",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == s)
    }

    /// The knob values of this preset (architecture.md §6).
    pub fn knobs(self) -> PresetKnobs {
        let k = |barrier, alpha, overlap, placement, mapping, on_weight_update| PresetKnobs {
            barrier,
            alpha,
            overlap,
            placement,
            mapping,
            on_weight_update,
        };
        use OnWeightUpdate::{Abort, Recompute};
        match self {
            Self::Sync => k(
                Barrier::Batch,
                0,
                false,
                RewardPlacement::Local,
                MappingMode::SinglePool,
                Abort,
            ),
            Self::SyncPlus => k(
                Barrier::None,
                0,
                false,
                RewardPlacement::Serverless,
                MappingMode::SinglePool,
                Abort,
            ),
            Self::OneOff => k(
                Barrier::Wave,
                1,
                true,
                RewardPlacement::Serverless,
                MappingMode::SinglePool,
                Abort,
            ),
            Self::Areal => k(
                Barrier::None,
                1,
                true,
                RewardPlacement::Local,
                MappingMode::SinglePool,
                Recompute,
            ),
            Self::Rollarc => k(
                Barrier::None,
                1,
                true,
                RewardPlacement::Serverless,
                MappingMode::Declared,
                Abort,
            ),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Barrier {
    /// Trajectory-level: every trajectory advances on its own.
    None,
    /// Batch-level generation: groups are admitted in waves of `batch_size`, the next wave once
    /// the previous one has ended; within a wave every trajectory advances on its own.
    Wave,
    /// Every environment waits for the slowest each turn.
    Turn,
    /// Turn barrier, and rewards only after the whole batch is generated.
    Batch,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnWeightUpdate {
    Abort,
    Recompute,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RolloutSpec {
    #[serde(default)]
    pub barrier: Option<Barrier>,
    #[serde(default)]
    #[schema(maximum = 1000)]
    pub alpha: Option<u64>,
    #[serde(default)]
    pub overlap_training: Option<bool>,
    /// Groups per training batch.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 65536)]
    pub batch_size: Option<usize>,
    #[serde(default)]
    #[schema(minimum = 1, maximum = 1000000000)]
    pub steps: Option<u64>,
    #[serde(default)]
    pub on_weight_update: Option<OnWeightUpdate>,
    #[serde(default)]
    #[schema(minimum = 1, maximum = 100000)]
    pub max_concurrent_episodes: Option<usize>,
    /// Drop groups whose rewards are all equal (dynamic sampling).
    #[serde(default)]
    pub filter_all_equal: Option<bool>,
    #[serde(default)]
    pub max_retries_per_group: Option<u32>,
    #[serde(default)]
    #[schema(exclusive_minimum = 0.0, maximum = 2592000.0)]
    pub env_call_timeout_s: Option<f64>,
    /// A shard with work and no progress for this long is restarted.
    #[serde(default)]
    #[schema(exclusive_minimum = 0.0, maximum = 2592000.0)]
    pub frozen_after_s: Option<f64>,
    /// Fault budget of each reward function and each task's environments: after
    /// `fault_min_failures` consecutive failed calls spanning `fault_window_s` (no success in
    /// between), the job fails naming the dependency and its last failure. Defaults 30 s, 5.
    #[serde(default)]
    #[schema(minimum = 0.0, maximum = 2592000.0)]
    pub fault_window_s: Option<f64>,
    #[serde(default)]
    #[schema(minimum = 1, maximum = 1000000)]
    pub fault_min_failures: Option<u64>,
    /// The longest a training step may take: waiting for its batch, and training (seconds,
    /// on the job's clock). Default: an hour for real jobs with the built-in trainer; 30 days
    /// for fully simulated jobs (a production iteration can take hours of virtual time) and
    /// for external trainers (their pace is theirs; a lost trainer's lease ends instead).
    #[serde(default)]
    #[schema(exclusive_minimum = 0.0, maximum = 2592000.0)]
    pub step_timeout_s: Option<f64>,
    /// Over-provisioned waves (RollArt's redundant environments) for the barrier modes: each
    /// wave admits `batch_size + overprovision` groups, the first `batch_size` to finish make
    /// the batch and the rest are cancelled (their tokens and environment time are reported
    /// as wasted). Per-group redundancy (`tasks.redundancy`) works beside it. Default 0.
    #[serde(default)]
    #[schema(maximum = 65536)]
    pub overprovision: Option<usize>,
}

/// Largest `rollout.fault_min_failures`.
pub const MAX_FAULT_FAILURES: u64 = 1_000_000;

/// The concrete knobs a job runs with, after the preset and the defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Knobs {
    pub preset: Option<Preset>,
    pub barrier: Barrier,
    pub alpha: u64,
    pub overlap_training: bool,
    pub placement: RewardPlacement,
    pub mapping: MappingMode,
    pub batch_size: usize,
    pub steps: u64,
    pub on_weight_update: OnWeightUpdate,
    pub max_concurrent_episodes: usize,
    pub filter_all_equal: bool,
    pub max_retries_per_group: u32,
    pub env_call_timeout_s: f64,
    pub frozen_after_s: f64,
    pub fault_window_s: f64,
    pub fault_min_failures: u64,
    pub step_timeout_s: f64,
    /// Extra groups per wave (barrier modes), cancelled once the batch is full.
    #[serde(default)]
    pub overprovision: usize,
}

impl RolloutSpec {
    /// Checks the rollout knobs (and the clock they run on).
    pub(super) fn check(&self, spec: &JobSpec, problems: &mut Problems) {
        let r = self;
        if let Some(b) = r.batch_size
            && !(1..=super::MAX_BATCH_GROUPS).contains(&b)
        {
            problems.push(
                "rollout.batch_size".into(),
                format!("must be in 1..={} groups, got {b}", super::MAX_BATCH_GROUPS),
            );
        }
        if let Some(s) = r.steps
            && !(1..=super::MAX_STEPS).contains(&s)
        {
            problems.push(
                "rollout.steps".into(),
                format!("must be in 1..={}, got {s}", super::MAX_STEPS),
            );
        }
        if r.alpha.is_some_and(|a| a > 1000) {
            problems.push("rollout.alpha".into(), "must be at most 1000".into());
        }
        if let Some(k) = r.overprovision
            && k > 0
        {
            if k > super::MAX_BATCH_GROUPS {
                problems.push(
                    "rollout.overprovision".into(),
                    format!(
                        "must be at most {} groups, got {k}",
                        super::MAX_BATCH_GROUPS
                    ),
                );
            } else if spec.knobs().barrier == Barrier::None {
                problems.push(
                    "rollout.overprovision".into(),
                    "over-provisioning cuts the stragglers of a wave (barrier = wave, turn or \
                     batch); with barrier = none every extra group in flight trains in a later \
                     step anyway (alpha bounds how many)"
                        .into(),
                );
            }
        }
        if r.overlap_training == Some(true) && spec.knobs().alpha == 0 {
            problems.push(
                "rollout.overlap_training".into(),
                "training overlaps rollout only with alpha >= 1: with alpha = 0 every batch \
                 needs the weights of the step before it"
                    .into(),
            );
        }
        if spec.sim.clock == Some(Clock::Virtual) && !spec.all_simulated() {
            problems.push(
                "sim.clock".into(),
                "a virtual clock needs every backend simulated and no external environment \
                 (real compute and real programs take real time); leave sim.clock unset to \
                 get the real clock"
                    .into(),
            );
        }
        if let Some(n) = r.max_concurrent_episodes
            && !(1..=super::MAX_EPISODES).contains(&n)
        {
            problems.push(
                "rollout.max_concurrent_episodes".into(),
                format!("must be in 1..={}, got {n}", super::MAX_EPISODES),
            );
        } else if r.max_concurrent_episodes.is_none() {
            let n = spec.knobs().max_concurrent_episodes;
            if n > super::MAX_EPISODES {
                problems.push(
                    "rollout.max_concurrent_episodes".into(),
                    format!(
                        "the default, batch_size × (group_size + redundancy) × (alpha + 1) = {n}, \
                         exceeds {}; set it explicitly",
                        super::MAX_EPISODES
                    ),
                );
            }
        }
        if let Some(n) = r.fault_min_failures
            && !(1..=MAX_FAULT_FAILURES).contains(&n)
        {
            problems.push(
                "rollout.fault_min_failures".into(),
                format!("must be in 1..={MAX_FAULT_FAILURES}, got {n}"),
            );
        }
        if let Some(w) = r.fault_window_s {
            problems.seconds("rollout.fault_window_s".into(), w, false);
        }
        for (name, v) in [
            ("env_call_timeout_s", r.env_call_timeout_s),
            ("frozen_after_s", r.frozen_after_s),
            ("step_timeout_s", r.step_timeout_s),
        ] {
            if let Some(v) = v {
                problems.seconds(format!("rollout.{name}"), v, true);
            }
        }
    }
}

impl JobSpec {
    /// Resolves knobs: explicit values, else the preset's, else the `rollarc` preset's.
    pub fn knobs(&self) -> Knobs {
        let PresetKnobs {
            barrier,
            alpha,
            overlap,
            placement,
            mapping,
            on_weight_update,
        } = self.preset.unwrap_or(Preset::Rollarc).knobs();
        let r = &self.rollout;
        let batch_size = r.batch_size.unwrap_or(8);
        let alpha = r.alpha.unwrap_or(alpha);
        let group_eps: usize = self
            .tasks
            .iter()
            .map(|t| t.group_size + t.redundancy)
            .max()
            .unwrap_or(8);
        Knobs {
            preset: self.preset,
            barrier: r.barrier.unwrap_or(barrier),
            alpha,
            // Training overlaps rollout only when trajectories may lag a version: with α = 0
            // the next batch needs the weights the step being trained produces (the driver
            // would wait for that batch before installing them).
            overlap_training: r.overlap_training.unwrap_or(overlap && alpha > 0),
            placement: self.reward.placement.unwrap_or(placement),
            mapping: self.mapping.mode.unwrap_or(
                if mapping == MappingMode::Declared && self.mapping.declared.is_empty() {
                    MappingMode::CostModel
                } else {
                    mapping
                },
            ),
            batch_size,
            steps: r.steps.unwrap_or(10),
            on_weight_update: r.on_weight_update.unwrap_or(on_weight_update),
            max_concurrent_episodes: r.max_concurrent_episodes.unwrap_or(
                batch_size
                    .saturating_add(r.overprovision.unwrap_or(0))
                    .saturating_mul(group_eps)
                    .saturating_mul((alpha as usize).saturating_add(1)),
            ),
            filter_all_equal: r.filter_all_equal.unwrap_or(false),
            max_retries_per_group: r.max_retries_per_group.unwrap_or(2),
            env_call_timeout_s: r.env_call_timeout_s.unwrap_or(600.0),
            frozen_after_s: r.frozen_after_s.unwrap_or(120.0),
            fault_window_s: r.fault_window_s.unwrap_or(30.0),
            fault_min_failures: r.fault_min_failures.unwrap_or(5),
            step_timeout_s: r.step_timeout_s.unwrap_or(
                if self.all_simulated() || matches!(self.trainer, super::TrainerSpec::External(_)) {
                    super::MAX_SECONDS
                } else {
                    3600.0
                },
            ),
            overprovision: r.overprovision.unwrap_or(0),
        }
    }

    /// Applies a preset on top of a spec: the preset's knobs win over the spec's.
    pub fn with_preset(&self, preset: Preset) -> JobSpec {
        let mut s = self.clone();
        s.preset = Some(preset);
        let PresetKnobs {
            barrier,
            alpha,
            overlap,
            placement,
            mapping,
            on_weight_update,
        } = preset.knobs();
        s.rollout.barrier = Some(barrier);
        s.rollout.alpha = Some(alpha);
        s.rollout.overlap_training = Some(overlap);
        s.rollout.on_weight_update = Some(on_weight_update);
        s.reward.placement = Some(placement);
        s.mapping.mode = Some(
            if mapping == MappingMode::Declared && s.mapping.declared.is_empty() {
                MappingMode::CostModel
            } else {
                mapping
            },
        );
        s.rollout.max_concurrent_episodes = None;
        s
    }
}
