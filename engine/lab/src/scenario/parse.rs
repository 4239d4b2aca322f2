//! The scenario file: its TOML form, and its expansion into runs (each a validated job spec)
//! and checks.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::checks::{CheckDef, CheckKind, Side};
use super::error::{CheckError, RunError, ScenarioError};
use super::matrix::{build_spec, combinations, sub_str, substitute};
use super::metric::Metric;
use job::spec::JobSpec;

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
    /// Copies of the job run together on one virtual clock (seeds `seed`, `seed + 1`, …).
    #[serde(default = "one_job")]
    jobs: u32,
    /// Whether those jobs share their simulated function deployments (one deployment and
    /// autoscaler per name) instead of each deploying its own.
    #[serde(default)]
    shared_functions: bool,
}

fn one_job() -> u32 {
    1
}

/// Most jobs one run may hold (the bound `RunError::Jobs` states).
pub(super) const MAX_JOBS_PER_RUN: u32 = 64;

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
    /// Jobs run together, and whether they share their simulated function deployments.
    pub jobs: u32,
    pub shared_functions: bool,
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

impl Scenario {
    /// A job spec alone (a `rollarc profile` of a real run, say) as a scenario of one run, with
    /// a `[plan]` table for the planner.
    pub fn of_spec(name: &str, spec: JobSpec, plan: Option<Value>) -> Result<Self, ScenarioError> {
        let base = serde_json::to_value(&spec).map_err(|source| ScenarioError::Base {
            file: name.to_string(),
            source,
        })?;
        Ok(Self {
            name: name.to_string(),
            title: name.to_string(),
            figure: String::new(),
            metric: Metric::StepS,
            warmup_steps: 1,
            notes: None,
            base,
            runs: vec![RunDef {
                name: name.to_string(),
                spec,
                jobs: 1,
                shared_functions: false,
            }],
            checks: Vec::new(),
            plan,
        })
    }

    pub fn load(path: &Path) -> Result<Self, ScenarioError> {
        let file = path.display().to_string();
        let body = std::fs::read_to_string(path).map_err(|source| ScenarioError::Read {
            file: file.clone(),
            source,
        })?;
        Self::parse(&file, &body)
    }

    pub fn parse(file: &str, body: &str) -> Result<Self, ScenarioError> {
        let f: ScenarioFile = toml::from_str(body).map_err(|source| ScenarioError::Syntax {
            file: file.to_string(),
            source,
        })?;
        let base = serde_json::to_value(&f.base).map_err(|source| ScenarioError::Base {
            file: file.to_string(),
            source,
        })?;
        let runs = expand_runs(file, &base, &f.runs)?;
        let mut checks = Vec::new();
        for c in &f.checks {
            for (i, vars) in combinations(&c.matrix).into_iter().enumerate() {
                let name = sub_str(&c.name, &vars);
                let def = expand_check(c, name.clone(), i, &vars, f.scenario.metric, &runs)
                    .map_err(|source| ScenarioError::Check {
                        file: file.to_string(),
                        check: name,
                        source,
                    })?;
                checks.push(def);
            }
        }
        let plan = f
            .plan
            .map(|p| serde_json::to_value(p).unwrap_or(Value::Null));
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

/// Every run of every matrix, in file order; the base alone when the file lists none.
fn expand_runs(file: &str, base: &Value, list: &[RunFile]) -> Result<Vec<RunDef>, ScenarioError> {
    let err = |run: &str, source: RunError| ScenarioError::Run {
        file: file.to_string(),
        run: run.to_string(),
        source,
    };
    let mut runs: Vec<RunDef> = Vec::new();
    for r in list {
        for vars in combinations(&r.matrix) {
            let name = sub_str(&r.name, &vars);
            let set: BTreeMap<String, Value> = r
                .set
                .iter()
                .map(|(k, v)| (sub_str(k, &vars), substitute(v, &vars)))
                .collect();
            let spec = build_spec(base, &set).map_err(|e| err(&name, e.into()))?;
            if !spec.all_simulated() {
                return Err(err(&name, RunError::NotSimulated));
            }
            if runs.iter().any(|x| x.name == name) {
                return Err(err(&name, RunError::Duplicate));
            }
            if r.jobs == 0 || r.jobs > MAX_JOBS_PER_RUN {
                return Err(err(&name, RunError::Jobs(r.jobs)));
            }
            runs.push(RunDef {
                name,
                spec,
                jobs: r.jobs,
                shared_functions: r.shared_functions,
            });
        }
    }
    if runs.is_empty() {
        let spec = build_spec(base, &BTreeMap::new()).map_err(|e| err("base", e.into()))?;
        runs.push(RunDef {
            name: "base".into(),
            spec,
            jobs: 1,
            shared_functions: false,
        });
    }
    Ok(runs)
}

/// Row `row` of a check's matrix (variables `vars`), named `name`.
fn expand_check(
    c: &CheckFile,
    name: String,
    row: usize,
    vars: &BTreeMap<String, Value>,
    default_metric: Metric,
    runs: &[RunDef],
) -> Result<CheckDef, CheckError> {
    let kind = match (&c.ratio, &c.order, &c.value) {
        (Some((a, b)), None, None) => CheckKind::Ratio(a.substitute(vars), b.substitute(vars)),
        (None, Some(o), None) => CheckKind::Order(o.iter().map(|r| sub_str(r, vars)).collect()),
        (None, None, Some(v)) => CheckKind::Value(sub_str(v, vars)),
        _ => return Err(CheckError::Kind),
    };
    for r in kind.referenced() {
        if !runs.iter().any(|x| x.name == r) {
            return Err(CheckError::UnknownRun(r));
        }
    }
    let paper_num = match &c.paper {
        Some(PaperValue::One(x)) => Some(*x),
        Some(PaperValue::Each(v)) => Some(*v.get(row).ok_or(CheckError::PaperValues {
            values: v.len(),
            rows: row + 1,
        })?),
        _ => None,
    };
    let paper = match &c.paper {
        Some(PaperValue::Text(t)) => Some(sub_str(t, vars)),
        _ => paper_num.map(|x| format!("{x:.2}×")),
    };
    let band = match (c.band, c.tolerance, paper_num) {
        (Some(b), _, _) => Some(b),
        (None, Some(t), Some(p)) => Some([p * (1.0 - t), p * (1.0 + t)]),
        (None, Some(_), None) => return Err(CheckError::ToleranceWithoutPaper),
        (None, None, _) => None,
    };
    if matches!(kind, CheckKind::Ratio(..) | CheckKind::Value(..)) && band.is_none() {
        return Err(CheckError::NoBand);
    }
    Ok(CheckDef {
        name,
        metric: c.metric.unwrap_or(default_metric),
        kind,
        paper,
        band,
        note: c.note.clone(),
    })
}
