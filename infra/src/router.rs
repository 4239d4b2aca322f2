//! The async router that reaches function instances.
//!
//! Per call, outside in:
//! - **idempotency**: results are keyed by the call's idempotency key; concurrent calls with one
//!   key share one dispatch and a finished key answers from the cache, so a retried or hedged
//!   call yields exactly one result;
//! - **deadline** for the whole call (propagated in `x-rollarc-deadline-ms`);
//! - **retries** (tower `Retry`) of retryable failures only, within a `TpsBudget` (20 % of calls
//!   + 10/s over 10 s), with full-jitter exponential backoff that honours `Retry-After`;
//! - optional **hedging** (tower `Hedge`) after the p95 latency, under its own budget;
//! - **activator** buffer (tower `Buffer` + `LoadShed`): while nothing can take a request
//!   (no instance ready, or all at their container concurrency) it waits in a bounded buffer;
//!   past the bound the call fails at once with `Overloaded` (a 503 with a retry hint);
//! - **balancing** (tower `p2c::Balance`) over ready, non-ejected instances scored by
//!   **peak-EWMA** latency × in-flight; 429 and 503-with-`Retry-After` hold their load handle for
//!   the hinted time, so a shedding instance looks slow, never fast;
//! - per instance a **concurrency limit** (the container concurrency), a per-try timeout, a
//!   response-size cap, and **outlier ejection** (5 consecutive failures → out for 30 s × n, at
//!   most 10 % of instances, at least one).
//!
//! Files: `call.rs` (calls, replies, errors), `config.rs`, `stats.rs`, `outliers.rs`,
//! `instance.rs` (one try at one instance), `discovery.rs`, `policy.rs` (retry and hedge),
//! `dispatch.rs` (the [`Router`] and its tower stack).

mod call;
mod config;
mod discovery;
mod dispatch;
mod instance;
mod outliers;
mod policy;
mod stats;

pub use crate::faas::runtime::Endpoint;
pub use call::{Call, CallFailure, Reply, RouterError};
pub use config::RouterConfig;
pub use dispatch::{RESULT_CACHE, Router, Target};
pub use outliers::{RATE_MIN, RATE_THRESHOLD, RATE_WINDOW};
pub use stats::{InstanceBusy, RouterSnapshot, RouterStats};
