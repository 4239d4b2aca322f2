//! An error that several holders of one result share.
//!
//! Engine replies, training results and failed-engine reasons are cloned (a reply may be
//! kept and compared in tests), so their causes sit behind an `Arc`. The wrapper shows the
//! cause's message and hands on the cause's own source, so an error chain reads as if the
//! cause were there directly.

use std::fmt;
use std::sync::Arc;

/// A shared cause: clone it freely; two values are equal when they are the same error.
#[derive(Clone)]
pub struct SharedError(Arc<dyn std::error::Error + Send + Sync>);

impl SharedError {
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(Arc::new(e))
    }
}

impl fmt::Debug for SharedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for SharedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for SharedError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl PartialEq for SharedError {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for SharedError {}
