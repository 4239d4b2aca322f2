//! The simulator's prefix cache.

use std::collections::{BTreeMap, HashMap};

/// Prefix cache: the KV of finished turns, per session, evicted least recently used first when
/// admissions need the memory.
#[derive(Default)]
pub(super) struct PrefixCache {
    pub(super) entries: HashMap<u64, (u64, u64)>,
    pub(super) lru: BTreeMap<u64, u64>,
    pub(super) tokens: u64,
    pub(super) clock: u64,
    pub(super) hits: u64,
    pub(super) evictions: u64,
}

impl PrefixCache {
    pub(super) fn put(&mut self, session: u64, tokens: u64) {
        self.take(session);
        self.clock += 1;
        self.entries.insert(session, (tokens, self.clock));
        self.lru.insert(self.clock, session);
        self.tokens += tokens;
    }

    /// Removes a session's entry (it is now owned by a running sequence, or released).
    pub(super) fn take(&mut self, session: u64) -> u64 {
        match self.entries.remove(&session) {
            Some((t, stamp)) => {
                self.lru.remove(&stamp);
                self.tokens -= t;
                t
            }
            None => 0,
        }
    }

    pub(super) fn evict_oldest(&mut self) -> bool {
        let Some((_, session)) = self.lru.pop_first() else {
            return false;
        };
        if let Some((t, _)) = self.entries.remove(&session) {
            self.tokens -= t;
        }
        self.evictions += 1;
        true
    }

    pub(super) fn clear(&mut self) {
        self.entries.clear();
        self.lru.clear();
        self.tokens = 0;
    }
}
