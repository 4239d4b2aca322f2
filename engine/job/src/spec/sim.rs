//! The `sim` section: the clock, custom device and model profiles, injected faults and the
//! weight-sync model of simulated clusters.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::pool::{BackendSpec, BuiltinModelSpec};
use super::reward::FunctionSpec;
use super::trainer::TrainerSpec;
use super::{JobSpec, Problems};
use actors::device::{DeviceProfile, ModelProfile};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Clock {
    /// Paused tokio clock: simulated durations take no wall time.
    #[default]
    Virtual,
    /// Wall clock: simulated durations are really waited (demos, restart tests).
    Real,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SimSpec {
    /// Default: virtual when every backend is simulated, real otherwise.
    #[serde(default)]
    pub clock: Option<Clock>,
    /// Fault injection (test hook): the trainer panics at this step, counted from 0 (the
    /// driver's index: 0 is the first training step) ...
    #[serde(default)]
    pub trainer_panic_at_step: Option<u64>,
    /// ... in the first this-many runs of the job (default 1; a restarted run is the next).
    #[serde(default)]
    pub trainer_panic_runs: Option<u64>,
    /// Device classes beyond the built-in ones (or replacing them), for pools and trainers.
    #[serde(default)]
    pub devices: Vec<DeviceSpec>,
    /// Model profiles beyond the built-in ones.
    #[serde(default)]
    pub models: Vec<ModelSpec>,
    /// How weights reach the rollout shards (default: the relay, 1 GB buckets, 200/400 Gbit/s).
    #[serde(default)]
    pub weight_sync: Option<WeightSyncSpec>,
    /// Injected shard failures: the shard's engine freezes after this many engine steps (once;
    /// the watchdog restarts it and its requests are retried or masked).
    #[serde(default)]
    pub faults: Vec<FaultSpec>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    pub pool: String,
    pub shard: usize,
    pub hang_after_steps: u64,
}

/// A device class for the simulator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    pub name: String,
    /// Dense BF16 TFLOP/s.
    pub tflops: f64,
    /// Memory in GB.
    pub hbm_gb: f64,
    /// Memory bandwidth in TB/s.
    pub hbm_tbps: f64,
    /// Relative cost per hour (H20 = 1).
    pub cost: f64,
}

/// A model profile for the simulator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub name: String,
    /// Total parameters, billions.
    pub params_b: f64,
    /// Parameters active per token, billions (MoE); default: all.
    #[serde(default)]
    pub active_b: Option<f64>,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Bytes per weight in the rollout engines (2 for BF16, 1 for FP8).
    #[serde(default = "default_bytes_per_param")]
    pub bytes_per_param: f64,
}

