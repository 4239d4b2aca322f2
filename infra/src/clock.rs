//! The one wall-clock reader.
//!
//! Everything else reads `tokio::time` so that a paused clock drives tests and simulations.
//! Measuring how long real work took (a benchmark, a simulation's wall time, a report's
//! wall-seconds column) needs the machine's clock even while tokio's is paused: that is
//! what [`wall_now`] is for, and it is the only place allowed to call
//! `std::time::Instant::now`.

/// The machine's monotonic clock, independent of tokio's (possibly paused) one.
pub fn wall_now() -> std::time::Instant {
    #[allow(clippy::disallowed_methods)]
    std::time::Instant::now()
}

/// Milliseconds since the Unix epoch: for timestamps of records (creation times, an API
/// answer's `created`), which are facts about the real world, not about the simulated clock.
#[allow(clippy::disallowed_methods)]
pub fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
