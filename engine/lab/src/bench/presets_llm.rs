//! `rollarc bench --what presets-llm`: the RollArt comparison at equal learning. The
//! real-model job (SmolLM2 learning addition, `examples/smollm2-reasoning.toml`) runs under
//! each scheduling preset with environment latency injected, and each run is timed until its
//! held-out pass@1 first reaches the goal; several seeds give a mean and its standard error.
//!
//! The figure is the wall time from the start to the end of the evaluation that first reached
//! the goal. Beside it stands the same without the evaluations' own durations (they are equal
//! under every preset; the asynchronous presets keep generating while one runs, so that figure
//! flatters them a little). A run that does not reach the goal within its steps is reported
//! as such, never averaged in.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use infra::clock::wall_now;
use job::runtime::{ObserverError, StepMetrics, StepObserver};
use job::spec::{JobSpec, Preset};

use super::presets::PresetsBenchError;

/// The presets compared, baselines first.
const PRESETS: [Preset; 5] = [
    Preset::Sync,
    Preset::SyncPlus,
    Preset::OneOff,
    Preset::Areal,
    Preset::Rollarc,
];

/// How a presets-llm run is set up.
#[derive(Clone, Debug)]
pub struct PresetsLlmOptions {
    /// Training steps a run may take to reach the goal.
    pub max_steps: u64,
    /// Seeds per preset (each a whole run).
    pub seeds: Vec<u64>,
    /// Held-out pass@1 to reach.
    pub goal: f64,
    /// A held-out evaluation every this many steps.
    pub eval_every: u64,
    /// Held-out problems per evaluation (one sample each).
    pub eval_problems: u64,
}

impl Default for PresetsLlmOptions {
    fn default() -> Self {
        Self {
            max_steps: 30,
            seeds: vec![1, 2, 3],
            goal: 0.8,
            eval_every: 3,
            eval_problems: 100,
        }
    }
}

/// One run's outcome.
#[derive(Clone, Debug, Default)]
struct Reached {
    /// Wall seconds from the start to the end of the evaluation that reached the goal.
    wall_s: f64,
    /// The same less the evaluations' durations.
    train_wall_s: f64,
    step: u64,
    pass: f64,
}

/// Stops the run at the first held-out evaluation at or above the goal (by failing the step's
/// record with [`GoalReached`]), noting when.
struct GoalWatch {
    goal: f64,
    started: tokio::time::Instant,
    eval_s: Mutex<f64>,
    reached: Mutex<Option<Reached>>,
    last_pass: Mutex<Option<f64>>,
    profile: Mutex<Profile>,
}

/// Where a run's steps went, summed over its steps: the rollout metrics that explain a
/// preset's time per step (printed under each run).
#[derive(Clone, Debug, Default)]
struct Profile {
    steps: u64,
    step_s: f64,
    train_s: f64,
    wait_batch_s: f64,
    weight_sync_s: f64,
    staleness: f64,
    generate_s: f64,
    env_s: f64,
    stage_wait_s: f64,
    decode_tokens: u64,
    /// Idle fraction of generation since the start, at the last step.
    bubble: f64,
    cancelled_tokens: u64,
}

impl Profile {
    fn add(&mut self, m: &StepMetrics) {
        self.steps += 1;
        self.step_s += m.step_s;
        self.train_s += m.train_s;
        self.wait_batch_s += m.wait_batch_s;
        self.weight_sync_s += m.rollout.weight_sync_s;
        self.staleness += m.staleness_mean;
        let st = &m.rollout.stages;
        self.generate_s += st.generate_s;
        self.env_s += st.reset_s + st.env_step_s;
        self.stage_wait_s += st.wait_s;
        self.decode_tokens += m.decode_tokens;
        self.bubble = m.bubble_ratio;
        self.cancelled_tokens = m.rollout.cancelled_tokens;
    }

