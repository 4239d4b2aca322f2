//! Generation pools: device profile (a tensor-parallel shard is its whole group), model
//! profile, engine configuration, and prefill/decode links.

use actors::device::{DeviceProfile, Efficiency, ModelProfile};
use actors::generation::sim::SimEngineConfig;

use super::{WiringError, device, model, weight_sync};
use crate::cost::PrefillLink;
use crate::resolve::Resolved;
use crate::spec::{BackendSpec, JobSpec, Knobs, ModelChoice, ServerSpec};

/// One generation pool of a job.
pub struct PoolPlan {
    pub name: String,
    pub shards: usize,
    /// The profile of one shard (a tensor-parallel shard aggregates its GPUs).
    pub device: actors::device::DeviceProfile,
    pub model: ModelProfile,
    pub max_batch: usize,
    pub engine: EnginePlan,
    /// Prefill/decode disaggregation: the pool that prefills for this one, and the KV link.
    pub prefill_from: Option<PrefillLink>,
    /// This pool only prefills for another; no group is mapped to it.
    pub prefill_only: bool,
    /// Seconds without an engine step (with work queued) before the watchdog restarts it.
    pub frozen_after_s: f64,
}

/// What each shard of a pool runs.
pub enum EnginePlan {
    /// The roofline simulator; each shard gets its own seed, and `faults` freezes shard
    /// `.0` after `.1` engine steps (once).
    Sim {
        config: Box<SimEngineConfig>,
        faults: Vec<(usize, u64)>,
    },
    /// The built-in engine on CPU (the tiny transformer or a checkpoint), one OS thread
    /// per shard.
    Builtin { model: ModelChoice },
    /// Inference servers (a checkpoint), one per shard.
    Server {
        model: ModelChoice,
        server: Box<ServerPlan>,
    },
}

impl EnginePlan {
    /// The real model the pool serves (`None`: simulated).
    pub fn real_model(&self) -> Option<&ModelChoice> {
        match self {
            Self::Builtin { model } | Self::Server { model, .. } => Some(model),
            Self::Sim { .. } => None,
        }
    }
}

/// Which inference server a pool runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServerKind {
    Llamacpp,
    Sglang,
    Vllm,
}

/// Where a server pool's servers are.
#[derive(Clone, Debug, PartialEq)]
pub struct ServerPlan {
    pub kind: ServerKind,
    /// Attach mode: one server per shard.
    pub urls: Vec<String>,
    /// Discovery mode: where the servers come from (the pool's shards are slots for them).
    pub discover: Option<actors::env::remote::Membership>,
    /// Managed mode: the launch command (placeholders unfilled), its environment, ports,
    /// GPUs per shard, and the exported weights' type.
    pub command: Vec<String>,
    pub env: Vec<(String, String)>,
    pub ports: Option<(u16, u16)>,
    pub gpus_per_shard: u32,
    pub export_q8: bool,
    pub slots: usize,
    /// Context tokens per slot.
    pub context: usize,
}

/// The shape the resolve step read for pool `pi`'s real model.
fn resolved_shape(inputs: &Resolved, pi: usize) -> Result<crate::spec::ModelShape, WiringError> {
    inputs
        .shapes
        .get(pi)
        .copied()
        .flatten()
        .ok_or(WiringError::UnresolvedModel { pool: pi })
}

/// Placeholder for the launcher script's path in a default llama.cpp command; the job
/// replaces it with the script it writes.
pub const XLLAMACPP_SCRIPT: &str = "{xllamacpp_serve}";

/// The profile of a real model (f32 weights and KV cache).
fn real_profile(shape: &crate::spec::ModelShape) -> ModelProfile {
    ModelProfile {
        name: "builtin".into(),
        params: shape.params as f64,
        active_params: shape.params as f64,
        layers: shape.n_layers as u32,
        kv_bytes_per_token: (2 * shape.n_layers * shape.kv_width * 4) as f64,
        bytes_per_param: 4.0,
    }
}

