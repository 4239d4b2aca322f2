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
        /// A reward model on GPUs: each instance batches its calls on the device roofline
        /// (`latency_s` is then what a call costs besides the model). Its GPU time held and
        /// busy is reported per function.
        #[serde(default)]
        gpu: Option<SimGpuSpec>,
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

/// A simulated reward or judge model served on GPUs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SimGpuSpec {
    /// Device class (`sim.devices` or the catalogue: H800, H20, H100, A100, CPU).
    pub device: String,
    /// Model profile (`sim.models` or the catalogue, e.g. `qwen3-8b`).
    pub model: String,
    /// GPUs per instance, one tensor-parallel group.
    #[serde(default = "one")]
    pub gpus_per_instance: u32,
    /// Instances of a dedicated deployment (`reward.placement = "local"`): always on. A
    /// serverless one is scaled by its `scaling`.
    #[serde(default = "one")]
    pub instances: u32,
    /// Calls an instance runs in one batch.
    #[serde(default = "default_judge_batch")]
    pub max_batch: u32,
    /// Tokens of the verdict decoded per call.
    #[serde(default = "default_verdict_tokens")]
    pub verdict_tokens: u32,
    /// What the judge reads of a trajectory.
    #[serde(default)]
    pub reads: JudgeReads,
}

/// What a judge on GPUs reads of a trajectory (what its prefill costs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum JudgeReads {
    /// Every turn: observations and answers.
    #[default]
    Trajectory,
    /// The task (first observation) and the final answer.
    FinalAnswer,
}

fn one() -> u32 {
    1
}
fn default_judge_batch() -> u32 {
    32
}
fn default_verdict_tokens() -> u32 {
    16
}

impl SimGpuSpec {
    fn check(&self, p: &str, spec: &super::JobSpec, problems: &mut Problems) {
        if spec.device_profile(&self.device).is_none() {
            problems.push(
                format!("{p}.device"),
                format!(
                    "unknown device class {:?}, expected one of {} or one under sim.devices",
                    self.device,
                    actors::device::DeviceProfile::BUILTIN_NAMES.join(", ")
                ),
            );
        }
        if spec.model_profile(&self.model).is_none() {
            problems.push(
                format!("{p}.model"),
                format!(
                    "unknown model {:?}, expected one of {} or one under sim.models",
                    self.model,
                    actors::device::ModelProfile::BUILTIN_NAMES.join(", ")
                ),
            );
        }
        for (field, v, max) in [
            ("gpus_per_instance", self.gpus_per_instance, 64),
            ("instances", self.instances, 4096),
            ("max_batch", self.max_batch, 65_536),
            ("verdict_tokens", self.verdict_tokens, 1 << 20),
        ] {
            if v == 0 || v > max {
                problems.push(
                    format!("{p}.{field}"),
                    format!("must be in 1..={max}, got {v}"),
                );
            }
        }
        if let (Some(d), Some(m)) = (
            spec.device_profile(&self.device),
            spec.model_profile(&self.model),
        ) {
            let have = d.memory * f64::from(self.gpus_per_instance.max(1));
            if m.weight_bytes() > have {
                problems.push(
                    format!("{p}.gpus_per_instance"),
                    format!(
                        "{}'s weights ({:.0} GB) do not fit in {} × {} ({:.0} GB)",
                        m.name,
                        m.weight_bytes() / 1e9,
                        self.gpus_per_instance,
                        d.name,
                        have / 1e9
                    ),
                );
            }
        }
    }
}

fn default_function_timeout() -> f64 {
    30.0
}
fn default_score_range() -> [f64; 2] {
    [0.0, 1.0]
}

/// Built-in function executables (`rollarc-fn NAME`).
pub const BUILTIN_FUNCTIONS: [&str; 7] = [
    "math", "format", "env", "code", "python", "judge", "tool_use",
];

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
    pub(super) fn check(&self, spec: &super::JobSpec, problems: &mut Problems) {
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
                    gpu,
                } => {
                    if let Some(g) = gpu {
                        g.check(&format!("{p}.gpu"), spec, problems);
                    }
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
