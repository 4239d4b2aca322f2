//! Arithmetic: one question `a+b=` (or `-`, `*`), answered in one turn. The environment checks
//! the integer answer itself (reward 1 or 0); the math reward function checks equivalence
//! more generally when a job names it.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::env::{EnvError, Environment, Observation, StepOutcome};

#[derive(Clone, Debug, PartialEq)]
pub struct ArithmeticConfig {
    /// Operands are drawn from 0..=max_operand.
    pub max_operand: i64,
    /// Operators to draw from: any of `+ - *`.
    pub ops: Vec<char>,
}

impl Default for ArithmeticConfig {
    fn default() -> Self {
        Self {
            max_operand: 9,
            ops: vec!['+'],
        }
    }
}

pub struct Arithmetic {
    cfg: ArithmeticConfig,
    question: String,
    answer: i64,
    done: bool,
}

impl Arithmetic {
    pub fn new(cfg: ArithmeticConfig) -> Self {
        Self {
            cfg,
            question: String::new(),
            answer: 0,
            done: true,
        }
    }

    pub fn answer(&self) -> i64 {
        self.answer
    }
}

/// The first integer in a text (optionally signed), e.g. "12", " = -3", "\\boxed{7}".
pub fn first_integer(text: &str) -> Option<i64> {
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let neg = b[i] == b'-' && i + 1 < b.len() && b[i + 1].is_ascii_digit();
        if b[i].is_ascii_digit() || neg {
            let start = i;
            i += 1;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            return text[start..i].parse().ok();
        }
        i += 1;
    }
    None
}

impl Environment for Arithmetic {
    async fn reset(&mut self, seed: u64) -> Result<Observation, EnvError> {
        let mut rng = SmallRng::seed_from_u64(seed);
        let m = self.cfg.max_operand.max(1);
        let (a, b) = (rng.random_range(0..=m), rng.random_range(0..=m));
        let ops = if self.cfg.ops.is_empty() {
            vec!['+']
        } else {
            self.cfg.ops.clone()
        };
        let op = ops[rng.random_range(0..ops.len())];
        self.answer = match op {
            '-' => a - b,
            '*' => a * b,
            _ => a + b,
        };
        self.question = format!("{a}{op}{b}=");
        self.done = false;
        Ok(Observation {
            text: self.question.clone(),
            tokens: None,
            sim_response_len: None,
            reference: Some(serde_json::json!({ "answer": self.answer.to_string() })),
            messages: None,
        })
    }

    async fn step(
        &mut self,
        action: &str,
        _tokens: &crate::tokens::Tokens,
    ) -> Result<StepOutcome, EnvError> {
        if self.done {
            return Err(EnvError::EpisodeOver);
        }
        self.done = true;
        let got = first_integer(action);
        let success = got == Some(self.answer);
        Ok(StepOutcome {
            observation: Observation::default(),
            reward: if success { 1.0 } else { 0.0 },
            terminated: true,
            success,
            invalid_action: got.is_none(),
            ..StepOutcome::default()
        })
    }

    async fn close(&mut self) {}
}
