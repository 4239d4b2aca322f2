//! Memory admission: an upper estimate of a job's peak memory from its spec, checked against
//! the service's budget at submit, before a recovered job restarts, and when dispatching
//! (a job waits in the queue until the running ones leave it room).
//!
//! The estimate counts what grows with spec fields — built-in model weights, KV caches and
//! activations per shard, the trainer's weights, gradients, optimiser state and kept
//! versions, every trajectory that can be in flight or buffered, the environments — plus a
//! fixed base per job. It is deliberately pessimistic (the KV cache of every batch slot at
//! `max_seq`, every trajectory at its longest); a simulated backend's modelled GPU memory is
//! not host memory and is not counted. Trajectories of simulated environments are counted at
//! twice their mean length, not their longest: their lengths are drawn from the spec's
//! distributions, so thousands in flight sum to about their mean (a lognormal's six-sigma
//! tail made the production-scale scenario ask for 1.5 TiB; it peaks at 0.34 GiB).

use job::spec::{BackendSpec, EnvSpec, JobSpec};

/// Memory of a job apart from what its fields size: runtime, actors, metrics, store handles.
pub const JOB_BASE_BYTES: u64 = 64 << 20;
/// Bookkeeping of one trajectory apart from its tokens (measured by the scheduler benchmark:
/// ≈ 17.6 KiB per in-flight trajectory).
pub const TRAJECTORY_BASE_BYTES: u64 = 20 << 10;
/// Bytes per token of a kept trajectory: the context, the response, its logprob and version.
pub const TOKEN_BYTES: u64 = 24;
/// Resident memory assumed for an external environment process (an interpreter and a small
/// simulator); built-in environments are small state machines.
pub const EXTERNAL_ENV_BYTES: u64 = 48 << 20;
pub const BUILTIN_ENV_BYTES: u64 = 256 << 10;
/// Observation tokens assumed per turn where the spec does not say (external and built-in
/// environments).
pub const DEFAULT_OBSERVATION_TOKENS: u64 = 256;
/// Margin over the mean length of a simulated environment's trajectories.
pub const SIM_TRAJECTORY_MARGIN: f64 = 2.0;

/// One component of the estimate, with the spec field that sizes it.
#[derive(Clone, Debug, PartialEq)]
pub struct Part {
    pub field: String,
    pub what: &'static str,
    pub bytes: u64,
}

/// A job's estimated peak memory.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryEstimate {
    pub parts: Vec<Part>,
}

impl MemoryEstimate {
    pub fn total(&self) -> u64 {
        self.parts
            .iter()
            .fold(JOB_BASE_BYTES, |a, p| a.saturating_add(p.bytes))
    }

    /// The parts, largest first, as `field: what ≈ N MiB`.
    pub fn breakdown(&self) -> Vec<(String, String)> {
        let mut parts = self.parts.clone();
        parts.sort_by_key(|p| std::cmp::Reverse(p.bytes));
        parts
            .into_iter()
            .filter(|p| p.bytes > 0)
            .map(|p| (p.field, format!("{} ≈ {}", p.what, human(p.bytes))))
            .collect()
    }
}

/// `N MiB` / `N GiB`.
pub fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.1} GiB", b / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    }
}

fn mul(xs: &[u64]) -> u64 {
    xs.iter().fold(1u64, |a, &x| a.saturating_mul(x))
}

