//! Scenario files: experiments on the simulated cluster, written as data.
//!
//! A scenario is a base job spec, a list of runs (each the base with some fields set, possibly
//! over a matrix of values), and checks that compare the runs' figures with the paper's: the
//! ratio of a metric between two runs (or the best of several) against a band, or an expected
//! ordering. Every run is the real scheduler and actors on the virtual clock, so a new
//! experiment needs a file, not code.
//!
//! ```toml
//! [scenario]
//! name = "sigma"
//! title = "..."
//! figure = "RollArt Fig. 11"
//! [base]            # a job spec
//! ...
//! [[runs]]
//! name = "turn-s{sigma}"
//! matrix = { sigma = [1, 3, 5] }
//! set = { preset = "sync_plus", "tasks[0].env.step_latency_s.normal.std" = "{sigma}" }
//! [[checks]]
//! name = "σ = {sigma} s"
//! matrix = { sigma = [1, 3, 5] }
//! ratio = ["turn-s{sigma}", "traj-s{sigma}"]
//! paper = [1.23, 1.51, 1.69]
//! tolerance = 0.15
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::job::JobSummary;
use crate::spec::{self, JobSpec};

#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    #[error("{0}: not a valid scenario file: {1}")]
    Parse(String, String),
    #[error("{file}: run {run:?}: {message}")]
    Run { file: String, run: String, message: String },
    #[error("{file}: check {check:?}: {message}")]
    Check { file: String, check: String, message: String },
}

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
}

impl Metric {
    pub const ALL: [Metric; 5] = [Metric::StepS, Metric::Throughput, Metric::Bubble, Metric::TrainerBusy, Metric::ElapsedS];

