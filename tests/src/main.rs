//! Integration tests, one binary (see the harness in lib.rs).

#![allow(
    clippy::too_many_lines,
    reason = "test code: the 100-line limit is on shipped code; a test reads top to bottom"
)]

mod access;
mod admission;
mod agent_episodes;
mod agents;
mod api;
mod builtin;
mod cli;
mod code_judge;
mod datasets;
mod env_workers;
mod envs;
mod eval;
mod faults;
mod gateway;
mod kube_discovery;
mod llm;
mod mux;
mod otlp;
mod persistence;
mod prometheus;
mod remote_agents;
mod reward_functions;
mod sandbox_starts;
mod scheduler;
mod server_fakes;
mod serverless;
mod sigkill_loop;
mod train_cli;
mod trainer_api;
mod truncation;
mod viewer;
mod worker_sandbox;
