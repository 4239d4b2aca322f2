//! The connections of the HTTP edge and who may hold them.
//!
//! A connection is *evictable* while it is not doing work for its client: before its first
//! request has arrived, while a request body is still being received, and while idle between
//! requests. It is *busy* from the moment a request's body is complete until its response
//! body has been sent (an event stream stays busy; those are capped per owner and address in
//! [`crate::access`]).
//!
//! The table bounds the connections of the whole server and of each client address. When a
//! bound is reached, a new connection evicts the evictable connection that has waited
//! longest (for that address, then anywhere); only when every connection is busy is the new
//! one refused. A legitimate client's request completes within milliseconds, so the
//! connections that have waited longest are the slow ones: 1,100 clients that each send a
//! body one byte every 5 s cannot keep `/healthz` from being answered. A request body
//! must also be complete within [`super::EdgeLimits::body_read_timeout`], or its connection
//! is closed.

use std::collections::HashMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::body::Bytes;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use crate::access::ClientAddr;

/// One connection's entry.
struct Entry {
    ip: IpAddr,
    /// Requests in a handler or sending their response.
    busy: usize,
    /// When a request body started arriving (none: not receiving one).
    reading_since: Option<Instant>,
    /// When the connection last became evictable (accepted, or its last response sent).
    waiting_since: Instant,
    kill: CancellationToken,
}

impl Entry {
    fn evictable(&self) -> bool {
        self.busy == 0 || self.reading_since.is_some()
    }

    /// How long it has waited for its client (the order of eviction).
    fn waiting_since(&self) -> Instant {
        self.reading_since.unwrap_or(self.waiting_since)
    }
}

#[derive(Default)]
struct Table {
    next: u64,
    conns: HashMap<u64, Entry>,
    per_ip: HashMap<IpAddr, usize>,
}

impl Table {
    /// Closes the evictable connection (of `ip`, or of anyone) that has waited longest.
    fn evict_oldest(&mut self, ip: Option<IpAddr>) -> bool {
        let oldest = self
            .conns
            .iter()
            .filter(|(_, e)| e.evictable() && ip.is_none_or(|ip| e.ip == ip))
            .min_by_key(|(_, e)| e.waiting_since())
            .map(|(id, _)| *id);
        match oldest.and_then(|id| self.remove(id)) {
            Some(e) => {
                e.kill.cancel();
                true
            }
            None => false,
        }
    }

    fn remove(&mut self, id: u64) -> Option<Entry> {
        let e = self.conns.remove(&id)?;
        if let Some(n) = self.per_ip.get_mut(&e.ip) {
            *n -= 1;
            if *n == 0 {
                self.per_ip.remove(&e.ip);
            }
        }
        Some(e)
    }
}

/// The connections of one server.
pub struct ConnTable {
    table: Mutex<Table>,
    max_total: usize,
    max_per_address: usize,
    /// Connections evicted or refused so far (for the server's log and the tests).
    evicted: std::sync::atomic::AtomicU64,
}

