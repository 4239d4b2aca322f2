//! The local function runtime: deployments whose instances are child processes on free ports,
//! scaled by the KPA (`kpa.rs`), probed for readiness, replaced when they crash, drained on
//! scale-down (SIGTERM, wait for in-flight requests, SIGKILL after the grace period).
//!
//! One runtime is shared by every job of a service. Routers reach a deployment's ready
//! instances through `Deployment::endpoints()` and report the requests they carry (in flight
//! or buffered by the activator) through `Deployment::track()`; that count is the KPA's signal.
//!
//! Files: `deployment.rs` (a deployment's state and what it shows), `control.rs` (the
//! autoscaler's loop), `instance.rs` (one instance's process).

mod control;
mod deployment;
mod instance;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::config::DeploymentConfig;
pub use deployment::{
    Deployment, DeploymentCounters, DeploymentStatus, Endpoint, InstanceStatus, Phase, Tracked,
};

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("deployment {name}: {field}: {message}")]
    Invalid {
        name: String,
        field: String,
        message: String,
    },
    #[error("deployment {0} already exists with a different configuration")]
    Conflict(String),
    #[error("the function runtime is shutting down")]
    ShuttingDown,
}

/// The local runtime: owns every deployment's processes.
pub struct FunctionRuntime {
    deployments: Mutex<BTreeMap<String, Arc<Deployment>>>,
    cancel: CancellationToken,
    tasks: TaskTracker,
    /// Every control loop and instance task runs here, whoever deploys.
    rt: tokio::runtime::Handle,
}

impl FunctionRuntime {
    /// A runtime whose tasks run on the current tokio runtime (call from within one).
    pub fn new() -> Arc<Self> {
        Self::on(tokio::runtime::Handle::current())
    }

    /// A runtime whose tasks run on `rt`.
    pub fn on(rt: tokio::runtime::Handle) -> Arc<Self> {
        Arc::new(Self {
            deployments: Mutex::new(BTreeMap::new()),
            cancel: CancellationToken::new(),
            tasks: TaskTracker::new(),
            rt,
        })
    }

    fn map(&self) -> MutexGuard<'_, BTreeMap<String, Arc<Deployment>>> {
        self.deployments.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Creates a deployment, or returns the existing one of that name when its configuration
    /// is the same (jobs share functions this way).
    pub fn deploy(&self, cfg: DeploymentConfig) -> Result<Arc<Deployment>, RuntimeError> {
        if let Some((field, message)) = cfg.problems().into_iter().next() {
            return Err(RuntimeError::Invalid {
                name: cfg.name.clone(),
                field,
                message,
            });
        }
        if self.cancel.is_cancelled() {
            return Err(RuntimeError::ShuttingDown);
        }
        let mut map = self.map();
        if let Some(d) = map.get(&cfg.name) {
            return if d.cfg == cfg {
                Ok(d.clone())
            } else {
                Err(RuntimeError::Conflict(cfg.name))
            };
        }
        let initial = cfg.scaling.initial_scale.max(cfg.scaling.min_scale);
        let dep = Arc::new(Deployment::new(cfg, self.cancel.child_token()));
        map.insert(dep.cfg.name.clone(), dep.clone());
        self.tasks.spawn_on(
            control::control_loop(dep.clone(), self.tasks.clone()),
            &self.rt,
        );
        tracing::info!(function = %dep.cfg.name, initial, "deployment created");
        Ok(dep)
    }

    pub fn get(&self, name: &str) -> Option<Arc<Deployment>> {
        self.map().get(name).cloned()
    }

    /// Stops a deployment: drains every instance.
    pub async fn remove(&self, name: &str) {
        let dep = self.map().remove(name);
        if let Some(dep) = dep {
            dep.cancel.cancel();
            let mut rx = dep.endpoints();
            // Wait (bounded) for the instances to go.
            let deadline = Instant::now() + dep.cfg.termination_grace.0 + Duration::from_secs(2);
            while !dep.lock().instances.is_empty() && Instant::now() < deadline {
                let _ = tokio::time::timeout(Duration::from_millis(50), rx.changed()).await;
            }
            dep.forget();
        }
    }

    pub fn status(&self) -> Vec<DeploymentStatus> {
        self.map().values().map(|d| d.status()).collect()
    }

    /// Drains every instance of every deployment, then returns.
    pub async fn shutdown(&self) {
        self.cancel.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

impl Drop for FunctionRuntime {
    fn drop(&mut self) {
        // Instance tasks kill their process groups when their tasks are dropped (the
        // `process::Spawned` guard).
        self.cancel.cancel();
    }
}
