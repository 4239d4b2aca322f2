//! The planner's second stage and its accounting: what a configuration costs an hour under the
//! price table, where its steps wait (the bottleneck), and a search over the resources beside
//! the GPUs — α, environment slots and sandbox cores per task, reward replicas per function —
//! by cost per step, one dimension at a time from the best GPU configuration.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use job::runtime::JobSummary;
use job::spec::{BackendSpec, EnvSpec, FunctionSpec, JobSpec, TrainerSpec};

use crate::scenario::Metric;

/// Prices per hour (H20 GPU-hours by default): a GPU of each device class, a sandbox core, and
/// a reward replica of each function (a GPU judge's instance costs its GPUs).
#[derive(Clone, Debug, Serialize)]
pub struct Prices {
    pub gpu: BTreeMap<String, f64>,
    pub core: f64,
    /// A sandbox kept started ahead (default: a core's price; it holds its memory idle).
    pub warm: Option<f64>,
    pub replica: BTreeMap<String, f64>,
}

/// A core-hour against an H20-hour (≈ $0.02–0.04 against $1–2 rented).
pub const DEFAULT_CORE_PRICE: f64 = 0.02;

impl Prices {
    /// The catalogue's device costs, overridden by `table` (`H800 = 2.85`, `core = 0.02`,
    /// `replica.judge = 1.5`).
    pub fn new(spec: &JobSpec, table: &BTreeMap<String, Value>) -> Self {
        let mut gpu = BTreeMap::new();
        let names = spec
            .pools
            .iter()
            .map(|p| p.device.clone())
            .chain(trainer_device(spec))
            .chain(spec.sim.devices.iter().map(|d| d.name.clone()))
            .chain(["H800", "H20", "H100", "A100"].map(String::from));
        for n in names {
            if let Some(d) = spec.device_profile(&n) {
                gpu.insert(n, d.cost);
            }
        }
        let mut p = Self {
            gpu,
            core: DEFAULT_CORE_PRICE,
            warm: None,
            replica: BTreeMap::new(),
        };
        for (k, v) in table {
            match (k.as_str(), v) {
                ("core", v) => p.core = v.as_f64().unwrap_or(p.core),
                ("warm", v) => p.warm = v.as_f64(),
                ("replica", Value::Object(o)) => {
                    for (f, x) in o {
                        if let Some(x) = x.as_f64() {
                            p.replica.insert(f.clone(), x);
                        }
                    }
                }
                (name, v) => {
                    if let Some(x) = v.as_f64() {
                        p.gpu.insert(name.to_string(), x);
                    }
                }
            }
        }
        p
    }

    fn gpu(&self, device: &str) -> f64 {
        self.gpu.get(device).copied().unwrap_or(1.0)
    }

    /// What `spec` costs an hour: its trainer's and pools' GPUs, its sandboxes' cores and its
    /// reward replicas.
    pub fn hourly(&self, spec: &JobSpec) -> f64 {
        let mut h = 0.0;
        if let TrainerSpec::Sim { gpus, .. } = &spec.trainer {
            h += f64::from(*gpus) * self.gpu(&trainer_device(spec).unwrap_or_default());
        }
        for p in &spec.pools {
            let per_shard = match &p.backend {
                BackendSpec::Sim { gpus_per_shard, .. } => *gpus_per_shard,
                _ => 1,
            };
            h += (p.count as u32 * per_shard) as f64 * self.gpu(&p.device);
        }
        for t in &spec.tasks {
            if let EnvSpec::Sim {
                sandbox: Some(s), ..
            } = &t.env
            {
                h += f64::from(s.cores.unwrap_or(0)) * self.core
                    + f64::from(s.warm) * self.warm.unwrap_or(self.core);
            }
        }
        for (name, f) in &spec.reward.functions {
            if let FunctionSpec::Sim {
                gpu, concurrency, ..
            } = f
            {
                h += match (gpu, self.replica.get(name)) {
                    (_, Some(price)) => replicas(f) as f64 * price,
                    (Some(g), None) => {
                        f64::from(g.instances * g.gpus_per_instance) * self.gpu(&g.device)
                    }
                    (None, None) => *concurrency as f64 * self.core,
                };
            }
        }
        h
    }
}

fn trainer_device(spec: &JobSpec) -> Option<String> {
    match &spec.trainer {
        TrainerSpec::Sim { device, .. } => Some(device.clone().unwrap_or_else(|| "H800".into())),
        _ => None,
    }
}

/// A simulated function's replicas: a GPU judge's instances, or its concurrent slots.
fn replicas(f: &FunctionSpec) -> u32 {
    match f {
        FunctionSpec::Sim { gpu: Some(g), .. } => g.instances,
        FunctionSpec::Sim { concurrency, .. } => *concurrency as u32,
        _ => 0,
    }
}

/// Where a configuration's steps wait: `trainer` when it trains most of each step, otherwise
/// the stage the steps' critical trajectories spent most time in (`generation`,
/// `environments`, `reward`, or `waits` when they were held back: suspended for a weight
/// update, at a barrier), the most frequent over the steps after the warm-up.
pub fn bottleneck(s: &JobSummary, warmup: u64) -> String {
    if Metric::TrainerBusy.of(s, warmup) >= 0.85 {
        return "trainer".into();
    }
    let mut count: BTreeMap<&str, usize> = BTreeMap::new();
    for m in s.steps.iter().filter(|m| m.step > warmup) {
        if let Some(c) = &m.rollout.critical {
            let stage = match c.bottleneck.as_str() {
                "reset" | "env_step" => "environments",
                "reward" => "reward",
                "wait" => "waits",
                _ => "generation",
            };
            *count.entry(stage).or_default() += 1;
        }
    }
    count
        .into_iter()
        .max_by_key(|(_, n)| *n)
        .map_or_else(|| "generation".into(), |(s, _)| s.to_string())
}

