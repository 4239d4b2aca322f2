//! Domain-free platform for rollarc: telemetry (tracing, OpenTelemetry metrics with a
//! Prometheus text endpoint, OTLP export), configuration access through a trait, shutdown
//! ownership, child processes and their sandbox, the serverless function runtime, the
//! async router, and random tokens (`secret`).
//!
//! The bottom layer: depends on no crate of the workspace (`tools/check-layers.py`).
//! Architecture invariant: nothing here knows about RL, trajectories, models or jobs.

#![cfg_attr(
    test,
    allow(
        clippy::too_many_lines,
        reason = "the 100-line limit is on shipped code; a test reads top to bottom"
    )
)]

pub mod clock;
pub mod dns;
pub mod env;
pub mod faas;
pub mod files;
pub mod process;
pub mod router;
pub mod sandbox;
pub mod seccomp;
pub mod secret;
pub mod shutdown;
pub mod telemetry;

/// An error and its sources, joined with ": " (for logs and error bodies).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
