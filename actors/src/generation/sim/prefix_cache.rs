//! The simulator's prefix cache: the KV of finished turns, one entry per session (the leading
//! tokens of its last context), in the device memory the running sequences leave free.
//!
//! Like a paged engine's cache (vLLM's block pool, SGLang's radix tree with pages), it holds
//! whole blocks and evicts least recently used first, a block at a time from the end of the
//! oldest entry: a partly evicted session keeps its leading blocks, and its next turn
//! re-prefills only what was lost. A hit is counted in whole blocks too.

use std::collections::{BTreeMap, HashMap};

/// Prefix cache with capacity taken from the engine's free KV memory.
pub(super) struct PrefixCache {
    /// Session → (cached tokens, LRU stamp).
    pub(super) entries: HashMap<u64, (u64, u64)>,
    pub(super) lru: BTreeMap<u64, u64>,
    /// Tokens held (a multiple of `block` per entry).
    pub(super) tokens: u64,
    clock: u64,
    /// Tokens per KV block (≥ 1).
    pub(super) block: u64,
    /// Admissions that found some of their context cached.
    pub(super) hits: u64,
    /// Entries evicted whole, and blocks evicted (whole entries included).
    pub(super) evictions: u64,
    pub(super) evicted_blocks: u64,
    /// Context tokens looked up at admission, and those found cached.
    pub(super) lookup_tokens: u64,
    pub(super) hit_tokens: u64,
}

impl PrefixCache {
    pub(super) fn new(block: u64) -> Self {
        Self {
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            tokens: 0,
            clock: 0,
            block: block.max(1),
            hits: 0,
            evictions: 0,
            evicted_blocks: 0,
            lookup_tokens: 0,
            hit_tokens: 0,
        }
    }

    /// The whole blocks of `tokens`.
    pub(super) fn whole_blocks(&self, tokens: u64) -> u64 {
        tokens / self.block * self.block
    }

    /// Caches the first `tokens` tokens of `session`'s context (whole blocks), as its most
    /// recently used entry; returns what the session's entry held before.
    pub(super) fn put(&mut self, session: u64, tokens: u64) -> u64 {
        let before = self.take(session);
        let tokens = self.whole_blocks(tokens);
        if tokens > 0 {
            self.clock += 1;
            self.entries.insert(session, (tokens, self.clock));
            self.lru.insert(self.clock, session);
            self.tokens += tokens;
        }
        before
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

    /// Counts an admission that looked `lookup` context tokens up and found `hit` of them.
    pub(super) fn record(&mut self, lookup: u64, hit: u64) {
        self.lookup_tokens += lookup;
        self.hit_tokens += hit;
        if hit > 0 {
            self.hits += 1;
        }
    }

    /// Frees at least `need` tokens (rounded up to whole blocks), evicting blocks from the end
    /// of the least recently used entries; returns the tokens freed (less than `need` only
    /// when the cache is empty).
    pub(super) fn evict(&mut self, need: u64) -> u64 {
        let mut freed = 0;
        while freed < need {
            let Some((&stamp, &session)) = self.lru.first_key_value() else {
                break;
            };
            let Some(entry) = self.entries.get_mut(&session) else {
                self.lru.remove(&stamp);
                continue;
            };
            let want = (need - freed).div_ceil(self.block) * self.block;
            let cut = want.min(entry.0);
            entry.0 -= cut;
            self.tokens -= cut;
            freed += cut;
            self.evicted_blocks += cut.div_ceil(self.block);
            if entry.0 == 0 {
                self.entries.remove(&session);
                self.lru.remove(&stamp);
                self.evictions += 1;
            }
        }
        freed
    }

    pub(super) fn clear(&mut self) {
        self.entries.clear();
        self.lru.clear();
        self.tokens = 0;
    }
}
