//! Domain-free platform for rollarc: telemetry (tracing, OpenTelemetry metrics with a
//! Prometheus text endpoint, OTLP export), configuration access through a trait, shutdown
//! ownership, and (in later modules) the serverless function runtime and the async router.
//!
//! Architecture invariant: nothing here knows about RL, trajectories, models or jobs.

pub mod env;
pub mod faas;
pub mod router;
pub mod sandbox;
pub mod shutdown;
pub mod telemetry;
