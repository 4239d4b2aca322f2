//! The simulator's knobs: the shard's device and model, batching and prefill chunking, KV
//! memory, weight sync, fault injection, fusion limits, and costs measured on a real engine.

use std::sync::Arc;

use crate::device::{DeviceProfile, Efficiency, ModelProfile, WeightSync};

/// Knobs of the simulator.
#[derive(Clone, Debug)]
pub struct SimEngineConfig {
    /// The shard's device: one GPU, or a tensor-parallel group as one aggregated profile
    /// ([`DeviceProfile::group`]).
    pub device: DeviceProfile,
    pub model: ModelProfile,
    pub efficiency: Efficiency,
    /// Largest decode batch.
    pub max_batch: usize,
    /// Prefill tokens per engine step (chunked prefill).
    pub prefill_chunk: u64,
    /// Fraction of device memory left for KV after weights.
    pub kv_memory_fraction: f64,
    /// Tokens per KV block: the prefix cache holds, hits and evicts whole blocks.
    pub block_tokens: u64,
    /// How new weights reach this shard.
    pub weight_sync: WeightSync,
    /// Probability that an engine iteration hangs (frozen shard), for fault injection.
    pub hang_probability: f64,
    pub seed: u64,
    /// Vocabulary the simulated tokens are drawn from.
    pub vocab: u32,
    /// Most decode iterations fused into one step (0 or 1: no fusion).
    pub max_fused_iterations: u64,
    /// Longest fused step in modelled seconds (keeps progress visible to the shard watchdog).
    pub max_fused_s: f64,
    /// Fault injection: the engine freezes after this many steps.
    pub hang_after_steps: Option<u64>,
    /// Costs measured on a real engine (`rollarc profile`), replacing the roofline's step time.
    pub measured: Option<MeasuredCost>,
    /// The host whose cores this engine shares with the trainer (a CPU deployment): every
    /// modelled step is charged to it.
    pub host: Option<Arc<crate::trainer::HostCpu>>,
}

/// An engine step's cost as measured on a real engine: a fixed part per step, plus each token
/// prefilled and each sequence decoded.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MeasuredCost {
    pub step_s: f64,
    pub prefill_s_per_token: f64,
    pub decode_s_per_token: f64,
}

impl SimEngineConfig {
    pub fn new(device: DeviceProfile, model: ModelProfile) -> Self {
        Self {
            device,
            model,
            efficiency: Efficiency::default(),
            max_batch: 256,
            prefill_chunk: 16_384,
            kv_memory_fraction: 0.9,
            block_tokens: 1,
            weight_sync: WeightSync::default(),
            hang_probability: 0.0,
            seed: 0,
            vocab: 32_000,
            max_fused_iterations: 4096,
            max_fused_s: 20.0,
            hang_after_steps: None,
            measured: None,
            host: None,
        }
    }
}