    /// One line: per-step means, then per-trajectory stage means.
    fn line(&self) -> String {
        let n = self.steps.max(1) as f64;
        format!(
            "per step: {:.1} s ({:.1} s training, {:.1} s waiting for the batch, {:.2} s weight sync), staleness {:.2}, {:.0} decode tokens; per trajectory: generate {:.1} s, env {:.1} s, wait {:.1} s; generation idle {:.0} %, {} tokens cancelled",
            self.step_s / n,
            self.train_s / n,
            self.wait_batch_s / n,
            self.weight_sync_s / n,
            self.staleness / n,
            self.decode_tokens as f64 / n,
            self.generate_s / n,
            self.env_s / n,
            self.stage_wait_s / n,
            100.0 * self.bubble,
            self.cancelled_tokens
        )
    }
}

#[derive(Debug, thiserror::Error)]
#[error("the held-out goal is reached")]
struct GoalReached;

impl StepObserver for GoalWatch {
    fn on_step(&self, m: &StepMetrics) -> Result<(), ObserverError> {
        self.profile
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .add(m);
        let mut eval_s = self.eval_s.lock().unwrap_or_else(|p| p.into_inner());
        for rec in &m.eval {
            *eval_s += rec.seconds;
            let tasks = rec.tasks.len().max(1) as f64;
            let pass = rec.tasks.values().map(|t| t.pass_at_1).sum::<f64>() / tasks;
            *self.last_pass.lock().unwrap_or_else(|p| p.into_inner()) = Some(pass);
            if pass >= self.goal && rec.step > 0 {
                let wall_s = self.started.elapsed().as_secs_f64();
                *self.reached.lock().unwrap_or_else(|p| p.into_inner()) = Some(Reached {
                    wall_s,
                    train_wall_s: wall_s - *eval_s,
                    step: rec.step,
                    pass,
                });
                return Err(Box::new(GoalReached));
            }
        }
        Ok(())
    }
}

/// `base` under preset `p` and `seed`: latency injected, held-out evaluation every
/// `eval_every` steps on `eval_problems` problems, at most `max_steps` steps.
fn variant(base: &JobSpec, p: Preset, seed: u64, o: &PresetsLlmOptions) -> JobSpec {
    let mut spec = base.with_preset(p);
    spec.seed = seed;
    spec.rollout.steps = Some(o.max_steps);
    for t in &mut spec.tasks {
        t.inject_latency = Some(super::presets::injected_latency());
    }
    if let Some(e) = &mut spec.eval {
        e.every = o.eval_every;
        e.n = 1;
        for t in &mut e.tasks {
            if let Some(s) = &mut t.seeds {
                s.count = o.eval_problems;
            }
        }
    }
    spec
}

/// Runs one variant to its goal: `Some` when reached, `None` when its steps ran out first;
/// with the last held-out pass@1 and the run's [`Profile`] line.
fn run_to_goal(
    spec: JobSpec,
    p: Preset,
    goal: f64,
) -> Result<(Option<Reached>, Option<f64>, String), PresetsBenchError> {
    let watch = Arc::new(GoalWatch {
        goal,
        started: tokio::time::Instant::now(),
        eval_s: Mutex::new(0.0),
        reached: Mutex::new(None),
        last_pass: Mutex::new(None),
        profile: Mutex::new(Profile::default()),
    });
    let r = job::simrun::run_blocking(
        spec,
        0,
        0,
        Arc::new(actors::buffer::CountingSink::default()),
        watch.clone(),
        None,
    );
    let reached = watch
        .reached
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let last = *watch.last_pass.lock().unwrap_or_else(|p| p.into_inner());
    let profile = watch
        .profile
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .line();
    match r {
        Ok(_) => Ok((None, last, profile)),
        // The watch stopped it: the goal was reached.
        Err(_) if reached.is_some() => Ok((reached, last, profile)),
        Err(source) => Err(PresetsBenchError::Run {
            preset: p.name(),
            source,
        }),
    }
}

/// Mean and standard error of `xs`.
fn mean_se(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n.max(1.0);
    if xs.len() < 2 {
        return (mean, f64::NAN);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, (var / n).sqrt())
}

