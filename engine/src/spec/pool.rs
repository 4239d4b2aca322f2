//! The `pools[]` and `mapping` sections: generation pools (device class, shard count,
//! backend) and how task domains are routed to them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{JobSpec, Problems};
use actors::device::{DeviceProfile, ModelProfile};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    pub name: String,
    /// Device class: H800, H20, H100, A100 or CPU.
    pub device: String,
    #[serde(default = "default_shard_count")]
    #[schema(minimum = 1, maximum = 4096)]
    pub count: usize,
    pub backend: BackendSpec,
}

fn default_shard_count() -> usize {
    1
}
fn default_gpus_per_shard() -> u32 {
    1
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum BackendSpec {
    /// Roofline simulator of the device class.
    Sim {
        /// A built-in model profile (`qwen3-8b`, …) or one defined under `sim.models`.
        #[serde(default = "default_sim_model")]
        model: String,
        #[serde(default)]
        max_batch: Option<usize>,
        /// Model FLOP utilisation of prefill (default 0.5).
        #[serde(default)]
        mfu: Option<f64>,
        /// Memory-bandwidth utilisation of decode (default 0.7).
        #[serde(default)]
        mbu: Option<f64>,
        /// Per-GPU weight pull bandwidth in GB/s (overrides `sim.weight_sync.intra_gbps`).
        #[serde(default)]
        weight_sync_gbps: Option<f64>,
        #[serde(default)]
        hang_probability: f64,
        /// GPUs per shard (tensor parallelism); `count` shards use `count × gpus_per_shard` GPUs.
        #[serde(default = "default_gpus_per_shard")]
        gpus_per_shard: u32,
        /// Fraction of linear scaling a tensor-parallel group keeps (default 0.9).
        #[serde(default)]
        tp_efficiency: Option<f64>,
        /// Prefill/decode disaggregation: this pool decodes; the named pool prefills, and the
        /// KV cache travels at `kv_transfer_gbps` (GB/s).
        #[serde(default)]
        prefill_pool: Option<String>,
        #[serde(default)]
        kv_transfer_gbps: Option<f64>,
    },
    /// The built-in transformer on CPU (real generation, on its own thread per shard).
    Builtin {
        #[serde(default)]
        model: BuiltinModelSpec,
        /// Sequences decoded together per engine step.
        #[serde(default = "default_builtin_batch")]
        max_batch: usize,
    },
}

fn default_builtin_batch() -> usize {
    64
}

/// Size of the built-in transformer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BuiltinModelSpec {
    #[serde(default = "default_d_model")]
    pub d_model: usize,
    #[serde(default = "default_layers")]
    pub n_layers: usize,
    #[serde(default = "default_heads")]
    pub n_heads: usize,
    #[serde(default = "default_d_ff")]
    pub d_ff: usize,
    #[serde(default = "default_max_seq")]
    pub max_seq: usize,
}

fn default_d_model() -> usize {
    64
}
fn default_layers() -> usize {
    2
}
fn default_heads() -> usize {
    4
}
fn default_d_ff() -> usize {
    256
}
fn default_max_seq() -> usize {
    512
}

impl Default for BuiltinModelSpec {
    fn default() -> Self {
        Self {
            d_model: default_d_model(),
            n_layers: default_layers(),
            n_heads: default_heads(),
            d_ff: default_d_ff(),
            max_seq: default_max_seq(),
        }
    }
}

impl BuiltinModelSpec {
    pub fn config(&self) -> actors::model::transformer::ModelConfig {
        actors::model::transformer::ModelConfig {
            vocab: actors::model::tokenizer::VOCAB,
            d_model: self.d_model,
            n_layers: self.n_layers,
            n_heads: self.n_heads,
            d_ff: self.d_ff,
            max_seq: self.max_seq,
        }
    }
}

