//! FrozenLake: walk from S to G over frozen tiles F without falling into a hole H. Reward 1 at
//! the goal; a hole ends the episode with 0. On slippery ice the agent moves as intended with
//! probability 1/3 and to either side with 1/3 each.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::{Dir, InvalidAction};
use crate::env::{EnvError, Environment, Observation, StepOutcome};

/// The classic maps.
pub const MAP_4X4: [&str; 4] = ["SFFF", "FHFH", "FFFH", "HFFG"];
pub const MAP_8X8: [&str; 8] = [
    "SFFFFFFF", "FFFFFFFF", "FFFHFFFF", "FFFFFHFF", "FFFHFFFF", "FHHFFFHF", "FHFFHFHF", "FFFHFFFG",
];

#[derive(Clone, Debug, PartialEq)]
pub struct FrozenLakeConfig {
    /// 4 or 8.
    pub size: usize,
    pub slippery: bool,
    /// Generate a random solvable map per seed instead of the classic one.
    pub random_map: bool,
    pub invalid: InvalidAction,
}

impl Default for FrozenLakeConfig {
    fn default() -> Self {
        Self {
            size: 4,
            slippery: false,
            random_map: false,
            invalid: InvalidAction::default(),
        }
    }
}

pub struct FrozenLake {
    cfg: FrozenLakeConfig,
    map: Vec<Vec<u8>>,
    pos: (usize, usize),
    rng: SmallRng,
    done: bool,
}

impl FrozenLake {
    pub fn new(cfg: FrozenLakeConfig) -> Self {
        Self {
            cfg,
            map: Vec::new(),
            pos: (0, 0),
            rng: SmallRng::seed_from_u64(0),
            done: true,
        }
    }

    fn classic(size: usize) -> Vec<Vec<u8>> {
        let rows: &[&str] = if size == 8 { &MAP_8X8 } else { &MAP_4X4 };
        rows.iter().map(|r| r.bytes().collect()).collect()
    }

    /// A random map with holes at density 0.2, regenerated until G is reachable from S.
    fn random(size: usize, rng: &mut SmallRng) -> Vec<Vec<u8>> {
        loop {
            let mut m: Vec<Vec<u8>> = (0..size)
                .map(|_| {
                    (0..size)
                        .map(|_| if rng.random_bool(0.2) { b'H' } else { b'F' })
                        .collect()
                })
                .collect();
            m[0][0] = b'S';
            m[size - 1][size - 1] = b'G';
            if reachable(&m) {
                return m;
            }
        }
    }

    pub fn render(&self) -> String {
        let mut s = String::new();
        for (r, row) in self.map.iter().enumerate() {
            let line: Vec<String> = row
                .iter()
                .enumerate()
                .map(|(c, &t)| {
                    if (r, c) == self.pos {
                        "P".to_string()
                    } else {
                        (t as char).to_string()
                    }
                })
                .collect();
            s.push_str(&line.join(" "));
            s.push('\n');
        }
        s
    }

    fn obs(&self) -> Observation {
        Observation {
            text: self.render(),
            tokens: None,
            sim_response_len: None,
            reference: None,
            messages: None,
        }
    }
}

fn reachable(m: &[Vec<u8>]) -> bool {
    let n = m.len();
    let mut seen = vec![vec![false; n]; n];
    let mut stack = vec![(0usize, 0usize)];
    while let Some((r, c)) = stack.pop() {
        if seen[r][c] || m[r][c] == b'H' {
            continue;
        }
        seen[r][c] = true;
        if m[r][c] == b'G' {
            return true;
        }
        for d in Dir::ALL {
            let (dr, dc) = d.delta();
            let (nr, nc) = (r as i32 + dr, c as i32 + dc);
            if nr >= 0 && nc >= 0 && (nr as usize) < n && (nc as usize) < n {
                stack.push((nr as usize, nc as usize));
            }
        }
    }
    false
}

impl Environment for FrozenLake {
    async fn reset(&mut self, seed: u64) -> Result<Observation, EnvError> {
        self.rng = SmallRng::seed_from_u64(seed);
        let size = if self.cfg.size == 8 { 8 } else { 4 };
        self.map = if self.cfg.random_map {
            Self::random(size, &mut self.rng)
        } else {
            Self::classic(size)
        };
        self.pos = (0, 0);
        self.done = false;
        Ok(self.obs())
    }

    async fn step(
        &mut self,
        action: &str,
        _tokens: &crate::tokens::Tokens,
    ) -> Result<StepOutcome, EnvError> {
        if self.done {
            return Err(EnvError::EpisodeOver);
        }
        let Some(intended) = Dir::parse(action) else {
            let (outcome, done) = self.cfg.invalid.outcome(self.obs());
            self.done = done;
            return Ok(outcome);
        };
        let dir = if self.cfg.slippery {
            match self.rng.random_range(0..3) {
                0 => intended,
                k => intended.perpendicular()[k - 1],
            }
        } else {
            intended
        };
        let n = self.map.len() as i32;
        let (dr, dc) = dir.delta();
        let (r, c) = (
            (self.pos.0 as i32 + dr).clamp(0, n - 1),
            (self.pos.1 as i32 + dc).clamp(0, n - 1),
        );
        self.pos = (r as usize, c as usize);
        let tile = self.map[self.pos.0][self.pos.1];
        let (terminated, success) = match tile {
            b'H' => (true, false),
            b'G' => (true, true),
            _ => (false, false),
        };
        self.done = terminated;
        Ok(StepOutcome {
            observation: self.obs(),
            reward: if success { 1.0 } else { 0.0 },
            terminated,
            success,
            ..StepOutcome::default()
        })
    }

    async fn close(&mut self) {}
}
