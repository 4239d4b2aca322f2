//! The `tasks[].env` section: which environment a task runs (simulated, built-in, or an
//! external program) and its parameters.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::Problems;
use actors::dist::Dist;

mod knobs;
mod sandbox;
pub(super) use knobs::knobs;
pub use knobs::*;
pub use sandbox::SimSandboxSpec;

/// How a task's environments are provided.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum EnvSpec {
    /// Latency and length model in virtual time.
    Sim {
        #[serde(default)]
        #[schema(value_type = Option<Object>)]
        reset_latency_s: Option<Dist>,
        #[serde(default)]
        #[schema(value_type = Option<Object>)]
        step_latency_s: Option<Dist>,
        #[serde(default)]
        #[schema(value_type = Option<Object>)]
        turns: Option<Dist>,
        #[serde(default)]
        #[schema(value_type = Option<Object>)]
        observation_tokens: Option<Dist>,
        /// The first observation (the prompt); default: `observation_tokens`.
        #[serde(default)]
        #[schema(value_type = Option<Object>)]
        prompt_tokens: Option<Dist>,
        #[serde(default)]
        #[schema(value_type = Option<Object>)]
        response_tokens: Option<Dist>,
        #[serde(default = "default_success_rate")]
        success_rate: f64,
        #[serde(default)]
        failure_probability: f64,
        #[serde(default)]
        hang_probability: f64,
        /// Correlated difficulty: a factor drawn once per prompt (group) from this
        /// distribution scales the turns, response lengths and environment latencies of every
        /// episode of the group, so stragglers are hard prompts rather than independent draws.
        /// Default: none (factor 1).
        #[serde(default)]
        #[schema(value_type = Option<Object>)]
        difficulty: Option<Dist>,
        /// The machine the task's sandboxes share (CPU work per call on a number of cores,
        /// starts at once); default: calls only wait their latency.
        #[serde(default)]
        sandbox: Option<SimSandboxSpec>,
    },
    /// FrozenLake (4×4 or 8×8, slippery or not); actions `left|down|right|up`.
    Frozenlake {
        #[serde(default = "default_frozenlake_size")]
        size: usize,
        #[serde(default)]
        slippery: bool,
        #[serde(default)]
        random_map: bool,
        #[serde(default = "default_invalid_penalty")]
        invalid_penalty: f64,
        #[serde(default)]
        end_on_invalid: bool,
    },
    /// Sokoban in generated rooms with 1–2 boxes; actions `left|down|right|up`.
    Sokoban {
        #[serde(default = "default_sokoban_size")]
        size: usize,
        #[serde(default = "default_sokoban_boxes")]
        boxes: usize,
        #[serde(default = "default_sokoban_scramble")]
        scramble: usize,
        #[serde(default = "default_invalid_penalty")]
        invalid_penalty: f64,
        #[serde(default)]
        end_on_invalid: bool,
    },
    /// One arithmetic question per episode; the answer is a number.
    Arithmetic {
        #[serde(default = "default_max_operand")]
        max_operand: i64,
        /// Operators to draw from, e.g. "+-*".
        #[serde(default = "default_ops")]
        ops: String,
    },
    /// Any program speaking the environment protocol (NDJSON over stdio).
    External {
        /// Program and arguments, e.g. `["python3", "envs/gymnasium_bridge.py", "FrozenLake-v1"]`.
        command: Vec<String>,
        /// `bwrap` (default: namespaces, read-only system, rlimits) or `none` (opt out).
        #[serde(default)]
        sandbox: EnvSandbox,
        /// Host paths made visible read-only inside the sandbox (e.g. an interpreter's install
        /// under a hidden home).
        #[serde(default)]
        readable_paths: Vec<String>,
        #[serde(default = "default_max_message_bytes")]
        max_message_bytes: usize,
        #[serde(default = "default_protocol")]
        protocol: u32,
        /// Protocol 3: programs serving the task's episodes (environment `i` uses program
        /// `i mod processes`). Versions 1 and 2 run one program per environment.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        processes: Option<usize>,
        /// Each observation carries the state the agent needs (a board, a screen), so old
        /// turns may leave the context (`truncation = "drop_oldest_turns"`).
        #[serde(default)]
        droppable_turns: bool,
    },
    /// One dataset row per episode (the task's `dataset`), answered in one turn; the answer
    /// is checked by `verifier` and is the reference of the task's reward functions.
    Prompt {
        #[serde(default)]
        verifier: VerifierSpec,
    },
    /// A multi-turn chat over a dataset row: its user messages are sent one per turn; the
    /// last answer is checked by `verifier`.
    Chat {
        #[serde(default)]
        verifier: VerifierSpec,
    },
    /// A reasoning-gym dataset by name (`envs/reasoning_gym_bridge.py`, embedded in the
    /// binary, run by `python`): one generated problem per episode, scored by the dataset's
    /// own verifier; its answer is the reference handed to reward functions.
    ReasoningGym {
        /// The dataset's name, e.g. `basic_arithmetic`, `gsm_symbolic`, `chain_sum`.
        dataset: String,
        /// The dataset's configuration (its generator's parameters).
        #[serde(default)]
        #[schema(value_type = Object)]
        config: serde_json::Map<String, serde_json::Value>,
        #[serde(default = "default_rg_size")]
        size: u64,
        /// The generator's seed: a different seed is a different problem set (held out).
        #[serde(default)]
        seed: u64,
        /// How the answer is read from a response: `auto`, `tagged` (`<answer>…</answer>`),
        /// `plain` or `number` (its last number).
        #[serde(default)]
        answer: AnswerFormat,
        /// Appended to each question (default: asks for the answer in `<answer>` tags).
        #[serde(default)]
        instruction: Option<String>,
        #[serde(default = "default_python")]
        python: String,
        #[serde(default)]
        sandbox: EnvSandbox,
        #[serde(default)]
        readable_paths: Vec<String>,
        /// Bridge processes serving the task's episodes (protocol 3, many episodes each).
        #[serde(default = "default_processes")]
        processes: usize,
    },
    /// A gymnasium environment (`envs/gymnasium_bridge.py`, embedded in the binary, run by
    /// `python`): a registered id (`FrozenLake-v1`) or a class of your own (`module:Class`,
    /// the module found on `python_path`).
    Gymnasium {
        id: String,
        #[serde(default)]
        #[schema(value_type = Object)]
        kwargs: serde_json::Map<String, serde_json::Value>,
        /// Directories searched for a `module:Class` environment's module.
        #[serde(default)]
        python_path: Vec<String>,
        #[serde(default = "default_python")]
        python: String,
        #[serde(default)]
        sandbox: EnvSandbox,
        #[serde(default)]
        readable_paths: Vec<String>,
        /// Bridge processes serving the task's episodes (protocol 3, many episodes each).
        #[serde(default = "default_processes")]
        processes: usize,
    },
    /// An agent program playing each episode through the gateway (OpenAI / Anthropic APIs):
    /// started by rollarc per episode in the sandbox, or run by an external harness that
    /// claims episodes.
    Agent(super::agent::AgentEnv),
    /// Tic-tac-toe against a fixed-strategy opponent; the action is a cell 1–9.
    Tictactoe {
        #[serde(default)]
        opponent_first: bool,
        #[serde(default = "default_invalid_penalty")]
        invalid_penalty: f64,
        #[serde(default)]
        end_on_invalid: bool,
    },
}

