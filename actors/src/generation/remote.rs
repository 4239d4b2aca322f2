//! Generation on a remote inference server (llama.cpp, SGLang, vLLM) behind the generation
//! contract.
//!
//! [`RemoteEngine`] is a [`GenerationEngine`] whose compute happens in a server process: `add`
//! submits the request as a task on the job's runtime (token ids in, token ids and
//! log-probabilities out, streamed so that a partial answer is known), `step` collects what
//! the server finished, `abort` closes the request (and tells servers that have an abort
//! endpoint), `install` puts new weights on the server by its best path and re-submits the
//! in-flight requests under the job's in-flight policy. The engine admits at most as many
//! requests as the server has slots and queues the rest, so it always knows what runs where,
//! and it keeps every session on the slot that holds its prefix.
//!
//! The server-specific part is a [`ServerClient`]; a [`managed`] server is a child process the
//! engine starts, health-checks and restarts.
//!
//! Layout: `client` holds the server contract (requests, completions, errors, the
//! [`ServerClient`] trait), `health` the readiness wait and the health probe, and `engine`
//! the [`RemoteEngine`] (its request lifecycle and its installs in submodules of its own).
//!
//! [`GenerationEngine`]: super::GenerationEngine

mod client;
pub mod elastic;
mod engine;
mod health;
pub mod http;
pub mod llamacpp;
pub mod managed;
pub mod sglang;
pub mod vllm;

pub use client::{
    BoxFut, Completion, Progress, ServerClient, ServerError, ServerInfo, ServerLoad, ServerRequest,
    WeightsExporter,
};
pub use engine::{RemoteConfig, RemoteEngine};

#[cfg(test)]
mod tests;
