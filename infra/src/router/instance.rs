//! One instance: the try itself, its in-flight accounting, and how its answers load it.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use tokio::time::Instant;
use tower::Service;
use tower::limit::ConcurrencyLimit;
use tower::load::completion::TrackCompletion;
use tower::load::peak_ewma::{Handle, PeakEwma};

use super::call::{Call, CallFailure, Reply};
use super::outliers::Outliers;
use super::stats::RouterStats;

/// One instance as a tower service: a try is one HTTP POST under the per-try timeout and the
/// body cap; its outcome feeds outlier ejection.
#[derive(Clone)]
pub(super) struct InstanceSvc {
    pub(super) id: u64,
    pub(super) url: String,
    pub(super) function: Arc<str>,
    pub(super) client: reqwest::Client,
    pub(super) per_try: Duration,
    pub(super) max_body: usize,
    pub(super) outliers: Arc<Outliers>,
    pub(super) stats: Arc<RouterStats>,
}

impl Service<Call> for InstanceSvc {
    type Response = Result<Reply, CallFailure>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, call: Call) -> Self::Future {
        let me = self.clone();
        Box::pin(async move {
            me.stats.tries.fetch_add(1, Ordering::Relaxed);
            call.tried();
            if let Ok(mut m) = me.stats.per_instance.lock() {
                *m.entry(me.id).or_insert(0) += 1;
            }
            let remaining = call.deadline.saturating_duration_since(Instant::now());
            let timeout = me.per_try.min(remaining).max(Duration::from_millis(1));
            let _busy = BusyGuard::start(&me.stats, me.id);
            let r = me.try_once(&call, remaining, timeout).await;
            if let Err(f) = &r {
                call.failed_try(f);
            }
            match &r {
                Ok(_) => me.outliers.success(me.id),
                Err(CallFailure::Status { status: 429, .. }) => {}
                Err(CallFailure::Status {
                    status: 503,
                    retry_after: Some(_),
                    ..
                }) => {}
                Err(e) if e.retryable() || matches!(e, CallFailure::BodyTooLarge { .. }) => {
                    me.outliers.failure(me.id, &me.function)
                }
                Err(_) => me.outliers.success(me.id),
            }
            Ok(r)
        })
    }
}

/// Counts a try as in flight at its instance until dropped (also when the call is cancelled).
struct BusyGuard<'a>(&'a RouterStats, u64);

impl<'a> BusyGuard<'a> {
    fn start(stats: &'a RouterStats, id: u64) -> Self {
        stats.in_flight(id, 1);
        Self(stats, id)
    }
}

impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        self.0.in_flight(self.1, -1);
    }
}

impl InstanceSvc {
    async fn try_once(
        &self,
        call: &Call,
        remaining: Duration,
        timeout: Duration,
    ) -> Result<Reply, CallFailure> {
        let send = self
            .client
            .post(&self.url)
            .header("content-type", "application/json")
            .header("idempotency-key", &call.key)
            .header("x-rollarc-deadline-ms", remaining.as_millis().to_string())
            .body(call.body.clone())
            .send();
        let fut = async {
            let mut resp = send
                .await
                .map_err(|e| CallFailure::Transport(Arc::new(e)))?;
            let status = resp.status().as_u16();
            let retry_after = resp
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|s| s.trim().parse::<f64>().ok())
                .map(Duration::from_secs_f64);
            if resp
                .content_length()
                .is_some_and(|n| n as usize > self.max_body)
            {
                self.stats.oversized.fetch_add(1, Ordering::Relaxed);
                return Err(CallFailure::BodyTooLarge {
                    limit: self.max_body,
                });
            }
            let mut body = Vec::new();
            while let Some(chunk) = resp
                .chunk()
                .await
                .map_err(|e| CallFailure::Transport(Arc::new(e)))?
            {
                if body.len() + chunk.len() > self.max_body {
                    self.stats.oversized.fetch_add(1, Ordering::Relaxed);
                    return Err(CallFailure::BodyTooLarge {
                        limit: self.max_body,
                    });
                }
                body.extend_from_slice(&chunk);
            }
            if (200..300).contains(&status)
                || (400..500).contains(&status) && status != 429 && status != 408
            {
                Ok(Reply {
                    status,
                    body: Bytes::from(body),
                    instance: self.id,
                })
            } else {
                Err(CallFailure::Status {
                    status,
                    retry_after,
                    body_excerpt: String::from_utf8_lossy(&body[..body.len().min(300)])
                        .into_owned(),
                })
            }
        };
        match tokio::time::timeout(timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(CallFailure::Timeout(timeout)),
        }
    }
}

/// Shedding answers keep the load handle for the hinted time: a fast 429 looks slow.
#[derive(Clone)]
pub(super) struct SlowOnShed {
    pub(super) cap: Duration,
}

impl TrackCompletion<Handle, Result<Reply, CallFailure>> for SlowOnShed {
    type Output = Result<Reply, CallFailure>;

    fn track_completion(&self, handle: Handle, value: Result<Reply, CallFailure>) -> Self::Output {
        let hold = match &value {
            Err(CallFailure::Status {
                status: 429,
                retry_after,
                ..
            }) => Some(retry_after.unwrap_or(Duration::from_secs(1))),
            Err(CallFailure::Status {
                status: 503,
                retry_after: Some(ra),
                ..
            }) => Some(*ra),
            _ => None,
        };
        if let Some(h) = hold {
            let h = h.min(self.cap);
            tokio::spawn(async move {
                tokio::time::sleep(h).await;
                drop(handle);
            });
        }
        value
    }
}

/// An instance as the balancer sees it.
pub(super) type Instance = PeakEwma<ConcurrencyLimit<InstanceSvc>, SlowOnShed>;
