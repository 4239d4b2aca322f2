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
}

/// One configuration the planner simulated.
#[derive(Clone, Debug, Serialize)]
pub struct Candidate {
    pub trainer_gpus: u32,
    /// GPUs per rollout device class.
    pub rollout_gpus: BTreeMap<String, u32>,
    pub cost: f64,
    pub step_s: f64,
    pub trainer_busy: f64,
    pub pool_utilisation: BTreeMap<String, f64>,
}

/// The search's outcome.
#[derive(Debug, Serialize)]
pub struct Plan {
    pub budget: f64,
    pub best: Candidate,
    pub candidates: Vec<Candidate>,
}

struct Space {
    devices: Vec<(String, u32, f64)>,
    trainer_device: String,
    trainer_cost: f64,
    steps: u64,
    fractions: Vec<f64>,
}

fn space(sc: &Scenario, base: &JobSpec) -> Result<Space, PlanError> {
    let t: PlanTable = match &sc.plan {
        Some(v) => serde_json::from_value(v.clone()).map_err(PlanError::Table)?,
        None => PlanTable::default(),
    };
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

fn simulate(
    base: &Value,
    sp: &Space,
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
    let warmup = (sp.steps / 3).max(1);
    let s = job::simrun::run_virtual(spec).ok()?;
    let rollout_gpus: BTreeMap<String, u32> = shards
        .iter()
        .filter(|s| s.1 > 0)
        .map(|&(i, n)| (sp.devices[i].0.clone(), n * sp.devices[i].1))
        .collect();
    let cost = trainer_gpus as f64 * sp.trainer_cost
        + shards
            .iter()
            .map(|&(i, n)| n as f64 * sp.devices[i].1 as f64 * sp.devices[i].2)
            .sum::<f64>();
    Some(Candidate {
        trainer_gpus,
        rollout_gpus,
        cost,
        step_s: Metric::StepS.of(&s, warmup),
        trainer_busy: Metric::TrainerBusy.of(&s, warmup),
        pool_utilisation: s
            .pools
            .iter()
            .map(|(k, p)| (k.clone(), p.utilisation))
            .collect(),
    })
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

/// Searches trainer size × rollout mix under `budget` (cost units, H20 = 1).
pub fn plan(
    sc: &Scenario,
    budget: f64,
    mut progress: impl FnMut(&Candidate),
) -> Result<Plan, PlanError> {
    let base_spec = sc
        .runs
        .first()
        .map(|r| r.spec.clone())
        .ok_or(PlanError::NoRun)?;
    let sp = space(sc, &base_spec)?;
    let base = &sc.base;
    let round8 = |g: f64| ((g / 8.0).round() as u32 * 8).max(8);
    let mut tried: Vec<(u32, Vec<u64>)> = Vec::new();
    let mut candidates: Vec<Candidate> = Vec::new();
    let mut run_batch = |jobs: Vec<(u32, Vec<f64>)>, candidates: &mut Vec<Candidate>| {
        let jobs: Vec<(u32, Vec<f64>)> = jobs
            .into_iter()
            .filter(|(t, s)| {
                let key = (
                    *t,
                    s.iter()
                        .map(|x| (x * 1000.0).round() as u64)
                        .collect::<Vec<_>>(),
                );
                if tried.contains(&key) {
                    false
                } else {
                    tried.push(key);
                    true
                }
            })
            .collect();
        // Two candidates at a time (two cores); each simulation has its own runtime.
        for chunk in jobs.chunks(2) {
            let found: Vec<Option<Candidate>> = std::thread::scope(|s| {
                let hs: Vec<_> = chunk
                    .iter()
                    .map(|(t, sh)| s.spawn(|| simulate(base, &sp, *t, sh, budget)))
                    .collect();
                hs.into_iter().map(|h| h.join().ok().flatten()).collect()
            });
            for c in found.into_iter().flatten() {
                progress(&c);
                candidates.push(c);
            }
        }
    };
    // Coarse grid.
    let mut jobs = Vec::new();
    for f in &sp.fractions {
        for sh in shares_grid(sp.devices.len(), 0.25) {
            jobs.push((round8(f * budget / sp.trainer_cost), sh));
        }
    }
    run_batch(jobs, &mut candidates);
    let best = candidates
        .iter()
        .min_by(|a, b| a.step_s.total_cmp(&b.step_s))
        .cloned()
        .ok_or(PlanError::NoCandidate(budget))?;
    let jobs = refine_jobs(&sp, &best);
    run_batch(jobs, &mut candidates);
    candidates.sort_by(|a, b| a.step_s.total_cmp(&b.step_s));
    // Shares that round to the same GPU counts are the same configuration.
    let mut seen = std::collections::BTreeSet::new();
    candidates.retain(|c| seen.insert((c.trainer_gpus, c.rollout_gpus.clone())));
    let best = candidates
        .first()
        .cloned()
        .ok_or(PlanError::NoCandidate(budget))?;
    Ok(Plan {
        budget,
        best,
        candidates,
    })
}

/// The planner's report, as printed.
pub fn render(p: &Plan) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "{} candidates under a budget of {:.0} (H20 = 1), fastest first:\n",
        p.candidates.len(),
        p.budget
    ));
    out.push_str(&format!(
        "  {:>8} {:<28} {:>8} {:>9} {:>8}  pool utilisation\n",
        "trainer", "rollout GPUs", "cost", "step s", "trainer"
    ));
    for c in p.candidates.iter().take(12) {
        let roll: Vec<String> = c
            .rollout_gpus
            .iter()
            .map(|(d, g)| format!("{g} {d}"))
            .collect();
        let util: Vec<String> = c
            .pool_utilisation
            .iter()
            .map(|(k, u)| format!("{k} {:.0}%", u * 100.0))
            .collect();
        out.push_str(&format!(
            "  {:>8} {:<28} {:>8.0} {:>9.1} {:>7.0}%  {}\n",
            c.trainer_gpus,
            roll.join(" + "),
            c.cost,
            c.step_s,
            c.trainer_busy * 100.0,
            util.join(", ")
        ));
    }
    let b = &p.best;
    let roll: Vec<String> = b
        .rollout_gpus
        .iter()
        .map(|(d, g)| format!("{g} × {d}"))
        .collect();
    out.push_str(&format!(
        "recommended: trainer {} GPUs, rollout {} (cost {:.0}): predicted step {:.1} s; the trainer trains {:.0}% of each step{}\n",
        b.trainer_gpus,
        roll.join(" + "),
        b.cost,
        b.step_s,
        b.trainer_busy * 100.0,
        if b.trainer_busy < 0.5 { " (it waits for data the rest: generation bounds the step)" } else { "" }
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_planner_finds_a_balanced_split_within_budget() {
        let body = r#"
[scenario]
name = "p"
title = "t"
figure = "f"
[base]
seed = 2
[[base.tasks]]
domain = "agent"
group_size = 4
max_turns = 4
max_tokens_per_turn = 512
env = { kind = "sim", turns = { constant = 3 }, prompt_tokens = { constant = 2000 }, observation_tokens = { constant = 500 }, response_tokens = { constant = 300 }, step_latency_s = { constant = 1.0 } }
[[base.pools]]
name = "h800"
device = "H800"
count = 8
backend = { kind = "sim", model = "qwen3-8b" }
[base.rollout]
batch_size = 16
steps = 6
[base.trainer]
kind = "sim"
device = "H800"
gpus = 8
[plan]
devices = ["H800", "H20"]
steps = 5
trainer_fractions = [0.1, 0.3, 0.6]
"#;
        let sc = Scenario::parse("p.toml", body).unwrap();
        let p = plan(&sc, 120.0, |_| {}).unwrap();
        assert!(p.candidates.len() >= 9, "{}", p.candidates.len());
        assert!(
            p.candidates.iter().all(|c| c.cost <= 120.0 + 1e-9),
            "every candidate fits the budget"
        );
        // Fastest first, and the recommendation is the fastest.
        assert!(p.candidates.windows(2).all(|w| w[0].step_s <= w[1].step_s));
        assert_eq!(p.best.step_s, p.candidates[0].step_s);
        // The extremes lose: almost everything in training starves generation.
        let starved = p
            .candidates
            .iter()
            .filter(|c| c.trainer_gpus >= 24)
            .map(|c| c.step_s)
            .fold(f64::INFINITY, f64::min);
        assert!(
            p.best.step_s < starved,
            "best {} vs trainer-heavy {starved}",
            p.best.step_s
        );
        assert!(render(&p).contains("recommended: trainer"));
    }

    #[test]
    fn a_bad_plan_table_is_a_typed_error_naming_the_field() {
        let scenario = |plan: &str| {
            let body = format!(
                r#"
[scenario]
name = "p"
title = "t"
figure = "f"
[base]
seed = 2
[[base.tasks]]
domain = "agent"
group_size = 2
max_turns = 2
max_tokens_per_turn = 16
env = {{ kind = "sim", turns = {{ constant = 1 }} }}
[[base.pools]]
name = "h800"
device = "H800"
backend = {{ kind = "sim", model = "qwen3-8b" }}
[base.rollout]
batch_size = 2
steps = 3
[plan]
{plan}
"#
            );
            Scenario::parse("p.toml", &body).unwrap()
        };
        let e = plan(&scenario("devices = [\"H999\"]"), 100.0, |_| {}).unwrap_err();
        assert!(
            matches!(&e, PlanError::UnknownDevice(d) if d == "H999"),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "[plan].devices: unknown device class \"H999\""
        );
        let e = plan(&scenario("trainer_fractions = [0.5, 1.5]"), 100.0, |_| {}).unwrap_err();
        assert!(matches!(e, PlanError::Fractions), "{e:?}");
        let e = plan(&scenario("gpus = 3"), 100.0, |_| {}).unwrap_err();
        assert!(matches!(e, PlanError::Table(_)), "{e:?}");
    }
}
