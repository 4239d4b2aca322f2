//! `rollarc plan SCENARIO --budget COST`: the capacity planner. It searches the trainer's
//! size and the rollout hardware mix under a cost budget by simulating each candidate (the
//! scenario's base job, the real scheduler on the virtual clock, cost-model mapping) and
//! recommends the fastest, with its predicted step time and the utilisation of every pool and
//! of the trainer. A split that leaves the trainer waiting for data (or generation waiting for
//! the trainer) shows up before any GPU is bought.
//!
//! The search space comes from the scenario's optional `[plan]` table:
//! `devices` (rollout device classes to mix; default: the base pools'), `trainer_device`,
//! `gpus_per_shard` (per device class; default: the base pools'), `steps` (simulated per
//! candidate, default 6), `trainer_fractions` (shares of the budget tried for training).
//! Without a budget the spec's GPUs stay as they are (a `rollarc profile` of a real run).
//!
//! A second stage ([`resources`]) then searches, from the best GPU configuration and one
//! dimension at a time, what else a job needs: `alpha` (values of α), `env_slots` (multiples
//! of every task's environment slots), `env_cores` (cores of the tasks' simulated sandbox
//! machines), `env_warm` (sandboxes they keep started ahead) and `reward_replicas` (per
//! function), by cost per step under `prices` (per hour,
//! H20 GPU-hours: device classes, `core`, `replica.FUNCTION`; defaults: the catalogue and
//! [`resources::DEFAULT_CORE_PRICE`]). Every candidate is ranked by cost per step, with its
//! predicted step time and bottleneck; the best one's spec is the recommendation.

mod report;
mod rescale;
mod resources;

pub use report::{recommended_spec, render};
use rescale::Rescale;
pub use resources::{DEFAULT_CORE_PRICE, Prices, Resources, bottleneck};

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::scenario::{BuildSpecError, Metric, Scenario, build_spec};
use job::spec::{BackendSpec, JobSpec, TrainerSpec};

