//! rollarc's service layer: the long-running `rollarc serve`.
//!
//! - [`service`]: the job lifecycle (admission, runs, cancel, resume after a restart) and the
//!   event stream;
//! - [`api`], [`server`]: the HTTP API v1 (axum) and its connection loop with edge limits;
//! - [`access`]: tokens, roles, owners and the program policy;
//! - [`admission`]: the memory estimate a job is admitted against;
//! - [`telemetry`], [`tensorboard`]: Prometheus gauges and TensorBoard events of each job;
//! - [`text`]: trajectory text for the viewer; [`ui`]: the embedded dashboard;
//! - [`bench_batches`]: the benchmark of the trainer API's batch fetch over real HTTP.
//!
//! Depends on `job` (and the crates below it), never on `lab`; no crate but the `rollarc`
//! binary (and the tests) depends on this one.

#![cfg_attr(
    test,
    allow(
        clippy::too_many_lines,
        reason = "the 100-line limit is on shipped code; a test reads top to bottom"
    )
)]

pub mod access;
pub mod admission;
pub mod api;
pub mod bench_batches;
pub mod env_worker;
pub mod server;
pub mod service;
pub mod telemetry;
pub mod tensorboard;
pub mod text;
pub mod ui;
