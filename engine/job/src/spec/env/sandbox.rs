//! A simulated task's sandbox machine: the cores its sandboxes share and how many start at once.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::spec::Problems;
use actors::dist::Dist;

/// A simulated task's sandbox machine (`env.sandbox`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SimSandboxSpec {
    /// Cores the task's sandboxes share; a call waits for a free one (default: unlimited).
    #[serde(default)]
    pub cores: Option<u32>,
    /// Seconds of one core each reset and each step computes, after its latency.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub reset_cpu_s: Option<Dist>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub step_cpu_s: Option<Dist>,
    /// Sandboxes that may start (reset) at once (default: unlimited).
    #[serde(default)]
    pub max_concurrent_starts: Option<u32>,
    /// Sandboxes kept started ahead: a reset takes one at no cost while any is ready, and a
    /// replacement starts in the background (default 0).
    #[serde(default)]
    pub warm: u32,
}

impl SimSandboxSpec {
    /// Checks the machine's sizes and distributions (at `p`, e.g. `tasks[0].env.sandbox`).
    pub(in crate::spec) fn check(&self, p: &str, problems: &mut Problems) {
        for (name, v) in [
            ("cores", self.cores),
            ("max_concurrent_starts", self.max_concurrent_starts),
        ] {
            if v == Some(0) {
                problems.push(format!("{p}.{name}"), "must be at least 1".into());
            }
        }
        for (name, d) in [
            ("reset_cpu_s", &self.reset_cpu_s),
            ("step_cpu_s", &self.step_cpu_s),
        ] {
            let Some(d) = d else { continue };
            let found = d.problems();
            let valid = found.is_empty();
            for m in found {
                problems.push(format!("{p}.{name}"), m);
            }
            if valid && d.upper() > crate::spec::MAX_SECONDS {
                problems.push(
                    format!("{p}.{name}"),
                    format!(
                        "reaches {:.3e} s; at most {} allowed",
                        d.upper(),
                        crate::spec::MAX_SECONDS
                    ),
                );
            }
        }
    }
}
