//! The `pools[]` and `mapping` sections: generation pools (device class, shard count,
//! backend) and how task domains are routed to them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

mod check;

use super::knob::{Knob, KnobInfo, knob};
use super::{JobSpec, Problems};

pub const POOL_COUNT: Knob<usize> = knob(
    ("PoolSpec", "pools[i]", "count"),
    (1, false, 4096),
    Some(1),
    "",
    "Shards of the pool (each a GPU group, a server or a built-in engine).",
);
pub const SERVER_SLOTS: Knob<usize> = knob(
    ("ServerSpec", "pools[i].backend", "slots"),
    (1, false, 256),
    Some(4),
    "",
    "Requests a server generates at once (its slots).",
);

pub const MODEL_MAX_SEQ: Knob<usize> = knob(
    ("BuiltinModelSpec", "pools[i].backend.model", "max_seq"),
    (2, false, actors::model::transformer::MAX_SEQ),
    None,
    "512 for the tiny model; 2048 for a checkpoint, at most its trained context",
    "Longest sequence (context and answers): the tiny model's positions or a checkpoint's context limit.",
);

/// The knobs of a pool, in the manual's order.
pub(super) fn knobs() -> Vec<KnobInfo> {
    vec![POOL_COUNT.info(), SERVER_SLOTS.info(), MODEL_MAX_SEQ.info()]
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    pub name: String,
    /// Device class: H800, H20, H100, A100 or CPU.
    pub device: String,
    #[serde(default = "default_shard_count")]
    pub count: usize,
    pub backend: BackendSpec,
}

fn default_shard_count() -> usize {
    POOL_COUNT.or_default(None)
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
        /// With `prefill_pool`: after each turn the decode side hands the turn's KV back to
        /// the prefill side over the same link (only what its cache lacks travels), so the
        /// next turn prefills only its new tokens there.
        #[serde(default)]
        kv_return: bool,
        /// Tokens per KV block of the prefix cache (default 16): it holds, hits and evicts
        /// whole blocks.
        #[serde(default)]
        block_tokens: Option<u64>,
        /// Step costs measured on a real engine (what `rollarc profile` writes): seconds per
        /// engine step, per prefilled token and per decoded token, replacing the roofline.
        #[serde(default)]
        #[schema(value_type = Option<Object>)]
        measured: Option<actors::generation::sim::MeasuredCost>,
    },
    /// The built-in transformer on CPU (real generation, on its own thread per shard).
    Builtin {
        #[serde(default)]
        model: BuiltinModelSpec,
        /// Sequences decoded together per engine step.
        #[serde(default = "default_builtin_batch")]
        max_batch: usize,
    },
    /// llama.cpp's HTTP server: servers rollarc starts, supervises and restarts (`launch`,
    /// the default), or servers running elsewhere (`urls`, one shard each).
    Llamacpp(Box<ServerSpec>),
    /// SGLang servers (`urls`, or `launch` with its command).
    Sglang(Box<ServerSpec>),
    /// vLLM servers with `VLLM_SERVER_DEV_MODE=1` (`urls`, or `launch` with its command).
    Vllm(Box<ServerSpec>),
}

/// A pool of inference servers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ServerSpec {
    /// The checkpoint (GGUF file or Hugging Face directory) the trainer trains and the
    /// servers serve; every new version is exported for them (llama.cpp: a GGUF file it
    /// restarts on; SGLang, vLLM: a Hugging Face directory they load from disk).
    pub model: BuiltinModelSpec,
    /// Attach mode: the servers' base URLs, one shard each (`count` must match). An attached
    /// llama.cpp cannot take new weights (it has no weight-update endpoint); SGLang and vLLM
    /// must be able to read the exported directories (same file system).
    #[serde(default)]
    pub urls: Vec<String>,
    /// Managed mode (the default): how each shard starts its server.
    #[serde(default)]
    pub launch: Option<LaunchSpec>,
    /// Discovery mode: the pool follows an inference Deployment's replicas, every address
    /// of a DNS name (`{ dns = "llm.ns.svc:8080" }`, a headless Service, with `nameserver`
    /// and `refresh_s`) or the ready endpoints of Kubernetes EndpointSlices
    /// (`{ kubernetes = { namespace, label_selector, port } }`), as env pools find their
    /// workers. `count` is the most servers it uses at once (its shard slots). A new server
    /// becomes a shard once healthy and serving the policy's current version; one that
    /// leaves finishes the trajectories it holds, then goes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub discover: Option<super::WorkersSpec>,
    #[serde(default = "default_slots")]
    pub slots: usize,
}

