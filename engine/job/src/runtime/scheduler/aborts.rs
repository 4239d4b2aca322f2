//! Cancelling work: a group's episodes (and what they wasted), the stragglers of a wave whose
//! batch is taken, and everything when the scheduler stops.

use actors::buffer::BufferMsg;

use super::{SchedState, Waste};

impl SchedState {
    /// Over-provisioning: once a wave's batch is taken, the rest of the wave is cancelled —
    /// groups still running, and any that finished too late to be taken (the buffer drops
    /// them; a dataset row goes back to be drawn again).
    pub(super) fn cancel_stragglers(&mut self, waves: &std::collections::BTreeSet<u64>) {
        let stragglers: Vec<u64> = self
            .groups
            .iter()
            .filter(|(_, g)| g.wave.is_some_and(|w| waves.contains(&w)))
            .map(|(id, _)| *id)
            .collect();
        for gid in stragglers {
            let spent = self.groups.get(&gid).map(|g| g.spent).unwrap_or_default();
            let w = self.abort_group_episodes(gid);
            self.count_waste(w);
            self.count_waste(spent);
            self.snap.cancelled_groups += 1;
            let _ = self.a.buffer.cast(BufferMsg::Abort { group: gid });
        }
    }

    /// Adds cancelled work to the snapshot's waste counters.
    pub(super) fn count_waste(&mut self, w: Waste) {
        self.snap.cancelled_tokens += w.tokens;
        self.snap.cancelled_env_s += w.env_s;
    }

    /// Closes group `gid` and aborts its running episodes (on their shards too); returns
    /// what they had taken.
    pub(super) fn abort_group_episodes(&mut self, gid: u64) -> Waste {
        let Some(g) = self.groups.get_mut(&gid) else {
            return Waste::default();
        };
        g.closed = true;
        let mut waste = Waste::default();
        for eid in std::mem::take(&mut g.episodes) {
            if let Some(e) = self.episodes.remove(&eid) {
                self.release_shards(&e);
                e.handle.abort();
                waste.episodes += 1;
                waste.tokens += e.tokens.load(std::sync::atomic::Ordering::Relaxed);
                waste.env_s += e.started.elapsed().as_secs_f64();
                let sh = &self.a.pools[e.pool].shards[e.shard];
                sh.abort(eid);
                sh.release(eid);
                if let (Some(link), Some(ps)) = (self.a.pools[e.pool].prefill_from, e.prefill_shard)
                {
                    let sh = &self.a.pools[link.pool].shards[ps];
                    sh.abort(eid);
                    sh.release(eid);
                }
            }
        }
        waste
    }

    /// Aborts every group's episodes and every episode task left.
    pub(super) fn abort_all(&mut self) {
        let ids: Vec<u64> = self.groups.keys().copied().collect();
        for g in ids {
            self.abort_group_episodes(g);
        }
        self.tasks.abort_all();
        self.reap();
    }

    /// Drops the finished episode tasks from the set (their outcomes came as messages).
    pub(super) fn reap(&mut self) {
        while self.tasks.try_join_next().is_some() {}
    }
}
