//! `rollarc bench`: the benchmarks, one per file. [`run`] picks them by `--what`.
//!
//! - `scheduler`: orchestration overhead on zero-latency simulated backends;
//! - `model`: the built-in model against this machine's roofline;
//! - `llm`: SmolLM2 on the built-in engine, against the roofline and llama.cpp;
//! - `llm-train`: the built-in trainer on SmolLM2 (full fine-tuning, LoRA) against the CPU
//!   bound;
//! - `servers`: SmolLM2 on llama.cpp shards: rollarc's overhead per turn, 1 vs 2 shards;
//! - `env`: environment steps through an actor, built-in and external (bare, sandboxed);
//! - `env-workers`: 10,000 concurrent episodes over four env workers on loopback against the
//!   same in this process (cost per step, memory per episode on a worker, resets per second);
//! - `functions`: the function router and runtime on real `rollarc-fn` processes;
//! - `presets`: the quickstart job under each scheduling preset;
//! - `presets-llm` (not in `all`: hours on 2 cores): the real-model job under each preset,
//!   timed to a held-out goal, over seeds;
//! - `batches`: the trainer API's batch fetch, JSON vs MessagePack, and weight announce →
//!   installed latency on the built-in engine;
//! - `gateway`: the agent gateway's overhead per call against calling the engine directly,
//!   and 1,000 concurrent sessions.
//!
//! `batches` and `gateway` drive the service, which this crate never depends on: the caller
//! hands them in ([`run`]'s `service`).

mod env;
mod env_workers;
mod functions;
mod llm;
mod model;
mod presets;
mod presets_llm;
mod scheduler;
mod servers;

use std::path::Path;

pub use env::{EnvBenchError, bench_env};
pub use env_workers::{EnvWorkersBenchError, bench_env_workers};
pub use functions::{FunctionsBenchError, bench_functions};
pub use llm::{LlmBenchError, bench_llm, bench_llm_train};
pub use model::{ModelBenchError, bench_model};
pub use presets::{PresetsBenchError, bench_presets};
pub use presets_llm::{PresetsLlmOptions, bench_presets_llm};
pub use scheduler::{SchedulerBenchError, bench_scheduler};
pub use servers::{ServersBenchError, bench_servers};

/// One benchmark of `rollarc bench`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Benchmark {
    Scheduler,
    Model,
    Llm,
    LlmTrain,
    Servers,
    Env,
    EnvWorkers,
    Functions,
    Presets,
    PresetsLlm,
    Batches,
    Gateway,
}

impl Benchmark {
    /// Every benchmark, in the order `all` runs them.
    pub const ALL: [Benchmark; 11] = [
        Benchmark::Scheduler,
        Benchmark::Model,
        Benchmark::Llm,
        Benchmark::LlmTrain,
        Benchmark::Servers,
        Benchmark::Env,
        Benchmark::EnvWorkers,
        Benchmark::Functions,
        Benchmark::Presets,
        Benchmark::Batches,
        Benchmark::Gateway,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Scheduler => "scheduler",
            Self::Model => "model",
            Self::Llm => "llm",
            Self::LlmTrain => "llm-train",
            Self::Servers => "servers",
            Self::Env => "env",
            Self::EnvWorkers => "env-workers",
            Self::Functions => "functions",
            Self::Presets => "presets",
            Self::PresetsLlm => "presets-llm",
            Self::Batches => "batches",
            Self::Gateway => "gateway",
        }
    }

    /// Benchmarks only named runs take (`all` leaves them out): they take hours here.
    pub const LONG: [Benchmark; 1] = [Benchmark::PresetsLlm];

    /// The benchmarks `--what` names: one, or `all`.
    pub fn select(what: &str) -> Result<Vec<Benchmark>, BenchError> {
        if what == "all" {
            return Ok(Self::ALL.to_vec());
        }
        Self::ALL
            .into_iter()
            .chain(Self::LONG)
            .find(|b| b.name() == what)
            .map(|b| vec![b])
            .ok_or_else(|| BenchError::Unknown(what.to_string()))
    }
}

/// What the benchmarks are run with.
#[derive(Clone, Copy, Debug)]
pub struct BenchOptions<'a> {
    /// Concurrent episodes of the scheduler benchmark.
    pub episodes: usize,
    /// The job spec of the preset benchmark.
    pub preset_file: &'a Path,
    /// Training steps per run of the preset benchmark.
    pub preset_steps: u64,
    /// The real-model job of `presets-llm`.
    pub llm_file: &'a Path,
    /// How `presets-llm` runs.
    pub llm: &'a PresetsLlmOptions,
}

/// Why `rollarc bench` failed.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(
        "unknown benchmark {0:?}: scheduler, model, llm, llm-train, servers, env, env-workers, functions, presets, presets-llm, batches, gateway or all"
    )]
    Unknown(String),
    #[error(transparent)]
    Scheduler(#[from] SchedulerBenchError),
    #[error(transparent)]
    Model(#[from] ModelBenchError),
    #[error(transparent)]
    Llm(#[from] LlmBenchError),
    #[error(transparent)]
    Servers(#[from] ServersBenchError),
    #[error(transparent)]
    Env(#[from] EnvBenchError),
    #[error(transparent)]
    EnvWorkers(#[from] EnvWorkersBenchError),
    #[error(transparent)]
    Functions(#[from] FunctionsBenchError),
    #[error(transparent)]
    Presets(#[from] PresetsBenchError),
    #[error("{0}")]
    Service(BoxError),
}

/// The error of a benchmark that the caller runs (`batches`, `gateway`).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Runs the benchmarks `what` names (one, or `all` in order); nothing runs when the name is
/// unknown. `service` runs the benchmarks that drive the service (`batches`, `gateway`).
pub fn run(
    what: &str,
    opts: &BenchOptions<'_>,
    service: impl Fn(Benchmark) -> Result<(), BoxError>,
) -> Result<(), BenchError> {
    for b in Benchmark::select(what)? {
        match b {
            Benchmark::Scheduler => bench_scheduler(opts.episodes)?,
            Benchmark::Model => bench_model()?,
            Benchmark::Llm => bench_llm()?,
            Benchmark::LlmTrain => bench_llm_train()?,
            Benchmark::Servers => bench_servers()?,
            Benchmark::Env => bench_env()?,
            Benchmark::EnvWorkers => bench_env_workers(10_000, 4, 20)?,
            Benchmark::Functions => bench_functions()?,
            Benchmark::Presets => bench_presets(opts.preset_file, opts.preset_steps)?,
            Benchmark::PresetsLlm => bench_presets_llm(opts.llm_file, opts.llm)?,
            Benchmark::Batches | Benchmark::Gateway => service(b).map_err(BenchError::Service)?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_selects_one_benchmark_or_all_in_order_and_rejects_the_rest() {
        assert_eq!(Benchmark::select("env").unwrap(), [Benchmark::Env]);
        assert_eq!(Benchmark::select("all").unwrap(), Benchmark::ALL);
        for b in Benchmark::ALL.into_iter().chain(Benchmark::LONG) {
            assert_eq!(Benchmark::select(b.name()).unwrap(), [b]);
        }
        assert!(!Benchmark::ALL.contains(&Benchmark::PresetsLlm));
        let e = Benchmark::select("gpu").unwrap_err();
        assert!(matches!(&e, BenchError::Unknown(w) if w == "gpu"), "{e:?}");
        assert_eq!(
            e.to_string(),
            "unknown benchmark \"gpu\": scheduler, model, llm, llm-train, servers, env, env-workers, functions, presets, presets-llm, batches, gateway or all"
        );
    }
}