/// How a dataset environment checks the final answer itself.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum VerifierSpec {
    /// Mathematical equivalence (the `math` reward's check).
    #[default]
    Math,
    /// Trimmed text equality.
    Exact,
    /// None: the environment's reward is 0; the reward functions decide.
    None,
}

/// How the reasoning-gym bridge reads the answer from a response.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AnswerFormat {
    /// The last `<answer>` tag, else the last `\boxed{}`, else the last line.
    #[default]
    Auto,
    Tagged,
    Plain,
    /// The last number of the response (numeric tasks; models that answer in a sentence).
    Number,
}

impl AnswerFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            AnswerFormat::Auto => "auto",
            AnswerFormat::Tagged => "tagged",
            AnswerFormat::Plain => "plain",
            AnswerFormat::Number => "number",
        }
    }
}

impl EnvSpec {
    /// The `kind` tag of this environment.
    pub fn kind_name(&self) -> &'static str {
        match self {
            EnvSpec::Sim { .. } => "sim",
            EnvSpec::Frozenlake { .. } => "frozenlake",
            EnvSpec::Sokoban { .. } => "sokoban",
            EnvSpec::Arithmetic { .. } => "arithmetic",
            EnvSpec::Tictactoe { .. } => "tictactoe",
            EnvSpec::External { .. } => "external",
            EnvSpec::Prompt { .. } => "prompt",
            EnvSpec::Chat { .. } => "chat",
            EnvSpec::ReasoningGym { .. } => "reasoning_gym",
            EnvSpec::Gymnasium { .. } => "gymnasium",
            EnvSpec::Agent(_) => "agent",
        }
    }

    /// Whether the environment is a program of its own (a real process, on the real clock).
    pub fn is_process(&self) -> bool {
        matches!(
            self,
            EnvSpec::External { .. }
                | EnvSpec::ReasoningGym { .. }
                | EnvSpec::Gymnasium { .. }
                | EnvSpec::Agent(_)
        )
    }

    /// Whether the environment serves the task's dataset rows (and so needs a dataset).
    pub fn needs_dataset(&self) -> bool {
        matches!(self, EnvSpec::Prompt { .. } | EnvSpec::Chat { .. })
    }

    /// Whether old turns may leave the context (`truncation = "drop_oldest_turns"`): each
    /// observation carries the state (the grid games, gymnasium's rendered states, simulated
    /// tokens), or an external program says so. Not a chat, where the dialogue is the state,
    /// nor a one-turn task.
    pub fn allows_dropping_turns(&self) -> bool {
        match self {
            EnvSpec::Sim { .. }
            | EnvSpec::Frozenlake { .. }
            | EnvSpec::Sokoban { .. }
            | EnvSpec::Tictactoe { .. }
            | EnvSpec::Gymnasium { .. } => true,
            EnvSpec::External {
                droppable_turns, ..
            } => *droppable_turns,
            EnvSpec::Arithmetic { .. }
            | EnvSpec::Prompt { .. }
            | EnvSpec::Chat { .. }
            | EnvSpec::ReasoningGym { .. }
            | EnvSpec::Agent(_) => false,
        }
    }

    /// The characters a built-in environment's actions are written in.
    pub fn action_alphabet(&self) -> Option<&'static str> {
        match self {
            EnvSpec::Frozenlake { .. } | EnvSpec::Sokoban { .. } => Some("LDRU"),
            EnvSpec::Arithmetic { .. } => Some("0123456789-"),
            EnvSpec::Tictactoe { .. } => Some("123456789"),
            EnvSpec::Sim { .. }
            | EnvSpec::External { .. }
            | EnvSpec::Prompt { .. }
            | EnvSpec::Chat { .. }
            | EnvSpec::ReasoningGym { .. }
            | EnvSpec::Gymnasium { .. }
            | EnvSpec::Agent(_) => None,
        }
    }
}

