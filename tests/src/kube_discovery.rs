//! Env pools that follow Kubernetes EndpointSlices: a fake API server that behaves as the
//! real one does for list and watch (a collection version, events from it, a watch the
//! server ends, a 410 for a version too old), and real env workers on 127.0.0.2–4.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use actors::env::Environment;
use actors::env::remote::{KubeTarget, Membership, WorkerPool, WorkerPoolConfig};

use crate::env_workers::{free_port, start_worker_on, task};

const SELECTOR: &str = "kubernetes.io/service-name=rollarc-env-worker";
const PATH: &str = "/apis/discovery.k8s.io/v1/namespaces/rl/endpointslices";

#[derive(Default)]
struct Api {
    slices: BTreeMap<String, Value>,
    rv: u64,
    watchers: Vec<mpsc::UnboundedSender<String>>,
    /// Every request's query.
    requests: Vec<HashMap<String, String>>,
    /// Answer the next watch with HTTP 410.
    gone_at_open: bool,
    /// Answer everything with a plain-text 403.
    forbid: bool,
}

type Shared = Arc<Mutex<Api>>;

/// An EndpointSlice with these endpoints (address, ready).
fn slice(name: &str, endpoints: &[(&str, bool)]) -> Value {
    json!({
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"name": name, "namespace": "rl",
                     "labels": {"kubernetes.io/service-name": "rollarc-env-worker"}},
        "addressType": "IPv4",
        "endpoints": endpoints.iter().map(|(ip, ready)| json!({
            "addresses": [ip],
            "conditions": {"ready": ready, "serving": true, "terminating": !ready},
        })).collect::<Vec<_>>(),
        "ports": [{"name": "http", "port": 7000, "protocol": "TCP"}],
    })
}

async fn endpointslices(
    State(api): State<Shared>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let mut a = api.lock().unwrap();
    a.requests.push(q.clone());
    if q.get("labelSelector").map(String::as_str) != Some(SELECTOR) {
        return (axum::http::StatusCode::BAD_REQUEST, "wrong selector").into_response();
    }
    if a.forbid {
        return (axum::http::StatusCode::FORBIDDEN, "Forbidden").into_response();
    }
    if q.get("watch").map(String::as_str) == Some("1") {
        if std::mem::take(&mut a.gone_at_open) {
            let gone = json!({"kind": "Status", "code": 410, "reason": "Expired",
                "message": "too old resource version"});
            return (axum::http::StatusCode::GONE, axum::Json(gone)).into_response();
        }
        let (tx, rx) = mpsc::unbounded_channel::<String>();
        a.watchers.push(tx);
        let body = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|l| (Ok::<_, std::io::Error>(l), rx))
        });
        return axum::body::Body::from_stream(body).into_response();
    }
    let items: Vec<Value> = a.slices.values().cloned().collect();
    axum::Json(json!({
        "kind": "EndpointSliceList",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"resourceVersion": a.rv.to_string()},
        "items": items,
    }))
    .into_response()
}

struct FakeApi {
    url: String,
    api: Shared,
}