fn default_slots() -> usize {
    SERVER_SLOTS.or_default(None)
}

/// How a managed server starts.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LaunchSpec {
    /// Program and arguments, with `{model}`, `{port}`, `{host}`, `{slots}`, `{context}` (per
    /// slot) and `{total_context}` filled in at each start; e.g. `["llama-server", "-m",
    /// "{model}", "--port", "{port}", "-np", "{slots}", "-c", "{total_context}"]`. Default
    /// for llama.cpp: its server from the `xllamacpp` wheel (`make setup` installs it; Python
    /// from `python` or `ROLLARC_XLLAMACPP_PYTHON`); SGLang and vLLM need one.
    #[serde(default)]
    pub command: Vec<String>,
    /// Python with the `xllamacpp` wheel, for the default command.
    #[serde(default)]
    pub python: Option<String>,
    /// Environment of the server process.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Ports to choose from, inclusive (default: any free port).
    #[serde(default)]
    pub port_range: Option<[u16; 2]>,
    /// GPUs per shard (given to the server as `CUDA_VISIBLE_DEVICES`); 0: CPU.
    #[serde(default)]
    pub gpus_per_shard: u32,
    /// CPU threads of the default command's server (default 1).
    #[serde(default)]
    pub threads: Option<usize>,
    /// Weights exported for the server: `"f32"` (default: the trainer's numbers) or `"q8_0"`.
    #[serde(default)]
    pub export: Option<String>,
}

impl BackendSpec {
    /// The real model of a built-in or server pool (`None`: simulated).
    pub fn real_model(&self) -> Option<&BuiltinModelSpec> {
        match self {
            Self::Builtin { model, .. } => Some(model),
            Self::Llamacpp(l) | Self::Sglang(l) | Self::Vllm(l) => Some(&l.model),
            Self::Sim { .. } => None,
        }
    }
}

fn default_builtin_batch() -> usize {
    64
}

/// The built-in engine's model: a real checkpoint (`path`) or the tiny byte-level
/// transformer (`tiny`, the default). The flat form `{ d_model = …, n_layers = … }` of
/// earlier specs is still read as `tiny`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BuiltinModelSpec {
    /// A GGUF file or a Hugging Face checkpoint directory (Llama, Qwen2, Qwen3 families),
    /// as the service sees it.
    #[serde(default)]
    pub path: Option<String>,
    /// The tiny byte-level transformer's sizes.
    #[serde(default)]
    pub tiny: Option<TinyModelSpec>,
    #[serde(default)]
    pub max_seq: Option<usize>,
    /// The precision a checkpoint generates with: `f32` (the default: the trainer's own
    /// numbers), or its matrices quantised to `q8_0` or `q4_1` (faster decode; the
    /// trainer still recomputes log-probabilities in f32, and every token records the
    /// precision that sampled it).
    #[serde(default)]
    pub precision: Option<actors::types::Precision>,
    /// Earlier flat form of `tiny`.
    #[serde(default)]
    pub d_model: Option<usize>,
    #[serde(default)]
    pub n_layers: Option<usize>,
    #[serde(default)]
    pub n_heads: Option<usize>,
    #[serde(default)]
    pub d_ff: Option<usize>,
}

/// Sizes of the tiny transformer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TinyModelSpec {
    #[serde(default = "default_d_model")]
    pub d_model: usize,
    #[serde(default = "default_layers")]
    pub n_layers: usize,
    #[serde(default = "default_heads")]
    pub n_heads: usize,
    #[serde(default = "default_d_ff")]
    pub d_ff: usize,
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
/// Default longest sequence of the tiny model.
const DEFAULT_TINY_MAX_SEQ: usize = 512;
/// Default context limit of a checkpoint.
pub const DEFAULT_CHECKPOINT_MAX_SEQ: usize = 2048;

/// Which model a built-in pool serves, resolved from the spec.
#[derive(Clone, Debug, PartialEq)]
pub enum ModelChoice {
    Tiny(actors::model::transformer::ModelConfig),
    Checkpoint {
        path: std::path::PathBuf,
        max_seq: usize,
        /// What the engines generate with (the trainer is f32 whatever this says).
        precision: actors::types::Precision,
    },
}

