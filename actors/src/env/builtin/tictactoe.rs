//! Tic-tac-toe as X against a fixed-strategy O: win if it can, else block, else take the
//! centre, else a corner, else the first free cell. Reward 1 for a win, 0.5 for a draw, 0 for
//! a loss; success is a win or a draw (the opponent never loses a won position by chance).

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::InvalidAction;
use crate::env::{EnvError, Environment, Observation, StepOutcome};

const LINES: [[usize; 3]; 8] = [
    [0, 1, 2],
    [3, 4, 5],
    [6, 7, 8],
    [0, 3, 6],
    [1, 4, 7],
    [2, 5, 8],
    [0, 4, 8],
    [2, 4, 6],
];

#[derive(Clone, Debug, Default, PartialEq)]
pub struct TicTacToeConfig {
    pub invalid: InvalidAction,
    /// The opponent opens (at a seeded random cell) instead of the agent.
    pub opponent_first: bool,
}

pub struct TicTacToe {
    cfg: TicTacToeConfig,
    board: [u8; 9],
    done: bool,
}

fn winner(b: &[u8; 9]) -> Option<u8> {
    LINES
        .iter()
        .find(|l| b[l[0]] != b'.' && b[l[0]] == b[l[1]] && b[l[1]] == b[l[2]])
        .map(|l| b[l[0]])
}

/// The opponent's move for `me` on board `b`.
pub fn opponent_move(b: &[u8; 9], me: u8, other: u8) -> Option<usize> {
    let completing = |who: u8| {
        LINES.iter().find_map(|l| {
            let cells: Vec<u8> = l.iter().map(|&i| b[i]).collect();
            (cells.iter().filter(|&&c| c == who).count() == 2)
                .then(|| l.iter().copied().find(|&i| b[i] == b'.'))
                .flatten()
        })
    };
    completing(me)
        .or_else(|| completing(other))
        .or_else(|| (b[4] == b'.').then_some(4))
        .or_else(|| [0, 2, 6, 8].into_iter().find(|&i| b[i] == b'.'))
        .or_else(|| (0..9).find(|&i| b[i] == b'.'))
}

impl TicTacToe {
    pub fn new(cfg: TicTacToeConfig) -> Self {
        Self {
            cfg,
            board: [b'.'; 9],
            done: true,
        }
    }

    pub fn render(&self) -> String {
        self.board
            .chunks(3)
            .map(|r| {
                r.iter()
                    .map(|&c| (c as char).to_string())
                    .collect::<Vec<_>>()
                    .join(" ")
                    + "\n"
            })
            .collect()
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

    fn end(&mut self, reward: f64, success: bool) -> StepOutcome {
        self.done = true;
        StepOutcome {
            observation: self.obs(),
            reward,
            terminated: true,
            success,
            ..StepOutcome::default()
        }
    }
}

impl Environment for TicTacToe {
    async fn reset(&mut self, seed: u64) -> Result<Observation, EnvError> {
        self.board = [b'.'; 9];
        self.done = false;
        if self.cfg.opponent_first {
            let mut rng = SmallRng::seed_from_u64(seed);
            self.board[rng.random_range(0..9)] = b'O';
        }
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
        let cell = action
            .trim()
            .chars()
            .next()
            .and_then(|c| c.to_digit(10))
            .filter(|d| (1..=9).contains(d))
            .map(|d| d as usize - 1);
        let Some(cell) = cell.filter(|&c| self.board[c] == b'.') else {
            let (outcome, done) = self.cfg.invalid.outcome(self.obs());
            self.done = done;
            return Ok(outcome);
        };
        self.board[cell] = b'X';
        if winner(&self.board) == Some(b'X') {
            return Ok(self.end(1.0, true));
        }
        match opponent_move(&self.board, b'O', b'X') {
            None => Ok(self.end(0.5, true)),
            Some(m) => {
                self.board[m] = b'O';
                if winner(&self.board) == Some(b'O') {
                    Ok(self.end(0.0, false))
                } else if !self.board.contains(&b'.') {
                    Ok(self.end(0.5, true))
                } else {
                    Ok(StepOutcome {
                        observation: self.obs(),
                        ..StepOutcome::default()
                    })
                }
            }
        }
    }

    async fn close(&mut self) {}
}
