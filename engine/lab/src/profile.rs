//! `rollarc profile`: a simulation spec derived from a finished real job's telemetry, so that
//! `rollarc sim` predicts the job at other settings (batch size, α, preset) without running it.
//!
//! What is measured, and how it becomes the simulation:
//! - **Generation**: every step record carries each pool's cumulative busy seconds, engine
//!   steps and tokens. Their per-step differences, over every pool (the pools of one job share
//!   the host), fit one engine-step cost `step_s + s_token × tokens` by least squares; each
//!   pool becomes a simulated pool with that `measured` cost, the same shard count and batch.
//! - **Training**: each step's `train_s` against the tokens of the trajectories it trained
//!   fits the simulated trainer's `step_overhead_s + seconds_per_token × tokens` (one GPU).
//!   Where training overlapped generation on the same cores, the engines' compute during the
//!   step (busy seconds / cores of this machine) is taken out first; the simulated trainer
//!   (`host_cores`) adds it back from whatever its simulated engines compute, so a setting
//!   without overlap (`sync`) trains faster, as the real one does.
//! - **Environments**: per task, the stored trajectories give quantile tables of turns,
//!   prompt, observation and answer lengths, reset and per-turn step latency, and the success
//!   rate: a simulated environment with those distributions.
//! - **Reward**: each function a task names becomes a simulated one whose latency is the
//!   task's measured reward time.
//!
//! The rest of the spec (tasks' weights and groups, mapping, rollout knobs, preset) is kept,
//! so a setting is changed on the profiled spec exactly as on the real one.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::{Value, json};

use job::spec::{BackendSpec, JobSpec};
use job::store::{Store, StoreError, TrainedFilter};

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("no job {0:?} in this store")]
    NoJob(String),
    #[error("job {job:?} has {steps} recorded step(s); a profile needs at least 3")]
    TooFewSteps { job: String, steps: usize },
    #[error("job {job:?} has no stored trajectories of task {task:?}")]
    NoTrajectories { job: String, task: String },
    #[error("the job's store")]
    Store(#[from] StoreError),
    #[error("the profiled spec is not valid: {0}")]
    Invalid(String),
}

/// What was fitted, besides the spec.
#[derive(Clone, Debug, Serialize)]
pub struct ProfileFit {
    /// Seconds per engine step and per token, over all pools.
    pub engine_step_s: f64,
    pub engine_s_per_token: f64,
    /// Relative error of that fit on the busy seconds of the steps it was fitted on.
    pub engine_fit_error: f64,
    /// Training's own cost, without the cores generation took beside it.
    pub train_overhead_s: f64,
    pub train_s_per_token: f64,
    pub train_fit_error: f64,
    /// Cores the trainer and the engines shared (this machine's).
    pub host_cores: u32,
    /// Trajectories read, per task.
    pub trajectories: BTreeMap<String, usize>,
    pub steps: usize,
}

/// Fits `y ≈ a·x1 + b·x2` with a, b ≥ 0 (least squares; one term alone when the pair would
/// need a negative coefficient). Returns (a, b, relative absolute error).
fn fit_nonneg(rows: &[(f64, f64, f64)]) -> (f64, f64, f64) {
    let (mut s11, mut s12, mut s22, mut s1y, mut s2y) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(x1, x2, y) in rows {
        s11 += x1 * x1;
        s12 += x1 * x2;
        s22 += x2 * x2;
        s1y += x1 * y;
        s2y += x2 * y;
    }
    let det = s11 * s22 - s12 * s12;
    let (mut a, mut b) = if det.abs() > 1e-12 * (s11 * s22).max(1e-300) {
        ((s1y * s22 - s2y * s12) / det, (s2y * s11 - s1y * s12) / det)
    } else {
        (-1.0, -1.0)
    };
    if a < 0.0 || b < 0.0 {
        // One term alone: the one that fits better.
        let one = |sxx: f64, sxy: f64| if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 };
        let (a1, b2) = (one(s11, s1y), one(s22, s2y));
        let err = |a: f64, b: f64| {
            rows.iter()
                .map(|r| (a * r.0 + b * r.1 - r.2).abs())
                .sum::<f64>()
        };
        (a, b) = if err(a1, 0.0) <= err(0.0, b2) {
            (a1, 0.0)
        } else {
            (0.0, b2)
        };
    }
    let total: f64 = rows.iter().map(|r| r.2.abs()).sum();
    let err: f64 = rows.iter().map(|r| (a * r.0 + b * r.1 - r.2).abs()).sum();
    (a, b, if total > 0.0 { err / total } else { 0.0 })
}

