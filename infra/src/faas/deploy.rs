//! The Knative translation of a local function deployment.
//!
//! A [`DeploymentConfig`] uses Knative's knob names, so it translates one to one into a
//! `serving.knative.dev/v1` `Service` ([`knative_service`]), plus the `config-autoscaler`
//! ConfigMap for the few knobs Knative sets once per cluster ([`knative_autoscaler_config`]).
//! [`write_manifests`] writes both as pretty JSON. JSON is valid YAML and `kubectl apply -f`
//! accepts `.json` files, so `kubectl apply -f DIR` applies them as they are.
//!
//! | local (`DeploymentConfig`)          | Knative                                                                  |
//! |-------------------------------------|--------------------------------------------------------------------------|
//! | `name`                              | `metadata.name` (URL `http://NAME.NAMESPACE.svc.cluster.local`)          |
//! | `scaling.container-concurrency`     | `spec.template.spec.containerConcurrency`                                |
//! | `scaling.target`                    | annotation `autoscaling.knative.dev/target` (only when set)              |
//! | `scaling.target-utilization-percentage`, `min-scale`, `initial-scale`, `panic-window-percentage`, `panic-threshold-percentage` | annotation of the same name |
//! | `scaling.max-scale`                 | annotation `max-scale` (only when > 0; 0 = unbounded in both)            |
//! | `scaling.activation-scale`          | annotation `activation-scale` (only when > 1: 1 is Knative's default and Knative rejects an explicit value below 2) |
//! | `scaling.stable-window`             | annotation `autoscaling.knative.dev/window`                              |
//! | `scaling.scale-down-delay`          | annotation `scale-down-delay` (only when non-zero)                       |
//! | `scaling.scale-to-zero-grace-period`, `max-scale-up-rate`, `max-scale-down-rate` | cluster-wide: `config-autoscaler` keys of the same name; recorded on the Service as `rollarc.dev/<knob>` annotations (information only) |
//! | `scaling.tick-interval`             | not configurable in Knative (fixed 2 s); not emitted                     |
//! | `timeout-seconds`                   | `spec.template.spec.timeoutSeconds` (Knative caps it at `max-revision-timeout-seconds`, 600 by default, in `config-defaults`) |
//! | `command`, `args`, `image`          | the one container: see [`knative_service`]                              |
//! | `env`                               | container `env`, sorted, without the variables Knative or the runtime set ([`RESERVED_ENV`]) |
//! | `readiness-path`                    | `readinessProbe.httpGet.path` (no port: Knative probes the serving port) |
//! | `path`                              | not part of the Service: callers post to `URL + path`                    |
//! | `startup-timeout`, `termination-grace`, `activator-capacity` | not translated: Knative derives the termination grace from `timeoutSeconds`, its activator buffer is not per Service, and a slow start is bounded by the revision's progress deadline |
//!
//! No `resources` are emitted: a function that needs a GPU gets
//! `resources.limits["nvidia.com/gpu"]` by editing the generated manifest (or through a future
//! `DeploymentConfig` field).
//!
//! Files: `service.rs` (the Service and what Knative would reject), `autoscaler.rs` (the
//! cluster-wide ConfigMap), `manifests.rs` (writing both).

mod autoscaler;
#[cfg(test)]
mod fixtures;
mod manifests;
mod service;

pub use autoscaler::{KnobConflict, KnobConflicts, knative_autoscaler_config};
pub use manifests::{ManifestError, ManifestProblem, write_manifests};
pub use service::{
    AUTOSCALER_CONFIG_NAME, BUILTIN_BINARY, CONTAINER_PORT, DEFAULT_IMAGE, RESERVED_ENV,
    knative_problems, knative_service,
};
