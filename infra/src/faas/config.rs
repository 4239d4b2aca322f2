//! Deployment configuration with Knative's knob names, so a deployment translates one to one
//! into a Knative Service (see `deploy/`).

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A duration written the Knative way: `"60s"`, `"500ms"`, `"2m"`, `"1h"` (or a number of seconds).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Dur(pub Duration);

impl Dur {
    pub const fn secs(s: u64) -> Self {
        Self(Duration::from_secs(s))
    }
    pub const fn millis(ms: u64) -> Self {
        Self(Duration::from_millis(ms))
    }
}

impl fmt::Display for Dur {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0.as_millis();
        if ms.is_multiple_of(1000) {
            write!(f, "{}s", ms / 1000)
        } else {
            write!(f, "{ms}ms")
        }
    }
}

/// Why a text is not a duration.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("{text:?} is not a duration (e.g. \"60s\", \"500ms\", \"2m\")")]
    NotANumber {
        text: String,
        #[source]
        source: std::num::ParseFloatError,
    },
    #[error("{text:?}: unknown unit {unit:?} (use ms, s, m or h)")]
    UnknownUnit { text: String, unit: String },
    #[error("{text:?} is not a non-negative duration")]
    OutOfRange { text: String },
}

/// Parses `"60s"`, `"1.5s"`, `"500ms"`, `"2m"`, `"1h"`.
pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let v: f64 = num.parse().map_err(|source| DurationError::NotANumber {
        text: s.to_string(),
        source,
    })?;
    let secs = match unit {
        "ms" => v / 1000.0,
        "s" | "" => v,
        "m" => v * 60.0,
        "h" => v * 3600.0,
        _ => {
            return Err(DurationError::UnknownUnit {
                text: s.to_string(),
                unit: unit.to_string(),
            });
        }
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(DurationError::OutOfRange {
            text: s.to_string(),
        });
    }
    Ok(Duration::from_secs_f64(secs))
}

impl Serialize for Dur {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Text(String),
            Secs(f64),
        }
        match Raw::deserialize(d)? {
            Raw::Text(t) => parse_duration(&t)
                .map(Dur)
                .map_err(serde::de::Error::custom),
            Raw::Secs(v) if v.is_finite() && v >= 0.0 => Ok(Dur(Duration::from_secs_f64(v))),
            Raw::Secs(v) => Err(serde::de::Error::custom(format!(
                "{v} is not a non-negative number of seconds"
            ))),
        }
    }
}

/// Autoscaling knobs, named as Knative names them (annotation `autoscaling.knative.dev/<name>`
/// or, for `container-concurrency`, `spec.template.spec.containerConcurrency`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct Scaling {
    /// Hard limit of in-flight requests per instance; 0 = no limit (soft target only).
    pub container_concurrency: u32,
    /// Soft concurrency target per instance; default: `container-concurrency`, or 100 without one.
    pub target: Option<f64>,
    pub target_utilization_percentage: f64,
    pub stable_window: Dur,
    pub panic_window_percentage: f64,
    pub panic_threshold_percentage: f64,
    pub max_scale_up_rate: f64,
    pub max_scale_down_rate: f64,
    pub scale_to_zero_grace_period: Dur,
    pub scale_down_delay: Dur,
    pub min_scale: u32,
    /// 0 = unbounded (the local runtime still caps every deployment at `LOCAL_MAX_INSTANCES`).
    pub max_scale: u32,
    pub initial_scale: u32,
    pub activation_scale: u32,
    /// How often the autoscaler decides (Knative: 2 s).
    pub tick_interval: Dur,
}

impl Default for Scaling {
    fn default() -> Self {
        Self {
            container_concurrency: 0,
            target: None,
            target_utilization_percentage: 70.0,
            stable_window: Dur::secs(60),
            panic_window_percentage: 10.0,
            panic_threshold_percentage: 200.0,
            max_scale_up_rate: 1000.0,
            max_scale_down_rate: 2.0,
            scale_to_zero_grace_period: Dur::secs(30),
            scale_down_delay: Dur::secs(0),
            min_scale: 0,
            max_scale: 0,
            initial_scale: 1,
            activation_scale: 1,
            tick_interval: Dur::secs(2),
        }
    }
}

