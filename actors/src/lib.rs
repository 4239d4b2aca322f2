//! The RL domain of rollarc: trajectories and policy versions, the backends behind traits
//! (generation, environment, reward, trainer), their simulated implementations that run in
//! virtual time, and the supervised ractor actors that own them.
//!
//! # Layout
//! - [`chat`]: an agent's conversation (messages, tool calls, tools), whatever API carried it.
//! - [`agent`]: agents' conversations as exact token contexts, tool calls, segments.
//! - [`types`]: trajectories, turns, policy versions, failure reasons.
//! - [`tokens`]: token and log-probability sequences, held or drawn (simulators).
//! - [`dist`]: seeded latency / length distributions used by simulators.
//! - [`device`]: device and model profiles, the roofline the mapper and the simulator share,
//!   and GPU discovery behind the `cuda` feature.
//! - [`discovery`]: where a pool's members come from (a URL list, DNS lookups, Kubernetes
//!   EndpointSlices by list and watch), for env pools and elastic inference-server pools.
//! - [`generation`]: the generation-engine trait, the shard engine loop behind a flume seam,
//!   the shard actor and the roofline simulator.
//! - [`env`]: the environment trait, environment actors and pools, the latency simulator.
//! - [`episode`]: the episode driver (reset → turns → reward → buffer) and wave barriers.
//! - [`reward`], [`trainer`], [`weights`]: reward scoring, training and the weight store.
//! - [`buffer`]: the sample buffer (group assembly, filters, staleness eviction, durable log).
//! - [`supervisor`]: restart policies with intensity / window and counters.
//! - [`call`]: request/reply calls with a timeout and their typed error.
//!
//! Depends on `infra` and `functions` only (`tools/check-layers.py`).
//! Architecture invariant: this crate knows nothing of HTTP, job specs or the storage schema.
//! It sees storage only through [`buffer::TrajectorySink`]. Time is read only through
//! `tokio::time`, randomness only from seeded RNGs, so a job on a paused clock is a
//! deterministic discrete-event simulation.

#![cfg_attr(
    test,
    allow(
        clippy::too_many_lines,
        reason = "the 100-line limit is on shipped code; a test reads top to bottom"
    )
)]

pub mod agent;
pub mod buffer;
pub mod call;
pub mod chat;
pub mod device;
pub mod discovery;
pub mod dist;
pub mod env;
pub mod episode;
pub mod error;
pub mod fault;
pub mod generation;
pub mod model;
pub mod reward;
pub mod rl;
pub mod supervisor;
pub mod tokens;
pub mod trainer;
pub mod types;
pub mod weights;