fn default_success_rate() -> f64 {
    0.5
}
fn default_protocol() -> u32 {
    EXTERNAL_PROTOCOL.or_default(None)
}
fn default_rg_size() -> u64 {
    REASONING_GYM_SIZE.or_default(None)
}
fn default_processes() -> usize {
    ENV_PROCESSES.or_default(None)
}
fn default_python() -> String {
    "python3".into()
}
fn default_max_message_bytes() -> usize {
    EXTERNAL_MAX_MESSAGE_BYTES.or_default(None)
}

/// Isolation of external environment programs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum EnvSandbox {
    #[default]
    Bwrap,
    None,
}
fn default_frozenlake_size() -> usize {
    4
}
fn default_sokoban_boxes() -> usize {
    1
}
fn default_sokoban_size() -> usize {
    6
}
fn default_sokoban_scramble() -> usize {
    12
}
fn default_max_operand() -> i64 {
    9
}
fn default_ops() -> String {
    "+".into()
}
fn default_invalid_penalty() -> f64 {
    -0.1
}

impl EnvSpec {
    /// Checks the environment parameters (at `at`, e.g. `tasks[0].env`).
    pub(super) fn check(&self, at: &str, problems: &mut Problems) {
        match self {
            EnvSpec::Sim { .. } => self.check_sim(at, problems),
            EnvSpec::Prompt { .. } | EnvSpec::Chat { .. } => {}
            EnvSpec::Agent(a) => a.check(at, problems),
            EnvSpec::ReasoningGym { .. } | EnvSpec::Gymnasium { .. } | EnvSpec::External { .. } => {
                self.check_program(at, problems);
            }
            EnvSpec::Frozenlake { .. }
            | EnvSpec::Sokoban { .. }
            | EnvSpec::Arithmetic { .. }
            | EnvSpec::Tictactoe { .. } => self.check_game(at, problems),
        }
    }

    /// Checks a built-in game's parameters.
    fn check_game(&self, p: &str, problems: &mut Problems) {
        match self {
            EnvSpec::Frozenlake {
                size,
                invalid_penalty,
                ..
            } => {
                if *size != 4 && *size != 8 {
                    problems.push(format!("{p}.size"), format!("must be 4 or 8, got {size}"));
                }
                problems.finite(format!("{p}.invalid_penalty"), *invalid_penalty);
            }
            EnvSpec::Sokoban {
                size,
                boxes,
                scramble,
                invalid_penalty,
                ..
            } => {
                problems.in_range(format!("{p}.size"), *size, 5..=10);
                if !(1..=2).contains(boxes) {
                    problems.push(format!("{p}.boxes"), format!("must be 1 or 2, got {boxes}"));
                }
                problems.in_range(format!("{p}.scramble"), *scramble, 1..=1000);
                problems.finite(format!("{p}.invalid_penalty"), *invalid_penalty);
            }
            EnvSpec::Arithmetic { max_operand, ops } => {
                problems.in_range(format!("{p}.max_operand"), *max_operand, 1..=1_000_000);
                if ops.is_empty() || !ops.chars().all(|c| "+-*".contains(c)) {
                    problems.push(
                        format!("{p}.ops"),
                        format!("must be a non-empty string of + - *, got {ops:?}"),
                    );
                }
            }
            EnvSpec::Tictactoe {
                invalid_penalty, ..
            } => problems.finite(format!("{p}.invalid_penalty"), *invalid_penalty),
            _ => {}
        }
    }

