//! Reward and judge functions: the versioned wire protocol (the only place reward types are
//! serialised), the SDK that serves a scorer as an HTTP function under the Knative runtime
//! contract, and the built-in scorers (`math`, `format`, `env`, `code` — Python run against
//! tests in the sandbox — and `judge` — an LLM judge behind an OpenAI-compatible endpoint;
//! served by the `rollarc-fn` binary).
//!
//! Depends on `infra` only (`tools/check-layers.py`).
//! Architecture invariant: nothing here knows about actors, GPUs or jobs.

#![cfg_attr(
    test,
    allow(
        clippy::too_many_lines,
        reason = "the 100-line limit is on shipped code; a test reads top to bottom"
    )
)]

pub mod basic;
pub mod client;
pub mod code;
pub mod judge;
pub mod math;
pub mod protocol;
pub mod scorer;
pub mod scorers;
pub mod sdk;
pub mod text;
pub mod tool_use;
