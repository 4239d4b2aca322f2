//! Device and model profiles and the roofline shared by the cost-model mapper and the
//! generation simulator. GPU discovery through the CUDA driver lives in [`gpu`] behind the
//! `cuda` feature.

/// What a device class can do. Figures are dense BF16 peak and HBM bandwidth.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceProfile {
    pub name: String,
    /// Peak dense FLOP/s.
    pub flops: f64,
    /// Memory bandwidth in bytes/s.
    pub bandwidth: f64,
    /// Device memory in bytes.
    pub memory: f64,
    /// Relative cost per hour (H20 = 1).
    pub cost: f64,
}

impl DeviceProfile {
    /// The built-in catalogue: H800, H20, H100, A100 and a CPU class.
    pub fn builtin(name: &str) -> Option<Self> {
        let (flops, bw, mem, cost) = match name.to_ascii_uppercase().as_str() {
            "H800" => (989.5e12, 3.35e12, 80e9, 2.85),
            "H20" => (148e12, 4.0e12, 96e9, 1.0),
            "H100" => (989.5e12, 3.35e12, 80e9, 3.0),
            "A100" => (312e12, 2.0e12, 80e9, 1.6),
            // A 2-core laptop-class CPU: ~100 GFLOP/s with AVX2 FMA, ~20 GB/s DRAM.
            "CPU" => (1.0e11, 2.0e10, 16e9, 0.05),
            // Zero-latency device for orchestration-overhead benchmarks.
            "IDEAL" => (1.0e30, 1.0e30, 1.0e15, 1.0),
            _ => return None,
        };
        Some(Self {
            name: name.to_ascii_uppercase(),
            flops,
            bandwidth: bw,
            memory: mem,
            cost,
        })
    }

    pub const BUILTIN_NAMES: [&'static str; 5] = ["H800", "H20", "H100", "A100", "CPU"];

    /// Arithmetic intensity (FLOP/byte) above which a kernel is compute-bound.
    pub fn ridge_point(&self) -> f64 {
        self.flops / self.bandwidth
    }

    /// A tensor-parallel group of `n` devices serving as one shard: `n`× compute, bandwidth,
    /// memory and cost, with compute and bandwidth scaled by `efficiency` for the all-reduces
    /// between layers (ignored for `n = 1`).
    pub fn group(&self, n: u32, efficiency: f64) -> Self {
        let n = n.max(1);
        let eff = if n == 1 {
            1.0
        } else {
            efficiency.clamp(0.05, 1.0)
        };
        let k = n as f64;
        Self {
            name: if n == 1 {
                self.name.clone()
            } else {
                format!("{}x{n}", self.name)
            },
            flops: self.flops * k * eff,
            bandwidth: self.bandwidth * k * eff,
            memory: self.memory * k,
            cost: self.cost * k,
        }
    }
}

/// How new weights travel from the trainer to the rollout shards (RollArt's weight relay).
#[derive(Clone, Debug, PartialEq)]
pub struct WeightSync {
    pub mode: SyncMode,
    /// Transfer unit (RollArt: 1 GB buckets).
    pub bucket_bytes: f64,
    /// Trainer → relay (or → rollout, direct) over the inter-cluster network, bytes/s; in
    /// direct mode every pulling shard shares it.
    pub inter_bandwidth: f64,
    /// Relay → each rollout GPU over the in-cluster fabric, bytes/s.
    pub intra_bandwidth: f64,
    /// Shards that pull at once (direct mode divides the trainer's link among them).
    pub shards: u32,
    /// GPUs per shard: each pulls its tensor-parallel slice over its own link.
    pub gpus_per_shard: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncMode {
    /// Naive: when generation is suspended, every shard pulls the full weights from the trainer
    /// at once over the shared inter-cluster link.
    Direct,
    /// Overlapped: the trainer pushes buckets to a CPU relay while its step runs (only the last
    /// bucket is exposed); shards pull from the relay in pipelined buckets over the fabric.
    Relay,
}

impl Default for WeightSync {
    fn default() -> Self {
        // RollArt: 1 GB buckets, 200 Gbit/s between clusters, 400 Gbit/s InfiniBand inside.
        Self {
            mode: SyncMode::Relay,
            bucket_bytes: 1e9,
            inter_bandwidth: 25e9,
            intra_bandwidth: 50e9,
            shards: 1,
            gpus_per_shard: 1,
        }
    }
}

impl WeightSync {
    /// Seconds a shard is suspended to install `bytes` of weights.
    pub fn install_seconds(&self, bytes: f64) -> f64 {
        let per_gpu = bytes / self.gpus_per_shard.max(1) as f64;
        match self.mode {
            SyncMode::Direct => {
                per_gpu * self.shards.max(1) as f64 * self.gpus_per_shard.max(1) as f64
                    / self.inter_bandwidth.max(1.0)
            }
            SyncMode::Relay => {
                (per_gpu + self.bucket_bytes.min(per_gpu)) / self.intra_bandwidth.max(1.0)
            }
        }
    }

