//! Token ids back to text for people reading trajectories (`GET
//! /v1/jobs/{id}/trajectories?text=true`): the byte-level tokenizer of the tiny model, or the
//! tokenizer of the job's checkpoint (read from the GGUF header, or the Hugging Face
//! directory). Ids are never re-tokenised for training; this is for display only.

use actors::model::llm::{self, Checkpoint, LlmTokenizer};
use actors::model::tokenizer::ByteTokenizer;

use job::spec::{JobSpec, ModelChoice};
use job::store::TurnText;

/// A job's tokenizer.
pub enum JobTokenizer {
    Bytes,
    Llm(Box<LlmTokenizer>),
}

impl JobTokenizer {
    /// The tokenizer of the model the job's first real pool runs; an error saying why there is
    /// none (simulated pools, an unreadable checkpoint).
    pub fn for_spec(spec: &JobSpec) -> Result<Self, String> {
        let model = spec
            .pools
            .iter()
            .find_map(|p| p.backend.real_model())
            .ok_or("the job runs simulated pools: its tokens are not text")?;
        match model.choice() {
            ModelChoice::Tiny(_) => Ok(Self::Bytes),
            ModelChoice::Checkpoint { path, .. } => {
                let t = if path.is_dir() {
                    llm::load(&path)
                        .map(|(_, t)| t)
                        .map_err(|e| e.to_string())?
                } else {
                    let ck = Checkpoint::open_gguf(&path).map_err(|e| e.to_string())?;
                    LlmTokenizer::from_gguf(&ck).map_err(|e| e.to_string())?
                };
                Ok(Self::Llm(Box::new(t)))
            }
        }
    }

    /// The text of `ids` (special tokens shown as the tokenizer writes them; bytes that are
    /// not UTF-8 replaced).
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            Self::Bytes => ByteTokenizer.decode(ids),
            Self::Llm(t) => t
                .decode(ids)
                .unwrap_or_else(|e| format!("<cannot decode: {e}>")),
        }
    }

    /// Each turn of a stored trajectory as text.
    pub fn turns(&self, trajectory: &serde_json::Value) -> Vec<TurnText> {
        self.turns_with(trajectory, false)
    }

    /// [`Self::turns`], with each response token decoded alone when `pieces`.
    pub fn turns_with(&self, trajectory: &serde_json::Value, pieces: bool) -> Vec<TurnText> {
        let ids = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_u64())
                        .map(|x| x as u32)
                        .collect()
                })
                .unwrap_or_default()
        };
        trajectory["turns"]
            .as_array()
            .map(|turns| {
                turns
                    .iter()
                    .map(|u| {
                        let response = ids(&u["response_tokens"]);
                        TurnText {
                            observation: self.decode(&ids(&u["observation_tokens"])),
                            response: self.decode(&response),
                            response_pieces: pieces
                                .then(|| response.iter().map(|&t| self.decode(&[t])).collect()),
                        }
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
}