/// A hard cap on instances of one deployment in the local runtime (processes on one machine).
pub const LOCAL_MAX_INSTANCES: u32 = 64;

impl Scaling {
    /// Concurrency one instance should carry: target × utilisation.
    pub fn per_instance_target(&self) -> f64 {
        let base = self.target.unwrap_or(if self.container_concurrency > 0 {
            self.container_concurrency as f64
        } else {
            100.0
        });
        (base * self.target_utilization_percentage / 100.0).max(0.01)
    }

    pub fn panic_window(&self) -> Duration {
        self.stable_window
            .0
            .mul_f64(self.panic_window_percentage / 100.0)
            .max(self.tick_interval.0)
    }

    /// Every problem, each naming its knob.
    pub fn problems(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        let mut bad = |k: &str, m: String| out.push((k.to_string(), m));
        if let Some(t) = self.target
            && !(t.is_finite() && t > 0.0)
        {
            bad("target", format!("must be > 0, got {t}"));
        }
        if !(self.target_utilization_percentage > 0.0
            && self.target_utilization_percentage <= 100.0)
        {
            bad(
                "target-utilization-percentage",
                format!(
                    "must be in (0, 100], got {}",
                    self.target_utilization_percentage
                ),
            );
        }
        if !(1.0..=100.0).contains(&self.panic_window_percentage) {
            bad(
                "panic-window-percentage",
                format!("must be in [1, 100], got {}", self.panic_window_percentage),
            );
        }
        if !(110.0..=1000.0).contains(&self.panic_threshold_percentage) {
            bad(
                "panic-threshold-percentage",
                format!(
                    "must be in [110, 1000], got {}",
                    self.panic_threshold_percentage
                ),
            );
        }
        if self.max_scale_up_rate.is_nan() || self.max_scale_up_rate <= 1.0 {
            bad(
                "max-scale-up-rate",
                format!("must be > 1, got {}", self.max_scale_up_rate),
            );
        }
        if self.max_scale_down_rate.is_nan() || self.max_scale_down_rate <= 1.0 {
            bad(
                "max-scale-down-rate",
                format!("must be > 1, got {}", self.max_scale_down_rate),
            );
        }
        if self.stable_window.0 < Duration::from_secs(1) {
            bad(
                "stable-window",
                format!("must be at least 1s, got {}", self.stable_window),
            );
        }
        if self.tick_interval.0 < Duration::from_millis(10)
            || self.tick_interval.0 > self.stable_window.0
        {
            bad(
                "tick-interval",
                format!(
                    "must be between 10ms and the stable window, got {}",
                    self.tick_interval
                ),
            );
        }
        if self.max_scale > 0 && self.min_scale > self.max_scale {
            bad(
                "min-scale",
                format!("{} is above max-scale {}", self.min_scale, self.max_scale),
            );
        }
        if self.max_scale > 0 && self.initial_scale > self.max_scale {
            bad(
                "initial-scale",
                format!(
                    "{} is above max-scale {}",
                    self.initial_scale, self.max_scale
                ),
            );
        }
        if self.activation_scale == 0 {
            bad("activation-scale", "must be at least 1".into());
        }
        out
    }
}

/// One function deployment: what to run and how to scale it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct DeploymentConfig {
    pub name: String,
    /// Executable; for Knative, the container image (see `image`).
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub scaling: Scaling,
    /// Readiness probe path (HTTP GET, 2xx = ready).
    #[serde(default = "d_readiness")]
    pub readiness_path: String,
    /// Request path the router posts to.
    #[serde(default = "d_path")]
    pub path: String,
    /// Instances not ready within this time are killed and replaced.
    #[serde(default = "d_startup")]
    pub startup_timeout: Dur,
    /// SIGTERM → wait this long for in-flight requests → SIGKILL.
    #[serde(default = "d_grace")]
    pub termination_grace: Dur,
    /// Requests the activator holds while short of capacity; past it: fast 503.
    #[serde(default = "d_activator")]
    pub activator_capacity: usize,
    /// Knative `timeoutSeconds`: the longest a request may take.
    #[serde(default = "d_timeout")]
    pub timeout_seconds: u64,
    /// Container image for the Knative translation.
    #[serde(default)]
    pub image: Option<String>,
    /// The `function` label of the deployment's metrics (default: `name`). A job's dedicated
    /// deployment is named after the job; its label leaves the job out, so labels stay bounded
    /// by the functions and configurations in use, not by the jobs ever run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_name: Option<String>,
}

