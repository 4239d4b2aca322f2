//! Turn and batch barriers for the synchronous baselines: every episode of a wave waits for
//! the slowest at each turn (`turn`), and, for `batch`, no reward fires until the whole wave
//! has finished generating — or, in an over-provisioned wave, until a quorum of its groups
//! has (the scheduler cancels the rest). Episodes that end or are cancelled leave the
//! barrier, so it never waits for someone who is gone.

use std::sync::Mutex;

use tokio::sync::oneshot;

#[derive(Debug, Default)]
struct WaveState {
    participants: usize,
    arrived: usize,
    finished: usize,
    /// Episodes waiting at this turn, in arrival order.
    at_turn: Vec<oneshot::Sender<()>>,
    /// Episodes waiting for the whole wave to finish, in arrival order.
    at_end: Vec<oneshot::Sender<()>>,
    /// Over-provisioned waves: the end comes once this many groups have each finished
    /// their episodes (the rest of the wave is cancelled), not when every episode has.
    quorum: Option<Quorum>,
}

#[derive(Debug, Default)]
struct Quorum {
    groups: usize,
    /// Per group: episodes finished, and how many make it whole.
    progress: std::collections::BTreeMap<u64, (usize, usize)>,
    whole: usize,
}

impl WaveState {
    /// Releases the turn's waiters once every episode still stepping has arrived, and the
    /// end's once every participant finished. Waiters wake in arrival order: a waker chosen
    /// by anything but the seed (tokio's `watch` picks among its notifiers at random) would
    /// reorder the engine's queue and make a seeded run differ from one invocation to the
    /// next.
    fn release(&mut self) {
        let still_stepping = self.participants.saturating_sub(self.finished);
        if self.arrived > 0 && self.arrived >= still_stepping {
            self.arrived = 0;
            for w in self.at_turn.drain(..) {
                let _ = w.send(());
            }
        }
        let quorum = self.quorum.as_ref().is_some_and(|q| q.whole >= q.groups);
        if self.finished >= self.participants || quorum {
            for w in self.at_end.drain(..) {
                let _ = w.send(());
            }
        }
    }
}

/// A barrier shared by the episodes of one wave.
pub struct WaveBarrier {
    state: Mutex<WaveState>,
}

impl WaveBarrier {
    pub fn new(participants: usize) -> Self {
        Self {
            state: Mutex::new(WaveState {
                participants,
                ..WaveState::default()
            }),
        }
    }

    /// A wave of `participants` episodes whose end (the batch barrier) comes once `groups`
    /// of its groups (id → episodes that make it whole) have finished.
    pub fn with_quorum(
        participants: usize,
        groups: usize,
        sizes: impl IntoIterator<Item = (u64, usize)>,
    ) -> Self {
        Self {
            state: Mutex::new(WaveState {
                participants,
                quorum: Some(Quorum {
                    groups,
                    progress: sizes.into_iter().map(|(g, n)| (g, (0, n))).collect(),
                    whole: 0,
                }),
                ..WaveState::default()
            }),
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut WaveState) -> T) -> T {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let out = f(&mut s);
        s.release();
        out
    }

    /// Waits until every episode still stepping has reached the end of this turn.
    pub async fn turn(&self) {
        let (tx, rx) = oneshot::channel();
        self.with(|s| {
            s.arrived += 1;
            s.at_turn.push(tx);
        });
        let _ = rx.await;
    }

    /// This episode (of `group`) is done stepping (ended, failed or truncated).
    pub fn finish(&self, group: u64) {
        self.with(|s| {
            s.finished += 1;
            if let Some(q) = &mut s.quorum
                && let Some((done, need)) = q.progress.get_mut(&group)
            {
                *done += 1;
                if *done == *need {
                    q.whole += 1;
                }
            }
        });
    }

    /// This episode left without finishing (cancelled).
    pub fn leave(&self) {
        self.with(|s| s.participants = s.participants.saturating_sub(1));
    }

    /// Waits until every episode of the wave finished stepping (batch barrier before reward).
    pub async fn all_finished(&self) {
        let (tx, rx) = oneshot::channel();
        self.with(|s| s.at_end.push(tx));
        let _ = rx.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn turn_waits_for_the_slowest_and_ignores_finished_episodes() {
        let b = Arc::new(WaveBarrier::new(3));
        let t0 = tokio::time::Instant::now();
        let mut hs = Vec::new();
        for (i, delay) in [1u64, 5, 2].into_iter().enumerate() {
            let b = b.clone();
            hs.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(delay)).await;
                if i == 2 {
                    // Episode 2 ends after its first turn: it must not hold the others.
                    b.finish(0);
                    return tokio::time::Instant::now();
                }
                b.turn().await;
                tokio::time::Instant::now()
            }));
        }
        let mut ends = Vec::new();
        for h in hs {
            ends.push(h.await.unwrap() - t0);
        }
        assert_eq!(
            ends,
            vec![
                Duration::from_secs(5),
                Duration::from_secs(5),
                Duration::from_secs(2)
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn leaving_releases_waiters() {
        let b = Arc::new(WaveBarrier::new(2));
        let b2 = b.clone();
        let h = tokio::spawn(async move { b2.turn().await });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!h.is_finished());
        b.leave();
        tokio::time::timeout(Duration::from_secs(1), h)
            .await
            .unwrap()
            .unwrap();
    }
}