/// The estimate of a (validated) spec.
pub fn estimate(spec: &JobSpec) -> MemoryEstimate {
    let knobs = spec.knobs();
    let mut parts = Vec::new();
    let mut trained_model = None;
    for (i, p) in spec.pools.iter().enumerate() {
        if let BackendSpec::Builtin { model, max_batch } = &p.backend {
            let Some(cfg) = model.choice().shape() else {
                continue;
            };
            let checkpoint = matches!(model.choice(), job::spec::ModelChoice::Checkpoint { .. });
            trained_model.get_or_insert((cfg, checkpoint));
            let (l, seq, b) = (cfg.n_layers, cfg.max_seq, *max_batch as u64);
            let weights = mul(&[cfg.params, 4]);
            // Keys and values of every layer for every batch slot at full length.
            let kv = mul(&[b, l, 2, seq, cfg.kv_width, 4]);
            // The widest activation of a step: logits or the feed-forward of the batch, and
            // one sequence's attention scores during its prefill.
            let width = cfg.d_ff.max(cfg.vocab);
            let act = mul(&[b, width, 4]).saturating_mul(2).saturating_add(mul(&[
                cfg.n_heads,
                seq,
                seq,
                4,
            ]));
            let per_shard = weights.saturating_add(kv).saturating_add(act);
            parts.push(Part {
                field: format!("pools[{i}]"),
                what: "built-in model shards (weights, KV cache at max_seq × max_batch, activations)",
                bytes: per_shard.saturating_mul(p.count as u64),
            });
        }
    }
    if spec.trains_builtin()
        && let Some((cfg, checkpoint)) = trained_model
    {
        let p4 = mul(&[cfg.params, 4]);
        // Weights, gradients, two Adam moments, and the versions the weight store keeps.
        let kept = knobs.alpha.saturating_add(2);
        let state = p4.saturating_mul(4u64.saturating_add(kept));
        // Backward keeps every layer's activations for the tokens of a pass: at most
        // micro_batch_rows rows (pessimistically each the longest), never more than the batch;
        // a checkpoint's passes also stop at MICRO_BATCH_TOKENS tokens (a longer row alone).
        let longest = longest_trajectory_tokens(spec);
        let budget = if checkpoint {
            (actors::model::llm::train::MICRO_BATCH_TOKENS as u64).max(longest)
        } else {
            u64::MAX
        };
        let tokens = match &spec.trainer {
            job::spec::TrainerSpec::Builtin(b) => b
                .micro_batch_rows
                .map_or(budget, |r| mul(&[r as u64, longest]).min(budget)),
            _ => budget,
        }
        .min(batch_tokens(spec, &knobs));
        // Per token and layer, the intermediates a checkpoint's differentiable forward keeps
        // (norms, projections, rotations, attention rows, the MLP's): ≈ 40 × d_model + 16 ×
        // d_ff floats (SmolLM2-135M: 1,024 tokens with LoRA peaked at ≈ 6 GB resident,
        // `rollarc bench --what llm-train`), and the head's logits, their gradient and copies:
        // 4 × vocab. The tiny model keeps its own estimate (8 × d_model + 2 × d_ff, 2 × vocab).
        let (per_layer, head) = if checkpoint {
            (cfg.d_model * 40 + cfg.d_ff * 16, 4)
        } else {
            (cfg.d_model * 8 + cfg.d_ff * 2, 2)
        };
        let act = mul(&[tokens, cfg.n_layers, per_layer, 4])
            .saturating_add(mul(&[tokens, cfg.vocab, head, 4]));
        parts.push(Part {
            field: "trainer".into(),
            what: "built-in trainer (weights, gradients, optimiser, kept versions, activations)",
            bytes: state.saturating_add(act),
        });
    }
    let per_traj = kept_trajectory_tokens(spec)
        .saturating_mul(TOKEN_BYTES)
        .saturating_add(TRAJECTORY_BASE_BYTES);
    parts.push(Part {
        field: "rollout.max_concurrent_episodes".into(),
        what: "trajectories in flight",
        bytes: per_traj.saturating_mul(knobs.max_concurrent_episodes as u64),
    });
    parts.push(Part {
        field: "rollout.batch_size".into(),
        what: "trajectories buffered for training",
        bytes: per_traj.saturating_mul(buffered_trajectories(spec, &knobs)),
    });
    for (i, t) in spec.tasks.iter().enumerate() {
        let each = match t.env {
            _ if t.env.is_process() => EXTERNAL_ENV_BYTES,
            EnvSpec::Sim { .. } => 4 << 10,
            _ => BUILTIN_ENV_BYTES,
        };
        let n = t.envs.unwrap_or(knobs.max_concurrent_episodes) as u64;
        parts.push(Part {
            field: format!("tasks[{i}].envs"),
            what: "environments",
            bytes: each.saturating_mul(n),
        });
    }
    MemoryEstimate { parts }
}

/// Trajectories the sample buffer can hold: the batch being assembled and the ones the
/// staleness bound lets run ahead.
fn buffered_trajectories(spec: &JobSpec, knobs: &job::spec::Knobs) -> u64 {
    let group = spec
        .tasks
        .iter()
        .map(|t| (t.group_size + t.redundancy) as u64)
        .max()
        .unwrap_or(1);
    mul(&[
        knobs.batch_size as u64,
        group,
        knobs.alpha.saturating_add(2),
    ])
}

