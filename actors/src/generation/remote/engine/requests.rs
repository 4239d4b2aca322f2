//! A request's life on the server: admission to a free slot (the session's own when it can),
//! the attempt's task, its completion or retry, and failing what waits when the server has
//! been down too long.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{Event, Pending, RemoteEngine, Running, backend_error, push_span};
use crate::error::SharedError;
use crate::generation::remote::{Completion, Progress, ServerError, ServerRequest};
use crate::generation::{FinishReason, GenError, GenOutput};
use crate::tokens::Tokens;

impl RemoteEngine {
    /// Starts waiting requests while slots are free.
    pub(super) fn admit(&mut self) {
        if let Some(e) = &self.broken {
            let e = e.clone();
            while let Some(p) = self.waiting.pop_front() {
                self.ready.push((p.req.id, Err(backend_error(e.clone()))));
            }
            return;
        }
        if let Some(b) = self.await_beat {
            if self.health.beats.load(Ordering::Relaxed) <= b {
                return;
            }
            self.await_beat = None;
        }
        while !self.paused && !self.free.is_empty() {
            let Some(p) = self.waiting.pop_front() else {
                break;
            };
            self.submit(p);
        }
    }

    /// Sends `p` to the server on a free slot (its session's when free), or fails it when its
    /// context cannot fit.
    fn submit(&mut self, p: Pending) {
        let id = p.req.id;
        let info = self
            .info
            .expect("slots are free only once the server is ready");
        let context: Arc<Tokens> = if p.kept.tokens.is_empty() {
            p.req.context.clone()
        } else {
            let mut c = Vec::with_capacity(p.req.context.len() + p.kept.tokens.len());
            c.extend_from_slice(&p.req.context);
            c.extend_from_slice(&p.kept.tokens);
            Arc::new(c.into())
        };
        if context.len() + 1 > info.context {
            self.ready.push((
                id,
                Err(GenError::ContextTooLong {
                    len: context.len(),
                    limit: info.context.saturating_sub(1),
                }),
            ));
            return;
        }
        // The session's slot when free (its prefix is cached there), else any free one.
        let slot = match self.affinity.get(&p.req.session) {
            Some(s) if self.free.contains(s) => *s,
            _ => *self
                .free
                .iter()
                .next()
                .expect("admit checks for a free slot"),
        };
        self.free.remove(&slot);
        self.affinity.insert(p.req.session, slot);
        let mut params = p.req.params.clone();
        params.max_tokens = params
            .max_tokens
            .saturating_sub(p.kept.tokens.len() as u32)
            .max(1);
        // The answer must fit the slot.
        let room = (info.context - context.len()) as u32;
        params.max_tokens = params.max_tokens.min(room);
        self.next_attempt += 1;
        let attempt = self.next_attempt;
        // Fixed width: servers that abort by id prefix (SGLang) never match another request.
        let rid = format!("rollarc-{id:016x}-{attempt:016x}");
        let progress = Arc::new(Mutex::new(Progress::default()));
        let fut = self.client.generate(ServerRequest {
            rid: rid.clone(),
            context,
            params,
            slot: Some(slot),
            progress: progress.clone(),
        });
        let (tx, wake) = (self.events_tx.clone(), self.wake.clone());
        let task = self.rt.spawn(async move {
            let r = fut.await;
            let _ = tx.send(Event::Done(id, attempt, r));
            wake.notify_one();
        });
        self.running.insert(
            id,
            Running {
                pending: p,
                attempt,
                slot: Some(slot),
                rid,
                progress,
                task,
            },
        );
    }

    /// Closes a running request; returns it with what it had generated.
    pub(super) fn close(&mut self, r: &Running) -> Progress {
        r.task.abort();
        let cancel = self.client.cancel(&r.rid);
        self.rt.spawn(cancel);
        if let Some(s) = r.slot {
            self.free.insert(s);
        }
        r.progress.lock().map(|p| p.clone()).unwrap_or_default()
    }

