//! The job spec: typed, `deny_unknown_fields`, parsed from TOML or JSON, validated in one
//! place that reports every problem with its dotted field path in one pass, and resolved
//! against a preset into the concrete knobs the scheduler runs with.

use std::collections::BTreeSet;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

mod agent;
pub mod catalogue;
mod env;
mod env_pool;
mod eval;
pub mod knob;
mod overrides;
mod pool;
mod reward;
mod rollout;
mod sim;
mod suggest;
mod tags;
mod task;
mod trainer;

pub use agent::*;
pub use env::*;
pub use env_pool::*;
pub use eval::*;
pub use overrides::apply_overrides;
pub use pool::*;
pub use reward::*;
pub use rollout::*;
pub use sim::*;
pub use tags::{MAX_TAGS, valid_tag};
pub use task::*;
pub use trainer::*;

/// A job as submitted.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    #[serde(default)]
    pub name: Option<String>,
    /// Labels to find and compare runs by (`["baseline", "lr=1e-5"]`): at most 16, each 1 to
    /// 64 characters of letters, digits and `_ . : / = + -`. `GET /v1/jobs?tag=T` lists the
    /// jobs that carry `T`.
    #[serde(default)]
    pub tags: Vec<String>,
    /// Seed of every RNG of the job.
    #[serde(default)]
    pub seed: u64,
    /// Knob values to start from; explicit knobs override them.
    #[serde(default)]
    pub preset: Option<Preset>,
    #[schema(min_items = 1)]
    pub tasks: Vec<TaskSpec>,
    #[schema(min_items = 1)]
    pub pools: Vec<PoolSpec>,
    /// Env workers hosting tasks' environments on other machines (`tasks[i].env_pool`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env_pools: Vec<EnvPoolSpec>,
    #[serde(default)]
    pub mapping: MappingSpec,
    #[serde(default)]
    pub rollout: RolloutSpec,
    #[serde(default)]
    pub reward: RewardSpec,
    #[serde(default)]
    pub trainer: TrainerSpec,
    #[serde(default)]
    pub sim: SimSpec,
    /// Held-out evaluation during training.
    #[serde(default)]
    pub eval: Option<EvalSpec>,
}

/// One problem with a spec.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FieldError {
    /// Dotted path of the field, e.g. `tasks[0].group_size`.
    pub field: String,
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid job spec: {}", .0.iter().map(|e| format!("{}: {}", e.field, e.message)).collect::<Vec<_>>().join("; "))]
pub struct SpecErrors(pub Vec<FieldError>);

/// Most problems one answer lists; the rest are counted in a last entry. A generated spec
/// with thousands of broken tables gets a short answer, not one as large as itself times 20.
pub const MAX_PROBLEMS: usize = 100;

/// Most entries of `tasks` and of `pools`.
pub const MAX_LIST_ENTRIES: usize = 256;

impl SpecErrors {
    /// `errs` with at most [`MAX_PROBLEMS`] listed and a final entry counting the others.
    pub fn capped(mut errs: Vec<FieldError>) -> Self {
        if errs.len() > MAX_PROBLEMS {
            let more = errs.len() - MAX_PROBLEMS;
            errs.truncate(MAX_PROBLEMS);
            errs.push(FieldError {
                field: String::new(),
                message: format!(
                    "… and {more} more problems (the first {MAX_PROBLEMS} are listed)"
                ),
            });
        }
        Self(errs)
    }
}

/// Body formats accepted for a spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Json,
    Toml,
}

/// Parses and validates a spec, reporting every problem found.
pub fn parse(body: &str, format: Format) -> Result<JobSpec, SpecErrors> {
    let value: serde_json::Value = match format {
        Format::Json => serde_json::from_str(body)
            .map_err(|e| one("", format!("body is not valid JSON: {e}")))?,
        Format::Toml => {
            let t: toml::Table = toml::from_str(body)
                .map_err(|e| one("", format!("body is not valid TOML: {}", e.message())))?;
            // JSON has no NaN or infinity: they would turn into `null` (an unset field).
            let mut bad = Vec::new();
            non_finite(&toml::Value::Table(t.clone()), "", &mut bad);
            if !bad.is_empty() {
                return Err(SpecErrors::capped(bad));
            }
            serde_json::to_value(t).map_err(|e| one("", e.to_string()))?
        }
    };
    let result = from_value(value);
    match (result, format) {
        // A TOML document's problems point at their line and column.
        (Err(SpecErrors(errs)), Format::Toml) => Err(SpecErrors(
            errs.into_iter()
                .map(|mut e| {
                    if let Some((line, column)) = toml_location(body, &e.field) {
                        e.message = format!("{} (line {line}, column {column})", e.message);
                    }
                    e
                })
                .collect(),
        )),
        (r, _) => r,
    }
}

