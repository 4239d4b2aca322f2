//! The job event stream (server-sent events), resumable by event id.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::{Extension, Path, Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures::Stream;
use serde::Deserialize;
use utoipa::IntoParams;

use super::{ApiError, ErrorBody, visible_job};
use crate::access::{Access, Principal};
use crate::service::{JobEvent, Service};

/// Where a reconnecting events client resumes.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct EventsQuery {
    /// Resume after this event id (as the `Last-Event-ID` header does; the header wins).
    after: Option<String>,
}

/// Server-sent events: `state` on every transition, `progress` after every step and
/// `weights_installed` after every weight update, each with an `id`. The stream starts with
/// the current state — or, given the id of an event it sent (`Last-Event-ID` header or
/// `after`), with the events since that one while this process holds them (the newest 256
/// of a running job) — and ends after a terminal state.
#[utoipa::path(get, path = "/v1/jobs/{id}/events", params(("id" = String, Path, description = "job id"), EventsQuery, ("Last-Event-ID" = Option<String>, Header, description = "resume after this event id")), responses((status = 200, description = "text/event-stream of JobEvent"), (status = 404, body = ErrorBody)))]
pub(super) async fn job_events(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    Extension(access): Extension<Arc<Access>>,
    client: Option<Extension<crate::access::ClientAddr>>,
    Path(id): Path<String>,
    Query(q): Query<EventsQuery>,
    headers: HeaderMap,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    visible_job(&s, &p, &id)?;
    let guard = access.open_stream(&p, client.map(|c| c.0.0));
    let after = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or(q.after);
    let sub = s.subscribe_after(&id, after.as_deref())?;
    let stream = async_stream(move |tx| async move {
        let guard = guard;
        let terminal =
            |e: &JobEvent| matches!(e, JobEvent::State { state, .. } if state.is_terminal());
        let mut sub = sub;
        for (eid, e) in std::mem::take(&mut sub.replay) {
            let end = terminal(&e);
            if tx.send(to_event(&e).id(eid)).await.is_err() || end {
                return;
            }
        }
        let Some(mut rx) = sub.rx.take() else {
            return;
        };
        let mut seq = sub.next;
        loop {
            let next = tokio::select! {
                r = rx.recv() => r,
                _ = guard.ended().cancelled() => {
                    // A newer stream of the same owner and address took this one's place.
                    let ev = Event::default().event("evicted").data(
                        "{\"reason\":\"a newer event stream of this owner took this one's place\"}",
                    );
                    let _ = tx.send(ev).await;
                    return;
                }
            };
            match next {
                Ok(e) => {
                    let end = terminal(&e);
                    let eid = sub.event_id(seq);
                    seq += 1;
                    if tx.send(to_event(&e).id(eid)).await.is_err() || end {
                        return;
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                    seq += n;
                    let ev = Event::default()
                        .event("lagged")
                        .data(format!("{{\"skipped\":{n}}}"));
                    if tx.send(ev).await.is_err() {
                        return;
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            }
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

/// The SSE form of a job event: its type as the event name, its JSON as the data.
fn to_event(e: &JobEvent) -> Event {
    let name = match e {
        JobEvent::State { .. } => "state",
        JobEvent::Progress { .. } => "progress",
        JobEvent::WeightsInstalled { .. } => "weights_installed",
    };
    Event::default()
        .event(name)
        .data(serde_json::to_string(e).unwrap_or_default())
}

/// A stream fed by a task through a bounded channel (capacity 64: the producer waits for a
/// slow client).
fn async_stream<F, Fut>(f: F) -> impl Stream<Item = Result<Event, Infallible>>
where
    F: FnOnce(tokio::sync::mpsc::Sender<Event>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(f(tx));
    futures::stream::unfold(
        rx,
        |mut rx| async move { rx.recv().await.map(|e| (Ok(e), rx)) },
    )
}
