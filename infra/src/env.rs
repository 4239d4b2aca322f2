//! Environment-variable access through a trait, so tests never set process environment.

use std::collections::HashMap;

/// A source of configuration variables.
pub trait EnvSource: Send + Sync {
    fn var(&self, key: &str) -> Option<String>;
}

/// The process environment.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn var(&self, key: &str) -> Option<String> {
        std::env::var(key).ok().filter(|v| !v.is_empty())
    }
}

/// A fixed map (tests).
#[derive(Clone, Debug, Default)]
pub struct MapEnv(pub HashMap<String, String>);

impl EnvSource for MapEnv {
    fn var(&self, key: &str) -> Option<String> {
        self.0.get(key).cloned()
    }
}
