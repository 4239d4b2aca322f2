//! rollarc's lab: the tools that study jobs rather than serve them.
//!
//! - [`scenario`], [`simbench`]: virtual-time scenarios and `bench-sim` against the paper;
//! - [`plan`]: capacity planning over simulated runs; [`profile`]: a sim spec measured from a
//!   finished job;
//! - [`report`]: `summary.json` and the plots of a run; [`export`]: trained weights out of a
//!   job's store;
//! - [`bench`]: `rollarc bench`.
//!
//! Depends on `job` (and the crates below it), never on `service`: the one benchmark that
//! drives the service (`batches`) is handed in by the caller.

#![cfg_attr(
    test,
    allow(
        clippy::too_many_lines,
        reason = "the 100-line limit is on shipped code; a test reads top to bottom"
    )
)]

pub mod bench;
pub mod export;
pub mod plan;
pub mod profile;
pub mod report;
pub mod scenario;
pub mod simbench;

/// `rollarc --version`: the crate version and the commit the binary was built from.
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (", env!("ROLLARC_COMMIT"), ")");
