//! Spec → wiring: everything a job's actors are built from, derived from a validated spec and
//! its resolved inputs ([`crate::resolve`]) by one pure function, [`plan`]. No I/O and no
//! actors here: [`crate::runtime`] spawns the tree from
//! a [`JobPlan`]. This module and [`crate::spec`] are the only ones that read spec types.
//!
//! Invariant: no silent fallbacks. A name the catalogue does not know is a [`WiringError`]
//! (validation rejects it first; the error guards callers that skip validation).

pub mod envs;
mod pools;
mod tasks;
mod trainer;

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use actors::device::{DeviceProfile, ModelProfile};
use actors::dist::Dist;

use crate::resolve::Resolved;
use crate::spec::{FunctionSpec, JobSpec, Knobs};

pub use pools::{EnginePlan, PoolPlan, ServerKind, ServerPlan, XLLAMACPP_SCRIPT};
pub use tasks::{ScorerPlan, TaskPlan, prior_tokens};
pub use trainer::{
    TrainerPlan, advantage_kind, builtin_trainer_config, checkpoint_spec, weight_sync,
};

/// Everything a job run is built from.
pub struct JobPlan {
    pub knobs: Knobs,
    pub seed: u64,
    pub pools: Vec<PoolPlan>,
    pub tasks: Vec<TaskPlan>,
    /// Reward functions by name, in name order.
    pub functions: Vec<(String, FunctionPlan)>,
    pub trainer: TrainerPlan,
    /// Held-out evaluation, when the spec asks for it.
    pub eval: Option<EvalPlan>,
}

/// The evaluation's knobs and its tasks (planned like training tasks).
pub struct EvalPlan {
    pub every: u64,
    pub at_start: bool,
    pub n: usize,
    pub temperature: f32,
    pub max_tokens: Option<u32>,
    pub concurrency: Option<usize>,
    pub tasks: Vec<TaskPlan>,
}

/// A task as the scheduler sees it (`crate::runtime::scheduler`).
#[derive(Clone, Debug)]
pub struct TaskView {
    pub domain: String,
    pub weight: f64,
    pub group_size: usize,
    pub redundancy: usize,
    pub seeds: Option<(u64, u64)>,
    /// The task's prompt dataset: groups draw its rows instead of seeds.
    pub dataset: Option<Arc<crate::dataset::Dataset>>,
    /// Prior estimate of tokens per trajectory, replaced by observations.
    pub estimate: crate::cost::Tokens,
    pub declared_pool: Option<usize>,
}

/// How a named reward function is provided.
pub enum FunctionPlan {
    /// A simulated serverless deployment scaled by the KPA (virtual time).
    SimScaled {
        latency: Dist,
        cold_start: Duration,
        scaling: infra::faas::Scaling,
        seed: u64,
        /// A reward model on GPUs (instances batch on the device roofline).
        gpu: Option<actors::reward::GpuService>,
    },
    /// A simulated function with fixed slots, optionally scaling to zero when idle.
    SimSlots {
        latency: Dist,
        cold_start: Duration,
        concurrency: usize,
        scale_to_zero_after: Option<Duration>,
        seed: u64,
    },
    /// A real function (built-in, command or URL), deployed through the function hub.
    Hub(FunctionSpec),
}

impl JobPlan {
    /// Bytes of the policy's weights (what a weight sync moves).
    pub fn weight_bytes(&self) -> f64 {
        self.pools.first().map_or(0.0, |p| p.model.weight_bytes())
    }
}

impl FunctionPlan {
    /// Whether the function runs as processes or behind a URL (so the job needs a hub).
    pub fn needs_hub(&self) -> bool {
        matches!(self, FunctionPlan::Hub(_))
    }
}

/// A spec that passed validation but cannot be turned into a job (a guard for callers that
/// skip validation).
#[derive(Debug, thiserror::Error)]
pub enum WiringError {
    #[error("{field}: unknown device class {name:?}")]
    UnknownDevice { field: String, name: String },
    #[error("{field}: unknown model {name:?}")]
    UnknownModel { field: String, name: String },
    #[error("trainer: the built-in trainer needs built-in pools (backend.kind = \"builtin\")")]
    BuiltinTrainerWithoutModel,
    #[error("pools: the built-in model trains only with trainer.kind = \"builtin\"")]
    BuiltinModelWithoutTrainer,
    #[error("tasks[{task}].reward: no reward function is named {name:?}")]
    UnknownFunction { task: usize, name: String },
    #[error("tasks[{task}]: its dataset or environment program was not resolved")]
    Unresolved { task: usize },
    #[error("pools[{pool}].backend.model: its shape was not resolved")]
    UnresolvedModel { pool: usize },
    #[error("env pool {name:?}: {why}")]
    EnvPool { name: String, why: String },
}

