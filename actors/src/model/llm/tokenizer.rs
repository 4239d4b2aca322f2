//! The checkpoint's own tokenizer (byte-level BPE from the GGUF metadata, through the
//! `tokenizers` crate) and its chat template (rendered by minijinja, a Jinja engine).
//!
//! Token-in/token-out: a multi-turn context grows by generated ids and the ids of each new
//! observation; history is never re-tokenised.

use serde::Serialize;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper, Tokenizer};

use super::checkpoint::{Checkpoint, CheckpointError};
use candle_core::quantized::gguf_file::Value as GgufValue;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("tokenizer model {0:?} is not supported (gpt2 byte-level BPE is)")]
    Model(String),
    #[error("tokenizer pre-processing {0:?} is not supported (smollm, gpt2 and default are)")]
    Pre(String),
    #[error("malformed merge rule {0:?}")]
    Merge(String),
    #[error("cannot build the tokenizer")]
    Build(#[source] tokenizers::Error),
    #[error("cannot encode the text")]
    Encode(#[source] tokenizers::Error),
    #[error("cannot decode ids")]
    Decode(#[source] tokenizers::Error),
    #[error("the checkpoint has no chat template")]
    NoTemplate,
    #[error("the chat template does not render")]
    Template(#[source] minijinja::Error),
}

/// One message of a chat.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A checkpoint's tokenizer: with its special tokens recognised in text, and without (a
/// literal `<|im_start|>` in an observation is then ordinary text).
pub struct LlmTokenizer {
    with_specials: Tokenizer,
    plain: Tokenizer,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    /// Ids that end a generation (EOS and the template's end-of-turn).
    pub stop_ids: Vec<u32>,
    pieces: Vec<String>,
    chat_template: Option<String>,
    /// llama.cpp's name of the pre-tokenizer (GGUF `tokenizer.ggml.pre`), when known.
    pub pre: Option<String>,
}

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

impl LlmTokenizer {
    /// The tokenizer described by a GGUF checkpoint's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(ck: &Checkpoint) -> Result<Self, TokenizerError> {
        let m = ck.meta();
        let model = m.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TokenizerError::Model(model.into()));
        }
        let pre = m.get_str("tokenizer.ggml.pre").unwrap_or("default");
        let tokens = m.get_strings("tokenizer.ggml.tokens")?;
        let types = m.get_ints("tokenizer.ggml.token_type").unwrap_or_default();
        let merges = m
            .get_strings("tokenizer.ggml.merges")?
            .into_iter()
            .map(|r| {
                r.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| TokenizerError::Merge(r.into()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| ((*t).to_string(), i as u32))
            .collect();
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(types.iter().chain(std::iter::repeat(&1)))
            .filter(|(_, t)| **t == TOKEN_CONTROL || **t == TOKEN_USER_DEFINED)
            .map(|(s, t)| AddedToken::from((*s).to_string(), *t == TOKEN_CONTROL))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(TokenizerError::Build)?;
        let mut t = Tokenizer::new(bpe);
        t.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
        t.with_decoder(Some(ByteLevel::default()));
        t.add_special_tokens(specials)
            .map_err(TokenizerError::Build)?;
        let id = |key: &str| m.get_u64(key).ok().map(|v| v as u32);
        let mut tok = Self::from_parts(
            t,
            id("tokenizer.ggml.bos_token_id"),
            id("tokenizer.ggml.eos_token_id"),
            m.get_str("tokenizer.chat_template")
                .ok()
                .map(str::to_string),
        );
        tok.pre = Some(pre.to_string());
        Ok(tok)
    }

    /// A tokenizer that recognises its special tokens in text, with the checkpoint's special
    /// ids and chat template.
    pub fn from_parts(
        with_specials: Tokenizer,
        bos_id: Option<u32>,
        eos_id: Option<u32>,
        chat_template: Option<String>,
    ) -> Self {
        // The same tokenizer, splitting special tokens' text like any other text.
        let mut plain = with_specials.clone();
        plain.set_encode_special_tokens(true);
        let mut pieces = vec![String::new(); with_specials.get_vocab_size(true)];
        for (piece, id) in with_specials.get_vocab(true) {
            if let Some(slot) = pieces.get_mut(id as usize) {
                *slot = piece;
            }
        }
        let mut stop_ids: Vec<u32> = eos_id.into_iter().collect();
        for end in ["<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>"] {
            if let Some(i) = with_specials.token_to_id(end)
                && !stop_ids.contains(&i)
            {
                stop_ids.push(i);
            }
        }
        Self {
            with_specials,
            plain,
            bos_id,
            eos_id,
            stop_ids,
            pieces,
            chat_template,
            pre: None,
        }
    }

    /// The GGUF `tokenizer.*` metadata describing this tokenizer (byte-level BPE): pieces,
    /// merge rules, token types (control for special tokens), special ids, chat template.
    pub fn gguf_metadata(&self) -> Result<Vec<(String, GgufValue)>, TokenizerError> {
        let json = serde_json::to_value(&self.with_specials)
            .map_err(|e| TokenizerError::Build(e.into()))?;
        let merges: Vec<String> = json["model"]["merges"]
            .as_array()
            .map(|rules| {
                rules
                    .iter()
                    .filter_map(|r| match r {
                        serde_json::Value::String(s) => Some(s.clone()),
                        serde_json::Value::Array(p) => {
                            Some(format!("{} {}", p.first()?.as_str()?, p.get(1)?.as_str()?))
                        }
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default();
        let added = self.with_specials.get_added_tokens_decoder();
        let types: Vec<GgufValue> = (0..self.pieces.len() as u32)
            .map(|i| {
                GgufValue::I32(match added.get(&i) {
                    Some(t) if t.special => TOKEN_CONTROL as i32,
                    Some(_) => TOKEN_USER_DEFINED as i32,
                    None => 1,
                })
            })
            .collect();
        let strings =
            |v: Vec<String>| GgufValue::Array(v.into_iter().map(GgufValue::String).collect());
        let mut m = vec![
            (
                "tokenizer.ggml.model".to_string(),
                GgufValue::String("gpt2".into()),
            ),
            (
                "tokenizer.ggml.pre".to_string(),
                GgufValue::String(self.pre.clone().unwrap_or_else(|| "default".into())),
            ),
            (
                "tokenizer.ggml.tokens".to_string(),
                strings(self.pieces.clone()),
            ),
            (
                "tokenizer.ggml.token_type".to_string(),
                GgufValue::Array(types),
            ),
            ("tokenizer.ggml.merges".to_string(), strings(merges)),
            (
                "tokenizer.ggml.add_bos_token".to_string(),
                GgufValue::Bool(false),
            ),
        ];
        for (key, id) in [
            ("tokenizer.ggml.bos_token_id", self.bos_id),
            ("tokenizer.ggml.eos_token_id", self.eos_id),
        ] {
            if let Some(id) = id {
                m.push((key.to_string(), GgufValue::U32(id)));
            }
        }
        if let Some(t) = &self.chat_template {
            m.push((
                "tokenizer.chat_template".to_string(),
                GgufValue::String(t.clone()),
            ));
        }
        Ok(m)
    }

    /// The underlying tokenizer (special tokens recognised), e.g. to save as `tokenizer.json`.
    pub fn inner(&self) -> &Tokenizer {
        &self.with_specials
    }

    /// The checkpoint's chat template, if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Token ids of `text`; `specials`: recognise the checkpoint's special tokens in it.
    pub fn encode(&self, text: &str, specials: bool) -> Result<Vec<u32>, TokenizerError> {
        let t = if specials {
            &self.with_specials
        } else {
            &self.plain
        };
        Ok(t.encode(text, false)
            .map_err(TokenizerError::Encode)?
            .get_ids()
            .to_vec())
    }

    /// The text of `ids` (special tokens included as written).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.with_specials
            .decode(ids, false)
            .map_err(TokenizerError::Decode)
    }

    /// The vocabulary entry of `id` (byte-level pieces, e.g. `Ġworld`).
    pub fn piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    /// The checkpoint's chat template rendered for `messages`.
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let messages: Vec<serde_json::Value> = messages
            .iter()
            .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
            .collect();
        self.render_chat_json(&messages, None, add_generation_prompt)
    }

    /// The checkpoint's chat template rendered for messages in OpenAI's JSON shape (tool
    /// calls, tool results) and, where given, the declared `tools`. Python string methods
    /// (`strip`, `startswith`, …) work as in Hugging Face's renderer, and `raise_exception`
    /// fails the render with the template's message.
    pub fn render_chat_json(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let template = self
            .chat_template
            .as_deref()
            .ok_or(TokenizerError::NoTemplate)?;
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template("chat", template)
            .map_err(TokenizerError::Template)?;
        let token = |id: Option<u32>| id.and_then(|i| self.piece(i)).unwrap_or_default();
        env.get_template("chat")
            .and_then(|t| {
                t.render(minijinja::context! {
                    messages => messages,
                    tools => tools,
                    add_generation_prompt => add_generation_prompt,
                    bos_token => token(self.bos_id),
                    eos_token => token(self.eos_id),
                })
            })
            .map_err(TokenizerError::Template)
    }

    /// The ids of a chat, special tokens recognised (the template writes them as text).
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.encode(&self.render_chat(messages, add_generation_prompt)?, true)
    }
}

/// The pre-tokenizer llama.cpp names `pre`: byte-level splitting (GPT-2's pattern), with
/// every digit its own piece for `smollm`.
fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper, TokenizerError> {
    let byte_level = PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true));
    match pre {
        "smollm" => Ok(PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            byte_level,
        ]))),
        "default" | "gpt2" => Ok(byte_level),
        other => Err(TokenizerError::Pre(other.into())),
    }
}
