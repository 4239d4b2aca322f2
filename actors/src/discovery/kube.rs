//! Pool membership from the Kubernetes API: the ready addresses of the EndpointSlices that a
//! label selector picks (the slices of a Service carry `kubernetes.io/service-name=NAME`),
//! followed by list and watch.
//!
//! - A list gives every slice and the collection's `resourceVersion`; a watch from that
//!   version streams `ADDED`, `MODIFIED`, `DELETED` and `BOOKMARK` events, one JSON object per
//!   line. A watch the server ends (its `timeoutSeconds`) is opened again from the last
//!   version seen; an `ERROR` event with code 410 (the version is too old) starts a new list.
//! - An endpoint counts while its `conditions.ready` is not false (the API reads an absent
//!   condition as ready). Terminating pods turn unready and leave the membership; episodes
//!   open on them finish there, as with any worker that leaves.
//! - The API is reached over plain HTTP, as every peer of the service is (no TLS client is
//!   built in): in a cluster, through `kubectl proxy` beside the service, which authenticates
//!   with the pod's service account (the manifests in `infra/deploy/service/` run one).

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use futures::StreamExt;
use serde_json::Value;

/// Where a pool's workers are in a cluster.
#[derive(Clone, Debug, PartialEq)]
pub struct KubeTarget {
    /// The API's base URL (`http://127.0.0.1:8001`, a `kubectl proxy`).
    pub api: String,
    pub namespace: String,
    /// Which EndpointSlices (`kubernetes.io/service-name=rollarc-env-worker`).
    pub label_selector: String,
    /// The workers' port.
    pub port: u16,
}