    pub fn name(self) -> &'static str {
        match self {
            Self::StepS => "step_s",
            Self::Throughput => "throughput",
            Self::Bubble => "bubble",
            Self::TrainerBusy => "trainer_busy",
            Self::ElapsedS => "elapsed_s",
        }
    }

    /// The metric of a finished run.
    pub fn of(self, s: &JobSummary, warmup: u64) -> f64 {
        let steps: Vec<_> = s.steps.iter().filter(|m| m.step >= warmup).collect();
        let steps = if steps.is_empty() { s.steps.iter().collect() } else { steps };
        let n = steps.len().max(1) as f64;
        match self {
            Self::StepS => steps.iter().map(|m| m.step_s).sum::<f64>() / n,
            Self::Throughput => {
                let t: f64 = steps.iter().map(|m| m.step_s).sum();
                steps.iter().map(|m| m.trajectories as f64).sum::<f64>() / t.max(1e-9)
            }
            Self::Bubble => s.bubble_ratio,
            Self::TrainerBusy => steps.iter().map(|m| (m.train_s / m.step_s.max(1e-9)).min(1.0)).sum::<f64>() / n,
            Self::ElapsedS => s.elapsed_s,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    name: String,
    title: String,
    /// Where the paper reports it.
    figure: String,
    #[serde(default)]
    metric: Metric,
    #[serde(default = "d_warmup")]
    warmup_steps: u64,
    #[serde(default)]
    notes: Option<String>,
}

fn d_warmup() -> u64 {
    1
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RunFile {
    name: String,
    #[serde(default)]
    matrix: BTreeMap<String, Vec<Value>>,
    #[serde(default)]
    set: BTreeMap<String, Value>,
}

/// One side of a ratio: a run, or the best (lowest metric) of several.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Side {
    One(String),
    BestOf(Vec<String>),
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(untagged)]
enum PaperValue {
    One(f64),
    Each(Vec<f64>),
    Text(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckFile {
    name: String,
    #[serde(default)]
    matrix: BTreeMap<String, Vec<Value>>,
    #[serde(default)]
    metric: Option<Metric>,
    /// metric(first) / metric(second).
    #[serde(default)]
    ratio: Option<(Side, Side)>,
    /// Runs expected in ascending order of the metric.
    #[serde(default)]
    order: Option<Vec<String>>,
    /// One run's metric itself (against `band`).
    #[serde(default)]
    value: Option<String>,
    /// The paper's figure (one value, one per matrix row, or text).
    #[serde(default)]
    paper: Option<PaperValue>,
    /// Accepted range of the ratio.
    #[serde(default)]
    band: Option<[f64; 2]>,
    /// Accepted range as the paper's value × (1 ± tolerance).
    #[serde(default)]
    tolerance: Option<f64>,
    #[serde(default)]
    note: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScenarioFile {
    scenario: Header,
    base: toml::Table,
    #[serde(default)]
    runs: Vec<RunFile>,
    #[serde(default)]
    checks: Vec<CheckFile>,
    #[serde(default)]
    plan: Option<toml::Table>,
}

/// A run of a scenario, expanded and validated.
#[derive(Clone, Debug)]
pub struct RunDef {
    pub name: String,
    pub spec: JobSpec,
}

/// A check, expanded.
#[derive(Clone, Debug, Serialize)]
pub struct CheckDef {
    pub name: String,
    pub metric: Metric,
    pub kind: CheckKind,
    pub paper: Option<String>,
    pub band: Option<[f64; 2]>,
    pub note: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckKind {
    Ratio(Side, Side),
    Order(Vec<String>),
    Value(String),
}

/// A parsed scenario.
#[derive(Debug)]
pub struct Scenario {
    pub name: String,
    pub title: String,
    pub figure: String,
    pub metric: Metric,
    pub warmup_steps: u64,
    pub notes: Option<String>,
    pub base: Value,
    pub runs: Vec<RunDef>,
    pub checks: Vec<CheckDef>,
    /// The `[plan]` table for `rollarc plan` (search space), if any.
    pub plan: Option<Value>,
}

/// Sets `path` (`a.b[2].c`) in `v` to `new`, creating tables on the way.
pub fn set_path(v: &mut Value, path: &str, new: Value) -> Result<(), String> {
    let mut cur = v;
    let mut parts = Vec::new();
    for seg in path.split('.') {
        let (key, rest) = match seg.find('[') {
            Some(i) => (&seg[..i], &seg[i..]),
            None => (seg, ""),
        };
        if !key.is_empty() {
            parts.push(Err(key.to_string()));
        }
        for idx in rest.split('[').filter(|s| !s.is_empty()) {
            let n: usize = idx.trim_end_matches(']').parse().map_err(|_| format!("{path}: bad index [{idx}"))?;
            parts.push(Ok(n));
        }
    }
    let last = parts.pop().ok_or_else(|| format!("empty path {path:?}"))?;
    for p in parts {
        cur = match p {
            Err(k) => {
                let obj = cur.as_object_mut().ok_or_else(|| format!("{path}: {k:?} is not inside a table"))?;
                obj.entry(k).or_insert_with(|| Value::Object(Default::default()))
            }
            Ok(i) => {
                let arr = cur.as_array_mut().ok_or_else(|| format!("{path}: [{i}] is not inside an array"))?;
                let len = arr.len();
                arr.get_mut(i).ok_or_else(|| format!("{path}: index {i} out of range (length {len})"))?
            }
        };
    }
    match last {
        Err(k) => {
            cur.as_object_mut().ok_or_else(|| format!("{path}: {k:?} is not inside a table"))?.insert(k, new);
        }
        Ok(i) => {
            let arr = cur.as_array_mut().ok_or_else(|| format!("{path}: [{i}] is not inside an array"))?;
            let len = arr.len();
            *arr.get_mut(i).ok_or_else(|| format!("{path}: index {i} out of range (length {len})"))? = new;
        }
    }
    Ok(())
}

/// Every combination of a matrix, in a stable order (variables sorted by name, values in the
/// given order, the last variable fastest).
fn combinations(m: &BTreeMap<String, Vec<Value>>) -> Vec<BTreeMap<String, Value>> {
    let mut out = vec![BTreeMap::new()];
    for (k, vals) in m {
        let mut next = Vec::new();
        for base in &out {
            for v in vals {
                let mut b = base.clone();
                b.insert(k.clone(), v.clone());
                next.push(b);
            }
        }
        out = next;
    }
    out
}

fn show(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Substitutes `{var}` in strings: a string that is exactly `{var}` becomes the value itself.
fn substitute(v: &Value, vars: &BTreeMap<String, Value>) -> Value {
    match v {
        Value::String(s) => {
            for (k, val) in vars {
                if s == &format!("{{{k}}}") {
                    return val.clone();
                }
            }
            let mut t = s.clone();
            for (k, val) in vars {
                t = t.replace(&format!("{{{k}}}"), &show(val));
            }
            Value::String(t)
        }
        Value::Array(a) => Value::Array(a.iter().map(|x| substitute(x, vars)).collect()),
        Value::Object(o) => {
            Value::Object(o.iter().map(|(k, x)| (substitute(&Value::String(k.clone()), vars).as_str().unwrap_or(k).to_string(), substitute(x, vars))).collect())
        }
        other => other.clone(),
    }
}

fn sub_str(s: &str, vars: &BTreeMap<String, Value>) -> String {
    show(&substitute(&Value::String(s.to_string()), vars))
}

fn sub_side(s: &Side, vars: &BTreeMap<String, Value>) -> Side {
    match s {
        Side::One(r) => Side::One(sub_str(r, vars)),
        Side::BestOf(v) => Side::BestOf(v.iter().map(|r| sub_str(r, vars)).collect()),
    }
}

impl Side {
    pub fn runs(&self) -> Vec<&str> {
        match self {
            Side::One(r) => vec![r.as_str()],
            Side::BestOf(v) => v.iter().map(String::as_str).collect(),
        }
    }

    fn label(&self) -> String {
        match self {
            Side::One(r) => r.clone(),
            Side::BestOf(v) => format!("best of {}", v.join(", ")),
        }
    }
}

/// Builds a run's spec from the base and its settings, with errors naming the field.
pub fn build_spec(base: &Value, set: &BTreeMap<String, Value>) -> Result<JobSpec, String> {
    let mut v = base.clone();
    for (path, val) in set {
        set_path(&mut v, path, val.clone())?;
    }
    spec::from_value(v).map_err(|e| e.0.iter().map(|f| format!("{}: {}", f.field, f.message)).collect::<Vec<_>>().join("; "))
}

impl Scenario {
    pub fn load(path: &Path) -> Result<Self, ScenarioError> {
        let file = path.display().to_string();
        let body = std::fs::read_to_string(path).map_err(|e| ScenarioError::Parse(file.clone(), e.to_string()))?;
        Self::parse(&file, &body)
    }

    pub fn parse(file: &str, body: &str) -> Result<Self, ScenarioError> {
        let f: ScenarioFile = toml::from_str(body).map_err(|e| ScenarioError::Parse(file.to_string(), e.message().to_string()))?;
        let base = serde_json::to_value(&f.base).map_err(|e| ScenarioError::Parse(file.to_string(), e.to_string()))?;
        let mut runs = Vec::new();
        for r in &f.runs {
            for vars in combinations(&r.matrix) {
                let name = sub_str(&r.name, &vars);
                let set: BTreeMap<String, Value> = r.set.iter().map(|(k, v)| (sub_str(k, &vars), substitute(v, &vars))).collect();
                let spec = build_spec(&base, &set).map_err(|message| ScenarioError::Run { file: file.to_string(), run: name.clone(), message })?;
                if !spec.all_simulated() {
                    return Err(ScenarioError::Run { file: file.to_string(), run: name, message: "every backend must be simulated (kind = \"sim\")".into() });
                }
                if runs.iter().any(|x: &RunDef| x.name == name) {
                    return Err(ScenarioError::Run { file: file.to_string(), run: name, message: "duplicate run name".into() });
                }
                runs.push(RunDef { name, spec });
            }
        }
        if runs.is_empty() {
            let spec = build_spec(&base, &BTreeMap::new()).map_err(|message| ScenarioError::Run { file: file.to_string(), run: "base".into(), message })?;
            runs.push(RunDef { name: "base".into(), spec });
        }
        let mut checks = Vec::new();
        for c in &f.checks {
            for (i, vars) in combinations(&c.matrix).into_iter().enumerate() {
                let name = sub_str(&c.name, &vars);
                let err = |message: String| ScenarioError::Check { file: file.to_string(), check: name.clone(), message };
                let kind = match (&c.ratio, &c.order, &c.value) {
                    (Some((a, b)), None, None) => CheckKind::Ratio(sub_side(a, &vars), sub_side(b, &vars)),
                    (None, Some(o), None) => CheckKind::Order(o.iter().map(|r| sub_str(r, &vars)).collect()),
                    (None, None, Some(v)) => CheckKind::Value(sub_str(v, &vars)),
                    _ => return Err(err("give exactly one of ratio, order or value".into())),
                };
                let referenced: Vec<String> = match &kind {
                    CheckKind::Ratio(a, b) => a.runs().into_iter().chain(b.runs()).map(String::from).collect(),
                    CheckKind::Order(o) => o.clone(),
                    CheckKind::Value(v) => vec![v.clone()],
                };
                for r in referenced {
                    if !runs.iter().any(|x| x.name == r) {
                        return Err(err(format!("no run is named {r:?}")));
                    }
                }
                let paper_num = match &c.paper {
                    Some(PaperValue::One(x)) => Some(*x),
                    Some(PaperValue::Each(v)) => Some(*v.get(i).ok_or_else(|| err(format!("paper has {} values for {} matrix rows", v.len(), i + 1)))?),
                    _ => None,
                };
                let paper = match &c.paper {
                    Some(PaperValue::Text(t)) => Some(sub_str(t, &vars)),
                    _ => paper_num.map(|x| format!("{x:.2}×")),
                };
                let band = match (c.band, c.tolerance, paper_num) {
                    (Some(b), _, _) => Some(b),
                    (None, Some(t), Some(p)) => Some([p * (1.0 - t), p * (1.0 + t)]),
                    (None, Some(_), None) => return Err(err("tolerance needs a numeric paper value".into())),
                    (None, None, _) => None,
                };
                if matches!(kind, CheckKind::Ratio(..) | CheckKind::Value(..)) && band.is_none() {
                    return Err(err("a ratio or value check needs band or tolerance".into()));
                }
                checks.push(CheckDef { name, metric: c.metric.unwrap_or(f.scenario.metric), kind, paper, band, note: c.note.clone() });
            }
        }
        let plan = f.plan.map(|p| serde_json::to_value(p).unwrap_or(Value::Null));
        Ok(Self {
            name: f.scenario.name,
            title: f.scenario.title,
            figure: f.scenario.figure,
            metric: f.scenario.metric,
            warmup_steps: f.scenario.warmup_steps,
            notes: f.scenario.notes,
            base,
            runs,
            checks,
            plan,
        })
    }
}

/// What one run measured, and what the simulator cost.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunResult {
    pub name: String,
    pub preset: Option<String>,
    pub metrics: BTreeMap<String, f64>,
    pub steps: u64,
    /// Virtual seconds simulated.
    pub simulated_s: f64,
    /// Wall seconds the simulation took.
    pub wall_s: f64,
    /// Simulated events: engine steps (a fused step counts once), environment calls, finished
    /// trajectories (each a reward call and a buffer commit) and training steps.
    pub events: u64,
    /// Utilisation of every pool over the run.
    pub pools: BTreeMap<String, f64>,
    /// Groups admitted to every pool.
    pub pool_groups: BTreeMap<String, u64>,
    /// Tokens prefilled and decoded over the run (prefix-cache hits are not prefilled).
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    /// Groups aborted past the staleness bound, and groups evicted stale from the buffer
    /// (work thrown away).
    pub stale_aborted: u64,
    pub stale_evicted: u64,
}

/// A check's outcome.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CheckResult {
    pub name: String,
    pub metric: String,
    pub what: String,
    pub paper: Option<String>,
    pub band: Option<[f64; 2]>,
    /// The ratio (ratio checks) or the value (value checks).
    pub ours: Option<f64>,
    /// The measured order (order checks).
    pub order: Option<Vec<String>>,
    pub pass: bool,
    pub note: Option<String>,
}

/// A scenario's results.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ScenarioResult {
    pub name: String,
    pub title: String,
    pub figure: String,
    pub notes: Option<String>,
    pub runs: Vec<RunResult>,
    pub checks: Vec<CheckResult>,
    pub wall_s: f64,
    pub events: u64,
    pub peak_rss_mib: f64,
}

fn wall_now() -> std::time::Instant {
    #[allow(clippy::disallowed_methods)]
    std::time::Instant::now()
}

/// Simulated events of a finished run (see [`RunResult::events`]).
pub fn events_of(s: &JobSummary) -> u64 {
    let Some(last) = s.steps.last() else { return 0 };
    let engine: u64 = last.pools.values().map(|p| p.engine_steps).sum();
    engine + last.env_calls + last.buffer.committed + s.steps_done
}

/// Runs one spec in virtual time and measures it.
pub fn run_one(name: &str, spec: JobSpec, warmup: u64) -> Result<RunResult, String> {
    let preset = spec.preset.map(|p| p.name().to_string());
    let t = wall_now();
    let s = crate::simrun::run_virtual(spec).map_err(|e| e.to_string())?;
    let wall_s = t.elapsed().as_secs_f64();
    let metrics = Metric::ALL.iter().map(|m| (m.name().to_string(), m.of(&s, warmup))).collect();
    Ok(RunResult {
        name: name.to_string(),
        preset,
        metrics,
        steps: s.steps_done,
        simulated_s: s.elapsed_s,
        wall_s,
        events: events_of(&s),
        pools: s.pools.iter().map(|(k, p)| (k.clone(), p.utilisation)).collect(),
        pool_groups: s.pools.iter().map(|(k, p)| (k.clone(), p.groups)).collect(),
        prefill_tokens: s.pools.values().map(|p| p.prefill_tokens).sum(),
        decode_tokens: s.pools.values().map(|p| p.decode_tokens).sum(),
        stale_aborted: s.steps.last().map_or(0, |m| m.scheduler.aborted_stale),
        stale_evicted: s.steps.last().map_or(0, |m| m.buffer.evicted_stale),
    })
}

fn metric_of(runs: &[RunResult], side: &Side, m: Metric) -> Option<f64> {
    let vals = side.runs().into_iter().filter_map(|r| runs.iter().find(|x| x.name == r).and_then(|x| x.metrics.get(m.name()).copied()));
    vals.fold(None, |acc: Option<f64>, v| Some(acc.map_or(v, |a| a.min(v))))
}

/// Evaluates the checks against the runs.
pub fn evaluate(checks: &[CheckDef], runs: &[RunResult]) -> Vec<CheckResult> {
    checks
        .iter()
        .map(|c| {
            let (what, ours, order, pass) = match &c.kind {
                CheckKind::Ratio(a, b) => {
                    let r = match (metric_of(runs, a, c.metric), metric_of(runs, b, c.metric)) {
                        (Some(x), Some(y)) if y > 0.0 => Some(x / y),
                        _ => None,
                    };
                    let pass = match (r, c.band) {
                        (Some(r), Some([lo, hi])) => r >= lo && r <= hi,
                        _ => false,
                    };
                    (format!("{} / {}", a.label(), b.label()), r, None, pass)
                }
                CheckKind::Value(r) => {
                    let v = metric_of(runs, &Side::One(r.clone()), c.metric);
                    let pass = matches!((v, c.band), (Some(v), Some([lo, hi])) if v >= lo && v <= hi);
                    (format!("{} of {r}", c.metric.name()), v, None, pass)
                }
                CheckKind::Order(o) => {
                    let mut got: Vec<(f64, String)> = o
                        .iter()
                        .filter_map(|r| runs.iter().find(|x| &x.name == r).map(|x| (x.metrics.get(c.metric.name()).copied().unwrap_or(f64::NAN), r.clone())))
                        .collect();
                    got.sort_by(|a, b| a.0.total_cmp(&b.0));
                    let measured: Vec<String> = got.into_iter().map(|x| x.1).collect();
                    let pass = &measured == o;
                    (format!("ascending {}: {}", c.metric.name(), o.join(" < ")), None, Some(measured), pass)
                }
            };
            CheckResult {
                name: c.name.clone(),
                metric: c.metric.name().into(),
                what,
                paper: c.paper.clone(),
                band: c.band,
                ours,
                order,
                pass,
                note: c.note.clone(),
            }
        })
        .collect()
}

/// Peak resident memory of this process, MiB.
pub fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse::<f64>().ok()))
        .unwrap_or(0.0)
        / 1024.0
}

