//! Turn and batch barriers for the synchronous baselines: every episode of a wave waits for
//! the slowest at each turn (`turn`), and, for `batch`, no reward fires until the whole wave
//! has finished generating. Episodes that end or are cancelled leave the barrier, so it never
//! waits for someone who is gone.

use tokio::sync::watch;

#[derive(Clone, Debug, Default)]
struct WaveState {
    participants: usize,
    arrived: usize,
    turn_generation: u64,
    finished: usize,
}

impl WaveState {
    fn release_if_complete(&mut self) {
        let still_stepping = self.participants.saturating_sub(self.finished);
        if self.arrived > 0 && self.arrived >= still_stepping {
            self.arrived = 0;
            self.turn_generation += 1;
        }
    }
}

/// A barrier shared by the episodes of one wave.
pub struct WaveBarrier {
    tx: watch::Sender<WaveState>,
}

impl WaveBarrier {
    pub fn new(participants: usize) -> Self {
        let (tx, _) = watch::channel(WaveState {
            participants,
            ..WaveState::default()
        });
        Self { tx }
    }

    /// Waits until every episode still stepping has reached the end of this turn.
    pub async fn turn(&self) {
        let mut generation = 0;
        self.tx.send_modify(|s| {
            generation = s.turn_generation;
            s.arrived += 1;
            s.release_if_complete();
        });
        let mut rx = self.tx.subscribe();
        let _ = rx.wait_for(|s| s.turn_generation > generation).await;
    }

    /// This episode is done stepping (ended, failed or truncated).
    pub fn finish(&self) {
        self.tx.send_modify(|s| {
            s.finished += 1;
            s.release_if_complete();
        });
    }

    /// This episode left without finishing (cancelled).
    pub fn leave(&self) {
        self.tx.send_modify(|s| {
            s.participants = s.participants.saturating_sub(1);
            s.release_if_complete();
        });
    }

    /// Waits until every episode of the wave finished stepping (batch barrier before reward).
    pub async fn all_finished(&self) {
        let mut rx = self.tx.subscribe();
        let _ = rx.wait_for(|s| s.finished >= s.participants).await;
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
                    b.finish();
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
