//! `env = { kind = "agent", … }`: episodes played by agent programs through the gateway —
//! a command rollarc starts per episode (managed), or a harness elsewhere that claims them
//! (external).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{EnvSandbox, Problems};

/// An agent task's environment.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AgentEnv {
    /// `managed` (rollarc starts `command` per episode) or `external` (a harness claims
    /// episodes with `POST /v1/jobs/{id}/episodes:claim`).
    #[serde(default)]
    pub mode: AgentMode,
    /// Managed: the program and its arguments, e.g. `["python3", "examples/agents/calc.py"]`.
    /// It gets the dataset row as JSON on stdin and in `$ROLLARC_ROW`.
    #[serde(default)]
    pub command: Vec<String>,
    /// Managed: `bwrap` (default: the sandbox, whose only way out is the gateway) or `none`.
    #[serde(default)]
    pub sandbox: EnvSandbox,
    /// Host paths made readable inside the sandbox.
    #[serde(default)]
    pub readable_paths: Vec<String>,
    /// Managed: variables set in the program's environment (besides the gateway's).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Managed: seconds the program may run; then its process group is killed.
    #[serde(default = "default_timeout_s")]
    pub timeout_s: f64,
    /// External: seconds a claimed episode may take before it is failed and masked.
    #[serde(default = "default_claim_timeout_s")]
    pub claim_timeout_s: f64,
    /// Use the `reward` the agent reports (its last stdout line, or `finish`) instead of the
    /// task's reward functions.
    #[serde(default)]
    pub trust_agent_reward: bool,
    /// An episode succeeds (for success rates and pass@k) when its reward is above this.
    #[serde(default)]
    pub success_threshold: f64,
    /// The reward of a failure the policy caused: the program exited non-zero or ran out of
    /// time, or the episode's budget was spent.
    #[serde(default)]
    pub failure_reward: f64,
    /// The episode's budget: model calls, tokens generated over all calls, context tokens of
    /// one call.
    #[serde(default = "default_max_calls")]
    pub max_calls: u32,
    #[serde(default = "default_max_generated_tokens")]
    pub max_generated_tokens: u64,
    #[serde(default = "default_max_context")]
    pub max_context: usize,
    /// How tool calls are written: `hermes`, `llama3_json` or `mistral`; default: from the
    /// chat template (Hermes when it has no tool syntax).
    #[serde(default)]
    pub tool_format: Option<String>,
    /// A checkpoint (GGUF file or Hugging Face directory) whose tokenizer and chat template
    /// render the calls when the job's pools are simulated (checkpoint pools use their own).
    #[serde(default)]
    pub tokenizer: Option<String>,
}

/// Who runs an agent task's programs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AgentMode {
    #[default]
    Managed,
    External,
}

fn default_timeout_s() -> f64 {
    600.0
}
fn default_claim_timeout_s() -> f64 {
    1800.0
}
fn default_max_calls() -> u32 {
    32
}
fn default_max_generated_tokens() -> u64 {
    16_384
}
fn default_max_context() -> usize {
    4_096
}

/// Variables the program's environment may not set: the gateway's own and those that
/// change which code a listed program runs.
fn reserved_variable(k: &str) -> bool {
    ["OPENAI_", "ANTHROPIC_", "ROLLARC_", "LD_", "PYTHON"]
        .iter()
        .any(|p| k.starts_with(p))
        || [
            "PATH",
            "HOME",
            "NODE_OPTIONS",
            "BASH_ENV",
            "ENV",
            "PERL5OPT",
            "PERL5LIB",
            "RUBYOPT",
            "RUBYLIB",
        ]
        .contains(&k)
}

impl AgentEnv {
    pub(super) fn check(&self, p: &str, problems: &mut Problems) {
        match self.mode {
            AgentMode::Managed => {
                if self.command.is_empty() || self.command[0].trim().is_empty() {
                    problems.push(
                        format!("{p}.command"),
                        "name the agent program to run (or set mode = \"external\")".into(),
                    );
                }
            }
            AgentMode::External => {
                if !self.command.is_empty() {
                    problems.push(
                        format!("{p}.command"),
                        "an external agent task starts no program; leave it out".into(),
                    );
                }
            }
        }
        problems.seconds(format!("{p}.timeout_s"), self.timeout_s, true);
        problems.seconds(format!("{p}.claim_timeout_s"), self.claim_timeout_s, true);
        problems.finite(format!("{p}.failure_reward"), self.failure_reward);
        problems.finite(format!("{p}.success_threshold"), self.success_threshold);
        problems.in_range(format!("{p}.max_calls"), self.max_calls, 1..=10_000);
        problems.in_range(
            format!("{p}.max_generated_tokens"),
            self.max_generated_tokens,
            1..=10_000_000,
        );
        problems.in_range(format!("{p}.max_context"), self.max_context, 16..=1_048_576);
        for k in self.env.keys() {
            let ok = !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !ok {
                problems.push(format!("{p}.env.{k}"), "not a variable name".into());
            } else if reserved_variable(k) {
                problems.push(
                    format!("{p}.env.{k}"),
                    format!("{k} is set by rollarc (or chooses the code a program runs)"),
                );
            }
        }
        if let Some(f) = &self.tool_format
            && actors::agent::ToolFormat::parse_name(f).is_none()
        {
            problems.push(
                format!("{p}.tool_format"),
                format!("{f:?} is not hermes, llama3_json or mistral"),
            );
        }
    }
}