    /// Checks a program environment's command line: bridged (reasoning-gym, gymnasium) or
    /// external.
    fn check_program(&self, p: &str, problems: &mut Problems) {
        match self {
            EnvSpec::ReasoningGym {
                dataset,
                size,
                python,
                processes,
                ..
            } => {
                if dataset.trim().is_empty()
                    || !dataset
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '/')
                {
                    problems.push(
                        format!("{p}.dataset"),
                        format!(
                            "{dataset:?} is not a reasoning-gym dataset name (letters, digits, _)"
                        ),
                    );
                }
                REASONING_GYM_SIZE.check_at(p, Some(*size), problems);
                ENV_PROCESSES.check_at(p, Some(*processes), problems);
                if python.trim().is_empty() {
                    problems.push(format!("{p}.python"), "name the Python interpreter".into());
                }
            }
            EnvSpec::Gymnasium {
                id,
                python,
                processes,
                ..
            } => {
                ENV_PROCESSES.check_at(p, Some(*processes), problems);
                if id.trim().is_empty() {
                    problems.push(
                        format!("{p}.id"),
                        "name a registered id (FrozenLake-v1) or module:Class".into(),
                    );
                }
                if python.trim().is_empty() {
                    problems.push(format!("{p}.python"), "name the Python interpreter".into());
                }
            }
            EnvSpec::External {
                command,
                max_message_bytes,
                protocol,
                processes,
                ..
            } => {
                ENV_PROCESSES.check_at(p, *processes, problems);
                if processes.is_some() && *protocol < actors::env::protocol::PROTOCOL_V3 {
                    problems.push(
                        format!("{p}.processes"),
                        format!(
                            "needs protocol = 3 (one program serving many episodes); protocol {protocol} runs one program per environment"
                        ),
                    );
                }
                if command.is_empty() || command[0].trim().is_empty() {
                    problems.push(format!("{p}.command"), "name the program to run".into());
                }
                EXTERNAL_PROTOCOL.check_at(p, Some(*protocol), problems);
                EXTERNAL_MAX_MESSAGE_BYTES.check_at(p, Some(*max_message_bytes), problems);
            }
            _ => {}
        }
    }

    /// Checks a simulated environment's distributions and probabilities.
    fn check_sim(&self, p: &str, problems: &mut Problems) {
        let EnvSpec::Sim {
            reset_latency_s,
            step_latency_s,
            turns,
            observation_tokens,
            prompt_tokens,
            response_tokens,
            success_rate,
            failure_probability,
            hang_probability,
            difficulty,
            sandbox,
        } = self
        else {
            return;
        };
        if let Some(sb) = sandbox {
            sb.check(&format!("{p}.sandbox"), problems);
        }
        if let Some(d) = difficulty {
            let found = d.problems();
            let valid = found.is_empty();
            for m in found {
                problems.push(format!("{p}.difficulty"), m);
            }
            if valid && d.upper() > 100.0 {
                problems.push(
                    format!("{p}.difficulty"),
                    format!(
                        "a factor reaches {:.3e} (its largest value, or six standard deviations up); at most 100 allowed (negative draws count as 0)",
                        d.upper()
                    ),
                );
            }
        }
        // (field, distribution, the largest value it may reach)
        for (name, d, max) in [
            ("reset_latency_s", reset_latency_s, super::MAX_SECONDS),
            ("step_latency_s", step_latency_s, super::MAX_SECONDS),
            ("turns", turns, super::MAX_TURNS as f64),
            (
                "observation_tokens",
                observation_tokens,
                super::MAX_TOKENS as f64,
            ),
            ("prompt_tokens", prompt_tokens, super::MAX_TOKENS as f64),
            ("response_tokens", response_tokens, super::MAX_TOKENS as f64),
        ] {
            let Some(d) = d else { continue };
            let found = d.problems();
            let valid = found.is_empty();
            for m in found {
                problems.push(format!("{p}.{name}"), m);
            }
            if valid && d.upper() > max {
                problems.push(
                    format!("{p}.{name}"),
                    format!(
                        "reaches {:.3e} (its largest value, or six standard deviations up); at most {max} allowed",
                        d.upper()
                    ),
                );
            }
        }
        for (name, v) in [
            ("success_rate", success_rate),
            ("failure_probability", failure_probability),
            ("hang_probability", hang_probability),
        ] {
            if !(0.0..=1.0).contains(v) {
                problems.push(
                    format!("{p}.{name}"),
                    format!("must be a probability in [0, 1], got {v}"),
                );
            }
        }
    }
}