    /// Seconds the trainer's step grows by to publish `bytes` (relay: the last bucket's push;
    /// direct: nothing, the shards pull later).
    pub fn publish_seconds(&self, bytes: f64) -> f64 {
        match self.mode {
            SyncMode::Direct => 0.0,
            SyncMode::Relay => self.bucket_bytes.min(bytes) / self.inter_bandwidth.max(1.0),
        }
    }
}

/// Seconds of one training step over `tokens` tokens on `gpus` devices: forward + backward
/// (6 FLOPs per active parameter per token) plus recomputing the behaviour log-probabilities
/// (2 more), at model FLOP utilisation `mfu`.
pub fn train_seconds(
    dev: &DeviceProfile,
    model: &ModelProfile,
    gpus: u32,
    mfu: f64,
    tokens: f64,
) -> f64 {
    8.0 * model.active_params * tokens / (dev.flops * gpus.max(1) as f64 * mfu.max(1e-3))
}

/// A model's size as the roofline sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelProfile {
    pub name: String,
    /// Total parameters.
    pub params: f64,
    /// Parameters active per token (equal to `params` for dense models).
    pub active_params: f64,
    pub layers: u32,
    /// KV-cache bytes per token (all layers, K and V).
    pub kv_bytes_per_token: f64,
    /// Bytes per parameter (2 for BF16).
    pub bytes_per_param: f64,
}

impl ModelProfile {
    /// Qwen3-style profiles used by the simulator.
    pub fn builtin(name: &str) -> Option<Self> {
        // kv bytes/token = 2 (K,V) * layers * kv_heads * head_dim * 2 bytes
        let (p, a, layers, kv_heads, head_dim) = match name.to_ascii_lowercase().as_str() {
            "qwen3-8b" => (8.2e9, 8.2e9, 36, 8, 128),
            "qwen3-14b" => (14.8e9, 14.8e9, 40, 8, 128),
            "qwen3-32b" => (32.8e9, 32.8e9, 64, 8, 128),
            "qwen3-30b-a3b" => (30.5e9, 3.3e9, 48, 4, 128),
            "tiny" => (2.0e6, 2.0e6, 4, 4, 32),
            _ => return None,
        };
        Some(Self {
            name: name.to_ascii_lowercase(),
            params: p,
            active_params: a,
            layers,
            kv_bytes_per_token: 2.0 * layers as f64 * kv_heads as f64 * head_dim as f64 * 2.0,
            bytes_per_param: 2.0,
        })
    }

    pub const BUILTIN_NAMES: [&'static str; 5] = [
        "qwen3-8b",
        "qwen3-14b",
        "qwen3-32b",
        "qwen3-30b-a3b",
        "tiny",
    ];

    pub fn weight_bytes(&self) -> f64 {
        self.params * self.bytes_per_param
    }
}

/// Efficiency factors that turn peak figures into achievable ones.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Efficiency {
    /// Model FLOP utilisation for prefill / training.
    pub mfu: f64,
    /// Memory-bandwidth utilisation for decode.
    pub mbu: f64,
}