/// Derives the whole wiring of a job from its (validated) spec and its resolved outside
/// inputs ([`crate::resolve::resolve`]).
pub fn plan(spec: &JobSpec, inputs: &Resolved) -> Result<JobPlan, WiringError> {
    let knobs = spec.knobs();
    let mut pools = pools::plan(spec, &knobs, inputs)?;
    let tasks = tasks::plan(spec, &knobs, &inputs.tasks)?;
    let functions = spec
        .reward
        .functions
        .iter()
        .map(|(name, f)| Ok((name.clone(), function(spec, &knobs, name, f)?)))
        .collect::<Result<_, WiringError>>()?;
    known_functions(spec, &tasks)?;
    let trainer = trainer::plan(spec, &pools)?;
    // A trainer sharing its host's cores: the simulated engines charge their compute to it.
    if let TrainerPlan::Sim { trainer: t, .. } = &trainer
        && let Some(host) = &t.host
    {
        for p in &mut pools {
            if let EnginePlan::Sim { config, .. } = &mut p.engine {
                config.host = Some(host.clone());
            }
        }
    }
    let eval = match &spec.eval {
        None => None,
        Some(e) => {
            // Held-out tasks are planned as tasks of their own job (same pools, functions).
            let mut held_out = spec.clone();
            held_out.tasks = e.tasks.clone();
            let tasks = tasks::plan(&held_out, &knobs, &inputs.eval_tasks)?;
            known_functions(spec, &tasks)?;
            Some(EvalPlan {
                every: e.every,
                at_start: e.at_start,
                n: e.n,
                temperature: e.temperature as f32,
                max_tokens: e.max_tokens,
                concurrency: e.concurrency,
                tasks,
            })
        }
    };
    Ok(JobPlan {
        knobs,
        seed: spec.seed,
        pools,
        tasks,
        functions,
        trainer,
        eval,
    })
}

/// The trainer's part of the plan alone (it needs the pools' models, not the tasks'
/// inputs): `inputs` from [`crate::resolve::resolve_models`] suffice.
pub fn plan_trainer(spec: &JobSpec, inputs: &Resolved) -> Result<TrainerPlan, WiringError> {
    let pools = pools::plan(spec, &spec.knobs(), inputs)?;
    trainer::plan(spec, &pools)
}

/// Every reward function the tasks name is one of `reward.functions` (or the environment's).
fn known_functions(spec: &JobSpec, tasks: &[TaskPlan]) -> Result<(), WiringError> {
    for (ti, t) in tasks.iter().enumerate() {
        for s in &t.scorers {
            if let ScorerPlan::Function(name) = s
                && !spec.reward.functions.contains_key(name)
            {
                return Err(WiringError::UnknownFunction {
                    task: ti,
                    name: name.clone(),
                });
            }
        }
    }
    Ok(())
}

fn function(
    spec: &JobSpec,
    knobs: &Knobs,
    name: &str,
    f: &FunctionSpec,
) -> Result<FunctionPlan, WiringError> {
    use crate::spec::RewardPlacement;
    let FunctionSpec::Sim {
        latency_s,
        cold_start_s,
        concurrency,
        scale_to_zero_after_s,
        scaling,
        gpu,
    } = f
    else {
        return Ok(FunctionPlan::Hub(f.clone()));
    };
    let latency = latency_s.clone().unwrap_or_default();
    let seed = spec.seed
        ^ name
            .bytes()
            .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
    let cold_start = Duration::from_secs_f64(*cold_start_s);
    if let Some(g) = gpu {
        let at = |k: &str| format!("reward.functions.{name}.gpu.{k}");
        let base = device(spec, at("device"), &g.device)?;
        let service = actors::reward::GpuService {
            device: base.group(g.gpus_per_instance, 0.9),
            model: model(spec, at("model"), &g.model)?,
            efficiency: actors::device::Efficiency::default(),
            gpus: g.gpus_per_instance,
            max_batch: g.max_batch,
            verdict_tokens: g.verdict_tokens,
            final_answer_only: g.reads == crate::spec::JudgeReads::FinalAnswer,
        };
        let scaling = match knobs.placement {
            RewardPlacement::Serverless => {
                let mut s = scaling.clone().unwrap_or_default();
                if s.container_concurrency == 0 {
                    // An instance takes what one batch holds.
                    s.container_concurrency = g.max_batch;
                }
                s
            }
            // Dedicated: `instances` always on, each taking a batch's worth of calls.
            RewardPlacement::Local => infra::faas::Scaling {
                container_concurrency: g.max_batch,
                initial_scale: g.instances,
                min_scale: g.instances,
                max_scale: g.instances,
                ..Default::default()
            },
        };
        return Ok(FunctionPlan::SimScaled {
            latency,
            cold_start,
            scaling,
            seed,
            gpu: Some(service),
        });
    }
    Ok(match (knobs.placement, scaling) {
        (RewardPlacement::Serverless, Some(scaling)) => FunctionPlan::SimScaled {
            latency,
            cold_start,
            scaling: scaling.clone(),
            seed,
            gpu: None,
        },
        (RewardPlacement::Serverless, None) => FunctionPlan::SimSlots {
            latency,
            cold_start,
            concurrency: *concurrency,
            scale_to_zero_after: Some(Duration::from_secs_f64(*scale_to_zero_after_s)),
            seed,
        },
        (RewardPlacement::Local, _) => FunctionPlan::SimSlots {
            latency,
            cold_start: Duration::ZERO,
            concurrency: *concurrency,
            scale_to_zero_after: None,
            seed,
        },
    })
}

/// A device class of the spec (`sim.devices` or the catalogue), or an error naming `field`.
fn device(spec: &JobSpec, field: String, name: &str) -> Result<DeviceProfile, WiringError> {
    spec.device_profile(name)
        .ok_or_else(|| WiringError::UnknownDevice {
            field,
            name: name.to_string(),
        })
}

/// A model profile of the spec (`sim.models` or the catalogue), or an error naming `field`.
fn model(spec: &JobSpec, field: String, name: &str) -> Result<ModelProfile, WiringError> {
    spec.model_profile(name)
        .ok_or_else(|| WiringError::UnknownModel {
            field,
            name: name.to_string(),
        })
}