fn default_bytes_per_param() -> f64 {
    2.0
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SyncModeSpec {
    /// Naive: every shard pulls from the trainer over the shared inter-cluster link.
    Direct,
    /// Overlapped: bucketed push to a CPU relay during training, pipelined pulls.
    Relay,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WeightSyncSpec {
    #[serde(default = "default_sync_mode")]
    pub mode: SyncModeSpec,
    #[serde(default = "default_bucket_gb")]
    pub bucket_gb: f64,
    /// Trainer → relay / rollout, Gbit/s.
    #[serde(default = "default_inter_gbps")]
    pub inter_gbps: f64,
    /// Relay → each rollout GPU, Gbit/s.
    #[serde(default = "default_intra_gbps")]
    pub intra_gbps: f64,
}

fn default_sync_mode() -> SyncModeSpec {
    SyncModeSpec::Relay
}
fn default_bucket_gb() -> f64 {
    1.0
}
fn default_inter_gbps() -> f64 {
    200.0
}
fn default_intra_gbps() -> f64 {
    400.0
}

impl SimSpec {
    /// Checks custom profiles, faults and the weight-sync model.
    pub(super) fn check(&self, spec: &JobSpec, problems: &mut Problems) {
        let positive = |v: f64| v.is_finite() && v > 0.0;
        for (i, d) in spec.sim.devices.iter().enumerate() {
            for (k, v) in [
                ("tflops", d.tflops),
                ("hbm_gb", d.hbm_gb),
                ("hbm_tbps", d.hbm_tbps),
                ("cost", d.cost),
            ] {
                if !positive(v) {
                    problems.push(
                        format!("sim.devices[{i}].{k}"),
                        format!("must be positive, got {v}"),
                    );
                }
            }
        }
        for (i, m) in spec.sim.models.iter().enumerate() {
            if !positive(m.params_b) {
                problems.push(
                    format!("sim.models[{i}].params_b"),
                    format!("must be positive, got {}", m.params_b),
                );
            }
            if let Some(a) = m.active_b
                && !(positive(a) && a <= m.params_b)
            {
                problems.push(
                    format!("sim.models[{i}].active_b"),
                    format!("must be in (0, params_b], got {a}"),
                );
            }
            if !(m.bytes_per_param > 0.0 && m.bytes_per_param <= 4.0) {
                problems.push(
                    format!("sim.models[{i}].bytes_per_param"),
                    format!("must be in (0, 4], got {}", m.bytes_per_param),
                );
            }
            for (k, v) in [
                ("layers", m.layers),
                ("kv_heads", m.kv_heads),
                ("head_dim", m.head_dim),
            ] {
                if v == 0 {
                    problems.push(format!("sim.models[{i}].{k}"), "must be at least 1".into());
                }
            }
        }
        for (i, f) in spec.sim.faults.iter().enumerate() {
            match spec.pools.iter().find(|p| p.name == f.pool) {
                None => problems.push(
                    format!("sim.faults[{i}].pool"),
                    format!("no pool is named {:?}", f.pool),
                ),
                Some(p) if !matches!(p.backend, BackendSpec::Sim { .. }) => problems.push(
                    format!("sim.faults[{i}].pool"),
                    "faults are injected into simulated pools only".into(),
                ),
                Some(p) if f.shard >= p.count => problems.push(
                    format!("sim.faults[{i}].shard"),
                    format!("pool {:?} has {} shards", f.pool, p.count),
                ),
                Some(_) => {}
            }
        }
        if let Some(w) = &spec.sim.weight_sync {
            for (k, v) in [
                ("bucket_gb", w.bucket_gb),
                ("inter_gbps", w.inter_gbps),
                ("intra_gbps", w.intra_gbps),
            ] {
                if !positive(v) {
                    problems.push(
                        format!("sim.weight_sync.{k}"),
                        format!("must be positive, got {v}"),
                    );
                }
            }
        }
    }
}

impl JobSpec {
    /// A device class by name: `sim.devices` first, then the built-in catalogue.
    pub fn device_profile(&self, name: &str) -> Option<DeviceProfile> {
        match self
            .sim
            .devices
            .iter()
            .find(|d| d.name.eq_ignore_ascii_case(name))
        {
            Some(d) => Some(DeviceProfile {
                name: d.name.clone(),
                flops: d.tflops * 1e12,
                bandwidth: d.hbm_tbps * 1e12,
                memory: d.hbm_gb * 1e9,
                cost: d.cost,
            }),
            None => DeviceProfile::builtin(name),
        }
    }

    /// A model profile by name: `sim.models` first, then the built-in catalogue.
    pub fn model_profile(&self, name: &str) -> Option<ModelProfile> {
        match self
            .sim
            .models
            .iter()
            .find(|m| m.name.eq_ignore_ascii_case(name))
        {
            Some(m) => Some(ModelProfile {
                name: m.name.clone(),
                params: m.params_b * 1e9,
                active_params: m.active_b.unwrap_or(m.params_b) * 1e9,
                layers: m.layers,
                kv_bytes_per_token: 2.0
                    * m.layers as f64
                    * m.kv_heads as f64
                    * m.head_dim as f64
                    * 2.0,
                bytes_per_param: m.bytes_per_param,
            }),
            None => ModelProfile::builtin(name),
        }
    }

    /// Whether every backend is simulated and no environment is an external program (so the
    /// job can run on the virtual clock).
    pub fn all_simulated(&self) -> bool {
        self.pools
            .iter()
            .all(|p| matches!(p.backend, BackendSpec::Sim { .. }))
            && matches!(self.trainer, TrainerSpec::Sim { .. })
            && self
                .reward
                .functions
                .values()
                .all(|f| matches!(f, FunctionSpec::Sim { .. }))
            // An external environment is a real process: it takes real time.
            && !self.tasks.iter().any(|t| t.env.is_process() || t.remote_pool().is_some())
    }

    /// The clock the job runs on.
    pub fn clock(&self) -> Clock {
        self.sim.clock.unwrap_or(if self.all_simulated() {
            Clock::Virtual
        } else {
            Clock::Real
        })
    }

    /// The built-in model's size, when the job uses it.
    pub fn builtin_model(&self) -> Option<BuiltinModelSpec> {
        self.pools
            .iter()
            .find_map(|p| p.backend.real_model().cloned())
    }
}
