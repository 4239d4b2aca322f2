//! The rollarc service: job spec and validation, the HTTP API (v1), the job store (SQLite),
//! the job runtime (supervision tree, scheduler, weight-update protocol), the CLI, and the
//! virtual-time simulation runner.
//!
//! Architecture invariant: the HTTP and storage types live here and nowhere else; the actors
//! crate sees storage only through `TrajectorySink`.

pub mod access;
pub mod admission;
pub mod api;
pub mod bench;
pub mod cli;
pub mod dataset;
pub mod export;
pub mod hub;
pub mod job;
pub mod plan;
pub mod profile;
pub mod report;
pub mod scenario;
pub mod server;
pub mod service;
pub mod simbench;
pub mod simrun;
pub mod spec;
pub mod store;
pub mod telemetry;
pub mod tensorboard;
pub mod text;
pub mod train_client;
pub mod trainer_api;
pub mod ui;
pub mod wiring;

pub use wiring::envs;
