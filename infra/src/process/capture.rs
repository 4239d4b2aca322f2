//! Captured output of a child process: the first (or last) bytes of a stream, and what was
//! cut.

use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt};

/// The first (or, made with [`Capped::tail`], the last) `cap` bytes of a stream, and how
/// many more were discarded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Capped {
    pub data: Vec<u8>,
    pub cap: usize,
    /// Bytes read past the cap and discarded.
    pub dropped: u64,
    /// Keeps the last bytes: the discarded ones are the oldest.
    pub keep_tail: bool,
}

impl Capped {
    pub fn new(cap: usize) -> Self {
        Self {
            data: Vec::new(),
            cap,
            dropped: 0,
            keep_tail: false,
        }
    }

    /// Keeps the last `cap` bytes.
    pub fn tail(cap: usize) -> Self {
        Self {
            keep_tail: true,
            ..Self::new(cap)
        }
    }

    /// Whether anything was cut.
    pub fn truncated(&self) -> bool {
        self.dropped > 0
    }

    fn push(&mut self, chunk: &[u8]) {
        if self.keep_tail {
            self.data.extend_from_slice(chunk);
            let excess = self.data.len().saturating_sub(self.cap);
            self.data.drain(..excess);
            self.dropped += excess as u64;
            return;
        }
        let keep = self.cap.saturating_sub(self.data.len()).min(chunk.len());
        self.data.extend_from_slice(&chunk[..keep]);
        self.dropped += (chunk.len() - keep) as u64;
    }

    /// The kept bytes as text (invalid UTF-8 replaced), ending in a truncation marker line
    /// when bytes were discarded.
    pub fn text(&self) -> String {
        let mut s = String::from_utf8_lossy(&self.data).into_owned();
        if self.truncated() && self.keep_tail {
            return format!("{}\n{s}", truncation_marker(self.dropped, self.cap));
        }
        if self.truncated() {
            if !s.is_empty() && !s.ends_with('\n') {
                s.push('\n');
            }
            s.push_str(&truncation_marker(self.dropped, self.cap));
        }
        s
    }
}

/// The line that marks a cut stream.
pub fn truncation_marker(dropped: u64, cap: usize) -> String {
    format!("[… output truncated: {dropped} more bytes past the {cap}-byte cap were discarded]")
}

/// Reads a stream to its end into `into`, keeping at most its cap.
pub(super) async fn drain<R: AsyncRead + Unpin>(mut r: R, into: Arc<Mutex<Capped>>) {
    let mut buf = vec![0u8; 8192];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => into
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(&buf[..n]),
        }
    }
}