impl FakeApi {
    async fn start() -> Self {
        let api: Shared = Arc::default();
        let app = axum::Router::new()
            .route(PATH, axum::routing::get(endpointslices))
            .with_state(api.clone());
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(l, app).await });
        Self { url, api }
    }

    /// Stores `obj` (or deletes it) at a new version and sends the event to every watch.
    fn apply(&self, kind: &str, mut obj: Value) {
        let mut a = self.api.lock().unwrap();
        a.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(a.rv.to_string());
        let name = obj["metadata"]["name"].as_str().unwrap().to_string();
        if kind == "DELETED" {
            a.slices.remove(&name);
        } else {
            a.slices.insert(name, obj.clone());
        }
        let line = format!("{}\n", json!({"type": kind, "object": obj}));
        a.watchers.retain(|w| w.send(line.clone()).is_ok());
    }

    /// Changes the store with no event, then tells every watch its version is too old (410,
    /// as after a compaction) and ends it.
    fn expire_after(&self, change: impl FnOnce(&mut BTreeMap<String, Value>)) {
        let mut a = self.api.lock().unwrap();
        a.rv += 1;
        change(&mut a.slices);
        let gone = json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1",
            "status": "Failure", "reason": "Expired", "code": 410,
            "message": "too old resource version"}});
        for w in a.watchers.drain(..) {
            let _ = w.send(format!("{gone}\n"));
        }
    }

    /// Ends every watch as the server does at its `timeoutSeconds`.
    fn close_watches(&self) {
        self.api.lock().unwrap().watchers.clear();
    }

    fn requests(&self) -> Vec<HashMap<String, String>> {
        self.api.lock().unwrap().requests.clone()
    }

    /// Waits until `n` watches are open.
    async fn watching(&self, n: usize) {
        for _ in 0..200 {
            {
                let mut a = self.api.lock().unwrap();
                a.watchers.retain(|w| !w.is_closed());
                if a.watchers.len() == n {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("{n} watches never opened: {:?}", self.requests());
    }
}

/// A pool following the fake API's slices, its workers at `port`.
fn kube_pool(api: &str, port: u16) -> Arc<WorkerPool> {
    WorkerPool::new(WorkerPoolConfig {
        name: "fleet".into(),
        membership: Membership::Kubernetes(KubeTarget {
            api: api.into(),
            namespace: "rl".into(),
            label_selector: SELECTOR.into(),
            port,
        }),
        token: None,
    })
    .unwrap()
}

/// Waits until the pool's members are `want`.
async fn members(p: &WorkerPool, want: &[&String]) {
    let want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
    for _ in 0..200 {
        let now: Vec<String> = p.snapshot().into_iter().map(|(u, _)| u).collect();
        if now == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("members {:?}, wanted {want:?}", p.snapshot());
}

#[tokio::test]
async fn a_kubernetes_pool_follows_endpointslices_through_list_watch_and_expiry() {
    let port = free_port();
    let ws: Vec<_> = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
        .iter()
        .map(|ip| start_worker_on(&format!("{ip}:{port}"), 4, None))
        .collect();
    let api = FakeApi::start().await;
    api.apply("ADDED", slice("w-a", &[("127.0.0.2", true)]));
    let p = kube_pool(&api.url, port);
    // The first placement waits for the list: the one listed worker gets the episode.
    let t = task(&p, "t1", json!({"kind": "frozenlake"}), 5);
    let mut first = t.env(0);
    first.reset(1).await.unwrap();
    members(&p, &[&ws[0].url]).await;
    assert_eq!(p.snapshot()[0].1.mine, 1);
    api.watching(1).await;
    let reqs = api.requests();
    assert!(!reqs[0].contains_key("watch"), "a list first: {reqs:?}");
    let w = &reqs[1];
    assert_eq!(w["watch"], "1");
    assert_eq!(
        w["resourceVersion"], "1",
        "the watch starts at the list's version"
    );
    assert_eq!(w["allowWatchBookmarks"], "true");

    // Additions by watch: a new slice with one ready and one unready endpoint, then the
    // unready one turns ready; a bookmark changes nothing.
    api.apply(
        "ADDED",
        slice("w-b", &[("127.0.0.3", true), ("127.0.0.4", false)]),
    );
    members(&p, &[&ws[0].url, &ws[1].url]).await;
    api.apply(
        "BOOKMARK",
        json!({"kind": "EndpointSlice", "metadata": {"name": "w-b"}}),
    );
    api.apply(
        "MODIFIED",
        slice("w-b", &[("127.0.0.3", true), ("127.0.0.4", true)]),
    );
    members(&p, &[&ws[0].url, &ws[1].url, &ws[2].url]).await;

    // A watch the server ends is opened again from the last version, without a list.
    let lists =
        |r: &[HashMap<String, String>]| r.iter().filter(|q| !q.contains_key("watch")).count();
    api.close_watches();
    api.watching(1).await;
    let reqs = api.requests();
    assert_eq!(lists(&reqs), 1, "{reqs:?}");
    assert_eq!(reqs.last().unwrap()["resourceVersion"], "4");

    // Removal: the first slice goes; its worker leaves, and the episode open there goes on.
    api.apply("DELETED", slice("w-a", &[]));
    members(&p, &[&ws[1].url, &ws[2].url]).await;
    first.step("down", &Default::default()).await.unwrap();

    // A version too old: the pool lists again and finds what changed without an event.
    api.expire_after(|s| {
        s.insert(
            "w-b".into(),
            slice("w-b", &[("127.0.0.3", false), ("127.0.0.4", true)]),
        );
    });
    members(&p, &[&ws[2].url]).await;
    assert_eq!(lists(&api.requests()), 2);
    // A 410 when a watch opens (HTTP status, not event) also makes a new list.
    api.api.lock().unwrap().gone_at_open = true;
    api.close_watches();
    api.watching(1).await;
    assert_eq!(lists(&api.requests()), 3, "{:?}", api.requests());
    // New episodes go to the member left.
    let mut second = t.env(1);
    second.reset(2).await.unwrap();
    let on: Vec<usize> = p.snapshot().iter().map(|(_, st)| st.mine).collect();
    assert_eq!(on, [1], "{:?}", p.snapshot());
    first.close().await;
    second.close().await;
}

#[tokio::test]
async fn a_kubernetes_pool_whose_api_cannot_be_reached_names_the_pool_and_the_api() {
    // A port nothing listens on.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let p = kube_pool(&url, 7000);
    let t = task(&p, "t1", json!({"kind": "frozenlake"}), 5);
    let e = t.env(0).reset(1).await.unwrap_err().to_string();
    assert!(
        e.contains("env pool fleet") && e.contains("endpointslices") && e.contains(&url),
        "{e}"
    );
}

#[tokio::test]
async fn a_refused_list_names_the_role_the_account_needs() {
    let api = FakeApi::start().await;
    api.api.lock().unwrap().forbid = true;
    let p = kube_pool(&api.url, 7000);
    let t = task(&p, "t1", json!({"kind": "frozenlake"}), 5);
    let e = t.env(0).reset(1).await.unwrap_err().to_string();
    assert!(
        e.contains("env pool fleet") && e.contains("403: Forbidden") && e.contains("Role"),
        "{e}"
    );
}

/// Each slot's assigned server.
fn slots(p: &actors::generation::remote::elastic::ElasticPool) -> Vec<Option<String>> {
    p.slots.iter().map(|s| s.assigned()).collect()
}

/// Waits until the slots' assigned servers are `want`.
async fn assigned(p: &actors::generation::remote::elastic::ElasticPool, want: Vec<Option<&str>>) {
    let want: Vec<Option<String>> = want.into_iter().map(|w| w.map(String::from)).collect();
    for _ in 0..200 {
        if slots(p) == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("slots {:?}, wanted {want:?}", slots(p));
}

/// An elastic inference-server pool (`backend.discover = { kubernetes = … }`) follows the
/// same list and watch: each ready endpoint gets a slot of its own and keeps it while it
/// stays, one that turns unready loses it, and a later one takes the freed slot.
#[tokio::test]
async fn an_elastic_server_pool_assigns_its_slots_from_endpointslices() {
    use actors::generation::remote::elastic::{ElasticPool, follow};
    let api = FakeApi::start().await;
    api.apply("ADDED", slice("llm-a", &[("10.0.0.1", true)]));
    let pool = ElasticPool::new("llm", 2);
    let target = KubeTarget {
        api: api.url.clone(),
        namespace: "rl".into(),
        label_selector: SELECTOR.into(),
        port: 8000,
    };
    tokio::spawn(follow(
        Arc::downgrade(&pool),
        Membership::Kubernetes(target),
    ));
    assigned(&pool, vec![Some("http://10.0.0.1:8000"), None]).await;
    api.watching(1).await;
    api.apply(
        "ADDED",
        slice("llm-b", &[("10.0.0.2", true), ("10.0.0.3", false)]),
    );
    assigned(
        &pool,
        vec![Some("http://10.0.0.1:8000"), Some("http://10.0.0.2:8000")],
    )
    .await;
    // The first turns unready: its slot is cleared, the second keeps its own.
    api.apply("MODIFIED", slice("llm-a", &[("10.0.0.1", false)]));
    assigned(&pool, vec![None, Some("http://10.0.0.2:8000")]).await;
    // A third becomes ready: it takes the free slot (no engine holds a server there).
    api.apply(
        "MODIFIED",
        slice("llm-b", &[("10.0.0.2", true), ("10.0.0.3", true)]),
    );
    assigned(
        &pool,
        vec![Some("http://10.0.0.3:8000"), Some("http://10.0.0.2:8000")],
    )
    .await;
    // More servers than slots: the extra one waits; nothing moves.
    api.apply("MODIFIED", slice("llm-a", &[("10.0.0.1", true)]));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        slots(&pool),
        vec![
            Some("http://10.0.0.3:8000".into()),
            Some("http://10.0.0.2:8000".into())
        ]
    );
}