impl ConnTable {
    pub fn new(max_total: usize, max_per_address: usize) -> Arc<Self> {
        Arc::new(Self {
            table: Mutex::new(Table::default()),
            max_total: max_total.max(1),
            max_per_address: max_per_address.max(1),
            evicted: std::sync::atomic::AtomicU64::new(0),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits a connection from `ip`, evicting a waiting one where a bound is reached;
    /// `None` when every connection in the way is busy (the new one is closed unanswered).
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<Conn> {
        let mut t = self.lock();
        if t.per_ip.get(&ip).copied().unwrap_or(0) >= self.max_per_address {
            if !t.evict_oldest(Some(ip)) {
                return None;
            }
            self.evicted
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if t.conns.len() >= self.max_total {
            if !t.evict_oldest(None) {
                return None;
            }
            self.evicted
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        t.next += 1;
        let id = t.next;
        let kill = CancellationToken::new();
        t.conns.insert(
            id,
            Entry {
                ip,
                busy: 0,
                reading_since: None,
                waiting_since: Instant::now(),
                kill: kill.clone(),
            },
        );
        *t.per_ip.entry(ip).or_insert(0) += 1;
        Some(Conn {
            table: self.clone(),
            id,
            ip,
            kill,
        })
    }

    /// Connections open now.
    pub fn len(&self) -> usize {
        self.lock().conns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Connections evicted so far.
    pub fn evicted(&self) -> u64 {
        self.evicted.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn update(&self, id: u64, f: impl FnOnce(&mut Entry)) {
        if let Some(e) = self.lock().conns.get_mut(&id) {
            f(e);
        }
    }
}

/// A connection's place in its table (removed when dropped).
pub struct Conn {
    table: Arc<ConnTable>,
    id: u64,
    ip: IpAddr,
    kill: CancellationToken,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.table.lock().remove(self.id);
    }
}

impl Conn {
    pub fn client(&self) -> ClientAddr {
        ClientAddr(self.ip)
    }

    /// Cancelled when the connection is evicted, or its body deadline passes.
    pub fn killed(&self) -> &CancellationToken {
        &self.kill
    }

    /// Whether a request body has been arriving for longer than `limit` (the connection is
    /// then closed).
    pub fn body_overdue(&self, limit: std::time::Duration) -> bool {
        self.table
            .lock()
            .conns
            .get(&self.id)
            .is_some_and(|e| e.reading_since.is_some_and(|t| t.elapsed() > limit))
    }

    /// A request arrived: busy until its response is sent, and receiving its body until the
    /// body ends (`has_body`).
    pub fn request(self: &Arc<Self>, has_body: bool) -> Busy {
        let now = Instant::now();
        self.table.update(self.id, |e| {
            e.busy += 1;
            if has_body {
                e.reading_since = Some(now);
            }
        });
        Busy { conn: self.clone() }
    }

    fn body_done(&self) {
        self.table.update(self.id, |e| e.reading_since = None);
    }
}

/// One request's hold on its connection: while it lives the connection is busy (unless it
/// is still receiving the body).
pub struct Busy {
    conn: Arc<Conn>,
}

impl Drop for Busy {
    fn drop(&mut self) {
        let now = Instant::now();
        self.conn.table.update(self.conn.id, |e| {
            e.busy = e.busy.saturating_sub(1);
            e.reading_since = None;
            if e.busy == 0 {
                e.waiting_since = now;
            }
        });
    }
}

/// A request body that marks its connection as no longer receiving once it ends (or is
/// dropped unread).
pub struct TrackedBody<B> {
    inner: B,
    conn: Option<Arc<Conn>>,
}

impl<B> TrackedBody<B> {
    pub fn new(inner: B, conn: Arc<Conn>) -> Self {
        Self {
            inner,
            conn: Some(conn),
        }
    }

    fn done(&mut self) {
        if let Some(c) = self.conn.take() {
            c.body_done();
        }
    }
}

impl<B> Drop for TrackedBody<B> {
    fn drop(&mut self) {
        self.done();
    }
}

impl<B> http_body::Body for TrackedBody<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, B::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(r, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) || self.inner.is_end_stream()
        {
            self.done();
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A response body that holds its request's [`Busy`] until it has been sent (or dropped).
pub struct HeldBody<B> {
    inner: B,
    _busy: Busy,
}

impl<B> HeldBody<B> {
    pub fn new(inner: B, busy: Busy) -> Self {
        Self { inner, _busy: busy }
    }
}

impl<B> http_body::Body for HeldBody<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, B::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, n])
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_table_evicts_the_connection_that_waited_longest() {
        let t = ConnTable::new(3, 2);
        let a = Arc::new(t.admit(ip(1)).unwrap());
        tokio::time::advance(std::time::Duration::from_secs(1)).await;
        let b = Arc::new(t.admit(ip(1)).unwrap());
        // Address 1 is at its bound: its oldest waiting connection makes room.
        let c = Arc::new(t.admit(ip(1)).unwrap());
        assert!(a.killed().is_cancelled());
        assert!(!b.killed().is_cancelled());
        assert_eq!(t.len(), 2);
        // A busy connection (its body complete, its response not yet sent) is never evicted.
        let busy_b = b.request(false);
        let busy_c = c.request(false);
        assert!(t.admit(ip(1)).is_none(), "every connection of 1 is busy");
        let d = Arc::new(t.admit(ip(2)).unwrap());
        let busy_d = d.request(false);
        assert!(
            t.admit(ip(3)).is_none(),
            "the server is full of busy connections"
        );
        // Receiving a body is not busy: a slow body is evicted first.
        drop(busy_c);
        let _reading = c.request(true);
        let e = t.admit(ip(3)).unwrap();
        assert!(c.killed().is_cancelled());
        assert!(!b.killed().is_cancelled());
        assert_eq!(t.evicted(), 2);
        drop((busy_b, busy_d, e));
        assert_eq!(t.len(), 2, "b and d, while their Arcs live");
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_takes_too_long_is_overdue_and_one_that_ended_is_not() {
        let t = ConnTable::new(8, 8);
        let c = Arc::new(t.admit(ip(1)).unwrap());
        let busy = c.request(true);
        tokio::time::advance(std::time::Duration::from_secs(31)).await;
        assert!(c.body_overdue(std::time::Duration::from_secs(30)));
        c.body_done();
        assert!(!c.body_overdue(std::time::Duration::from_secs(30)));
        drop(busy);
    }
}
