//! The built-in policy: a byte-level tokenizer, a small decoder-only transformer on candle
//! (CPU), its generation engine and its trainer. The embedded default every quickstart uses.

pub mod decoder;
pub mod engine;
pub mod llm;
pub mod runtime;
pub mod tokenizer;
pub mod trainer;
pub mod transformer;

#[cfg(test)]
mod tests;
