//! A job's event stream: the events, the channel and recent history each running job keeps,
//! and subscriptions that resume after an event id.

use serde::Serialize;
use tokio::sync::broadcast;
use utoipa::ToSchema;

use super::{Service, ServiceError};
use job::store::JobState;

/// Capacity of each job's event channel. A subscriber that falls further behind receives a
/// `lagged` event and continues from the newest events (progress is cumulative, so nothing
/// needed is lost); the store keeps every step's metrics.
const EVENT_CAPACITY: usize = 1024;

/// An event of a job's stream.
#[derive(Clone, Debug, PartialEq, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum JobEvent {
    State {
        id: String,
        state: JobState,
        step: u64,
        steps: u64,
        error: Option<String>,
    },
    Progress {
        id: String,
        step: u64,
        steps: u64,
        #[schema(value_type = Object)]
        metrics: serde_json::Value,
    },
    /// Every shard now generates with `version` (suspend → install → resume done).
    WeightsInstalled { id: String, version: u64 },
}

/// Events of a running job kept for clients that reconnect (`Last-Event-ID`).
pub const EVENT_HISTORY: usize = 256;

/// A running job's event channel, its count of events and the newest of them.
pub(super) struct EventLog {
    tx: broadcast::Sender<JobEvent>,
    seq: u64,
    recent: std::collections::VecDeque<(u64, JobEvent)>,
}

impl EventLog {
    fn new() -> Self {
        Self {
            tx: broadcast::channel(EVENT_CAPACITY).0,
            seq: 0,
            recent: std::collections::VecDeque::with_capacity(16),
        }
    }

    /// Whether every event after number `k` is still held.
    fn holds_after(&self, k: u64) -> bool {
        match self.recent.front() {
            Some((first, _)) => *first <= k + 1,
            None => k == self.seq,
        }
    }
}

/// A client's view of a job's events: what to send first (each with its event id), then the
/// live receiver (none for an ended job), whose events are numbered from `next` on.
pub struct Subscription {
    pub replay: Vec<(String, JobEvent)>,
    pub rx: Option<broadcast::Receiver<JobEvent>>,
    pub next: u64,
    pub boot: i64,
}

impl Subscription {
    /// The id of the live event numbered `seq`.
    pub fn event_id(&self, seq: u64) -> String {
        format!("{}-{seq}", self.boot)
    }
}

impl Service {
    /// The job's current state event and, unless the job has ended, a receiver of its next
    /// events. Channels exist only for jobs that exist and have not ended: an unknown id is
    /// `NotFound` and creates nothing.
    pub fn subscribe(
        &self,
        id: &str,
    ) -> Result<(JobEvent, Option<broadcast::Receiver<JobEvent>>), ServiceError> {
        let sub = self.subscribe_after(id, None)?;
        let first = sub
            .replay
            .into_iter()
            .next()
            .map(|(_, e)| e)
            .ok_or_else(|| ServiceError::NotFound(id.to_string()))?;
        Ok((first, sub.rx))
    }

    /// Like [`Service::subscribe`], resuming after the event id `after` (as the events
    /// endpoint numbered it): the job's events since then are replayed when this process still
    /// holds them all (the newest [`EVENT_HISTORY`] of a running job); otherwise, and without
    /// `after`, the stream starts from the current state.
    pub fn subscribe_after(
        &self,
        id: &str,
        after: Option<&str>,
    ) -> Result<Subscription, ServiceError> {
        let mut ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        // Read the state under the lock: a transition is stored before its event is sent
        // under this lock, so one that this read misses reaches the new receiver (one it sees
        // may arrive once more, which is harmless).
        let first = self
            .state_event(id)
            .ok_or_else(|| ServiceError::NotFound(id.to_string()))?;
        let terminal = matches!(&first, JobEvent::State { state, .. } if state.is_terminal());
        let log = (!terminal).then(|| ev.entry(id.to_string()).or_insert_with(EventLog::new));
        let seq = log.as_ref().map_or(0, |l| l.seq);
        let resume = after
            .and_then(|a| a.split_once('-'))
            .filter(|(boot, _)| *boot == self.boot.to_string())
            .and_then(|(_, n)| n.parse::<u64>().ok());
        let replay = match (&log, resume) {
            (Some(l), Some(k)) if k <= l.seq && l.holds_after(k) => l
                .recent
                .iter()
                .filter(|(n, _)| *n > k)
                .map(|(n, e)| (self.event_id(*n), e.clone()))
                .collect(),
            _ => vec![(self.event_id(seq), first)],
        };
        Ok(Subscription {
            replay,
            rx: log.map(|l| l.tx.subscribe()),
            next: seq + 1,
            boot: self.boot,
        })
    }

    /// The id of the newest event job `id` sent in this process (`{boot}-0` before any): a
    /// client that read the job's steps after taking it resumes the events after it and
    /// misses no step (a step is stored before its event is sent).
    pub fn last_event_id(&self, id: &str) -> String {
        let ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        self.event_id(ev.get(id).map_or(0, |l| l.seq))
    }

    /// The id of this process's event numbered `seq`.
    fn event_id(&self, seq: u64) -> String {
        format!("{}-{seq}", self.boot)
    }

    /// Sends to the job's subscribers and keeps the event in the job's recent history; after a
    /// terminal state the channel and history are dropped (subscribers still receive what was
    /// sent, then the end of the stream).
    pub(super) fn send(&self, id: &str, e: JobEvent) {
        let mut ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let terminal = matches!(&e, JobEvent::State { state, .. } if state.is_terminal());
        let log = ev.entry(id.to_string()).or_insert_with(EventLog::new);
        log.seq += 1;
        if log.recent.len() == EVENT_HISTORY {
            log.recent.pop_front();
        }
        log.recent.push_back((log.seq, e.clone()));
        let _ = log.tx.send(e);
        if terminal {
            ev.remove(id);
        }
    }

    /// Event channels held now (one per job that has sent or been asked for events and has
    /// not ended).
    pub fn event_channels(&self) -> usize {
        self.events.lock().map(|e| e.len()).unwrap_or(0)
    }

    pub fn state_event(&self, id: &str) -> Option<JobEvent> {
        let j = self.store.get(id).ok()??;
        Some(JobEvent::State {
            id: j.id,
            state: j.state,
            step: j.step,
            steps: j.steps,
            error: j.error,
        })
    }

    /// Sends job `id`'s current state to its subscribers.
    pub(super) fn emit_state(&self, id: &str) {
        if let Some(e) = self.state_event(id) {
            self.send(id, e);
        }
    }
}