impl Default for Efficiency {
    fn default() -> Self {
        Self { mfu: 0.5, mbu: 0.7 }
    }
}

/// Seconds to prefill `tokens` tokens.
pub fn prefill_seconds(
    dev: &DeviceProfile,
    model: &ModelProfile,
    eff: Efficiency,
    tokens: f64,
) -> f64 {
    2.0 * model.active_params * tokens / (dev.flops * eff.mfu)
}

/// Seconds for one decode step of `batch` sequences holding `kv_tokens` tokens of KV in all.
/// The step reads the weights touched by the batch plus every sequence's KV, or is limited by
/// compute when the batch is large enough to pass the ridge point.
pub fn decode_step_seconds(
    dev: &DeviceProfile,
    model: &ModelProfile,
    eff: Efficiency,
    batch: f64,
    kv_tokens: f64,
) -> f64 {
    if batch <= 0.0 {
        return 0.0;
    }
    // MoE: a small batch touches only the active experts; a large one touches all of them.
    let touched = (model.active_params * batch)
        .min(model.params)
        .max(model.active_params);
    let bytes = touched * model.bytes_per_param + kv_tokens * model.kv_bytes_per_token;
    let memory_s = bytes / (dev.bandwidth * eff.mbu);
    let compute_s = 2.0 * model.active_params * batch / (dev.flops * eff.mfu);
    memory_s.max(compute_s)
}

#[cfg(feature = "cuda")]
pub mod gpu;

/// A GPU found on this machine, with the profile the mapper would use for it.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    /// CUDA compute capability (major, minor): 9.0 for Hopper, 8.0 for the A100.
    pub compute_capability: (u32, u32),
    pub sms: u32,
    pub memory_bytes: u64,
    pub clock_mhz: u32,
    pub memory_clock_mhz: u32,
    pub bus_width_bits: u32,
    pub profile: DeviceProfile,
}

/// Why no GPU could be listed.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error(
        "rollarc was built without the `cuda` feature; rebuild with `--features cuda` to list GPUs"
    )]
    NotBuilt,
    #[error(
        "no CUDA driver found (libcuda could not be loaded); generation runs on CPU or simulated devices"
    )]
    NoDriver,
    #[cfg(feature = "cuda")]
    #[error("the CUDA driver failed")]
    Driver(#[source] cudarc::driver::DriverError),
}

/// Lists the GPUs visible through the CUDA driver.
pub fn discover_gpus() -> Result<Vec<GpuInfo>, DiscoveryError> {
    #[cfg(feature = "cuda")]
    {
        gpu::discover()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(DiscoveryError::NotBuilt)
    }
}

/// Dense FP16/BF16 tensor-core FLOP per SM per clock by compute capability: 4 tensor cores
/// per SM doing 256 FMA a clock before Ampere's A100 (sm_7x, and the sm_86/87/89 parts
/// that kept that rate), 512 on the A100 (sm_80), 1024 on Hopper (sm_90), 2048 on the
/// data-centre Blackwell (sm_100); consumer parts (sm_12x) as sm_89. One FMA is 2 FLOP.
pub fn tensor_flop_per_sm_clock(compute_capability: (u32, u32)) -> f64 {
    match compute_capability {
        (8, 0) => 2048.0,
        (9, _) => 4096.0,
        (10, _) => 8192.0,
        _ => 1024.0,
    }
}

/// Peak figures estimated from what the driver reports: FP16/BF16 dense tensor FLOP/s from
/// the SM count, the clock and the compute capability ([`tensor_flop_per_sm_clock`]), and
/// bandwidth from memory clock and bus width (DDR: ×2).
pub fn profile_from_attributes(gpu: &GpuInfo) -> DeviceProfile {
    let flops = gpu.sms as f64
        * gpu.clock_mhz as f64
        * 1e6
        * tensor_flop_per_sm_clock(gpu.compute_capability);
    let bandwidth = gpu.memory_clock_mhz as f64 * 1e6 * 2.0 * gpu.bus_width_bits as f64 / 8.0;
    let name = short_name(&gpu.name);
    let cost = DeviceProfile::builtin(&name).map_or(1.0, |d| d.cost);
    DeviceProfile {
        name,
        flops,
        bandwidth,
        memory: gpu.memory_bytes as f64,
        cost,
    }
}