/// Seconds the server keeps one watch open (it then ends it, and the watch is opened again).
const WATCH_SECONDS: u64 = 240;
/// A watch that delivers nothing (not even a bookmark) for this long is given up and listed
/// again.
const WATCH_IDLE: Duration = Duration::from_secs(WATCH_SECONDS + 60);
/// How long a list may take.
const LIST_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest list body or watch event read (an EndpointSlice holds at most 1,000
/// endpoints, a few hundred KB).
const MAX_BODY_BYTES: usize = 8 << 20;
/// Pause after a failed list or watch before the next list.
const RETRY: Duration = Duration::from_secs(1);

/// The ready addresses of each slice, by slice name.
type Slices = BTreeMap<String, Vec<IpAddr>>;

/// How a watch ended.
enum WatchEnd {
    /// The server closed it: watch again from this version.
    Closed(String),
    /// The version is too old (410): list again.
    Gone,
    Failed(String),
    /// The pool is gone.
    Stop,
}

impl KubeTarget {
    fn collection(&self) -> String {
        format!(
            "{}/apis/discovery.k8s.io/v1/namespaces/{}/endpointslices",
            self.api.trim_end_matches('/'),
            self.namespace
        )
    }

    /// The collection's URL with the selector and `params` as its query.
    fn with_query(&self, params: &[(&str, &str)]) -> Result<reqwest::Url, String> {
        let url = self.collection();
        let mut u = reqwest::Url::parse(&url).map_err(|e| format!("{url:?}: {e}"))?;
        {
            let mut q = u.query_pairs_mut();
            q.append_pair("labelSelector", &self.label_selector);
            for (k, v) in params {
                q.append_pair(k, v);
            }
        }
        Ok(u)
    }

    /// What it is, for an error.
    pub fn describe(&self) -> String {
        format!(
            "kubernetes endpointslices {:?} in namespace {} (api {})",
            self.label_selector, self.namespace, self.api
        )
    }

    /// The workers' base URLs, sorted, each once.
    fn urls(&self, slices: &Slices) -> Vec<String> {
        let mut addrs: Vec<SocketAddr> = slices
            .values()
            .flatten()
            .map(|ip| SocketAddr::new(*ip, self.port))
            .collect();
        addrs.sort();
        addrs.dedup();
        addrs.into_iter().map(|a| format!("http://{a}")).collect()
    }

    /// One list: every slice and the collection's version.
    async fn list(&self, client: &reqwest::Client) -> Result<(Slices, String), String> {
        let url = self.collection();
        let query = self.with_query(&[])?;
        // One bound over the request and its body: a proxy that sends headers and then
        // stalls must not freeze the membership.
        let (status, body) = tokio::time::timeout(LIST_TIMEOUT, async {
            let resp = client
                .get(query)
                .send()
                .await
                .map_err(|e| infra::error_chain(&e))?;
            let status = resp.status();
            Ok::<_, String>((status, read_capped(resp).await?))
        })
        .await
        .map_err(|_| format!("listing {url}: no whole answer within {LIST_TIMEOUT:?}"))?
        .map_err(|e| format!("listing {url}: {e}"))?;
        if !status.is_success() {
            return Err(api_error(&url, status.as_u16(), &body));
        }
        let v: Value = serde_json::from_slice(&body)
            .map_err(|e| format!("listing {url}: not JSON ({status}): {e}"))?;
        let rv = v["metadata"]["resourceVersion"]
            .as_str()
            .ok_or_else(|| format!("listing {url}: the list has no metadata.resourceVersion"))?
            .to_string();
        let mut slices = Slices::new();
        for item in v["items"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
            if let Some(name) = item["metadata"]["name"].as_str() {
                slices.insert(name.to_string(), ready_addresses(item));
            }
        }
        Ok((slices, rv))
    }

    /// The workers' URLs now (one list).
    pub async fn resolve(&self) -> Result<Vec<String>, String> {
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(3))
            .build()
            .map_err(|e| e.to_string())?;
        let (slices, _) = self.list(&client).await?;
        Ok(self.urls(&slices))
    }

    /// Follows the membership for as long as `report` returns true: it gets the workers'
    /// URLs after the first list and after every change, and the reason of each failed list
    /// or watch (the members found before stay meanwhile).
    pub async fn follow(&self, mut report: impl FnMut(Result<Vec<String>, String>) -> bool) {
        let client = match reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(3))
            .build()
        {
            Ok(c) => c,
            Err(e) => {
                report(Err(format!("HTTP client: {e}")));
                return;
            }
        };
        loop {
            let (mut slices, mut rv) = match self.list(&client).await {
                Ok(l) => l,
                Err(e) => {
                    if !report(Err(e)) {
                        return;
                    }
                    tokio::time::sleep(RETRY).await;
                    continue;
                }
            };
            let mut sent = self.urls(&slices);
            if !report(Ok(sent.clone())) {
                return;
            }
            loop {
                let opened = tokio::time::Instant::now();
                let end = self
                    .watch(&client, &mut slices, &rv, &mut sent, &mut report)
                    .await;
                // A watch that ends at once, again and again (a proxy that cuts it), must not
                // turn into a busy loop of requests.
                if matches!(end, WatchEnd::Closed(_) | WatchEnd::Gone)
                    && opened.elapsed() < Duration::from_secs(1)
                {
                    tokio::time::sleep(RETRY).await;
                }
                match end {
                    WatchEnd::Closed(v) => rv = v,
                    WatchEnd::Gone => break,
                    WatchEnd::Failed(e) => {
                        if !report(Err(e)) {
                            return;
                        }
                        tokio::time::sleep(RETRY).await;
                        break;
                    }
                    WatchEnd::Stop => return,
                }
            }
        }
    }

    /// One watch from version `rv`, applying its events to `slices` and reporting each
    /// change of the URLs (`sent` holds the last reported).
    async fn watch(
        &self,
        client: &reqwest::Client,
        slices: &mut Slices,
        rv: &str,
        sent: &mut Vec<String>,
        report: &mut impl FnMut(Result<Vec<String>, String>) -> bool,
    ) -> WatchEnd {
        let url = self.collection();
        let seconds = WATCH_SECONDS.to_string();
        let query = self.with_query(&[
            ("watch", "1"),
            ("resourceVersion", rv),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", seconds.as_str()),
        ]);
        let query = match query {
            Ok(q) => q,
            Err(e) => return WatchEnd::Failed(e),
        };
        let opened = tokio::time::timeout(LIST_TIMEOUT, client.get(query).send()).await;
        let resp = match opened {
            Err(_) => {
                return WatchEnd::Failed(format!(
                    "watching {url}: no answer within {LIST_TIMEOUT:?}"
                ));
            }
            Ok(Err(e)) => {
                return WatchEnd::Failed(format!("watching {url}: {}", infra::error_chain(&e)));
            }
            Ok(Ok(r)) => r,
        };
        let status = resp.status();
        if status.as_u16() == 410 {
            return WatchEnd::Gone;
        }
        if !status.is_success() {
            let body = tokio::time::timeout(LIST_TIMEOUT, read_capped(resp))
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or_default();
            return WatchEnd::Failed(api_error(&url, status.as_u16(), &body));
        }
        let mut rv = rv.to_string();
        let mut stream = resp.bytes_stream();
        let mut buf: Vec<u8> = Vec::new();
        loop {
            let chunk = match tokio::time::timeout(WATCH_IDLE, stream.next()).await {
                Err(_) => {
                    return WatchEnd::Failed(format!("watching {url}: nothing for {WATCH_IDLE:?}"));
                }
                Ok(None) if buf.iter().all(u8::is_ascii_whitespace) => {
                    return WatchEnd::Closed(rv);
                }
                Ok(None) => {
                    return WatchEnd::Failed(format!(
                        "watching {url}: the stream ended inside an event"
                    ));
                }
                Ok(Some(Err(e))) => {
                    return WatchEnd::Failed(format!("watching {url}: {}", infra::error_chain(&e)));
                }
                Ok(Some(Ok(c))) => c,
            };
            // Only the new bytes can hold the next line's end.
            let mut from = buf.len();
            buf.extend_from_slice(&chunk);
            while let Some(nl) = buf[from..].iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buf.drain(..=from + nl).collect();
                from = 0;
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                if let Some(end) = apply_event(&url, slices, &mut rv, &line) {
                    return end;
                }
                let now = self.urls(slices);
                if now != *sent {
                    *sent = now.clone();
                    if !report(Ok(now)) {
                        return WatchEnd::Stop;
                    }
                }
            }
            if buf.len() > MAX_BODY_BYTES {
                return WatchEnd::Failed(format!(
                    "watching {url}: an event over {MAX_BODY_BYTES} bytes"
                ));
            }
        }
    }
}

