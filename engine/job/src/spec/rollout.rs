//! The `preset` and `rollout` sections: barriers, staleness α, overlap, batch and step counts,
//! and their resolution against a preset into the concrete [`Knobs`] a job runs with.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::knob::{Knob, KnobInfo};
use super::pool::MappingMode;
use super::reward::RewardPlacement;
use super::sim::Clock;
use super::{JobSpec, MAX_BATCH_GROUPS, MAX_EPISODES, MAX_SECONDS, MAX_STEPS, Problems};

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

/// The `rollout` section. Its numeric fields are [`Knob`]s: their bounds, defaults and
/// meanings are declared once, below the struct, and read by validation, [`JobSpec::knobs`],
/// the OpenAPI schema and the manual.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RolloutSpec {
    #[serde(default)]
    pub barrier: Option<Barrier>,
    #[serde(default)]
    pub alpha: Option<u64>,
    #[serde(default)]
    pub overlap_training: Option<bool>,
    #[serde(default)]
    pub batch_size: Option<usize>,
    #[serde(default)]
    pub steps: Option<u64>,
    #[serde(default)]
    pub on_weight_update: Option<OnWeightUpdate>,
    #[serde(default)]
    pub max_concurrent_episodes: Option<usize>,
    /// Drop groups whose rewards are all equal (dynamic sampling).
    #[serde(default)]
    pub filter_all_equal: Option<bool>,
    #[serde(default)]
    pub max_retries_per_group: Option<u32>,
    #[serde(default)]
    pub env_call_timeout_s: Option<f64>,
    #[serde(default)]
    pub frozen_after_s: Option<f64>,
    #[serde(default)]
    pub fault_window_s: Option<f64>,
    #[serde(default)]
    pub fault_min_failures: Option<u64>,
    #[serde(default)]
    pub step_timeout_s: Option<f64>,
    #[serde(default)]
    pub overprovision: Option<usize>,
}

/// A knob of the `rollout` section.
const fn rollout<T: Copy>(
    name: &'static str,
    (min, exclusive_min, max): (T, bool, T),
    default: Option<T>,
    default_note: &'static str,
    doc: &'static str,
) -> Knob<T> {
    let unit = "";
    Knob {
        schema: "RolloutSpec",
        section: "rollout",
        name,
        min,
        exclusive_min,
        max,
        default,
        unit,
        default_note,
        doc,
    }
}

/// A duration knob of the `rollout` section: seconds, at most [`MAX_SECONDS`]; more than 0
/// when `positive`.
const fn rollout_seconds(
    name: &'static str,
    positive: bool,
    default: Option<f64>,
    default_note: &'static str,
    doc: &'static str,
) -> Knob<f64> {
    Knob {
        unit: "s",
        ..rollout(
            name,
            (0.0, positive, MAX_SECONDS),
            default,
            default_note,
            doc,
        )
    }
}

pub const ALPHA: Knob<u64> = rollout(
    "alpha",
    (0, false, 1000),
    None,
    "the preset's: 0 for `sync`, else 1",
    "Staleness bound α: a trajectory started under policy version v trains at version v + α at the latest; older groups are evicted.",
);
pub const BATCH_SIZE: Knob<usize> = rollout(
    "batch_size",
    (1, false, MAX_BATCH_GROUPS),
    Some(8),
    "",
    "Groups per training batch.",
);
pub const STEPS: Knob<u64> = rollout(
    "steps",
    (1, false, MAX_STEPS),
    Some(10),
    "",
    "Training steps the job runs.",
);
pub const MAX_CONCURRENT_EPISODES: Knob<usize> = rollout(
    "max_concurrent_episodes",
    (1, false, MAX_EPISODES),
    None,
    "batch_size × (group_size + redundancy) × (α + 1)",
    "Episodes in flight at once, over all tasks.",
);
pub const MAX_RETRIES_PER_GROUP: Knob<u32> = rollout(
    "max_retries_per_group",
    (0, false, 1000),
    Some(2),
    "",
    "Retries per group for trajectories that failed for infrastructure reasons (those are masked, never scored zero).",
);
pub const ENV_CALL_TIMEOUT_S: Knob<f64> = rollout_seconds(
    "env_call_timeout_s",
    true,
    Some(600.0),
    "",
    "The longest an environment reset or step may take.",
);
pub const FROZEN_AFTER_S: Knob<f64> = rollout_seconds(
    "frozen_after_s",
    true,
    Some(120.0),
    "",
    "A shard with work and no progress for this long is restarted.",
);
pub const FAULT_WINDOW_S: Knob<f64> = rollout_seconds(
    "fault_window_s",
    false,
    Some(30.0),
    "",
    "Fault budget of each reward function and each task's environments: after fault_min_failures consecutive failed calls spanning this long (no success in between), the job fails naming the dependency and its last failure.",
);
pub const FAULT_MIN_FAILURES: Knob<u64> = rollout(
    "fault_min_failures",
    (1, false, 1_000_000),
    Some(5),
    "",
    "Consecutive failed calls of the fault budget (see fault_window_s).",
);
/// [`STEP_TIMEOUT_S`]'s default for real jobs with the built-in trainer (its note says it).
pub const REAL_STEP_TIMEOUT_S: f64 = 3600.0;
pub const STEP_TIMEOUT_S: Knob<f64> = rollout_seconds(
    "step_timeout_s",
    true,
    None,
    "3600 s for real jobs with the built-in trainer; 30 days for fully simulated jobs and external trainers",
    "The longest a training step may take: waiting for its batch, and training (seconds on the job's clock). A lost external trainer's lease ends instead.",
);
pub const OVERPROVISION: Knob<usize> = rollout(
    "overprovision",
    (0, false, MAX_BATCH_GROUPS),
    Some(0),
    "",
    "Over-provisioned waves (the barrier modes): each wave admits batch_size + overprovision groups, the first batch_size to finish make the batch and the rest are cancelled (their tokens and environment time are reported as wasted).",
);

