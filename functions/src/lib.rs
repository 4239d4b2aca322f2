//! Reward and judge functions: the versioned wire protocol (the only place reward types are
//! serialised), and, in later modules, the SDK that serves a scorer under the Knative runtime
//! contract and the built-in functions.
//!
//! Architecture invariant: nothing here knows about actors, GPUs or jobs.

pub mod protocol;