    /// Takes the result of request `id`'s attempt `attempt` (a stale attempt's is ignored):
    /// delivers it, queues the request again, or fails it.
    pub(super) fn finish(&mut self, id: u64, attempt: u64, res: Result<Completion, ServerError>) {
        let Some(r) = self.running.get(&id) else {
            return;
        };
        if r.attempt != attempt {
            return;
        }
        let r = self.running.remove(&id).expect("present");
        if let Some(s) = r.slot {
            self.free.insert(s);
        }
        let mut p = r.pending;
        match res {
            Ok(c) => {
                if c.missing_logprobs > 0 {
                    tracing::warn!(server = %self.client.describe(), request = id, tokens = c.missing_logprobs, "the server reported no log-probability for some tokens; they count as 0");
                }
                self.prefill_tokens += u64::from(c.prefill_tokens);
                self.decode_tokens += c.tokens.len() as u64;
                let mut tokens = p.kept.tokens;
                let mut logprobs = p.kept.logprobs;
                let mut versions = p.kept.versions;
                push_span(&mut versions, self.version, c.tokens.len() as u32);
                tokens.extend_from_slice(&c.tokens);
                logprobs.extend_from_slice(&c.logprobs);
                let finish = c.finish.unwrap_or(FinishReason::Stop);
                self.ready.push((
                    id,
                    Ok(GenOutput {
                        tokens: tokens.into(),
                        logprobs: logprobs.into(),
                        versions,
                        finish,
                        prefill_tokens: c.prefill_tokens,
                    }),
                ));
            }
            // A server that refuses for now (paused by someone else, overloaded) is asked
            // again after each health beat, for up to `down_after`.
            Err(e @ ServerError::Unavailable { .. })
                if p.unavailable < self.unavailable_budget() =>
            {
                tracing::debug!(error = %e, request = id, "server unavailable; retrying");
                p.unavailable += 1;
                self.waiting.push_front(p);
                self.await_beat = Some(self.health.beats.load(Ordering::Relaxed));
            }
            Err(e) if e.transient() && p.failures + 1 < self.cfg.attempts => {
                // The server went away mid-request (crash, restart): start it again once the
                // server is back, from the tokens kept before.
                tracing::debug!(error = %e, request = id, "request dropped by the server; retrying");
                p.failures += 1;
                self.waiting.push_front(p);
                self.await_beat = Some(self.health.beats.load(Ordering::Relaxed));
            }
            Err(e) => self.ready.push((id, Err(e.into()))),
        }
    }

    /// Applies what one of the engine's tasks reported.
    pub(super) fn on_event(&mut self, ev: Event) {
        match ev {
            Event::Done(id, attempt, res) => self.finish(id, attempt, res),
            Event::Ready(Ok(info)) => {
                self.info = Some(info);
                self.free = (0..info.slots.max(1) as u32).collect();
            }
            Event::Ready(Err(e)) => {
                tracing::error!(error = %e, "inference server never became healthy");
                self.broken = Some(infra::error_chain(&e));
            }
        }
    }

    /// "Unavailable" answers a request may get: as many health beats as fit in `down_after`.
    fn unavailable_budget(&self) -> u32 {
        let beats =
            self.cfg.down_after.as_secs_f64() / self.cfg.probe_every.as_secs_f64().max(1e-3);
        (beats as u32).max(self.cfg.attempts)
    }

    /// Fails every request when the server has been down too long.
    pub(super) fn check_down(&mut self) {
        let since = self.health.down_since_ms.load(Ordering::Relaxed);
        if since == 0 {
            return;
        }
        let down_for = self
            .started
            .elapsed()
            .saturating_sub(Duration::from_millis(since));
        if down_for < self.cfg.down_after {
            return;
        }
        let server = self.client.describe();
        let err = || {
            GenError::Backend(SharedError::new(ServerError::NotHealthy {
                server: server.clone(),
                seconds: down_for.as_secs_f64(),
            }))
        };
        let ids: Vec<u64> = self.running.keys().copied().collect();
        for id in ids {
            if let Some(r) = self.running.remove(&id) {
                self.close(&r);
                self.ready.push((id, Err(err())));
            }
        }
        while let Some(p) = self.waiting.pop_front() {
            self.ready.push((p.req.id, Err(err())));
        }
    }
}