/// `rollarc bench --what presets-llm` (see the module's text). `file`: the real-model job;
/// a missing model path is replaced by the SmolLM2 checkpoint `make setup` downloads.
pub fn bench_presets_llm(file: &Path, o: &PresetsLlmOptions) -> Result<(), PresetsBenchError> {
    let base = super::presets::read_spec(file, Some(&actors::model::llm::smollm2_path()))?;
    let t0 = wall_now();
    println!(
        "presets at equal learning: {} until held-out pass@1 ≥ {} (≤ {} steps; {} problems every {} steps), seeds {:?}; injected env latency: step Normal(0.3 s, σ 0.15 s), reset LogNormal(μ −2, σ 1)",
        file.display(),
        o.goal,
        o.max_steps,
        o.eval_problems,
        o.eval_every,
        o.seeds
    );
    println!(
        "    {:<10} {:>5} {:>12} {:>14} {:>6} {:>8}",
        "preset", "seed", "to goal s", "w/o evals s", "step", "pass@1"
    );
    let mut times: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    let mut bare: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    for p in PRESETS {
        for &seed in &o.seeds {
            let (reached, last, profile) = run_to_goal(variant(&base, p, seed, o), p, o.goal)?;
            match reached {
                Some(r) => {
                    println!(
                        "    {:<10} {:>5} {:>12.1} {:>14.1} {:>6} {:>8.3}",
                        p.name(),
                        seed,
                        r.wall_s,
                        r.train_wall_s,
                        r.step,
                        r.pass
                    );
                    times.entry(p.name()).or_default().push(r.wall_s);
                    bare.entry(p.name()).or_default().push(r.train_wall_s);
                }
                None => println!(
                    "    {:<10} {:>5} {:>12} {:>14} {:>6} {:>8}",
                    p.name(),
                    seed,
                    "not reached",
                    "",
                    o.max_steps,
                    last.map_or("-".into(), |x| format!("{x:.3}"))
                ),
            }
            println!("           {profile}");
        }
    }
    println!(
        "  per preset (runs that reached the goal): mean ± standard error of the time to goal, then without the evaluations"
    );
    // One run has no spread: shown as "–", not NaN.
    let show = |(m, se): (f64, f64)| {
        if se.is_nan() {
            format!("{m:>8.1} ±      – s")
        } else {
            format!("{m:>8.1} ± {se:>6.1} s")
        }
    };
    for p in PRESETS {
        let xs = times.get(p.name()).cloned().unwrap_or_default();
        let bare_xs = bare.get(p.name()).cloned().unwrap_or_default();
        println!(
            "    {:<10} {}   {}  ({} of {} runs)",
            p.name(),
            show(mean_se(&xs)),
            show(mean_se(&bare_xs)),
            xs.len(),
            o.seeds.len()
        );
    }
    if let Some(r) = times.get("rollarc").map(|x| mean_se(x).0) {
        let ratios: Vec<String> = ["sync", "sync_plus", "one_off", "areal"]
            .iter()
            .filter_map(|b| Some(format!("{:.2}× {b}", mean_se(times.get(b)?).0 / r)))
            .collect();
        println!("    rollarc reaches the goal {}", ratios.join(", "));
    }
    println!("  ({:.0} s in all)", t0.elapsed().as_secs_f64());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_and_standard_error() {
        let (m, se) = mean_se(&[1.0, 2.0, 3.0]);
        assert!((m - 2.0).abs() < 1e-12);
        assert!((se - (1.0f64 / 3.0).sqrt()).abs() < 1e-12);
        assert!(mean_se(&[4.0]).1.is_nan());
    }

    /// Each variant keeps the job and changes only what the comparison sets.
    #[test]
    fn a_variant_sets_the_preset_seed_latency_and_evaluation() {
        let file =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/smollm2-reasoning.toml");
        let base =
            super::super::presets::read_spec(&file, Some(Path::new("/models/m.gguf"))).unwrap();
        let o = PresetsLlmOptions::default();
        let v = variant(&base, Preset::OneOff, 7, &o);
        assert_eq!(v.seed, 7);
        assert_eq!(v.preset, Some(Preset::OneOff));
        assert_eq!(v.rollout.steps, Some(30));
        assert!(v.tasks.iter().all(|t| t.inject_latency.is_some()));
        let e = v.eval.unwrap();
        assert_eq!((e.every, e.n), (3, 1));
        assert_eq!(e.tasks[0].seeds.as_ref().unwrap().count, 100);
        assert_eq!(v.tasks, {
            let mut t = base.with_preset(Preset::OneOff).tasks;
            for x in &mut t {
                x.inject_latency = v.tasks[0].inject_latency.clone();
            }
            t
        });
    }
}
