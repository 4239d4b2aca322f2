//! `[plan.rescale]`: a profile moved to another model and cluster on the device roofline.

use serde::Deserialize;
use serde_json::Value;

/// A profile of a real run rescaled to another model and cluster (`[plan.rescale]`): its
/// environments, rewards, task mix and rollout knobs stay as measured; generation and training
/// move to the device roofline of `model` on the named pools and trainer.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Rescale {
    /// A built-in model profile (`qwen3-8b`, …) or one under `sim.models`.
    model: String,
    /// Rollout pools: device class and shards (one GPU each unless `gpus_per_shard`).
    pools: Vec<RescalePool>,
    trainer_device: String,
    trainer_gpus: u32,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RescalePool {
    device: String,
    count: usize,
    #[serde(default)]
    gpus_per_shard: Option<u32>,
}

impl Rescale {
    /// `spec` (JSON) on the roofline: the pools and trainer replaced, the measured costs gone.
    pub(super) fn apply(&self, spec: &mut Value) {
        let pools: Vec<Value> = self
            .pools
            .iter()
            .enumerate()
            .map(|(i, p)| {
                serde_json::json!({
                    "name": format!("{}-{i}", p.device.to_ascii_lowercase()),
                    "device": p.device,
                    "count": p.count,
                    "backend": {
                        "kind": "sim",
                        "model": self.model,
                        "gpus_per_shard": p.gpus_per_shard.unwrap_or(1),
                    },
                })
            })
            .collect();
        spec["pools"] = Value::Array(pools);
        spec["mapping"] = serde_json::json!({ "mode": "cost_model" });
        spec["trainer"] = serde_json::json!({
            "kind": "sim",
            "model": self.model,
            "device": self.trainer_device,
            "gpus": self.trainer_gpus,
        });
    }
}
