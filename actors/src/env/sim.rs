//! A simulated environment: reset and step latencies, turn counts, observation and response
//! lengths drawn from seeded distributions, with injected failures and hangs. Runs on the
//! virtual clock.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::{EnvError, Environment, Observation, StepOutcome};
use crate::dist::Dist;
use crate::tokens::{Draw, Tokens};

/// Largest sampled observation or response length (a heavy tail is cut here; specs are
/// validated against the same bound).
const MAX_TOKENS: f64 = (1u64 << 20) as f64;
/// Longest sampled latency of one call: 30 days.
const MAX_LATENCY_S: f64 = 30.0 * 24.0 * 3600.0;

#[derive(Clone, Debug)]
pub struct SimEnvConfig {
    /// Seconds per reset.
    pub reset_latency: Dist,
    /// Seconds per step.
    pub step_latency: Dist,
    /// Turns until the episode terminates.
    pub turns: Dist,
    /// Observation tokens per turn after the first.
    pub observation_tokens: Dist,
    /// Tokens of the first observation (the prompt); default: `observation_tokens`.
    pub prompt_tokens: Option<Dist>,
    /// Tokens the simulated policy answers with per turn.
    pub response_tokens: Dist,
    pub success_rate: f64,
    pub failure_probability: f64,
    pub hang_probability: f64,
    /// Correlated difficulty: a factor drawn from the reset seed alone (so shared by every
    /// episode of a group) scaling turns, response lengths and latencies. `None`: 1.
    pub difficulty: Option<Dist>,
    /// The machine the task's sandboxes share: CPU cores their calls compute on, and how many
    /// may start at once. `None`: calls only wait their latency.
    pub sandboxes: Option<std::sync::Arc<SimSandboxes>>,
}

/// The simulated machine a task's sandboxes run on, shared by all of them: each reset and step
/// computes `reset_cpu_s` / `step_cpu_s` seconds on one of `cores` (waiting its turn, first
/// come first served, when every core is busy), after its latency (waiting on I/O holds no
/// core); at most `max_concurrent_starts` resets run at once. A warm pool keeps `warm`
/// sandboxes started ahead (ready when the job begins): a reset takes one at no cost, and a
/// replacement starts in the background (its latency, a start slot and its reset's CPU).
#[derive(Debug)]
pub struct SimSandboxes {
    pub reset_cpu_s: Option<Dist>,
    pub step_cpu_s: Option<Dist>,
    cores: Option<tokio::sync::Semaphore>,
    starts: Option<tokio::sync::Semaphore>,
    /// Started sandboxes ready for a reset.
    warm: std::sync::atomic::AtomicU32,
}

impl SimSandboxes {
    pub fn new(
        cores: Option<u32>,
        max_concurrent_starts: Option<u32>,
        reset_cpu_s: Option<Dist>,
        step_cpu_s: Option<Dist>,
        warm: u32,
    ) -> Self {
        let sem = |n: u32| tokio::sync::Semaphore::new(n.max(1) as usize);
        Self {
            reset_cpu_s,
            step_cpu_s,
            cores: cores.map(sem),
            starts: max_concurrent_starts.map(sem),
            warm: std::sync::atomic::AtomicU32::new(warm),
        }
    }

    /// Takes a warm sandbox, if one is ready.
    fn take_warm(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        self.warm
            .fetch_update(Relaxed, Relaxed, |w| w.checked_sub(1))
            .is_ok()
    }

    /// Starts a sandbox for the warm pool: a start slot, `latency_s`, then `cpu_s` on a core.
    fn refill(self: std::sync::Arc<Self>, latency_s: f64, cpu_s: f64) {
        tokio::spawn(async move {
            let _start = match &self.starts {
                Some(s) => s.acquire().await.ok(),
                None => None,
            };
            if latency_s > 0.0 {
                tokio::time::sleep(crate::dist::seconds(latency_s.min(MAX_LATENCY_S))).await;
            }
            self.compute(cpu_s).await;
            self.warm.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        });
    }

    /// Computes `secs` on one core, waiting for a free one first.
    async fn compute(&self, secs: f64) {
        if secs <= 0.0 {
            return;
        }
        let _core = match &self.cores {
            Some(c) => c.acquire().await.ok(),
            None => None,
        };
        tokio::time::sleep(crate::dist::seconds(secs.min(MAX_LATENCY_S))).await;
    }
}

impl Default for SimEnvConfig {
    fn default() -> Self {
        Self {
            reset_latency: Dist::Constant(0.0),
            step_latency: Dist::Constant(0.0),
            turns: Dist::Constant(1.0),
            observation_tokens: Dist::Constant(64.0),
            prompt_tokens: None,
            response_tokens: Dist::Constant(64.0),
            success_rate: 0.5,
            failure_probability: 0.0,
            hang_probability: 0.0,
            difficulty: None,
            sandboxes: None,
        }
    }
}

pub struct SimEnv {
    cfg: SimEnvConfig,
    rng: SmallRng,
    turns_left: u32,
    success: bool,
    /// This episode's prompt's difficulty factor.
    factor: f64,
    /// How the last reset found its sandbox (with a sandbox machine only).
    last_start: Option<super::starts::Start>,
}