/// "NVIDIA H100 80GB HBM3" → "H100", so the catalogue's relative cost applies.
pub fn short_name(full: &str) -> String {
    for known in ["H800", "H200", "H20", "H100", "A100"] {
        if full.to_ascii_uppercase().contains(known) {
            return known.to_string();
        }
    }
    full.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(name: &str, cc: (u32, u32), sms: u32, clock: u32, mem: u32, bus: u32) -> GpuInfo {
        GpuInfo {
            ordinal: 0,
            name: name.into(),
            compute_capability: cc,
            sms,
            memory_bytes: 80 << 30,
            clock_mhz: clock,
            memory_clock_mhz: mem,
            bus_width_bits: bus,
            profile: DeviceProfile::builtin("CPU").unwrap(),
        }
    }

    /// The attributes an H200 reported through the driver on a device machine (132 SMs,
    /// 1,980 MHz, 3,201 MHz × 6,016 bit) give the datasheet's figures within the clock's
    /// margin (989 TFLOP/s dense BF16 is quoted at 1,830 MHz; 4.8 TB/s); an A100 SXM gives
    /// 312 TFLOP/s. The first version counted Hopper like Ampere and said 535 TFLOP/s.
    #[test]
    fn peak_figures_follow_the_compute_capability() {
        let h200 = profile_from_attributes(&gpu("NVIDIA H200", (9, 0), 132, 1980, 3201, 6016));
        assert_eq!(h200.name, "H200");
        assert!((h200.flops / 1e12 - 1070.5).abs() < 1.0, "{}", h200.flops);
        assert!(
            (h200.bandwidth / 1e12 - 4.815).abs() < 0.01,
            "{}",
            h200.bandwidth
        );
        let a100 =
            profile_from_attributes(&gpu("NVIDIA A100-SXM4-80GB", (8, 0), 108, 1410, 1593, 5120));
        assert_eq!(a100.name, "A100");
        assert!((a100.flops / 1e12 - 311.9).abs() < 0.5, "{}", a100.flops);
        assert_eq!(a100.cost, DeviceProfile::builtin("A100").unwrap().cost);
        let l4 = profile_from_attributes(&gpu("NVIDIA L4", (8, 9), 58, 2040, 6251, 192));
        assert!((l4.flops / 1e12 - 121.2).abs() < 0.5, "{}", l4.flops);
    }

    #[test]
    fn prefill_prefers_compute_rich_and_decode_prefers_bandwidth_rich() {
        let h800 = DeviceProfile::builtin("h800").unwrap();
        let h20 = DeviceProfile::builtin("H20").unwrap();
        let m = ModelProfile::builtin("qwen3-8b").unwrap();
        let e = Efficiency::default();
        assert!(prefill_seconds(&h800, &m, e, 4096.0) * 5.0 < prefill_seconds(&h20, &m, e, 4096.0));
        assert!(
            decode_step_seconds(&h20, &m, e, 8.0, 8.0 * 2048.0)
                < decode_step_seconds(&h800, &m, e, 8.0, 8.0 * 2048.0)
        );
        // Ridge points quoted in the design notes: ~37 (H20), ~295 (H800).
        assert!((h20.ridge_point() - 37.0).abs() < 1.0);
        assert!((h800.ridge_point() - 295.0).abs() < 1.0);
    }

    #[test]
    fn moe_decode_reads_fewer_bytes_at_small_batch() {
        let dev = DeviceProfile::builtin("H20").unwrap();
        let moe = ModelProfile::builtin("qwen3-30b-a3b").unwrap();
        let e = Efficiency::default();
        assert!(
            decode_step_seconds(&dev, &moe, e, 1.0, 0.0) * 5.0
                < decode_step_seconds(&dev, &moe, e, 64.0, 0.0)
        );
    }
}