/// A quantile table of `xs` (empty: constant 0), as the spec writes distributions.
fn quantiles(mut xs: Vec<f64>) -> Value {
    xs.retain(|x| x.is_finite());
    if xs.is_empty() {
        return json!({ "constant": 0.0 });
    }
    xs.sort_by(f64::total_cmp);
    if xs[0] == xs[xs.len() - 1] {
        return json!({ "constant": xs[0] });
    }
    let at = |p: f64| xs[((xs.len() - 1) as f64 * p).round() as usize];
    let points: Vec<Value> = [0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0]
        .iter()
        .map(|&p| json!([p, at(p)]))
        .collect();
    json!({ "quantiles": points })
}

fn pool_counter(m: &Value, pool: &str, key: &str) -> f64 {
    m["pools"][pool][key].as_f64().unwrap_or(0.0)
}

/// Derives a simulation spec (JSON, valid) from job `job` of `store`.
pub fn profile(store: &Store, job: &str) -> Result<(Value, ProfileFit), ProfileError> {
    let spec: JobSpec = store
        .spec(job)?
        .ok_or_else(|| ProfileError::NoJob(job.to_string()))?;
    let steps = store.step_metrics(job)?;
    if steps.len() < 3 {
        return Err(ProfileError::TooFewSteps {
            job: job.to_string(),
            steps: steps.len(),
        });
    }
    let trajs = trained_trajectories(store, job)?;
    let engine = fit_engine(&spec, &steps);
    // The generation engines shared the host's cores with the trainer: while a step trained
    // beside generation (overlap), the trainer lost the engines' compute / cores. Fitted
    // without that loss; the simulated trainer takes it back from the simulated engines.
    let host_cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let (train_overhead_s, train_s_per_token, train_fit_error) =
        fit_training(&spec, &steps, &trajs, &engine.busy, host_cores);

    // The simulated spec: the real one with every part replaced by its measurement.
    let mut out = serde_json::to_value(&spec).map_err(|e| ProfileError::Invalid(e.to_string()))?;
    let obj = out.as_object_mut().expect("a spec is an object");
    obj.remove("eval");
    obj.insert(
        "name".into(),
        json!(format!("{}-profiled", spec.name.as_deref().unwrap_or(job))),
    );
    let mut per_task = BTreeMap::new();
    let mut tasks = Vec::new();
    let mut functions = serde_json::Map::new();
    for t in &spec.tasks {
        let mine: Vec<_> = trajs
            .iter()
            .map(|(_, t)| t)
            .filter(|x| x.task == t.domain)
            .collect();
        if mine.is_empty() {
            return Err(ProfileError::NoTrajectories {
                job: job.to_string(),
                task: t.domain.clone(),
            });
        }
        per_task.insert(t.domain.clone(), mine.len());
        tasks.push(simulated_task(t, &mine, &mut functions));
    }
    obj.insert("tasks".into(), Value::Array(tasks));
    let mut reward = obj.get("reward").cloned().unwrap_or_else(|| json!({}));
    reward["functions"] = Value::Object(functions);
    obj.insert("reward".into(), reward);
    obj.insert(
        "pools".into(),
        simulated_pools(&spec, engine.step_s, engine.s_per_token),
    );
    obj.insert(
        "trainer".into(),
        json!({
            "kind": "sim",
            "gpus": 1,
            "seconds_per_token": train_s_per_token,
            "step_overhead_s": train_overhead_s,
            "host_cores": host_cores as u32,
        }),
    );
    // Of the simulation section, only the device classes the pools name (no clock: every
    // part is simulated now, so the clock is virtual; no injected faults).
    obj.insert(
        "sim".into(),
        json!({ "devices": spec.sim.devices, "models": spec.sim.models }),
    );
    check_simulated(&out)?;
    Ok((
        out,
        ProfileFit {
            engine_step_s: engine.step_s,
            engine_s_per_token: engine.s_per_token,
            engine_fit_error: engine.fit_error,
            train_overhead_s,
            train_s_per_token,
            train_fit_error,
            host_cores: host_cores as u32,
            trajectories: per_task,
            steps: steps.len(),
        },
    ))
}