fn d_readiness() -> String {
    "/healthz".into()
}
fn d_path() -> String {
    "/".into()
}
fn d_startup() -> Dur {
    Dur::secs(60)
}
fn d_grace() -> Dur {
    Dur::secs(30)
}
fn d_activator() -> usize {
    10_000
}
fn d_timeout() -> u64 {
    300
}

impl DeploymentConfig {
    pub fn new(name: impl Into<String>, command: impl Into<String>, args: Vec<String>) -> Self {
        Self {
            name: name.into(),
            command: command.into(),
            args,
            env: BTreeMap::new(),
            scaling: Scaling::default(),
            readiness_path: d_readiness(),
            path: d_path(),
            startup_timeout: d_startup(),
            termination_grace: d_grace(),
            activator_capacity: d_activator(),
            timeout_seconds: d_timeout(),
            image: None,
            metrics_name: None,
        }
    }

    /// The `function` label of this deployment's metrics.
    pub fn metrics_label(&self) -> &str {
        self.metrics_name.as_deref().unwrap_or(&self.name)
    }

    /// Every problem, each with its dotted field path.
    pub fn problems(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = self
            .scaling
            .problems()
            .into_iter()
            .map(|(k, m)| (format!("scaling.{k}"), m))
            .collect();
        let dns_ok = !self.name.is_empty()
            && self.name.len() <= 63
            && self
                .name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !self.name.starts_with('-')
            && !self.name.ends_with('-');
        if !dns_ok {
            out.push((
                "name".into(),
                format!(
                    "{:?} must be a DNS label (lowercase letters, digits, '-', at most 63)",
                    self.name
                ),
            ));
        }
        if self.command.trim().is_empty() {
            out.push(("command".into(), "must name an executable".into()));
        }
        if !self.readiness_path.starts_with('/') {
            out.push((
                "readiness-path".into(),
                format!("{:?} must start with '/'", self.readiness_path),
            ));
        }
        if !self.path.starts_with('/') {
            out.push((
                "path".into(),
                format!("{:?} must start with '/'", self.path),
            ));
        }
        if self.activator_capacity == 0 {
            out.push(("activator-capacity".into(), "must be at least 1".into()));
        }
        if self.timeout_seconds == 0 {
            out.push(("timeout-seconds".into(), "must be at least 1".into()));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_the_knative_way() {
        assert_eq!(parse_duration("60s").unwrap(), Duration::from_secs(60));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert!(matches!(
            parse_duration("soon"),
            Err(DurationError::NotANumber { .. })
        ));
        assert!(
            parse_duration("3d")
                .unwrap_err()
                .to_string()
                .contains("unknown unit")
        );

        assert_eq!(Dur::millis(1500).to_string(), "1500ms");
        assert_eq!(Dur::secs(60).to_string(), "60s");
    }

    #[test]
    fn knobs_are_checked_by_name() {
        let s = Scaling {
            min_scale: 5,
            max_scale: 2,
            target_utilization_percentage: 0.0,
            ..Scaling::default()
        };
        let p: Vec<String> = s.problems().into_iter().map(|(k, _)| k).collect();
        assert_eq!(p, vec!["target-utilization-percentage", "min-scale"]);
        let d = DeploymentConfig::new("Bad_Name", "", vec![]);
        let p: Vec<String> = d.problems().into_iter().map(|(k, _)| k).collect();
        assert_eq!(p, vec!["name", "command"]);
        let toml_text = "name = \"math\"\ncommand = \"rollarc-fn\"\n[scaling]\nstable-window = \"6s\"\ncontainer-concurrency = 4\n";
        let d: DeploymentConfig = toml::from_str(toml_text).unwrap();
        assert_eq!(d.scaling.stable_window, Dur::secs(6));
        assert_eq!(d.scaling.per_instance_target(), 4.0 * 0.7);
        assert!(
            toml::from_str::<DeploymentConfig>(
                "name = \"m\"\ncommand = \"x\"\n[scaling]\nstable_window = \"6s\"\n"
            )
            .is_err()
        );
    }
}