fn default_sim_model() -> String {
    "qwen3-8b".into()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum MappingMode {
    Declared,
    CostModel,
    SinglePool,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MappingSpec {
    #[serde(default)]
    pub mode: Option<MappingMode>,
    /// Task domain → pool name.
    #[serde(default)]
    pub declared: BTreeMap<String, String>,
    /// Pool for undeclared domains (default: the first pool).
    #[serde(default)]
    pub fallback: Option<String>,
}

impl PoolSpec {
    /// Checks this pool (at `at`, e.g. `pools[0]`) against the rest of the spec.
    pub(super) fn check(&self, at: &str, spec: &JobSpec, problems: &mut Problems) {
        let (pl, p) = (self, at);
        if spec.device_profile(&pl.device).is_none() {
            problems.push(
                format!("{p}.device"),
                format!(
                    "unknown device class {:?}, expected one of {} or one under sim.devices",
                    pl.device,
                    DeviceProfile::BUILTIN_NAMES.join(", ")
                ),
            );
        }
        if pl.count == 0 || pl.count > 4096 {
            problems.push(
                format!("{p}.count"),
                format!("must be in 1..=4096, got {}", pl.count),
            );
        }
        match &pl.backend {
            BackendSpec::Sim { .. } => self.check_sim(at, spec, problems),
            BackendSpec::Builtin { model, max_batch } => {
                check_builtin(at, spec, model, *max_batch, problems)
            }
        }
    }

    /// Checks a simulated backend.
    fn check_sim(&self, at: &str, spec: &JobSpec, problems: &mut Problems) {
        let (pl, p) = (self, at);
        let BackendSpec::Sim {
            model,
            max_batch,
            mfu,
            mbu,
            weight_sync_gbps,
            hang_probability,
            gpus_per_shard,
            tp_efficiency,
            prefill_pool,
            kv_transfer_gbps,
        } = &pl.backend
        else {
            return;
        };
        if spec.model_profile(model).is_none() {
            problems.push(
                format!("{p}.backend.model"),
                format!(
                    "unknown model {model:?}, expected one of {} or one under sim.models",
                    ModelProfile::BUILTIN_NAMES.join(", ")
                ),
            );
        }
        if *gpus_per_shard == 0 || *gpus_per_shard > 64 {
            problems.push(
                format!("{p}.backend.gpus_per_shard"),
                format!("must be in 1..=64, got {gpus_per_shard}"),
            );
        }
        if let Some(e) = tp_efficiency
            && !(*e > 0.0 && *e <= 1.0)
        {
            problems.push(
                format!("{p}.backend.tp_efficiency"),
                format!("must be in (0, 1], got {e}"),
            );
        }
        if let Some(pp) = prefill_pool {
            match spec.pools.iter().find(|q| &q.name == pp) {
                None => problems.push(
                    format!("{p}.backend.prefill_pool"),
                    format!("no pool is named {pp:?}"),
                ),
                Some(q) if q.name == pl.name => problems.push(
                    format!("{p}.backend.prefill_pool"),
                    "a pool cannot prefill for itself".into(),
                ),
                Some(q) if !matches!(q.backend, BackendSpec::Sim { .. }) => problems.push(
                    format!("{p}.backend.prefill_pool"),
                    format!("pool {pp:?} must be simulated too"),
                ),
                Some(_) => {}
            }
        }
        if let Some(g) = kv_transfer_gbps
            && !(g.is_finite() && *g > 0.0)
        {
            problems.push(
                format!("{p}.backend.kv_transfer_gbps"),
                format!("must be positive, got {g}"),
            );
        }
        if *max_batch == Some(0) {
            problems.push(
                format!("{p}.backend.max_batch"),
                "must be at least 1".into(),
            );
        }
        for (name, v) in [("mfu", mfu), ("mbu", mbu)] {
            if let Some(v) = v
                && !(*v > 0.0 && *v <= 1.0)
            {
                problems.push(
                    format!("{p}.backend.{name}"),
                    format!("must be in (0, 1], got {v}"),
                );
            }
        }
        if let Some(g) = weight_sync_gbps
            && !(g.is_finite() && *g > 0.0)
        {
            problems.push(
                format!("{p}.backend.weight_sync_gbps"),
                format!("must be positive, got {g}"),
            );
        }
        if !(0.0..=1.0).contains(hang_probability) {
            problems.push(
                format!("{p}.backend.hang_probability"),
                format!("must be a probability in [0, 1], got {hang_probability}"),
            );
        }
    }
}

/// Checks a built-in model backend (at `at`, e.g. `pools[0]`).
fn check_builtin(
    at: &str,
    spec: &JobSpec,
    model: &BuiltinModelSpec,
    max_batch: usize,
    problems: &mut Problems,
) {
    let p = at;
    for m in model.config().problems() {
        problems.push(format!("{p}.backend.model"), m);
    }
    if max_batch == 0 {
        problems.push(
            format!("{p}.backend.max_batch"),
            "must be at least 1".into(),
        );
    }
    if !spec.trains_builtin() {
        problems.push(
            format!("{p}.backend"),
            "the built-in model trains only with trainer.kind = \"builtin\"".into(),
        );
    }
    if let Some(first) = spec.pools.iter().find_map(|q| match &q.backend {
        BackendSpec::Builtin { model, .. } => Some(*model),
        _ => None,
    }) && first != *model
    {
        problems.push(
            format!("{p}.backend.model"),
            "every built-in pool must use the same model size (they share weights)".into(),
        );
    }
}

impl MappingSpec {
    /// Checks declared routes and the fallback against the tasks and pools of the spec.
    pub(super) fn check(&self, spec: &JobSpec, problems: &mut Problems) {
        let domains: std::collections::BTreeSet<&str> =
            spec.tasks.iter().map(|t| t.domain.as_str()).collect();
        let pools: std::collections::BTreeSet<&str> =
            spec.pools.iter().map(|p| p.name.as_str()).collect();
        let prefill_only: Vec<&str> = spec
            .pools
            .iter()
            .filter_map(|p| match &p.backend {
                BackendSpec::Sim {
                    prefill_pool: Some(pp),
                    ..
                } => Some(pp.as_str()),
                _ => None,
            })
            .collect();
        for (domain, pool) in &spec.mapping.declared {
            if prefill_only.contains(&pool.as_str()) {
                problems.push(
                format!("mapping.declared.{domain}"),
                format!(
                    "pool {pool:?} only prefills for another pool; map the task to the decoding pool"
                ),
            );
            }
            if !domains.contains(domain.as_str()) {
                problems.push(
                    format!("mapping.declared.{domain}"),
                    format!("no task has domain {domain:?}"),
                );
            }
            if !pools.contains(pool.as_str()) {
                problems.push(
                    format!("mapping.declared.{domain}"),
                    format!("no pool is named {pool:?}"),
                );
            }
        }
        if let Some(f) = &spec.mapping.fallback
            && !pools.contains(f.as_str())
        {
            problems.push("mapping.fallback".into(), format!("no pool is named {f:?}"));
        }
    }
}
