//! The configuration of `code`, and its checks.

use std::time::Duration;

use serde::Deserialize;

use crate::scorer::ScoreError;

/// Where candidate programs run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxMode {
    /// prlimit → bubblewrap → setpriv (see `infra::sandbox`).
    #[default]
    Bwrap,
    /// A plain child process: no isolation at all (trusted code, or hosts without bubblewrap).
    None,
}

/// Configuration of `code`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CodeConfig {
    #[serde(default)]
    pub sandbox: SandboxMode,
    /// Wall-clock limit per item (the whole program: loading and every test).
    #[serde(default = "default_timeout_s")]
    pub timeout_s: f64,
    /// The interpreter (looked up on `PATH` inside the sandbox, where `/root` and `/home` are
    /// hidden: an interpreter installed there needs its install in `readable_paths`).
    #[serde(default = "default_python")]
    pub python: String,
    /// At most this many bytes of each of stdout and stderr are kept; the rest is discarded.
    #[serde(default = "default_max_output_bytes")]
    pub max_output_bytes: usize,
    /// Host paths bound read-only into the sandbox (e.g. an interpreter's install).
    #[serde(default)]
    pub readable_paths: Vec<String>,
    /// Programs run at once by this function, across all requests.
    #[serde(default = "default_concurrency")]
    pub max_concurrency: usize,
}

fn default_timeout_s() -> f64 {
    10.0
}
fn default_python() -> String {
    "python3".into()
}
fn default_max_output_bytes() -> usize {
    65_536
}
fn default_concurrency() -> usize {
    4
}

impl Default for CodeConfig {
    fn default() -> Self {
        Self {
            sandbox: SandboxMode::Bwrap,
            timeout_s: default_timeout_s(),
            python: default_python(),
            max_output_bytes: default_max_output_bytes(),
            readable_paths: Vec::new(),
            max_concurrency: default_concurrency(),
        }
    }
}

impl CodeConfig {
    /// Checks the values (not the interpreter or the sandbox); the timeout per item.
    pub fn validate(&self) -> Result<Duration, ScoreError> {
        if !(self.timeout_s.is_finite() && self.timeout_s > 0.0 && self.timeout_s <= 86_400.0) {
            return Err(ScoreError::BadRequest(format!(
                "code config: timeout_s must be in (0, 86400], got {}",
                self.timeout_s
            )));
        }
        let timeout = Duration::try_from_secs_f64(self.timeout_s)
            .map_err(|e| ScoreError::bad("code config: timeout_s", e))?;
        if self.max_output_bytes < 1024 {
            return Err(ScoreError::BadRequest(format!(
                "code config: max_output_bytes must be at least 1024, got {}",
                self.max_output_bytes
            )));
        }
        if self.max_concurrency == 0 {
            return Err(ScoreError::BadRequest(
                "code config: max_concurrency must be at least 1".into(),
            ));
        }
        if self.python.trim().is_empty() {
            return Err(ScoreError::BadRequest(
                "code config: python must name an interpreter".into(),
            ));
        }
        Ok(timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_values_are_refused() {
        assert_eq!(
            CodeConfig::default().validate().unwrap(),
            Duration::from_secs(10)
        );
        for bad in [
            CodeConfig {
                timeout_s: f64::NAN,
                ..CodeConfig::default()
            },
            CodeConfig {
                timeout_s: -1.0,
                ..CodeConfig::default()
            },
            CodeConfig {
                max_output_bytes: 10,
                ..CodeConfig::default()
            },
            CodeConfig {
                max_concurrency: 0,
                ..CodeConfig::default()
            },
            CodeConfig {
                python: " ".into(),
                ..CodeConfig::default()
            },
        ] {
            assert!(bad.validate().is_err_and(|e| e.is_bad_request()), "{bad:?}");
        }
    }
}