/// Every trained trajectory of `job`, with the step that trained it.
fn trained_trajectories(
    store: &Store,
    job: &str,
) -> Result<Vec<(Option<u64>, actors::types::Trajectory)>, ProfileError> {
    let mut trajs = Vec::new();
    let mut after = 0;
    loop {
        let page = store.trajectories(job, after, 1000, TrainedFilter::Trained, false)?;
        let Some(last) = page.last() else { break };
        after = last.cursor;
        for r in page {
            let t: actors::types::Trajectory = serde_json::from_value(r.trajectory)
                .map_err(|e| ProfileError::Invalid(format!("stored trajectory: {e}")))?;
            trajs.push((r.trained_step, t));
        }
    }
    Ok(trajs)
}

/// The engine-step cost fitted over every pool, and the engines' busy seconds per step.
struct EngineFit {
    step_s: f64,
    s_per_token: f64,
    fit_error: f64,
    /// Engine seconds computed during each step (by its index in the records).
    busy: BTreeMap<u64, f64>,
}

/// Generation: fits the engine-step cost to the per-step differences of the pools'
/// cumulative counters.
fn fit_engine(spec: &JobSpec, steps: &[Value]) -> EngineFit {
    let pools: Vec<String> = spec.pools.iter().map(|p| p.name.clone()).collect();
    let mut rows = Vec::new();
    let mut engine_busy: BTreeMap<u64, f64> = BTreeMap::new();
    // The first record against the job's start (every counter zero).
    let start = json!({});
    for (i, b) in steps.iter().enumerate() {
        let a = if i == 0 { &start } else { &steps[i - 1] };
        for p in &pools {
            let busy = |m: &Value| {
                pool_counter(m, p, "utilisation")
                    * m["elapsed_s"].as_f64().unwrap_or(0.0)
                    * pool_counter(m, p, "shards")
            };
            let d = |k: &str| pool_counter(b, p, k) - pool_counter(a, p, k);
            let tokens = d("prefill_tokens") + d("decode_tokens");
            rows.push((d("engine_steps"), tokens, busy(b) - busy(a)));
            if let Some(step) = b["step"].as_u64() {
                *engine_busy.entry(step).or_default() += busy(b) - busy(a);
            }
        }
    }
    let (step_s, s_per_token, fit_error) = fit_nonneg(&rows);
    EngineFit {
        step_s,
        s_per_token,
        fit_error,
        busy: engine_busy,
    }
}

/// Training: fits train_s against the tokens trained at each step (a record's `step` and
/// the rows' `trained_step` both count from 1), less the engines'
/// compute beside it when the job overlapped training. Returns (overhead, per token, error).
fn fit_training(
    spec: &JobSpec,
    steps: &[Value],
    trajs: &[(Option<u64>, actors::types::Trajectory)],
    engine_busy: &BTreeMap<u64, f64>,
    host_cores: f64,
) -> (f64, f64, f64) {
    let mut tokens_at: BTreeMap<u64, f64> = BTreeMap::new();
    for (trained, t) in trajs {
        if let Some(s) = trained {
            *tokens_at.entry(*s).or_default() += t
                .turns
                .iter()
                .map(|x| (x.observation_tokens.len() + x.response_tokens.len()) as f64)
                .sum::<f64>();
        }
    }
    let overlap = spec.knobs().overlap_training;
    let train_rows: Vec<(f64, f64, f64)> = steps
        .iter()
        .filter_map(|m| {
            let step = m["step"].as_u64()?;
            let tokens = *tokens_at.get(&step)?;
            let train_s = m["train_s"].as_f64()?;
            let beside = if overlap {
                let share = (train_s / m["step_s"].as_f64()?.max(1e-9)).min(1.0);
                engine_busy.get(&step).copied().unwrap_or(0.0) * share / host_cores
            } else {
                0.0
            };
            Some((1.0, tokens, (train_s - beside).max(0.0)))
        })
        .collect();
    fit_nonneg(&train_rows)
}

