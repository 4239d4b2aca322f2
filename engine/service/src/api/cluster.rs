//! The cluster view: pools, shards, environments and functions of the running jobs, the
//! device catalogue, and (for the admin) the function deployments.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Extension, State};
use serde::Serialize;
use utoipa::ToSchema;

use super::ApiError;
use crate::access::{Principal, Role};
use crate::service::Service;
use job::spec;

#[derive(Debug, Serialize, ToSchema)]
pub struct Cluster {
    pub jobs: Vec<ClusterJob>,
    /// Device classes the mapper knows.
    pub devices: Vec<DeviceView>,
    /// Function deployments of the local runtime (shared by all jobs): instances by phase,
    /// autoscaler decision and panic state, requests now and at peak, router counters.
    #[schema(value_type = Vec<Object>)]
    pub functions: Vec<job::hub::FunctionView>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ClusterJob {
    pub id: String,
    pub pools: Vec<ClusterPool>,
    pub environments: Vec<EnvView>,
    pub functions: Vec<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ClusterPool {
    pub name: String,
    pub device: String,
    pub shards: usize,
    pub backend: String,
    /// Busy fraction since the job started (from the latest step).
    pub utilisation: Option<f64>,
    pub groups: Option<u64>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct EnvView {
    pub task: String,
    pub kind: String,
    pub envs: Option<usize>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DeviceView {
    pub name: String,
    pub tflops: f64,
    pub bandwidth_tb_s: f64,
    pub memory_gb: f64,
    pub relative_cost: f64,
}

/// Pools, shards, environments and functions of the running jobs, and the device catalogue.
#[utoipa::path(get, path = "/v1/cluster", responses((status = 200, body = Cluster)))]
pub(super) async fn cluster(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
) -> Result<Json<Cluster>, ApiError> {
    let mut jobs = Vec::new();
    for id in s.running_ids() {
        let Some(spec) = s.store.spec(&id)? else {
            continue;
        };
        let rec = s.store.get(&id)?;
        if !rec.as_ref().is_some_and(|r| p.owns(r.owner.as_deref())) {
            continue;
        }
        let metrics = rec.map(|r| r.metrics).unwrap_or_default();
        jobs.push(cluster_job(id, &spec, &metrics));
    }
    Ok(Json(Cluster {
        jobs,
        devices: device_catalogue(),
        // Deployments are shared by every owner's jobs and name them (with their instances'
        // URLs and pids): the admin's view only.
        functions: if p.role == Role::Admin {
            s.functions.view()
        } else {
            Vec::new()
        },
    }))
}

/// One running job's pools (with their latest utilisation and groups from `metrics`),
/// environments and functions.
fn cluster_job(id: String, spec: &spec::JobSpec, metrics: &serde_json::Value) -> ClusterJob {
    let knobs = spec.knobs();
    ClusterJob {
        id,
        pools: spec
            .pools
            .iter()
            .map(|p| ClusterPool {
                name: p.name.clone(),
                device: p.device.clone(),
                shards: p.count,
                backend: backend_name(&p.backend),
                utilisation: metrics
                    .pointer(&format!("/pools/{}/utilisation", p.name))
                    .and_then(|v| v.as_f64()),
                groups: metrics
                    .pointer(&format!("/pools/{}/groups", p.name))
                    .and_then(|v| v.as_u64()),
            })
            .collect(),
        environments: spec
            .tasks
            .iter()
            .map(|t| EnvView {
                task: t.domain.clone(),
                kind: t.env.kind_name().into(),
                envs: Some(t.envs.unwrap_or(knobs.max_concurrent_episodes)),
            })
            .collect(),
        functions: spec.reward.functions.keys().cloned().collect(),
    }
}

/// A pool's backend as the cluster view names it: its kind and its model (`sim:qwen3-8b`,
/// `builtin:d64-l2`, `vllm:model.gguf`).
fn backend_name(backend: &spec::BackendSpec) -> String {
    match backend {
        spec::BackendSpec::Sim { model, .. } => format!("sim:{model}"),
        spec::BackendSpec::Builtin { model, .. } => match model.choice() {
            spec::ModelChoice::Tiny(c) => {
                format!("builtin:d{}-l{}", c.d_model, c.n_layers)
            }
            spec::ModelChoice::Checkpoint { path, .. } => format!(
                "builtin:{}",
                path.file_name().unwrap_or_default().to_string_lossy()
            ),
        },
        spec::BackendSpec::Llamacpp(l)
        | spec::BackendSpec::Sglang(l)
        | spec::BackendSpec::Vllm(l) => {
            format!(
                "{}:{}",
                match backend {
                    spec::BackendSpec::Sglang(_) => "sglang",
                    spec::BackendSpec::Vllm(_) => "vllm",
                    _ => "llamacpp",
                },
                std::path::Path::new(l.model.path.as_deref().unwrap_or_default())
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
            )
        }
    }
}

/// The device classes the mapper knows.
fn device_catalogue() -> Vec<DeviceView> {
    actors::device::DeviceProfile::BUILTIN_NAMES
        .iter()
        .filter_map(|n| actors::device::DeviceProfile::builtin(n))
        .map(|d| DeviceView {
            name: d.name,
            tflops: d.flops / 1e12,
            bandwidth_tb_s: d.bandwidth / 1e12,
            memory_gb: d.memory / 1e9,
            relative_cost: d.cost,
        })
        .collect()
}