/// Every NaN or infinite float of a TOML document, with its field path.
fn non_finite(v: &toml::Value, path: &str, out: &mut Vec<FieldError>) {
    match v {
        toml::Value::Float(f) if !f.is_finite() => out.push(FieldError {
            field: path.to_string(),
            message: format!("must be a finite number, got {f}"),
        }),
        toml::Value::Table(t) => {
            for (k, v) in t {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                non_finite(v, &p, out);
            }
        }
        toml::Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                non_finite(v, &format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

fn one(field: &str, message: String) -> SpecErrors {
    SpecErrors(vec![FieldError {
        field: field.into(),
        message,
    }])
}

/// Deserialises section by section so that every structural problem is reported, then runs
/// the semantic checks.
pub fn from_value(value: serde_json::Value) -> Result<JobSpec, SpecErrors> {
    let mut errs = Vec::new();
    let serde_json::Value::Object(mut obj) = value else {
        return Err(one("", "a job spec must be a table / object".into()));
    };
    const KNOWN: [&str; 13] = [
        "name",
        "tags",
        "seed",
        "preset",
        "tasks",
        "pools",
        "env_pools",
        "mapping",
        "rollout",
        "reward",
        "trainer",
        "sim",
        "eval",
    ];
    for k in obj.keys() {
        if !KNOWN.contains(&k.as_str()) {
            errs.push(FieldError {
                field: k.clone(),
                message: format!("unknown field, expected one of {}", KNOWN.join(", ")),
            });
        }
    }
    let name = section::<Option<String>>(&mut obj, "name", &mut errs).flatten();
    let tags = section::<Vec<String>>(&mut obj, "tags", &mut errs).unwrap_or_default();
    let seed = section::<u64>(&mut obj, "seed", &mut errs).unwrap_or(0);
    let preset = section::<Option<Preset>>(&mut obj, "preset", &mut errs).flatten();
    if let Some(functions) = obj
        .get_mut("reward")
        .and_then(|r| r.get_mut("functions"))
        .and_then(|f| f.as_object_mut())
    {
        for f in functions.values_mut() {
            python_function_sugar(f);
        }
    }
    let tasks = list::<TaskSpec>(&mut obj, "tasks", &mut errs);
    let pools = list::<PoolSpec>(&mut obj, "pools", &mut errs);
    let env_pools = if obj.contains_key("env_pools") {
        list::<EnvPoolSpec>(&mut obj, "env_pools", &mut errs)
    } else {
        Some(Vec::new())
    };
    let mapping = section::<MappingSpec>(&mut obj, "mapping", &mut errs).unwrap_or_default();
    let rollout = section::<RolloutSpec>(&mut obj, "rollout", &mut errs).unwrap_or_default();
    let reward = section::<RewardSpec>(&mut obj, "reward", &mut errs).unwrap_or_default();
    let trainer = section::<TrainerSpec>(&mut obj, "trainer", &mut errs).unwrap_or_default();
    let sim = section::<SimSpec>(&mut obj, "sim", &mut errs).unwrap_or_default();
    let eval = section::<Option<EvalSpec>>(&mut obj, "eval", &mut errs).flatten();
    let spec = JobSpec {
        name,
        tags,
        seed,
        preset,
        tasks: tasks.unwrap_or_default(),
        pools: pools.unwrap_or_default(),
        env_pools: env_pools.unwrap_or_default(),
        mapping,
        rollout,
        reward,
        trainer,
        sim,
        eval,
    };
    // A section that failed to parse would make the semantic checks report problems that
    // follow from it ("at least one task is required" after a task's misspelt field): they
    // run once the structure is right.
    if errs.is_empty() {
        errs.extend(validate(&spec));
    }
    if errs.is_empty() {
        Ok(spec)
    } else {
        Err(SpecErrors::capped(errs))
    }
}

/// `kind = "python"` (a file with `compute_score(row, answer, transcript)`) is the built-in
/// function `python` with the file and the interpreter's settings as its config: rewritten
/// so before the reward section is read (the stored spec shows the built-in form).
fn python_function_sugar(f: &mut serde_json::Value) {
    let Some(o) = f.as_object_mut() else { return };
    if o.get("kind").and_then(|k| k.as_str()) != Some("python") {
        return;
    }
    let mut config = serde_json::Map::new();
    for key in [
        "file",
        "python",
        "sandbox",
        "readable_paths",
        "max_output_bytes",
        "max_concurrency",
        "item_timeout_s",
    ] {
        if let Some(v) = o.remove(key) {
            // The per-item limit is `config.timeout_s`; the call's own is `timeout_s`.
            let key = if key == "item_timeout_s" {
                "timeout_s"
            } else {
                key
            };
            config.insert(key.to_string(), v);
        }
    }
    o.insert("kind".into(), "builtin".into());
    o.insert("function".into(), "python".into());
    o.insert("config".into(), serde_json::Value::Object(config));
}

fn de_at<T: DeserializeOwned>(
    v: serde_json::Value,
    path: &str,
    errs: &mut Vec<FieldError>,
) -> Option<T> {
    match serde_path_to_error::deserialize::<_, T>(v) {
        Ok(t) => Some(t),
        Err(e) => {
            let inner = e.path().to_string();
            let field = if inner == "." || inner.is_empty() {
                path.to_string()
            } else {
                format!("{path}.{inner}")
            };
            errs.push(FieldError {
                field,
                message: suggest::with_suggestion(e.into_inner().to_string()),
            });
            None
        }
    }
}

fn section<T: DeserializeOwned + Default>(
    obj: &mut serde_json::Map<String, serde_json::Value>,
    key: &str,
    errs: &mut Vec<FieldError>,
) -> Option<T> {
    match obj.remove(key) {
        None => Some(T::default()),
        Some(v) => de_at(v, key, errs),
    }
}

fn list<T: DeserializeOwned>(
    obj: &mut serde_json::Map<String, serde_json::Value>,
    key: &str,
    errs: &mut Vec<FieldError>,
) -> Option<Vec<T>> {
    match obj.remove(key) {
        None => {
            errs.push(FieldError {
                field: key.into(),
                message: "missing field".into(),
            });
            None
        }
        Some(serde_json::Value::Array(items)) if items.len() > MAX_LIST_ENTRIES => {
            errs.push(FieldError {
                field: key.into(),
                message: format!("at most {MAX_LIST_ENTRIES} entries, got {}", items.len()),
            });
            None
        }
        Some(serde_json::Value::Array(items)) => Some(
            items
                .into_iter()
                .enumerate()
                .filter_map(|(i, v)| de_at(v, &format!("{key}[{i}]"), errs))
                .collect(),
        ),
        Some(_) => {
            errs.push(FieldError {
                field: key.into(),
                message: "expected an array".into(),
            });
            None
        }
    }
}

impl JobSpec {
    /// The training tasks and the held-out ones, each list with its field path
    /// (`tasks`, `eval.tasks`).
    pub fn task_lists(&self) -> [(&'static str, &[TaskSpec]); 2] {
        let eval = self
            .eval
            .as_ref()
            .map(|e| e.tasks.as_slice())
            .unwrap_or(&[]);
        [("tasks", self.tasks.as_slice()), ("eval.tasks", eval)]
    }

    /// Whether the job trains with the built-in trainer.
    pub fn trains_builtin(&self) -> bool {
        matches!(self.trainer, TrainerSpec::Builtin(_))
    }

    /// Whether every pool runs a real model (built-in engine or inference server).
    pub fn all_pools_builtin(&self) -> bool {
        self.pools.iter().all(|p| p.backend.real_model().is_some())
    }
}

/// Longest duration any spec field may ask for: 30 days.
pub const MAX_SECONDS: f64 = 30.0 * 24.0 * 3600.0;
/// Most tokens a simulated observation, prompt or response may have.
pub const MAX_TOKENS: u64 = 1 << 20;
/// Most turns a simulated episode may take.
pub const MAX_TURNS: u64 = 10_000;
/// Most episodes in flight at once (and environments per task): each holds memory.
pub const MAX_EPISODES: usize = 100_000;
/// Most groups in one training batch.
pub const MAX_BATCH_GROUPS: usize = 65_536;
/// Most training steps of one job.
pub const MAX_STEPS: u64 = 1_000_000_000;

/// Collects every problem of a spec with its dotted field path.
#[derive(Debug, Default)]
pub struct Problems(Vec<FieldError>);

impl Problems {
    pub fn push(&mut self, field: String, message: String) {
        self.0.push(FieldError { field, message });
    }

    pub fn into_vec(self) -> Vec<FieldError> {
        self.0
    }

    /// A number in `range` (whole numbers: `must be in 1..=1000, got 0`).
    pub fn in_range<T: PartialOrd + std::fmt::Display>(
        &mut self,
        field: String,
        v: T,
        range: std::ops::RangeInclusive<T>,
    ) {
        if !range.contains(&v) {
            let msg = format!("must be in {}..={}, got {v}", range.start(), range.end());
            self.push(field, msg);
        }
    }

    /// A finite number (no NaN, no infinity).
    pub fn finite(&mut self, field: String, v: f64) {
        if !v.is_finite() {
            self.push(field, "must be a finite number".into());
        }
    }

    /// A duration field in seconds: finite, at least `min` (exclusive when `min` is 0 and
    /// `positive`), and at most [`MAX_SECONDS`] (a longer time is a typo, and would overflow
    /// the clock's arithmetic).
    pub fn seconds(&mut self, field: String, v: f64, positive: bool) {
        let low_ok = if positive { v > 0.0 } else { v >= 0.0 };
        if !(v.is_finite() && low_ok && v <= MAX_SECONDS) {
            let low = if positive { "(0" } else { "[0" };
            self.push(
                field,
                format!("must be a number of seconds in {low}, {MAX_SECONDS}], got {v}"),
            );
        }
    }
}

/// Semantic checks, section by section; every problem with its path.
pub fn validate(spec: &JobSpec) -> Vec<FieldError> {
    let mut problems = Problems::default();
    tags::check(&spec.tags, &mut problems);
    if spec.tasks.is_empty() {
        problems.push("tasks".into(), "at least one task is required".into());
    }
    if spec.pools.is_empty() {
        problems.push(
            "pools".into(),
            "at least one generation pool is required".into(),
        );
    }
    let mut domains = BTreeSet::new();
    for (i, t) in spec.tasks.iter().enumerate() {
        let p = format!("tasks[{i}]");
        if t.domain.trim().is_empty() {
            problems.push(format!("{p}.domain"), "must not be empty".into());
        } else if !domains.insert(t.domain.as_str()) {
            problems.push(
                format!("{p}.domain"),
                format!("duplicate task domain {:?}", t.domain),
            );
        }
        t.check(&p, spec, &mut problems);
    }
    let mut pools = BTreeSet::new();
    for (i, pl) in spec.pools.iter().enumerate() {
        let p = format!("pools[{i}]");
        if pl.name.trim().is_empty() {
            problems.push(format!("{p}.name"), "must not be empty".into());
        } else if !pools.insert(pl.name.as_str()) {
            problems.push(
                format!("{p}.name"),
                format!("duplicate pool name {:?}", pl.name),
            );
        }
        pl.check(&p, spec, &mut problems);
    }
    env_pool::check_pools(spec, &mut problems);
    spec.mapping.check(spec, &mut problems);
    spec.rollout.check(spec, &mut problems);
    spec.sim.check(spec, &mut problems);
    spec.reward.check(spec, &mut problems);
    spec.trainer.check(spec, &mut problems);
    if let Some(e) = &spec.eval {
        e.check(spec, &mut problems);
    }
    problems.into_vec()
}

#[cfg(test)]
mod tests;

/// One step of a field path: a key, or an index into an array.
enum Segment<'a> {
    Key(&'a str),
    Index(usize),
}

/// The segments of a dotted field path as [`FieldError`] names fields
/// (`tasks[0].env.step_latency_s`).
fn segments(field: &str) -> Vec<Segment<'_>> {
    let mut out = Vec::new();
    for part in field.split('.').filter(|p| !p.is_empty()) {
        let (key, mut rest) = part.split_once('[').map_or((part, ""), |(k, r)| (k, r));
        if !key.is_empty() {
            out.push(Segment::Key(key));
        }
        while let Some((n, after)) = rest.split_once(']') {
            if let Ok(i) = n.parse() {
                out.push(Segment::Index(i));
            }
            rest = after.strip_prefix('[').unwrap_or(after);
        }
    }
    out
}

/// Where `field` is in the TOML document `text`: the 1-based line and column of its key
/// (or of the deepest enclosing table or entry the document has).
pub fn toml_location(text: &str, field: &str) -> Option<(usize, usize)> {
    use toml::de::{DeTable, DeValue};
    let doc = DeTable::parse(text).ok()?;
    let mut at: Option<std::ops::Range<usize>> = None;
    let mut table: Option<&DeTable<'_>> = Some(doc.get_ref());
    let mut array: Option<&toml::de::DeArray<'_>> = None;
    for seg in segments(field) {
        let value = match seg {
            Segment::Key(k) => {
                let Some((key, value)) =
                    table.and_then(|t| t.iter().find(|(key, _)| key.get_ref() == k))
                else {
                    break;
                };
                at = Some(key.span());
                value
            }
            Segment::Index(i) => {
                let Some(value) = array.and_then(|a| a.get(i)) else {
                    break;
                };
                at = Some(value.span());
                value
            }
        };
        (table, array) = match value.get_ref() {
            DeValue::Table(t) => (Some(t), None),
            DeValue::Array(a) => (None, Some(a)),
            _ => (None, None),
        };
    }
    let start = at?.start.min(text.len());
    let before = &text[..start];
    let line = before.matches('\n').count() + 1;
    let column = before.rfind('\n').map_or(start, |nl| start - nl - 1) + 1;
    Some((line, column))
}