/// Why the planner could not search.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("[plan]")]
    Table(#[source] serde_json::Error),
    #[error("[plan].devices: unknown device class {0:?}")]
    UnknownDevice(String),
    #[error("[plan].trainer_device: unknown device class {0:?}")]
    UnknownTrainerDevice(String),
    #[error("[plan].trainer_fractions: every share must be in (0, 1)")]
    Fractions,
    #[error("the scenario has no run")]
    NoRun,
    #[error("no candidate fits the budget {0}")]
    NoCandidate(f64),
    #[error("[plan].rescale: the rescaled spec is not valid: {0}")]
    Rescale(String),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanTable {
    #[serde(default)]
    devices: Vec<String>,
    #[serde(default)]
    trainer_device: Option<String>,
    #[serde(default)]
    gpus_per_shard: BTreeMap<String, u32>,
    #[serde(default)]
    steps: Option<u64>,
    #[serde(default)]
    trainer_fractions: Vec<f64>,
    #[serde(default)]
    alpha: Vec<u64>,
    #[serde(default)]
    env_slots: Vec<f64>,
    #[serde(default)]
    env_cores: Vec<u32>,
    #[serde(default)]
    env_warm: Vec<u32>,
    #[serde(default)]
    reward_replicas: BTreeMap<String, Vec<u32>>,
    #[serde(default)]
    prices: BTreeMap<String, Value>,
    #[serde(default)]
    rescale: Option<Rescale>,
}

/// One configuration the planner simulated.
#[derive(Clone, Debug, Serialize)]
pub struct Candidate {
    pub trainer_gpus: u32,
    /// GPUs per rollout device class.
    pub rollout_gpus: BTreeMap<String, u32>,
    /// The GPUs' cost (the budget's units).
    pub cost: f64,
    pub step_s: f64,
    pub trainer_busy: f64,
    pub pool_utilisation: BTreeMap<String, f64>,
    /// What the second stage set besides the GPUs.
    pub resources: Resources,
    /// Everything's price an hour (GPUs, sandbox cores, reward replicas), and per step.
    pub hourly: f64,
    pub cost_per_step: f64,
    /// Where its steps wait: `trainer`, `generation`, `environments`, `reward`, `waits`.
    pub bottleneck: String,
    /// The candidate's job spec.
    #[serde(skip)]
    pub spec: Value,
}

/// The search's outcome.
#[derive(Debug, Serialize)]
pub struct Plan {
    /// The GPU budget searched under (none: the spec's GPUs as they are).
    pub budget: Option<f64>,
    pub best: Candidate,
    pub candidates: Vec<Candidate>,
}

struct Space {
    devices: Vec<(String, u32, f64)>,
    trainer_device: String,
    trainer_cost: f64,
    steps: u64,
    fractions: Vec<f64>,
    dims: resources::Dimensions,
    prices: BTreeMap<String, Value>,
}

fn table(sc: &Scenario) -> Result<PlanTable, PlanError> {
    match &sc.plan {
        Some(v) => serde_json::from_value(v.clone()).map_err(PlanError::Table),
        None => Ok(PlanTable::default()),
    }
}

/// The scenario's base (JSON and parsed), rescaled when the table asks.
fn base_of(sc: &Scenario, t: &PlanTable) -> Result<(Value, JobSpec), PlanError> {
    let first = sc
        .runs
        .first()
        .map(|r| r.spec.clone())
        .ok_or(PlanError::NoRun)?;
    let Some(r) = &t.rescale else {
        return Ok((sc.base.clone(), first));
    };
    let mut v = sc.base.clone();
    r.apply(&mut v);
    let spec = job::spec::from_value(v.clone()).map_err(|e| PlanError::Rescale(e.to_string()))?;
    Ok((v, spec))
}

fn space(t: PlanTable, base: &JobSpec) -> Result<Space, PlanError> {
    let mut names = t.devices.clone();
    if names.is_empty() {
        for p in &base.pools {
            if !names.contains(&p.device) {
                names.push(p.device.clone());
            }
        }
    }
    let mut devices = Vec::new();
    for n in names {
        let d = base
            .device_profile(&n)
            .ok_or_else(|| PlanError::UnknownDevice(n.clone()))?;
        let gps = t.gpus_per_shard.get(&n).copied().or_else(|| {
            base.pools
                .iter()
                .find(|p| p.device == n)
                .and_then(|p| match &p.backend {
                    BackendSpec::Sim { gpus_per_shard, .. } => Some(*gpus_per_shard),
                    BackendSpec::Builtin { .. }
                    | BackendSpec::Llamacpp(_)
                    | BackendSpec::Sglang(_)
                    | BackendSpec::Vllm(_) => None,
                })
        });
        devices.push((n, gps.unwrap_or(1).max(1), d.cost));
    }
    let trainer_device = t.trainer_device.clone().or_else(|| match &base.trainer {
        TrainerSpec::Sim { device, .. } => device.clone(),
        TrainerSpec::Builtin(_) | TrainerSpec::External(_) => None,
    });
    let trainer_device = trainer_device.unwrap_or_else(|| "H800".into());
    let trainer_cost = base
        .device_profile(&trainer_device)
        .ok_or_else(|| PlanError::UnknownTrainerDevice(trainer_device.clone()))?
        .cost;
    let fractions = if t.trainer_fractions.is_empty() {
        vec![0.08, 0.12, 0.17, 0.25, 0.33, 0.45]
    } else {
        t.trainer_fractions.clone()
    };
    if fractions.iter().any(|f| !(*f > 0.0 && *f < 1.0)) {
        return Err(PlanError::Fractions);
    }
    Ok(Space {
        devices,
        trainer_device,
        trainer_cost,
        steps: t.steps.unwrap_or(6).max(3),
        fractions,
        dims: resources::Dimensions {
            alpha: t.alpha,
            env_slots: t.env_slots,
            env_cores: t.env_cores,
            env_warm: t.env_warm,
            reward_replicas: t.reward_replicas,
        },
        prices: t.prices,
    })
}

/// The base spec with this candidate's trainer and pools (cost-model mapping).
fn candidate_spec(
    base: &Value,
    sp: &Space,
    trainer_gpus: u32,
    shards: &[(usize, u32)],
) -> Result<JobSpec, BuildSpecError> {
    let mut set = BTreeMap::new();
    let mut pools = Vec::new();
    // Every pool runs like the base's first pool (model, batch, efficiencies).
    let template = base
        .pointer("/pools/0/backend")
        .cloned()
        .filter(Value::is_object)
        .unwrap_or_else(|| serde_json::json!({ "kind": "sim" }));
    for &(di, n) in shards {
        if n == 0 {
            continue;
        }
        let (name, gps, _) = &sp.devices[di];
        let mut backend = template.clone();
        backend["gpus_per_shard"] = Value::from(*gps);
        if let Some(o) = backend.as_object_mut() {
            o.remove("hang_probability");
        }
        pools.push(serde_json::json!({ "name": name.to_ascii_lowercase(), "device": name, "count": n, "backend": backend }));
    }
    set.insert("pools".to_string(), Value::Array(pools));
    set.insert(
        "mapping".to_string(),
        serde_json::json!({ "mode": "cost_model" }),
    );
    set.insert("trainer.gpus".to_string(), Value::from(trainer_gpus));
    set.insert(
        "trainer.device".to_string(),
        Value::String(sp.trainer_device.clone()),
    );
    set.insert("rollout.steps".to_string(), Value::from(sp.steps));
    set.insert("sim.faults".to_string(), Value::Array(Vec::new()));
    build_spec(base, &set)
}

/// `spec` as the planner simulates it: `steps` steps, no injected faults.
fn prepared(spec: &Value, steps: u64) -> Value {
    let mut v = spec.clone();
    v["rollout"]["steps"] = Value::from(steps);
    v["sim"]["faults"] = Value::Array(Vec::new());
    v
}

/// Simulates `spec` (JSON) and measures it.
fn measure(spec: Value, sp: &Space, prices: &Prices, resources: Resources) -> Option<Candidate> {
    let job = job::spec::from_value(spec).ok()?;
    // Defaults written out: a resource set to its default is the same configuration.
    let spec = serde_json::to_value(&job).ok()?;
    let warmup = (sp.steps / 3).max(1);
    let hourly = prices.hourly(&job);
    let trainer_gpus = match &job.trainer {
        TrainerSpec::Sim { gpus, .. } => *gpus,
        TrainerSpec::Builtin(_) | TrainerSpec::External(_) => 0,
    };
    let mut rollout_gpus: BTreeMap<String, u32> = BTreeMap::new();
    for p in &job.pools {
        let per = match &p.backend {
            BackendSpec::Sim { gpus_per_shard, .. } => *gpus_per_shard,
            _ => 1,
        };
        *rollout_gpus.entry(p.device.clone()).or_default() += p.count as u32 * per;
    }
    let cost = f64::from(trainer_gpus) * sp.trainer_cost
        + rollout_gpus
            .iter()
            .map(|(d, g)| {
                f64::from(*g)
                    * sp.devices
                        .iter()
                        .find(|x| &x.0 == d)
                        .map_or_else(|| job.device_profile(d).map_or(1.0, |p| p.cost), |x| x.2)
            })
            .sum::<f64>();
    let s = job::simrun::run_virtual(job).ok()?;
    let step_s = Metric::StepS.of(&s, warmup);
    Some(Candidate {
        trainer_gpus,
        rollout_gpus,
        cost,
        step_s,
        trainer_busy: Metric::TrainerBusy.of(&s, warmup),
        pool_utilisation: s
            .pools
            .iter()
            .map(|(k, p)| (k.clone(), p.utilisation))
            .collect(),
        resources,
        hourly,
        cost_per_step: hourly * step_s / 3600.0,
        bottleneck: bottleneck(&s, warmup),
        spec,
    })
}

/// Runs `f` on every job, two at a time (two cores; each simulation has its own runtime).
fn two_at_a_time<T: Sync>(
    jobs: &[T],
    f: impl Fn(&T) -> Option<Candidate> + Sync,
    progress: &mut impl FnMut(&Candidate),
) -> Vec<Candidate> {
    let mut out = Vec::new();
    for chunk in jobs.chunks(2) {
        let found: Vec<Option<Candidate>> = std::thread::scope(|s| {
            let hs: Vec<_> = chunk.iter().map(|j| s.spawn(|| f(j))).collect();
            hs.into_iter().map(|h| h.join().ok().flatten()).collect()
        });
        for c in found.into_iter().flatten() {
            progress(&c);
            out.push(c);
        }
    }
    out
}

/// The GPU candidate with `trainer_gpus` and the rollout budget split by `shares`.
fn simulate(
    base: &Value,
    sp: &Space,
    prices: &Prices,
    trainer_gpus: u32,
    shares: &[f64],
    budget: f64,
) -> Option<Candidate> {
    let rollout_budget = budget - trainer_gpus as f64 * sp.trainer_cost;
    if rollout_budget <= 0.0 {
        return None;
    }
    let shards: Vec<(usize, u32)> = shares
        .iter()
        .enumerate()
        .map(|(i, s)| {
            (
                i,
                (s * rollout_budget / (sp.devices[i].2 * sp.devices[i].1 as f64)).floor() as u32,
            )
        })
        .collect();
    if shards.iter().all(|s| s.1 == 0) {
        return None;
    }
    let spec = candidate_spec(base, sp, trainer_gpus, &shards).ok()?;
    measure(
        serde_json::to_value(&spec).ok()?,
        sp,
        prices,
        Resources::default(),
    )
}

fn shares_grid(n: usize, step: f64) -> Vec<Vec<f64>> {
    match n {
        0 => vec![],
        1 => vec![vec![1.0]],
        2 => {
            let k = (1.0 / step).round() as usize;
            (0..=k)
                .map(|i| vec![i as f64 * step, 1.0 - i as f64 * step])
                .collect()
        }
        // More classes: all in equal shares, or all in one.
        _ => {
            let mut v = vec![vec![1.0 / n as f64; n]];
            for i in 0..n {
                let mut e = vec![0.0; n];
                e[i] = 1.0;
                v.push(e);
            }
            v
        }
    }
}

/// Candidates around the best of the coarse grid: neighbouring trainer sizes and finer mixes.
fn refine_jobs(sp: &Space, best: &Candidate) -> Vec<(u32, Vec<f64>)> {
    let rollout_cost: f64 = best
        .rollout_gpus
        .iter()
        .map(|(d, g)| *g as f64 * sp.devices.iter().find(|x| &x.0 == d).map_or(1.0, |x| x.2))
        .sum();
    let share0 = sp.devices.first().map_or(1.0, |d| {
        best.rollout_gpus.get(&d.0).copied().unwrap_or(0) as f64 * d.2 / rollout_cost.max(1e-9)
    });
    let mut jobs = Vec::new();
    for dt in [-16i64, -8, 0, 8, 16] {
        let t = (best.trainer_gpus as i64 + dt).max(8) as u32;
        if sp.devices.len() == 2 {
            for ds in [-0.125, 0.0, 0.125] {
                let s0 = (share0 + ds).clamp(0.0, 1.0);
                jobs.push((t, vec![s0, 1.0 - s0]));
            }
        } else {
            let mut sh = vec![0.0; sp.devices.len()];
            for (i, d) in sp.devices.iter().enumerate() {
                sh[i] = best.rollout_gpus.get(&d.0).copied().unwrap_or(0) as f64 * d.2
                    / rollout_cost.max(1e-9);
            }
            jobs.push((t, sh));
        }
    }
    jobs
}

/// The GPU stage: trainer size × rollout mix under `budget` (a coarse grid, then refined
/// around its fastest), or the spec's own GPUs without a budget.
fn gpu_stage(
    base: &Value,
    sp: &Space,
    prices: &Prices,
    budget: Option<f64>,
    progress: &mut impl FnMut(&Candidate),
) -> Result<Vec<Candidate>, PlanError> {
    let Some(budget) = budget else {
        let c = measure(prepared(base, sp.steps), sp, prices, Resources::default());
        return Ok(c.into_iter().inspect(|c| progress(c)).collect());
    };
    let round8 = |g: f64| ((g / 8.0).round() as u32 * 8).max(8);
    let mut tried: Vec<(u32, Vec<u64>)> = Vec::new();
    let mut fresh = |jobs: Vec<(u32, Vec<f64>)>| -> Vec<(u32, Vec<f64>)> {
        jobs.into_iter()
            .filter(|(t, s)| {
                let key = (*t, s.iter().map(|x| (x * 1000.0).round() as u64).collect());
                !tried.contains(&key) && {
                    tried.push(key);
                    true
                }
            })
            .collect()
    };
    let run = |(t, sh): &(u32, Vec<f64>)| simulate(base, sp, prices, *t, sh, budget);
    let mut jobs = Vec::new();
    for f in &sp.fractions {
        for sh in shares_grid(sp.devices.len(), 0.25) {
            jobs.push((round8(f * budget / sp.trainer_cost), sh));
        }
    }
    let mut candidates = two_at_a_time(&fresh(jobs), run, progress);
    let best = candidates
        .iter()
        .min_by(|a, b| a.step_s.total_cmp(&b.step_s))
        .cloned()
        .ok_or(PlanError::NoCandidate(budget))?;
    let more = fresh(refine_jobs(sp, &best));
    candidates.extend(two_at_a_time(&more, run, progress));
    Ok(candidates)
}

/// Searches the GPUs (under `budget`, when given), then the other resources, and ranks every
/// candidate by cost per step.
pub fn plan(
    sc: &Scenario,
    budget: Option<f64>,
    mut progress: impl FnMut(&Candidate),
) -> Result<Plan, PlanError> {
    let t = table(sc)?;
    let (base, base_spec) = base_of(sc, &t)?;
    let sp = space(t, &base_spec)?;
    let prices = Prices::new(&base_spec, &sp.prices);
    let mut candidates = gpu_stage(&base, &sp, &prices, budget, &mut progress)?;
    let by_cost = |a: &Candidate, b: &Candidate| a.cost_per_step.total_cmp(&b.cost_per_step);
    let gpus = candidates
        .iter()
        .min_by(|a, b| by_cost(a, b))
        .cloned()
        .ok_or(PlanError::NoCandidate(budget.unwrap_or(0.0)))?;
    // One dimension at a time, each from the best so far.
    let mut cur = gpus.clone();
    let dims = sp.dims.moves(&base_spec, &cur.resources).len();
    for d in 0..dims {
        let options: Vec<Resources> = sp.dims.moves(&base_spec, &cur.resources)[d]
            .iter()
            .filter(|r| **r != cur.resources)
            .cloned()
            .collect();
        let run = |r: &Resources| {
            let mut v = gpus.spec.clone();
            r.apply(&mut v);
            measure(v, &sp, &prices, r.clone())
        };
        let found = two_at_a_time(&options, run, &mut progress);
        if let Some(b) = found.iter().min_by(|a, b| by_cost(a, b))
            && b.cost_per_step < cur.cost_per_step
        {
            cur = b.clone();
        }
        candidates.extend(found);
    }
    candidates.sort_by(by_cost);
    // Shares that round to the same GPU counts, or a resource set to the spec's own value,
    // are the same configuration: the same spec.
    let mut seen = std::collections::BTreeSet::new();
    candidates.retain(|c| seen.insert(c.spec.to_string()));
    let best = candidates
        .first()
        .cloned()
        .ok_or(PlanError::NoCandidate(budget.unwrap_or(0.0)))?;
    Ok(Plan {
        budget,
        best,
        candidates,
    })
}

#[cfg(test)]
mod tests;
