//! A reward model served on GPUs: the tokens a judge reads of a trajectory and the time its
//! batches take on the device roofline.

use crate::types::Trajectory;

/// A reward model served on GPUs: every instance holds `gpus` devices (one tensor-parallel
/// group) and runs its waiting calls in batches of up to `max_batch`. A batch prefills every
/// trajectory it reads, then decodes `verdict_tokens` for each, on the device roofline.
#[derive(Clone, Debug)]
pub struct GpuService {
    /// The instance's device group (see [`crate::device::DeviceProfile::group`]).
    pub device: crate::device::DeviceProfile,
    pub model: crate::device::ModelProfile,
    pub efficiency: crate::device::Efficiency,
    pub gpus: u32,
    pub max_batch: u32,
    pub verdict_tokens: u32,
    /// Reads only the task and the final answer (otherwise every turn).
    pub final_answer_only: bool,
}

impl GpuService {
    /// Tokens the judge prefills for `traj`.
    pub fn read_tokens(&self, traj: &Trajectory) -> usize {
        if self.final_answer_only {
            traj.turns.first().map_or(0, |t| t.observation_tokens.len())
                + traj.turns.last().map_or(0, |t| t.response_tokens.len())
        } else {
            traj.turns
                .iter()
                .map(|t| t.observation_tokens.len() + t.response_tokens.len())
                .sum()
        }
    }

    /// Seconds one batch takes: prefill of every trajectory it reads, then the verdicts' decode
    /// steps over the batch's whole KV.
    pub fn batch_seconds(&self, tokens: &[f64]) -> f64 {
        use crate::device::{decode_step_seconds, prefill_seconds};
        let read: f64 = tokens.iter().sum();
        let b = tokens.len() as f64;
        let prefill = prefill_seconds(&self.device, &self.model, self.efficiency, read);
        let v = f64::from(self.verdict_tokens);
        // Mean KV over the verdict: the trajectories plus half the verdict of each.
        let decode = v * decode_step_seconds(
            &self.device,
            &self.model,
            self.efficiency,
            b,
            read + b * v / 2.0,
        );
        prefill + decode
    }
}
