//! Built-in environments: seeded, text observations, documented action formats, and an
//! invalid action never crashes — it costs the configured penalty or ends the episode.
//!
//! | environment | observation | action |
//! |---|---|---|
//! | FrozenLake (4×4 / 8×8, slippery or not) | grid rows of `S F H G`, the agent as `P` | `left`, `down`, `right`, `up` (or `l d r u`) |
//! | Sokoban (generated rooms, 1–2 boxes) | rows of `# _ @ $ . * +` | `left`, `down`, `right`, `up` (or `l d r u`) |
//! | arithmetic (one turn) | `a+b=` | the number |
//! | tic-tac-toe vs a fixed strategy | 3 rows of `X O .` | a cell `1`–`9` (row-major) |

pub mod arithmetic;
pub mod dataset;
pub mod frozenlake;
pub mod sokoban;
pub mod tictactoe;

/// What an invalid action does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct InvalidAction {
    /// Reward added for the invalid action (usually ≤ 0).
    pub penalty: f64,
    /// End the episode (truncated) instead of letting the agent try again.
    pub end_episode: bool,
}

impl Default for InvalidAction {
    fn default() -> Self {
        Self {
            penalty: -0.1,
            end_episode: false,
        }
    }
}

impl InvalidAction {
    /// The outcome of an invalid action on a game showing `observation`: the penalty, and
    /// truncation when invalid actions end the episode. Returns it with the new `done` flag.
    pub fn outcome(&self, observation: crate::env::Observation) -> (crate::env::StepOutcome, bool) {
        let done = self.end_episode;
        (
            crate::env::StepOutcome {
                observation,
                reward: self.penalty,
                truncated: done,
                invalid_action: true,
                ..Default::default()
            },
            done,
        )
    }
}

/// A move on a grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    Left,
    Down,
    Right,
    Up,
}

impl Dir {
    /// Parses the first word of an answer: `left|down|right|up` or `l|d|r|u`, any case.
    pub fn parse(action: &str) -> Option<Self> {
        let w = action
            .split_whitespace()
            .next()?
            .trim_matches(|c: char| !c.is_ascii_alphabetic())
            .to_ascii_lowercase();
        match w.as_str() {
            "left" | "l" => Some(Self::Left),
            "down" | "d" => Some(Self::Down),
            "right" | "r" => Some(Self::Right),
            "up" | "u" => Some(Self::Up),
            _ => None,
        }
    }

    pub fn delta(self) -> (i32, i32) {
        match self {
            Self::Left => (0, -1),
            Self::Down => (1, 0),
            Self::Right => (0, 1),
            Self::Up => (-1, 0),
        }
    }

    /// The two directions at right angles (slippery ice).
    pub fn perpendicular(self) -> [Self; 2] {
        match self {
            Self::Left | Self::Right => [Self::Up, Self::Down],
            Self::Up | Self::Down => [Self::Left, Self::Right],
        }
    }

    pub const ALL: [Dir; 4] = [Dir::Left, Dir::Down, Dir::Right, Dir::Up];
}

#[cfg(test)]
mod tests;
