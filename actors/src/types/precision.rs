//! The precision of the weights that sampled a token.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// The precision of the weights a generation engine samples with. The trainer always
/// recomputes log-probabilities in f32; a quantised engine's behaviour log-probabilities
/// differ from them by the quantisation error (measured in docs/results.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    #[default]
    F32,
    /// 8-bit blocks of 32 values with one scale (ggml's q8_0 with an f32 scale: 9 bits a
    /// weight).
    #[serde(rename = "q8_0")]
    Q8_0,
    /// 4-bit blocks of 32 with a scale and a minimum (ggml's q4_1 with f32 constants: 6
    /// bits a weight).
    #[serde(rename = "q4_1")]
    Q4_1,
}

impl Precision {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Q8_0 => "q8_0",
            Self::Q4_1 => "q4_1",
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