/// Applies one watch event to `slices` and `rv`; `Some` ends the watch.
fn apply_event(url: &str, slices: &mut Slices, rv: &mut String, line: &[u8]) -> Option<WatchEnd> {
    let ev: Value = match serde_json::from_slice(line) {
        Ok(v) => v,
        Err(e) => {
            return Some(WatchEnd::Failed(format!(
                "watching {url}: a bad event: {e}"
            )));
        }
    };
    let obj = &ev["object"];
    if let Some(v) = obj["metadata"]["resourceVersion"].as_str() {
        *rv = v.to_string();
    }
    let name = obj["metadata"]["name"].as_str().unwrap_or_default();
    match ev["type"].as_str().unwrap_or_default() {
        "ADDED" | "MODIFIED" => {
            slices.insert(name.to_string(), ready_addresses(obj));
        }
        "DELETED" => {
            slices.remove(name);
        }
        "BOOKMARK" => {}
        "ERROR" if obj["code"].as_u64() == Some(410) => return Some(WatchEnd::Gone),
        "ERROR" => {
            let code = obj["code"].as_u64().unwrap_or(0) as u16;
            return Some(WatchEnd::Failed(status_error(url, code, obj)));
        }
        other => {
            return Some(WatchEnd::Failed(format!(
                "watching {url}: an event of unknown type {other:?}"
            )));
        }
    }
    None
}

/// The addresses of a slice's endpoints whose `ready` condition is not false (IP slices
/// only: an FQDN slice names no address to dial).
fn ready_addresses(slice: &Value) -> Vec<IpAddr> {
    if slice["addressType"].as_str() == Some("FQDN") {
        return Vec::new();
    }
    slice["endpoints"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
        .iter()
        .filter(|e| e["conditions"]["ready"].as_bool() != Some(false))
        .flat_map(|e| {
            e["addresses"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or(&[])
                .iter()
                .filter_map(|a| a.as_str()?.parse().ok())
        })
        .collect()
}

/// An API error in words, from its body: a Status object's message, else the body's start.
fn api_error(url: &str, code: u16, body: &[u8]) -> String {
    match serde_json::from_slice::<Value>(body) {
        Ok(v) if v["message"].is_string() => status_error(url, code, &v),
        _ => {
            let text = String::from_utf8_lossy(&body[..body.len().min(200)]);
            status_error(url, code, &serde_json::json!({ "message": text.trim() }))
        }
    }
}

/// A Status object in words, and what a 401/403 usually means.
fn status_error(url: &str, code: u16, status: &Value) -> String {
    let msg = status["message"].as_str().unwrap_or("no message");
    let hint = match code {
        401 | 403 => {
            " (the service's account needs get, list and watch on endpointslices in that \
             namespace: see the Role in infra/deploy/env-worker/)"
        }
        _ => "",
    };
    format!("{url}: {code}: {msg}{hint}")
}

/// A body read whole, at most [`MAX_BODY_BYTES`].
async fn read_capped(resp: reqwest::Response) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(c) = stream.next().await {
        let c = c.map_err(|e| infra::error_chain(&e))?;
        if out.len() + c.len() > MAX_BODY_BYTES {
            return Err(format!("a body over {MAX_BODY_BYTES} bytes"));
        }
        out.extend_from_slice(&c);
    }
    Ok(out)
}
