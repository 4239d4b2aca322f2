//! rollarc's job layer: what a job is and how it runs.
//!
//! - [`spec`]: the job spec (TOML/YAML/JSON), its validation and the knobs it resolves to;
//! - [`cost`]: the pure cost model of hardware-affinity mapping (roofline per pool);
//! - [`resolve`]: the one step that reads outside the spec (datasets, checkpoints, programs,
//!   environment variables) before the plan;
//! - [`wiring`]: the plan that turns a spec and its resolved inputs into pools,
//!   environments, tasks and a trainer (pure);
//! - [`runtime`]: the supervision tree of one job (scheduler, shards, environments,
//!   episodes, trainer, weight-update protocol) and its step metrics;
//! - [`simrun`]: the same runtime on a paused clock (virtual time);
//! - [`store`]: the SQLite job store (jobs, trajectories, steps, batches, weights);
//! - [`trainer_api`]: the batches that external trainers lease and the weights they announce;
//! - [`hub`], [`dataset`], [`baseline`]: shared reward functions, dataset rows, random-policy
//!   baselines.
//!
//! Depends on `infra`, `functions` and `actors`, never on `service` or `lab` (the compiler
//! holds that: they depend on this crate). Architecture invariant: no HTTP server, no CLI and
//! no plots here; the serialised API types it owns are the job spec and the stored rows.

#![cfg_attr(
    test,
    allow(
        clippy::too_many_lines,
        reason = "the 100-line limit is on shipped code; a test reads top to bottom"
    )
)]

pub mod agents;
pub mod baseline;
pub mod cost;
pub mod dataset;
pub mod hub;
pub mod inputs;
pub mod resolve;
pub mod runtime;
pub mod simrun;
pub mod spec;
pub mod store;
pub mod trainer_api;
pub mod wiring;

pub use wiring::envs;