pub(super) fn plan(
    spec: &JobSpec,
    knobs: &Knobs,
    inputs: &Resolved,
) -> Result<Vec<PoolPlan>, WiringError> {
    let sim_shards: u32 = spec
        .pools
        .iter()
        .filter(|p| matches!(p.backend, BackendSpec::Sim { .. }))
        .map(|p| p.count as u32)
        .sum();
    let mut out = Vec::with_capacity(spec.pools.len());
    for (pi, p) in spec.pools.iter().enumerate() {
        let base = device(spec, format!("pools[{pi}].device"), &p.device)?;
        let (device, model, max_batch, engine) = match &p.backend {
            BackendSpec::Sim {
                model: model_name,
                max_batch,
                mfu,
                mbu,
                weight_sync_gbps,
                hang_probability,
                gpus_per_shard,
                tp_efficiency,
                measured,
                block_tokens,
                ..
            } => {
                let device = base.group(*gpus_per_shard, tp_efficiency.unwrap_or(0.9));
                let model = model(spec, format!("pools[{pi}].backend.model"), model_name)?;
                let mut cfg = SimEngineConfig::new(device.clone(), model.clone());
                let e = Efficiency::default();
                cfg.efficiency = Efficiency {
                    mfu: mfu.unwrap_or(e.mfu),
                    mbu: mbu.unwrap_or(e.mbu),
                };
                if let Some(b) = max_batch {
                    cfg.max_batch = *b;
                }
                cfg.weight_sync = weight_sync(spec);
                cfg.weight_sync.shards = sim_shards;
                cfg.weight_sync.gpus_per_shard = *gpus_per_shard;
                if let Some(g) = weight_sync_gbps {
                    cfg.weight_sync.intra_bandwidth = g * 1e9;
                }
                cfg.hang_probability = *hang_probability;
                cfg.measured = *measured;
                if let Some(b) = block_tokens {
                    cfg.block_tokens = (*b).max(1);
                }
                let faults = spec
                    .sim
                    .faults
                    .iter()
                    .filter(|f| f.pool == p.name)
                    .map(|f| (f.shard, f.hang_after_steps))
                    .collect();
                let mb = cfg.max_batch;
                let engine = EnginePlan::Sim {
                    config: Box::new(cfg),
                    faults,
                };
                (device, model, mb, engine)
            }
            BackendSpec::Llamacpp(l) | BackendSpec::Sglang(l) | BackendSpec::Vllm(l) => {
                server_pool(pi, &p.backend, l, base, inputs)?
            }
            BackendSpec::Builtin { model, max_batch } => {
                let choice = model.choice();
                let shape = resolved_shape(inputs, pi)?;
                (
                    base,
                    real_profile(&shape),
                    *max_batch,
                    EnginePlan::Builtin { model: choice },
                )
            }
        };
        out.push(PoolPlan {
            name: p.name.clone(),
            shards: p.count,
            device,
            model,
            max_batch,
            engine,
            prefill_from: None,
            prefill_only: false,
            frozen_after_s: knobs.frozen_after_s,
        });
    }
    link_disaggregated(spec, &mut out);
    Ok(out)
}

/// A pool of inference servers (llama.cpp, SGLang, vLLM), attached or managed.
fn server_pool(
    pi: usize,
    backend: &BackendSpec,
    l: &ServerSpec,
    base: DeviceProfile,
    inputs: &Resolved,
) -> Result<(DeviceProfile, ModelProfile, usize, EnginePlan), WiringError> {
    let kind = match backend {
        BackendSpec::Sglang(_) => ServerKind::Sglang,
        BackendSpec::Vllm(_) => ServerKind::Vllm,
        _ => ServerKind::Llamacpp,
    };
    let choice = l.model.choice();
    let shape = resolved_shape(inputs, pi)?;
    let launch = l.launch.clone().unwrap_or_default();
    let command = if launch.command.is_empty() && kind == ServerKind::Llamacpp {
        // The launcher script is written into the job's directory at spawn; its
        // path is the second word.
        actors::generation::remote::llamacpp::xllamacpp_command(
            &launch
                .python
                .clone()
                .unwrap_or_else(|| inputs.xllamacpp_python.clone()),
            std::path::Path::new(XLLAMACPP_SCRIPT),
            launch.threads.unwrap_or(1),
        )
    } else {
        launch.command.clone()
    };
    let server = ServerPlan {
        kind,
        urls: l.urls.clone(),
        discover: l.discover.as_ref().map(super::envs::membership),
        command,
        env: launch.env.clone().into_iter().collect(),
        ports: launch.port_range.map(|[a, b]| (a, b)),
        gpus_per_shard: launch.gpus_per_shard,
        export_q8: launch.export.as_deref() == Some("q8_0"),
        slots: l.slots,
        context: shape.max_seq as usize,
    };
    Ok((
        base,
        real_profile(&shape),
        l.slots,
        EnginePlan::Server {
            model: choice,
            server: Box::new(server),
        },
    ))
}

/// Prefill/decode disaggregation links (validated: the named pool exists and is simulated).
fn link_disaggregated(spec: &JobSpec, out: &mut [PoolPlan]) {
    for (pi, p) in spec.pools.iter().enumerate() {
        if let BackendSpec::Sim {
            prefill_pool: Some(pp),
            kv_transfer_gbps,
            kv_return,
            ..
        } = &p.backend
            && let Some(qi) = spec.pools.iter().position(|q| &q.name == pp)
        {
            out[pi].prefill_from = Some(PrefillLink {
                pool: qi,
                bandwidth: kv_transfer_gbps.unwrap_or(50.0) * 1e9,
                kv_bytes_per_token: out[pi].model.kv_bytes_per_token,
                kv_return: *kv_return,
            });
            out[qi].prefill_only = true;
        }
    }
}