impl BuiltinModelSpec {
    fn flat(&self) -> bool {
        self.d_model.is_some()
            || self.n_layers.is_some()
            || self.n_heads.is_some()
            || self.d_ff.is_some()
    }

    /// The tiny model's configuration (from `tiny`, or the flat fields).
    pub fn tiny_config(&self) -> actors::model::transformer::ModelConfig {
        let t = self.tiny.unwrap_or(TinyModelSpec {
            d_model: self.d_model.unwrap_or_else(default_d_model),
            n_layers: self.n_layers.unwrap_or_else(default_layers),
            n_heads: self.n_heads.unwrap_or_else(default_heads),
            d_ff: self.d_ff.unwrap_or_else(default_d_ff),
        });
        actors::model::transformer::ModelConfig {
            vocab: actors::model::tokenizer::VOCAB,
            d_model: t.d_model,
            n_layers: t.n_layers,
            n_heads: t.n_heads,
            d_ff: t.d_ff,
            max_seq: self.max_seq.unwrap_or(DEFAULT_TINY_MAX_SEQ),
        }
    }

    /// The model this spec names.
    pub fn choice(&self) -> ModelChoice {
        match &self.path {
            Some(p) => ModelChoice::Checkpoint {
                path: p.into(),
                max_seq: self.max_seq.unwrap_or(DEFAULT_CHECKPOINT_MAX_SEQ),
                precision: self.precision.unwrap_or_default(),
            },
            None => ModelChoice::Tiny(self.tiny_config()),
        }
    }

    /// Problems with the model at `at` (`pools[i].backend.model`). The checkpoint's header is
    /// checked by the resolve step ([`crate::resolve::check`]).
    pub(super) fn check(&self, at: &str, problems: &mut Problems) {
        if self.max_seq.is_some_and(|n| !MODEL_MAX_SEQ.allows(n)) {
            MODEL_MAX_SEQ.check_at(at, self.max_seq, problems);
            return;
        }
        match &self.path {
            Some(_) => {
                if self.tiny.is_some() || self.flat() {
                    problems.push(
                        format!("{at}.path"),
                        "give either a checkpoint path or the tiny model's sizes, not both".into(),
                    );
                }
            }
            None => {
                if self.precision.is_some() {
                    problems.push(
                        format!("{at}.precision"),
                        "a precision is for a checkpoint (`path`): the tiny model generates in f32"
                            .into(),
                    );
                }
                if self.tiny.is_some() && self.flat() {
                    problems.push(
                        format!("{at}.tiny"),
                        "give the sizes in `tiny` or in the flat form, not both".into(),
                    );
                }
                for m in self.tiny_config().problems() {
                    problems.push(at.to_string(), m);
                }
            }
        }
    }
}

/// What memory admission and the cost model need of a built-in model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelShape {
    pub params: u64,
    pub n_layers: u64,
    pub d_model: u64,
    /// Width of one layer's keys (or values): kv heads × head size.
    pub kv_width: u64,
    pub n_heads: u64,
    pub d_ff: u64,
    pub vocab: u64,
    pub max_seq: u64,
}

impl ModelChoice {
    /// The model's shape; a checkpoint's header is read (`None` if it cannot be).
    pub fn shape(&self) -> Option<ModelShape> {
        self.read_shape().ok()
    }

    /// The model's shape; a checkpoint's header is read (the only I/O: callers are the
    /// resolve step and the service's admission estimate).
    pub fn read_shape(&self) -> Result<ModelShape, actors::model::llm::LoadError> {
        match self {
            ModelChoice::Tiny(c) => Ok(ModelShape {
                params: c.params() as u64,
                n_layers: c.n_layers as u64,
                d_model: c.d_model as u64,
                kv_width: c.d_model as u64,
                n_heads: c.n_heads as u64,
                d_ff: c.d_ff as u64,
                vocab: c.vocab as u64,
                max_seq: c.max_seq as u64,
            }),
            ModelChoice::Checkpoint { path, max_seq, .. } => {
                let c = actors::model::llm::inspect(path)?;
                Ok(ModelShape {
                    params: c.params() as u64,
                    n_layers: c.n_layers as u64,
                    d_model: c.d_model as u64,
                    kv_width: (c.n_kv_heads * c.head_dim) as u64,
                    n_heads: c.n_heads as u64,
                    d_ff: c.d_ff as u64,
                    vocab: c.vocab as u64,
                    max_seq: (*max_seq).min(c.context_length) as u64,
                })
            }
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