/// Tokens of one training batch at the longest trajectories.
fn batch_tokens(spec: &JobSpec, knobs: &job::spec::Knobs) -> u64 {
    let group = spec
        .tasks
        .iter()
        .map(|t| t.group_size as u64)
        .max()
        .unwrap_or(1);
    mul(&[
        knobs.batch_size as u64,
        group,
        longest_trajectory_tokens(spec),
    ])
}

/// Tokens to count for each trajectory kept in flight or in the buffer: the longest one a
/// task can produce, or, when every pool is simulated, [`SIM_TRAJECTORY_MARGIN`] times a
/// simulated environment's mean (never more than the longest).
fn kept_trajectory_tokens(spec: &JobSpec) -> u64 {
    let longest = longest_trajectory_tokens(spec);
    // A real engine may answer up to max_tokens_per_turn whatever the environment models.
    let simulated = spec
        .pools
        .iter()
        .all(|p| matches!(p.backend, BackendSpec::Sim { .. }));
    if !simulated {
        return longest;
    }
    spec.tasks
        .iter()
        .map(|t| match &t.env {
            EnvSpec::Sim {
                turns,
                observation_tokens,
                prompt_tokens,
                response_tokens,
                difficulty,
                ..
            } => {
                // A hard prompt scales both turns and answers: their product goes with f².
                let f = difficulty
                    .as_ref()
                    .map_or(1.0, |d| d.mean_square_at_least(1.0).sqrt());
                let mean = |d: &Option<actors::dist::Dist>, default: f64| {
                    d.as_ref().map_or(default, |d| d.mean().max(0.0))
                };
                let n = (mean(turns, f64::from(t.max_turns)) * f).min(f64::from(t.max_turns));
                let obs = mean(observation_tokens, DEFAULT_OBSERVATION_TOKENS as f64);
                let first = mean(prompt_tokens, obs);
                let resp = mean(response_tokens, f64::from(t.max_tokens_per_turn)) * f;
                let tokens = first + resp + (n - 1.0).max(0.0) * (obs + resp);
                ((tokens * SIM_TRAJECTORY_MARGIN).ceil() as u64).min(longest)
            }
            _ => longest,
        })
        .max()
        .unwrap_or(0)
}

/// Tokens of the longest trajectory any task can produce.
fn longest_trajectory_tokens(spec: &JobSpec) -> u64 {
    spec.tasks
        .iter()
        .map(|t| {
            let (turns, obs, resp) = match &t.env {
                EnvSpec::Sim {
                    turns,
                    observation_tokens,
                    prompt_tokens,
                    response_tokens,
                    difficulty,
                    ..
                } => {
                    // A hard prompt scales turns and answers by up to its factor.
                    let f = difficulty.as_ref().map_or(1.0, |d| d.upper().max(1.0));
                    let up = |d: &Option<actors::dist::Dist>, default: u64, f: f64| {
                        d.as_ref()
                            .map_or(default, |d| (d.upper().max(0.0) * f) as u64)
                    };
                    let obs = up(observation_tokens, DEFAULT_OBSERVATION_TOKENS, 1.0);
                    (
                        up(turns, u64::from(t.max_turns), f).min(u64::from(t.max_turns)),
                        obs.max(up(prompt_tokens, obs, 1.0)),
                        up(response_tokens, u64::from(t.max_tokens_per_turn), f),
                    )
                }
                // An agent's turns are its model calls.
                EnvSpec::Agent(a) => (
                    u64::from(a.max_calls),
                    DEFAULT_OBSERVATION_TOKENS,
                    u64::from(t.max_tokens_per_turn),
                ),
                _ => (
                    u64::from(t.max_turns),
                    DEFAULT_OBSERVATION_TOKENS,
                    u64::from(t.max_tokens_per_turn),
                ),
            };
            // No trajectory outgrows its context budget or the model's context.
            let cap = t
                .max_context_tokens
                .map(u64::from)
                .into_iter()
                .chain(spec.pools.iter().filter_map(|p| {
                    p.backend
                        .real_model()
                        .and_then(|m| m.choice().shape())
                        .map(|c| c.max_seq)
                }))
                .min()
                .unwrap_or(u64::MAX);
            turns.saturating_mul(obs.saturating_add(resp)).min(cap)
        })
        .max()
        .unwrap_or(0)
}

/// The machine's memory (`MemTotal` of `/proc/meminfo`), if readable.
pub fn machine_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// The default budget: 60 % of the machine's memory (8 GiB where it cannot be read).
pub fn default_budget() -> u64 {
    machine_memory().map_or(8 << 30, |m| m / 5 * 3)
}

#[cfg(test)]
mod tests;
