//! The `reward` section: where reward functions run (placement) and the functions a task may
//! name (simulated, built-in, a command, or an HTTP endpoint).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::Problems;
use actors::dist::Dist;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RewardPlacement {
    Serverless,
    Local,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RewardSpec {
    #[serde(default)]
    pub placement: Option<RewardPlacement>,
    /// Named reward functions the tasks refer to.
    #[serde(default)]
    pub functions: BTreeMap<String, FunctionSpec>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum FunctionSpec {
    /// Latency, cold start and concurrency model in virtual time.
    Sim {
        #[serde(default)]
        #[schema(value_type = Option<Object>)]
        latency_s: Option<Dist>,
        #[serde(default)]
        cold_start_s: f64,
        #[serde(default = "default_concurrency")]
        concurrency: usize,
        #[serde(default = "default_scale_to_zero_after")]
        scale_to_zero_after_s: f64,
        /// Serverless placement scaled by the Knative pod autoscaler (Knative knob names, as for
        /// built-in functions; `cold_start_s` per instance started). Without it, serverless is a
        /// single pool of `concurrency` slots that goes cold after `scale_to_zero_after_s` idle.
        #[serde(default)]
        #[schema(value_type = Option<Object>)]
        scaling: Option<infra::faas::Scaling>,
    },
    /// A built-in function (`math`, `format`, `env`, `code`, `judge`) run as processes by the
    /// service's function runtime.
    Builtin {
        function: String,
        /// The function's own configuration (JSON object), e.g. the `format` regex.
        #[serde(default)]
        #[schema(value_type = Option<Object>)]
        config: Option<serde_json::Value>,
        /// Knative knob names (`container-concurrency`, `min-scale`, `stable-window`, …).
        #[serde(default)]
        #[schema(value_type = Object)]
        scaling: infra::faas::Scaling,
        #[serde(default = "default_function_timeout")]
        timeout_s: f64,
        /// Scores outside this range are rejected.
        #[serde(default = "default_score_range")]
        range: [f64; 2],
        /// Hedge a call (a second try elsewhere) once it runs past this latency percentile
        /// (e.g. 0.95), under a budget; off by default.
        #[serde(default)]
        hedge_percentile: Option<f64>,
    },
    /// Any program that serves the function protocol on `$PORT`, run by the function runtime.
    Command {
        command: String,
        #[serde(default)]
        args: Vec<String>,
        #[serde(default)]
        env: BTreeMap<String, String>,
        #[serde(default)]
        #[schema(value_type = Object)]
        scaling: infra::faas::Scaling,
        #[serde(default = "default_function_timeout")]
        timeout_s: f64,
        #[serde(default = "default_score_range")]
        range: [f64; 2],
        #[serde(default)]
        hedge_percentile: Option<f64>,
    },
    /// A function already served at a URL (e.g. a Knative Service).
    Http {
        url: String,
        #[serde(default = "default_function_timeout")]
        timeout_s: f64,
        #[serde(default = "default_score_range")]
        range: [f64; 2],
        #[serde(default)]
        hedge_percentile: Option<f64>,
    },
}

fn default_function_timeout() -> f64 {
    30.0
}
fn default_score_range() -> [f64; 2] {
    [0.0, 1.0]
}

/// Built-in function executables (`rollarc-fn NAME`).
pub const BUILTIN_FUNCTIONS: [&str; 5] = ["math", "format", "env", "code", "judge"];

fn default_concurrency() -> usize {
    64
}
fn default_scale_to_zero_after() -> f64 {
    90.0
}

/// Names of the reward functions every job has.
pub const BUILTIN_REWARDS: [&str; 1] = ["env"];

fn check_hedge(p: &str, hedge: Option<f64>, problems: &mut Problems) {
    if let Some(h) = hedge
        && !(h > 0.0 && h < 1.0)
    {
        problems.push(
            format!("{p}.hedge_percentile"),
            format!("must be in (0, 1), e.g. 0.95; got {h}"),
        );
    }
}

fn check_function_common(
    p: &str,
    scaling: Option<&infra::faas::Scaling>,
    timeout_s: f64,
    range: [f64; 2],
    problems: &mut Problems,
) {
    problems.seconds(format!("{p}.timeout_s"), timeout_s, true);
    if !(range[0].is_finite() && range[1].is_finite() && range[0] < range[1]) {
        problems.push(
            format!("{p}.range"),
            format!("must be [min, max] with min < max, got {range:?}"),
        );
    }
    if let Some(s) = scaling {
        for (k, m) in s.problems() {
            problems.push(format!("{p}.scaling.{k}"), m);
        }
    }
}

impl RewardSpec {
    /// Checks every function definition.
    pub(super) fn check(&self, problems: &mut Problems) {
        for (name, f) in &self.functions {
            let p = format!("reward.functions.{name}");
            if BUILTIN_REWARDS.contains(&name.as_str()) {
                problems.push(
                    p.clone(),
                    format!("{name:?} is a built-in reward and cannot be redefined"),
                );
            }
            match f {
                FunctionSpec::Sim {
                    latency_s,
                    cold_start_s,
                    concurrency,
                    scale_to_zero_after_s,
                    scaling,
                } => {
                    if let Some(s) = scaling {
                        for (k, m) in s.problems() {
                            problems.push(format!("{p}.scaling.{k}"), m);
                        }
                    }
                    if let Some(d) = latency_s {
                        for m in d.problems() {
                            problems.push(format!("{p}.latency_s"), m);
                        }
                    }
                    problems.seconds(format!("{p}.cold_start_s"), *cold_start_s, false);
                    if *concurrency == 0 {
                        problems.push(format!("{p}.concurrency"), "must be at least 1".into());
                    }
                    problems.seconds(
                        format!("{p}.scale_to_zero_after_s"),
                        *scale_to_zero_after_s,
                        false,
                    );
                }
                FunctionSpec::Builtin {
                    function,
                    config,
                    scaling,
                    timeout_s,
                    range,
                    hedge_percentile,
                } => {
                    check_hedge(&p, *hedge_percentile, problems);
                    if !BUILTIN_FUNCTIONS.contains(&function.as_str()) {
                        problems.push(
                            format!("{p}.function"),
                            format!(
                                "unknown built-in function {function:?}; one of {}",
                                BUILTIN_FUNCTIONS.join(", ")
                            ),
                        );
                    }
                    if config.as_ref().is_some_and(|c| !c.is_object()) {
                        problems.push(
                            format!("{p}.config"),
                            "must be a table (JSON object)".into(),
                        );
                    }
                    check_function_common(&p, Some(scaling), *timeout_s, *range, problems);
                }
                FunctionSpec::Command {
                    command,
                    scaling,
                    timeout_s,
                    range,
                    hedge_percentile,
                    ..
                } => {
                    check_hedge(&p, *hedge_percentile, problems);
                    if command.trim().is_empty() {
                        problems.push(format!("{p}.command"), "must name an executable".into());
                    }
                    check_function_common(&p, Some(scaling), *timeout_s, *range, problems);
                }
                FunctionSpec::Http {
                    url,
                    timeout_s,
                    range,
                    hedge_percentile,
                } => {
                    check_hedge(&p, *hedge_percentile, problems);
                    if !(url.starts_with("http://") || url.starts_with("https://"))
                        || reqwest::Url::parse(url).is_err()
                    {
                        problems.push(format!("{p}.url"), format!("{url:?} is not an http(s) URL"));
                    }
                    check_function_common(&p, None, *timeout_s, *range, problems);
                }
            }
        }
    }
}
