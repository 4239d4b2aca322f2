//! Serverless functions on one machine, with Knative's behaviour: deployment configuration
//! under Knative's knob names, the Knative Pod Autoscaler, the process runtime, and the
//! translation of a deployment into a Knative Service manifest.

pub mod config;
pub mod deploy;
pub mod kpa;
pub mod runtime;

pub use config::{DeploymentConfig, Dur, DurationError, Scaling};
pub use runtime::{Deployment, DeploymentStatus, Endpoint, FunctionRuntime};