/// The resources the second stage sets (unset: the spec's own).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Resources {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alpha: Option<u64>,
    /// Environment slots per task domain.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub env_slots: BTreeMap<String, usize>,
    /// Sandbox cores per task domain.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub env_cores: BTreeMap<String, u32>,
    /// Sandboxes kept started ahead per task domain.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub env_warm: BTreeMap<String, u32>,
    /// Replicas per reward function.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub reward_replicas: BTreeMap<String, u32>,
}

impl Resources {
    /// These resources set on `spec` (a job spec as JSON).
    pub fn apply(&self, spec: &mut Value) {
        if let Some(a) = self.alpha {
            spec["rollout"]["alpha"] = Value::from(a);
        }
        if let Some(tasks) = spec.get_mut("tasks").and_then(Value::as_array_mut) {
            for t in tasks {
                let domain = t["domain"].as_str().unwrap_or_default().to_string();
                if let Some(n) = self.env_slots.get(&domain) {
                    t["envs"] = Value::from(*n);
                }
                if let Some(c) = self.env_cores.get(&domain)
                    && t["env"]["sandbox"].is_object()
                {
                    t["env"]["sandbox"]["cores"] = Value::from(*c);
                }
                if let Some(w) = self.env_warm.get(&domain)
                    && t["env"]["sandbox"].is_object()
                {
                    t["env"]["sandbox"]["warm"] = Value::from(*w);
                }
            }
        }
        for (name, n) in &self.reward_replicas {
            let f = &mut spec["reward"]["functions"][name];
            if f["gpu"].is_object() {
                f["gpu"]["instances"] = Value::from(*n);
            } else if f.is_object() {
                f["concurrency"] = Value::from(*n);
            }
        }
    }

    /// A short label (`α 2, envs swe 32, cores swe 16, judge ×4`).
    pub fn label(&self) -> String {
        let mut parts = Vec::new();
        if let Some(a) = self.alpha {
            parts.push(format!("α {a}"));
        }
        for (t, n) in &self.env_slots {
            parts.push(format!("envs {t} {n}"));
        }
        for (t, n) in &self.env_cores {
            parts.push(format!("cores {t} {n}"));
        }
        for (t, n) in &self.env_warm {
            parts.push(format!("warm {t} {n}"));
        }
        for (f, n) in &self.reward_replicas {
            parts.push(format!("{f} ×{n}"));
        }
        parts.join(", ")
    }
}

/// The values the second stage tries, one dimension at a time.
pub(super) struct Dimensions {
    pub(super) alpha: Vec<u64>,
    /// Multiples of each task's environment slots.
    pub(super) env_slots: Vec<f64>,
    /// Sandbox cores (every task with a simulated sandbox machine).
    pub(super) env_cores: Vec<u32>,
    /// Sandboxes kept started ahead (every task with a simulated sandbox machine).
    pub(super) env_warm: Vec<u32>,
    pub(super) reward_replicas: BTreeMap<String, Vec<u32>>,
}

impl Dimensions {
    /// Every single-dimension change of `cur` the dimensions offer, for `spec`.
    pub(super) fn moves(&self, spec: &JobSpec, cur: &Resources) -> Vec<Vec<Resources>> {
        let mut dims = Vec::new();
        if !self.alpha.is_empty() {
            dims.push(
                self.alpha
                    .iter()
                    .map(|&a| Resources {
                        alpha: Some(a),
                        ..cur.clone()
                    })
                    .collect(),
            );
        }
        let knobs = spec.knobs();
        if !self.env_slots.is_empty() {
            dims.push(
                self.env_slots
                    .iter()
                    .map(|m| {
                        let mut r = cur.clone();
                        for t in &spec.tasks {
                            let base = t.envs.unwrap_or(knobs.max_concurrent_episodes);
                            r.env_slots.insert(
                                t.domain.clone(),
                                ((base as f64 * m).round() as usize).max(1),
                            );
                        }
                        r
                    })
                    .collect(),
            );
        }
        let sandboxed: Vec<&str> = spec
            .tasks
            .iter()
            .filter(|t| {
                matches!(
                    &t.env,
                    EnvSpec::Sim {
                        sandbox: Some(_),
                        ..
                    }
                )
            })
            .map(|t| t.domain.as_str())
            .collect();
        // One value for every sandboxed task: its cores, or its warm sandboxes.
        let per_task = |vals: &[u32], warm: bool| -> Vec<Resources> {
            vals.iter()
                .map(|&v| {
                    let mut r = cur.clone();
                    let field = if warm {
                        &mut r.env_warm
                    } else {
                        &mut r.env_cores
                    };
                    for d in &sandboxed {
                        field.insert(d.to_string(), if warm { v } else { v.max(1) });
                    }
                    r
                })
                .collect()
        };
        for (vals, warm) in [(&self.env_cores, false), (&self.env_warm, true)] {
            if !vals.is_empty() && !sandboxed.is_empty() {
                dims.push(per_task(vals, warm));
            }
        }
        for (f, vals) in &self.reward_replicas {
            dims.push(
                vals.iter()
                    .map(|&n| {
                        let mut r = cur.clone();
                        r.reward_replicas.insert(f.clone(), n.max(1));
                        r
                    })
                    .collect(),
            );
        }
        dims
    }
}
