//! Stopping the server's work before an install (asking servers that can to hand back
//! partial answers), and waiting on the job's runtime for the install itself.

use std::time::Duration;

use super::{Event, Pending, RemoteEngine};
use crate::generation::remote::{BoxFut, Progress, ServerError};

impl RemoteEngine {
    /// Stops every running request before an install; returns each with what it had
    /// generated. Servers that answer an aborted request with its partial answer are asked to
    /// abort and waited for (up to 10 s); the others' requests are closed at once.
    pub(super) fn stop_running(&mut self) -> Vec<(Pending, Progress)> {
        let mut closed = Vec::with_capacity(self.running.len());
        if self.client.partial_on_cancel() && !self.running.is_empty() {
            for r in self.running.values() {
                self.rt.spawn(self.client.cancel(&r.rid));
            }
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            let mut others = Vec::new();
            while !self.running.is_empty() {
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                let Ok(ev) = self.events_rx.recv_timeout(left) else {
                    break;
                };
                match ev {
                    Event::Done(id, attempt, res @ Ok(_))
                        if self.running.get(&id).is_some_and(|r| r.attempt == attempt) =>
                    {
                        // It finished before the abort landed: delivered as it is.
                        self.finish(id, attempt, res);
                    }
                    Event::Done(id, attempt, res)
                        if self.running.get(&id).is_some_and(|r| r.attempt == attempt) =>
                    {
                        let r = self.running.remove(&id).expect("present");
                        if let Some(s) = r.slot {
                            self.free.insert(s);
                        }
                        let partial = match res {
                            Err(ServerError::Aborted { partial: c, .. }) => Progress {
                                tokens: c.tokens,
                                logprobs: c.logprobs,
                            },
                            Ok(_) | Err(_) => Progress::default(),
                        };
                        closed.push((r.pending, partial));
                    }
                    other => others.push(other),
                }
            }
            for ev in others {
                self.on_event(ev);
            }
        }
        let ids: Vec<u64> = self.running.keys().copied().collect();
        for id in ids {
            if let Some(r) = self.running.remove(&id) {
                let progress = self.close(&r);
                closed.push((r.pending, progress));
            }
        }
        closed.sort_by_key(|(p, _)| p.req.id);
        closed
    }

    /// Runs `fut` on the job's runtime and waits for it on this (the engine's) thread.
    pub(super) fn block_on<T: Send + 'static>(
        &self,
        fut: BoxFut<Result<T, ServerError>>,
        timeout: Duration,
    ) -> Result<T, ServerError> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.rt.spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.recv_timeout(timeout).unwrap_or_else(|_| {
            Err(ServerError::NotHealthy {
                server: self.client.describe(),
                seconds: timeout.as_secs_f64(),
            })
        })
    }
}