impl SimEnv {
    pub fn new(cfg: SimEnvConfig, seed: u64) -> Self {
        Self {
            cfg,
            rng: SmallRng::seed_from_u64(seed),
            turns_left: 0,
            success: false,
            factor: 1.0,
            last_start: None,
        }
    }

    fn observation(&mut self, first: bool) -> Observation {
        let d = if first {
            self.cfg
                .prompt_tokens
                .as_ref()
                .unwrap_or(&self.cfg.observation_tokens)
        } else {
            &self.cfg.observation_tokens
        };
        let n = d.sample(&mut self.rng).round().clamp(1.0, MAX_TOKENS) as u32;
        // Token values do not matter to the simulator: a cheap xorshift stream, drawn (its
        // values computed only if something reads them).
        let tokens = Tokens::drawn(Draw {
            seed: self.rng.random::<u64>() | 1,
            len: n,
            modulus: 31_999,
        });
        let len = (self.cfg.response_tokens.sample(&mut self.rng) * self.factor)
            .round()
            .clamp(1.0, MAX_TOKENS) as u32;
        Observation {
            text: String::new(),
            tokens: Some(tokens),
            sim_response_len: Some(len),
            reference: None,
            messages: None,
        }
    }

    async fn latency(&mut self, d: &Dist, cpu: Option<&Dist>) -> Result<(), EnvError> {
        if self.cfg.hang_probability > 0.0
            && self.rng.random_bool(self.cfg.hang_probability.min(1.0))
        {
            std::future::pending::<()>().await;
        }
        let s = d.sample(&mut self.rng) * self.factor;
        if s > 0.0 {
            let s = s.min(MAX_LATENCY_S);
            tokio::time::sleep(crate::dist::seconds(s)).await;
        }
        if let (Some(m), Some(c)) = (&self.cfg.sandboxes, cpu) {
            let secs = c.sample(&mut self.rng) * self.factor;
            m.compute(secs).await;
        }
        if self.cfg.failure_probability > 0.0
            && self.rng.random_bool(self.cfg.failure_probability.min(1.0))
        {
            return Err(EnvError::Injected);
        }
        Ok(())
    }
}

impl SimEnv {
    /// A started episode: its turns and outcome drawn, its prompt.
    fn started(&mut self) -> Observation {
        self.turns_left = (self.cfg.turns.sample(&mut self.rng) * self.factor)
            .round()
            .clamp(1.0, f64::from(u32::MAX)) as u32;
        self.success = self.rng.random_bool(self.cfg.success_rate.clamp(0.0, 1.0));
        self.observation(true)
    }
}

impl Environment for SimEnv {
    async fn reset(&mut self, seed: u64) -> Result<Observation, EnvError> {
        // The prompt's difficulty follows the seed alone: every episode of the group shares it.
        self.factor = self.cfg.difficulty.as_ref().map_or(1.0, |d| {
            d.sample(&mut SmallRng::seed_from_u64(seed ^ 0xd1ff_1c01_7ee5_eed5))
                .max(0.0)
        });
        // The episode's own randomness follows its seed, so groups replay identically.
        self.rng = SmallRng::seed_from_u64(seed ^ self.rng.random::<u64>());
        let d = self.cfg.reset_latency.clone();
        let machine = self.cfg.sandboxes.clone();
        let cpu = machine.as_ref().and_then(|m| m.reset_cpu_s.clone());
        if let Some(m) = machine.as_ref().filter(|m| m.take_warm()) {
            // A started sandbox: ready now; its replacement starts in the background.
            let latency = d.sample(&mut self.rng) * self.factor;
            let cpu_s = cpu.as_ref().map_or(0.0, |c| c.sample(&mut self.rng)) * self.factor;
            m.clone().refill(latency, cpu_s);
            self.last_start = Some(super::starts::Start::Warm);
            return Ok(self.started());
        }
        self.last_start = machine.as_ref().map(|_| super::starts::Start::Cold);
        // A start slot is held for the whole reset (the sandbox starting).
        let _start = match machine.as_ref().and_then(|m| m.starts.as_ref()) {
            Some(s) => s.acquire().await.ok(),
            None => None,
        };
        self.latency(&d, cpu.as_ref()).await?;
        Ok(self.started())
    }

    async fn step(
        &mut self,
        _action: &str,
        _tokens: &crate::tokens::Tokens,
    ) -> Result<StepOutcome, EnvError> {
        let d = self.cfg.step_latency.clone();
        let cpu = self
            .cfg
            .sandboxes
            .as_ref()
            .and_then(|m| m.step_cpu_s.clone());
        self.latency(&d, cpu.as_ref()).await?;
        self.turns_left = self.turns_left.saturating_sub(1);
        let terminated = self.turns_left == 0;
        let success = terminated && self.success;
        Ok(StepOutcome {
            observation: if terminated {
                Observation::default()
            } else {
                self.observation(false)
            },
            reward: if success { 1.0 } else { 0.0 },
            terminated,
            truncated: false,
            success,
            invalid_action: false,
            info: None,
        })
    }

    async fn close(&mut self) {}

    fn last_start(&self) -> Option<super::starts::Start> {
        self.last_start
    }
}