/// The knobs of the section, in the manual's order.
pub(super) fn knobs() -> Vec<KnobInfo> {
    vec![
        BATCH_SIZE.info(),
        STEPS.info(),
        ALPHA.info(),
        MAX_CONCURRENT_EPISODES.info(),
        OVERPROVISION.info(),
        MAX_RETRIES_PER_GROUP.info(),
        ENV_CALL_TIMEOUT_S.info(),
        FROZEN_AFTER_S.info(),
        STEP_TIMEOUT_S.info(),
        FAULT_WINDOW_S.info(),
        FAULT_MIN_FAILURES.info(),
    ]
}

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
        BATCH_SIZE.check(r.batch_size, problems);
        STEPS.check(r.steps, problems);
        ALPHA.check(r.alpha, problems);
        MAX_CONCURRENT_EPISODES.check(r.max_concurrent_episodes, problems);
        OVERPROVISION.check(r.overprovision, problems);
        MAX_RETRIES_PER_GROUP.check(r.max_retries_per_group, problems);
        ENV_CALL_TIMEOUT_S.check(r.env_call_timeout_s, problems);
        FROZEN_AFTER_S.check(r.frozen_after_s, problems);
        STEP_TIMEOUT_S.check(r.step_timeout_s, problems);
        FAULT_WINDOW_S.check(r.fault_window_s, problems);
        FAULT_MIN_FAILURES.check(r.fault_min_failures, problems);
        let knobs = spec.knobs();
        if r.overprovision
            .is_some_and(|k| k > 0 && OVERPROVISION.allows(k))
            && knobs.barrier == Barrier::None
        {
            problems.push(
                OVERPROVISION.field(),
                "over-provisioning cuts the stragglers of a wave (barrier = wave, turn or \
                 batch); with barrier = none every extra group in flight trains in a later \
                 step anyway (alpha bounds how many)"
                    .into(),
            );
        }
        if r.overlap_training == Some(true) && knobs.alpha == 0 {
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
        if r.max_concurrent_episodes.is_none() && knobs.max_concurrent_episodes > MAX_EPISODES {
            problems.push(
                MAX_CONCURRENT_EPISODES.field(),
                format!(
                    "the default, {} = {}, exceeds {MAX_EPISODES}; set it explicitly",
                    MAX_CONCURRENT_EPISODES.default_note, knobs.max_concurrent_episodes
                ),
            );
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
        let batch_size = BATCH_SIZE.or_default(r.batch_size);
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
            steps: STEPS.or_default(r.steps),
            on_weight_update: r.on_weight_update.unwrap_or(on_weight_update),
            max_concurrent_episodes: r.max_concurrent_episodes.unwrap_or(
                batch_size
                    .saturating_add(OVERPROVISION.or_default(r.overprovision))
                    .saturating_mul(group_eps)
                    .saturating_mul((alpha as usize).saturating_add(1)),
            ),
            filter_all_equal: r.filter_all_equal.unwrap_or(false),
            max_retries_per_group: MAX_RETRIES_PER_GROUP.or_default(r.max_retries_per_group),
            env_call_timeout_s: ENV_CALL_TIMEOUT_S.or_default(r.env_call_timeout_s),
            frozen_after_s: FROZEN_AFTER_S.or_default(r.frozen_after_s),
            fault_window_s: FAULT_WINDOW_S.or_default(r.fault_window_s),
            fault_min_failures: FAULT_MIN_FAILURES.or_default(r.fault_min_failures),
            step_timeout_s: r.step_timeout_s.unwrap_or(
                if self.all_simulated() || matches!(self.trainer, super::TrainerSpec::External(_)) {
                    MAX_SECONDS
                } else {
                    REAL_STEP_TIMEOUT_S
                },
            ),
            overprovision: OVERPROVISION.or_default(r.overprovision),
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