/// Runs every run of the scenario (in order) and evaluates its checks.
pub fn run(sc: &Scenario, mut progress: impl FnMut(&RunResult)) -> Result<ScenarioResult, ScenarioError> {
    let t = wall_now();
    let mut runs = Vec::new();
    for r in &sc.runs {
        let res =
            run_one(&r.name, r.spec.clone(), sc.warmup_steps).map_err(|message| ScenarioError::Run { file: sc.name.clone(), run: r.name.clone(), message })?;
        progress(&res);
        runs.push(res);
    }
    let checks = evaluate(&sc.checks, &runs);
    Ok(ScenarioResult {
        name: sc.name.clone(),
        title: sc.title.clone(),
        figure: sc.figure.clone(),
        notes: sc.notes.clone(),
        events: runs.iter().map(|r| r.events).sum(),
        wall_s: t.elapsed().as_secs_f64(),
        runs,
        checks,
        peak_rss_mib: peak_rss_mib(),
    })
}

/// The table of a scenario's checks, as printed.
pub fn table(results: &[ScenarioResult]) -> String {
    let mut out = String::new();
    out.push_str(&format!("{:<12} {:<34} {:>12} {:>9} {:>15}  {}\n", "experiment", "check", "paper", "ours", "band", "in band"));
    for r in results {
        for c in &r.checks {
            let ours = match (&c.ours, &c.order) {
                (Some(x), _) if c.what.contains(" / ") => format!("{x:.2}×"),
                (Some(x), _) => format!("{x:.2}"),
                (None, Some(o)) => o.join("<"),
                _ => "-".into(),
            };
            let band = c.band.map(|[a, b]| format!("[{a:.2}, {b:.2}]")).unwrap_or_else(|| "order".into());
            out.push_str(&format!(
                "{:<12} {:<34} {:>12} {:>9} {:>15}  {}\n",
                r.name,
                c.name,
                c.paper.clone().unwrap_or_else(|| "-".into()),
                ours,
                band,
                if c.pass { "yes" } else { "NO" }
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests;