/// Task `t` of the profiled spec: its settings with a simulated environment drawn from its
/// trajectories `mine`; each reward function it names goes into `functions` as a simulated
/// one with the task's measured reward time.
fn simulated_task(
    t: &job::spec::TaskSpec,
    mine: &[&actors::types::Trajectory],
    functions: &mut serde_json::Map<String, Value>,
) -> Value {
    let col = |f: &dyn Fn(&actors::types::Trajectory) -> Vec<f64>| -> Vec<f64> {
        mine.iter().flat_map(|x| f(x)).collect()
    };
    let env = json!({
        "kind": "sim",
        "turns": quantiles(col(&|x| vec![x.turns.len() as f64])),
        "prompt_tokens": quantiles(col(&|x| x.turns.first().map(|u| u.observation_tokens.len() as f64).into_iter().collect())),
        "observation_tokens": quantiles(col(&|x| x.turns.iter().skip(1).map(|u| u.observation_tokens.len() as f64).collect())),
        "response_tokens": quantiles(col(&|x| x.turns.iter().map(|u| u.response_tokens.len() as f64).collect())),
        "reset_latency_s": quantiles(col(&|x| vec![x.timings.reset_s])),
        "step_latency_s": quantiles(col(&|x| vec![x.timings.env_step_s / x.turns.len().max(1) as f64])),
        "success_rate": mine.iter().filter(|x| x.success).count() as f64 / mine.len() as f64,
    });
    let reward = quantiles(col(&|x| vec![x.timings.reward_s]));
    for f in &t.reward {
        if f != "env" {
            functions.insert(
                f.clone(),
                json!({ "kind": "sim", "latency_s": reward.clone(), "concurrency": 1024 }),
            );
        }
    }
    let mut task = json!({
        "domain": t.domain,
        "weight": t.weight,
        "group_size": t.group_size,
        "redundancy": t.redundancy,
        "max_turns": t.max_turns,
        "max_tokens_per_turn": t.max_tokens_per_turn,
        "reward": t.reward,
        "context": t.context,
        "env": env,
    });
    if let Some(s) = &t.seeds {
        task["seeds"] = serde_json::to_value(s).unwrap_or(Value::Null);
    }
    if let Some(e) = t.envs {
        task["envs"] = json!(e);
    }
    task
}

/// The pools of the profiled spec: each real pool as a simulated one with the same shards
/// and batch, at the fitted engine-step cost.
fn simulated_pools(spec: &JobSpec, step_s: f64, s_per_token: f64) -> Value {
    let measured = json!({
        "step_s": step_s,
        "prefill_s_per_token": s_per_token,
        "decode_s_per_token": s_per_token,
    });
    let pools: Vec<Value> = spec
        .pools
        .iter()
        .map(|p| {
            json!({
                "name": p.name,
                "device": p.device,
                "count": p.count,
                "backend": {
                    "kind": "sim",
                    "model": "tiny",
                    "max_batch": match &p.backend {
                        BackendSpec::Sim { max_batch, .. } => max_batch.unwrap_or(256),
                        BackendSpec::Builtin { max_batch, .. } => *max_batch,
                        BackendSpec::Llamacpp(l) | BackendSpec::Sglang(l) | BackendSpec::Vllm(l) => {
                            l.slots
                        }
                    },
                    "measured": measured,
                },
            })
        })
        .collect();
    Value::Array(pools)
}

