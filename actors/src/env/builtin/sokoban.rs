//! Sokoban in small generated rooms: push every box `$` onto a target `.`. Rooms are made by
//! playing backwards from the solved state (the player pulls boxes off their targets), so every
//! generated room is solvable. Reward: +1 when solved, ±0.1 for a box put on / taken off a
//! target, −0.01 per move.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::{Dir, InvalidAction};
use crate::env::{EnvError, Environment, Observation, StepOutcome};

#[derive(Clone, Debug, PartialEq)]
pub struct SokobanConfig {
    /// Room side including walls (5..=10).
    pub size: usize,
    /// 1 or 2.
    pub boxes: usize,
    /// Backward moves used to scramble the solved room.
    pub scramble: usize,
    pub invalid: InvalidAction,
}

impl Default for SokobanConfig {
    fn default() -> Self {
        Self {
            size: 6,
            boxes: 1,
            scramble: 12,
            invalid: InvalidAction::default(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct State {
    walls: Vec<Vec<bool>>,
    targets: Vec<(usize, usize)>,
    boxes: Vec<(usize, usize)>,
    player: (usize, usize),
}

impl State {
    fn free(&self, p: (usize, usize)) -> bool {
        !self.walls[p.0][p.1] && !self.boxes.contains(&p)
    }

    fn solved(&self) -> bool {
        self.boxes.iter().all(|b| self.targets.contains(b))
    }

    fn on_target(&self) -> usize {
        self.boxes
            .iter()
            .filter(|b| self.targets.contains(b))
            .count()
    }
}

fn add(p: (usize, usize), d: Dir) -> (usize, usize) {
    let (dr, dc) = d.delta();
    ((p.0 as i32 + dr) as usize, (p.1 as i32 + dc) as usize)
}

pub struct Sokoban {
    cfg: SokobanConfig,
    st: Option<State>,
    done: bool,
}

impl Sokoban {
    pub fn new(cfg: SokobanConfig) -> Self {
        Self {
            cfg,
            st: None,
            done: true,
        }
    }

    /// Generates a room by reverse play from the solved state.
    fn generate(cfg: &SokobanConfig, rng: &mut SmallRng) -> State {
        let n = cfg.size.clamp(5, 10);
        loop {
            let walls: Vec<Vec<bool>> = (0..n)
                .map(|r| {
                    (0..n)
                        .map(|c| r == 0 || c == 0 || r == n - 1 || c == n - 1)
                        .collect()
                })
                .collect();
            let mut cells: Vec<(usize, usize)> = (1..n - 1)
                .flat_map(|r| (1..n - 1).map(move |c| (r, c)))
                .collect();
            let mut pick = |rng: &mut SmallRng| cells.swap_remove(rng.random_range(0..cells.len()));
            let targets: Vec<_> = (0..cfg.boxes.clamp(1, 2)).map(|_| pick(rng)).collect();
            let player = pick(rng);
            let mut st = State {
                walls,
                boxes: targets.clone(),
                targets,
                player,
            };
            // Reverse moves: the player steps back, pulling a box that was in front of it.
            for _ in 0..cfg.scramble.max(1) * 4 {
                let d = Dir::ALL[rng.random_range(0..4)];
                let back = add(st.player, d);
                if !st.free(back) {
                    continue;
                }
                let (dr, dc) = d.delta();
                let front = (
                    (st.player.0 as i32 - dr) as usize,
                    (st.player.1 as i32 - dc) as usize,
                );
                if let Some(i) = st.boxes.iter().position(|&b| b == front)
                    && rng.random_bool(0.7)
                {
                    st.boxes[i] = st.player;
                }
                st.player = back;
            }
            if !st.solved() {
                return st;
            }
        }
    }

    pub fn render(&self) -> String {
        let Some(st) = &self.st else {
            return String::new();
        };
        let mut s = String::new();
        for r in 0..st.walls.len() {
            for c in 0..st.walls[r].len() {
                let p = (r, c);
                let ch = if st.walls[r][c] {
                    '#'
                } else if st.player == p {
                    if st.targets.contains(&p) { '+' } else { '@' }
                } else if st.boxes.contains(&p) {
                    if st.targets.contains(&p) { '*' } else { '$' }
                } else if st.targets.contains(&p) {
                    '.'
                } else {
                    '_'
                };
                s.push(ch);
            }
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

impl Environment for Sokoban {
    async fn reset(&mut self, seed: u64) -> Result<Observation, EnvError> {
        let mut rng = SmallRng::seed_from_u64(seed);
        self.st = Some(Self::generate(&self.cfg, &mut rng));
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
        let Some(st) = self.st.as_mut() else {
            return Err(EnvError::NotReset);
        };
        let Some(d) = Dir::parse(action) else {
            let (outcome, done) = self.cfg.invalid.outcome(self.obs());
            self.done = done;
            return Ok(outcome);
        };
        let before = st.on_target();
        let next = add(st.player, d);
        let mut reward = -0.01;
        if !st.walls[next.0][next.1] {
            if let Some(i) = st.boxes.iter().position(|&b| b == next) {
                let beyond = add(next, d);
                if st.free(beyond) {
                    st.boxes[i] = beyond;
                    st.player = next;
                }
            } else {
                st.player = next;
            }
        }
        let after = st.on_target();
        reward += 0.1 * (after as f64 - before as f64);
        let solved = st.solved();
        if solved {
            reward += 1.0;
        }
        self.done = solved;
        Ok(StepOutcome {
            observation: self.obs(),
            reward,
            terminated: solved,
            success: solved,
            ..StepOutcome::default()
        })
    }

    async fn close(&mut self) {}
}
