//! Checks: how a scenario's runs compare with the paper (a ratio against a band, one run's
//! value against a band, or an expected ordering), and their evaluation.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::matrix::sub_str;
use super::metric::Metric;
use super::results::{CheckResult, RunResult};

/// One side of a ratio: a run, or the best (lowest metric) of several.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Side {
    One(String),
    BestOf(Vec<String>),
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

    /// The side with `{var}` substituted in its run names.
    pub(super) fn substitute(&self, vars: &BTreeMap<String, Value>) -> Side {
        match self {
            Side::One(r) => Side::One(sub_str(r, vars)),
            Side::BestOf(v) => Side::BestOf(v.iter().map(|r| sub_str(r, vars)).collect()),
        }
    }
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

impl CheckKind {
    /// Every run the check reads.
    pub(super) fn referenced(&self) -> Vec<String> {
        match self {
            CheckKind::Ratio(a, b) => a
                .runs()
                .into_iter()
                .chain(b.runs())
                .map(String::from)
                .collect(),
            CheckKind::Order(o) => o.clone(),
            CheckKind::Value(v) => vec![v.clone()],
        }
    }
}

fn metric_of(runs: &[RunResult], side: &Side, m: Metric) -> Option<f64> {
    let vals = side.runs().into_iter().filter_map(|r| {
        runs.iter()
            .find(|x| x.name == r)
            .and_then(|x| x.metrics.get(m.name()).copied())
    });
    vals.fold(None, |acc: Option<f64>, v| {
        Some(acc.map_or(v, |a| a.min(v)))
    })
}

fn in_band(v: Option<f64>, band: Option<[f64; 2]>) -> bool {
    matches!((v, band), (Some(v), Some([lo, hi])) if v >= lo && v <= hi)
}

/// What the check measured: its description, the ratio or value, the measured order, and
/// whether it passed.
type Outcome = (String, Option<f64>, Option<Vec<String>>, bool);

fn outcome(c: &CheckDef, runs: &[RunResult]) -> Outcome {
    match &c.kind {
        CheckKind::Ratio(a, b) => {
            let r = match (metric_of(runs, a, c.metric), metric_of(runs, b, c.metric)) {
                (Some(x), Some(y)) if y > 0.0 => Some(x / y),
                _ => None,
            };
            let what = format!("{} / {}", a.label(), b.label());
            (what, r, None, in_band(r, c.band))
        }
        CheckKind::Value(r) => {
            let v = metric_of(runs, &Side::One(r.clone()), c.metric);
            (
                format!("{} of {r}", c.metric.name()),
                v,
                None,
                in_band(v, c.band),
            )
        }
        CheckKind::Order(o) => {
            let mut got: Vec<(f64, String)> = o
                .iter()
                .filter_map(|r| {
                    runs.iter().find(|x| &x.name == r).map(|x| {
                        (
                            x.metrics.get(c.metric.name()).copied().unwrap_or(f64::NAN),
                            r.clone(),
                        )
                    })
                })
                .collect();
            got.sort_by(|a, b| a.0.total_cmp(&b.0));
            let measured: Vec<String> = got.into_iter().map(|x| x.1).collect();
            let pass = &measured == o;
            (
                format!("ascending {}: {}", c.metric.name(), o.join(" < ")),
                None,
                Some(measured),
                pass,
            )
        }
    }
}

/// Evaluates the checks against the runs.
pub fn evaluate(checks: &[CheckDef], runs: &[RunResult]) -> Vec<CheckResult> {
    checks
        .iter()
        .map(|c| {
            let (what, ours, order, pass) = outcome(c, runs);
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