/// The result must be a valid simulated spec.
fn check_simulated(out: &Value) -> Result<(), ProfileError> {
    let checked: JobSpec = job::spec::parse(
        &serde_json::to_string(out).map_err(|e| ProfileError::Invalid(e.to_string()))?,
        job::spec::Format::Json,
    )
    .map_err(|e| ProfileError::Invalid(e.to_string()))?;
    if !checked.all_simulated() {
        return Err(ProfileError::Invalid("not every part is simulated".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nonnegative_fit_recovers_a_linear_cost_and_drops_a_negative_term() {
        // y = 0.02·steps + 1e-4·tokens, exactly.
        let rows: Vec<_> = (1..20)
            .map(|i| {
                let (s, t) = (i as f64, (i * i) as f64 * 10.0);
                (s, t, 0.02 * s + 1e-4 * t)
            })
            .collect();
        let (a, b, e) = fit_nonneg(&rows);
        assert!((a - 0.02).abs() < 1e-9 && (b - 1e-4).abs() < 1e-12 && e < 1e-9);
        // A cost that falls with the second input: that term is dropped, not made negative.
        let rows: Vec<_> = (1..20)
            .map(|i| (1.0, i as f64, 2.0 - 0.01 * i as f64))
            .collect();
        let (a, b, _) = fit_nonneg(&rows);
        assert_eq!(b, 0.0);
        assert!((a - rows.iter().map(|r| r.2).sum::<f64>() / 19.0).abs() < 1e-9);
    }

    #[test]
    fn quantile_tables_span_the_sample() {
        let q = quantiles((0..=100).map(f64::from).collect());
        let pts = q["quantiles"].as_array().unwrap();
        assert_eq!(pts.first().unwrap(), &json!([0.0, 0.0]));
        assert_eq!(pts[4], json!([0.5, 50.0]));
        assert_eq!(pts.last().unwrap(), &json!([1.0, 100.0]));
        assert_eq!(quantiles(vec![3.0, 3.0]), json!({ "constant": 3.0 }));
        assert_eq!(quantiles(vec![]), json!({ "constant": 0.0 }));
    }

    /// A store holding a finished "real" job whose costs follow known formulas: the profile
    /// must recover them, and its spec must simulate.
    #[test]
    fn a_profile_recovers_the_costs_a_job_ran_at_and_its_spec_simulates() {
        let body = std::fs::read_to_string("../../examples/quickstart.toml").unwrap();
        let spec = job::spec::parse(&body, job::spec::Format::Toml).unwrap();
        let store = Store::in_memory().unwrap();
        let job = store.create_job(&spec, 8, None).unwrap();
        let tasks = ["frozenlake", "sokoban", "arithmetic"];
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let (mut elapsed, mut busy) = (0.0, [0.0f64; 2]);
        let (mut steps_c, mut tokens_c) = ([0u64; 2], [0u64; 2]);
        for step in 0..8u64 {
            // This step's trajectories: turns and lengths vary with the step.
            let mut ids = Vec::new();
            let mut tokens = 0usize;
            for (ti, task) in tasks.iter().enumerate() {
                for e in 0..4u64 {
                    let turns = 1 + ((step + e) % 4) as usize * (ti != 2) as usize;
                    let turn = |k: usize| {
                        json!({
                            "observation_tokens": vec![1u32; if k == 0 { 30 + ti * 5 } else { 10 }],
                            "response_tokens": vec![2u32; 1 + e as usize],
                            "logprobs": [], "versions": [], "env_reward": 0.0,
                            "prefill_tokens": 0,
                        })
                    };
                    let id = format!("s{step}-{task}-{e}");
                    let t: actors::types::Trajectory = serde_json::from_value(json!({
                        "id": id, "group_id": step, "task": task, "seed": e,
                        "start_version": step, "pool": "compute", "shard": 0,
                        "turns": (0..turns).map(turn).collect::<Vec<_>>(),
                        "reward": 1.0, "success": e % 2 == 0, "invalid_actions": 0,
                        "failure": null,
                        "timings": { "started_at_s": 0.0, "ended_at_s": 1.0,
                            "reset_s": 0.001 * (e + 1) as f64, "generate_s": 0.1,
                            "env_step_s": 0.0001 * turns as f64, "reward_s": 0.002, "wait_s": 0.0 },
                    }))
                    .unwrap();
                    tokens += t
                        .turns
                        .iter()
                        .map(|u| u.observation_tokens.len() + u.response_tokens.len())
                        .sum::<usize>();
                    store.append_trajectory(&job, &t).unwrap();
                    ids.push(id);
                }
            }
            // Engine: 10 ms a step + 20 µs a token; training: 0.5 s + 100 µs a token, plus
            // the cores the engines took beside it (the job overlaps training).
            let mut pools = serde_json::Map::new();
            let busy_before: f64 = busy.iter().sum();
            for pi in 0..2usize {
                let (k, t) = (
                    5 + step * (pi as u64 + 1),
                    300 + 97 * step * (2 - pi as u64),
                );
                steps_c[pi] += k;
                tokens_c[pi] += t;
                busy[pi] += 0.01 * k as f64 + 2e-5 * t as f64;
            }
            let beside = (busy.iter().sum::<f64>() - busy_before) / cores;
            let train_s = 0.5 + 1e-4 * tokens as f64 + beside;
            elapsed += train_s;
            for (pi, name) in ["compute", "bandwidth"].iter().enumerate() {
                pools.insert(
                    name.to_string(),
                    json!({
                        "device": "CPU", "shards": 1, "groups": 0,
                        "utilisation": busy[pi] / elapsed,
                        "engine_steps": steps_c[pi], "prefill_tokens": tokens_c[pi],
                        "decode_tokens": 0,
                    }),
                );
            }
            let m = json!({ "step": step + 1, "elapsed_s": elapsed, "train_s": train_s,
                "step_s": train_s, "trajectories": 12, "pools": pools });
            let trained: Vec<&str> = ids.iter().map(String::as_str).collect();
            store.complete_step(&job, step + 1, &m, &trained).unwrap();
        }
        let (out, fit) = profile(&store, &job).unwrap();
        assert!((fit.engine_step_s - 0.01).abs() < 1e-6, "{fit:?}");
        assert!((fit.engine_s_per_token - 2e-5).abs() < 1e-9, "{fit:?}");
        assert!((fit.train_overhead_s - 0.5).abs() < 1e-6, "{fit:?}");
        assert!((fit.train_s_per_token - 1e-4).abs() < 1e-9, "{fit:?}");
        assert!(fit.engine_fit_error < 1e-6 && fit.train_fit_error < 1e-6);
        assert_eq!(fit.trajectories["sokoban"], 32);
        // Environments from the trajectories: arithmetic is single-turn, frozenlake 1–4 turns.
        let env = |d: &str| {
            out["tasks"]
                .as_array()
                .unwrap()
                .iter()
                .find(|t| t["domain"] == d)
                .unwrap()["env"]
                .clone()
        };
        assert_eq!(env("arithmetic")["turns"], json!({ "constant": 1.0 }));
        let ft = env("frozenlake")["turns"]["quantiles"]
            .as_array()
            .unwrap()
            .clone();
        assert_eq!(
            (ft[0][1].as_f64(), ft.last().unwrap()[1].as_f64()),
            (Some(1.0), Some(4.0))
        );
        assert_eq!(env("sokoban")["prompt_tokens"], json!({ "constant": 35.0 }));
        assert_eq!(env("sokoban")["success_rate"], json!(0.5));
        // The pools and trainer carry the fitted costs, the math function its latency.
        assert_eq!(
            out["pools"][0]["backend"]["measured"]["step_s"]
                .as_f64()
                .unwrap(),
            fit.engine_step_s
        );
        assert_eq!(out["trainer"]["kind"], "sim");
        assert_eq!(out["trainer"]["host_cores"], json!(cores as u32));
        assert_eq!(
            out["reward"]["functions"]["math"]["latency_s"],
            json!({ "constant": 0.002 })
        );
        // It simulates.
        let mut spec: JobSpec = serde_json::from_value(out).unwrap();
        spec.rollout.steps = Some(3);
        let s = job::simrun::run_virtual(spec).unwrap();
        assert_eq!(s.steps_done, 3);
        // Train time in the simulation follows the fit: overhead + tokens × cost.
        for m in &s.steps {
            assert!(m.train_s >= 0.5, "{}", m.train_s);
        }
        assert!(matches!(
            profile(&store, "job-9"),
            Err(ProfileError::NoJob(_))
        ));
    }
}
