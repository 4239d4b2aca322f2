//! An elastic pool's slots against scripted servers: a joining server gets the pool's version
//! before it takes work; a leaving one finishes what it holds, then frees its slot; its
//! drain time bounds the wait; a server that cannot take the version never serves.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::super::tests::{Scripted, runtime};
use super::*;
use crate::generation::contract::{pause_briefly, request};

/// Scripted servers by URL.
fn servers(names: &[(&str, Scripted)]) -> ClientFor {
    let map: HashMap<String, Scripted> = names
        .iter()
        .map(|(n, s)| ((*n).to_string(), s.clone()))
        .collect();
    Arc::new(move |url: &str| -> Arc<dyn ServerClient> {
        Arc::new(map.get(url).cloned().expect("a known server"))
    })
}

fn engine(
    pool: &ElasticPool,
    slot: usize,
    client_for: &ClientFor,
    rt: &tokio::runtime::Runtime,
    drain_within: Duration,
) -> ElasticEngine {
    let cfg = RemoteConfig {
        probe_every: Duration::from_millis(10),
        serving: None,
        ..Default::default()
    };
    ElasticEngine::new(
        pool,
        slot,
        client_for.clone(),
        rt.handle().clone(),
        cfg,
        drain_within,
    )
}

/// What finished, by request id.
type Finished = Vec<(u64, Result<crate::generation::GenOutput, GenError>)>;

/// Steps `e` until `cond` holds (at most 20 s), collecting what finishes.
fn until(
    e: &mut ElasticEngine,
    out: &mut Finished,
    what: &str,
    cond: &mut dyn FnMut(&ElasticEngine, &Finished) -> bool,
) {
    let deadline = infra::clock::wall_now() + Duration::from_secs(20);
    while !cond(e, out) {
        assert!(
            infra::clock::wall_now() < deadline,
            "timed out waiting for {what}"
        );
        if e.has_work() {
            out.extend(e.step().finished);
        } else {
            pause_briefly();
        }
    }
}

fn weights(version: PolicyVersion) -> Weights {
    Weights {
        version,
        tensors: Vec::new(),
        shared: None,
        modelled_bytes: 0.0,
    }
}

#[test]
fn servers_join_at_the_pools_version_and_leave_after_their_trajectories() {
    let rt = runtime();
    let (a, b) = (Scripted::default(), Scripted::default());
    let client_for = servers(&[("http://a", a.clone()), ("http://b", b.clone())]);
    let pool = ElasticPool::new("elastic", 2);
    let mut e0 = engine(&pool, 0, &client_for, &rt, Duration::from_secs(30));
    let mut e1 = engine(&pool, 1, &client_for, &rt, Duration::from_secs(30));
    let mut out = Vec::new();
    // No server yet: no shard takes work. The policy moves to version 3 meanwhile.
    assert!(!e0.accepting() && !e1.accepting());
    e0.install(3, &weights(3), InFlightPolicy::Abort).unwrap();
    pool.set_members(&["http://a".into()]);
    until(&mut e0, &mut out, "a to serve", &mut |e, _| e.accepting());
    assert_eq!(
        *a.installs.lock().unwrap(),
        vec![3],
        "a got version 3 first"
    );
    assert!(!e1.accepting(), "one server, one shard");
    e0.add(request(1, vec![1, 2, 3], 4, 0));
    until(&mut e0, &mut out, "request 1", &mut |_, o| !o.is_empty());
    let got = out.remove(0).1.expect("served");
    assert_eq!(
        got.versions,
        vec![crate::types::VersionSpan {
            version: 3,
            tokens: 4,
            precision: None,
        }]
    );
    // A second server takes the free slot, at the version of the moment.
    pool.set_members(&["http://a".into(), "http://b".into()]);
    until(&mut e1, &mut out, "b to serve", &mut |e, _| e.accepting());
    assert_eq!(*b.installs.lock().unwrap(), vec![3]);
    assert_eq!(pool.slots[1].held().as_deref(), Some("http://b"));
    // b leaves while it generates for a trajectory: the shard takes no more, the request
    // finishes whole, and the slot frees only when the trajectory ends.
    e1.add(request(7, vec![5; 10], 150, 0));
    until(&mut e1, &mut out, "the answer to start", &mut |e, _| {
        e.progress(7).is_some_and(|n| n > 0)
    });
    pool.set_members(&["http://a".into()]);
    until(&mut e1, &mut out, "request 7", &mut |e, o| {
        !e.accepting() && !o.is_empty()
    });
    let got = out.remove(0);
    assert_eq!(got.0, 7);
    assert_eq!(
        got.1.expect("finished on the leaving server").tokens.len(),
        150
    );
    assert_eq!(
        pool.slots[1].held().as_deref(),
        Some("http://b"),
        "its trajectory goes on"
    );
    e1.release(7);
    until(&mut e1, &mut out, "b to leave", &mut |_, _| {
        pool.slots[1].held().is_none()
    });
    // The freed slot takes the next server.
    pool.set_members(&["http://a".into(), "http://b".into()]);
    until(&mut e1, &mut out, "b to serve again", &mut |e, _| {
        e.accepting()
    });
    assert!(b.calls.load(Ordering::SeqCst) >= 1);
}

#[test]
fn a_leaving_server_gets_its_drain_time_and_a_server_that_cannot_take_the_version_never_serves() {
    let rt = runtime();
    let slow = Scripted::default();
    let mut stuck = Scripted::default();
    stuck.no_installs = true;
    let client_for = servers(&[
        ("http://slow", slow.clone()),
        ("http://stuck", stuck.clone()),
    ]);
    let pool = ElasticPool::new("elastic", 2);
    let mut e0 = engine(&pool, 0, &client_for, &rt, Duration::from_millis(100));
    let mut e1 = engine(&pool, 1, &client_for, &rt, Duration::from_millis(100));
    let mut out = Vec::new();
    e0.install(2, &weights(2), InFlightPolicy::Abort).unwrap();
    pool.set_members(&["http://slow".into()]);
    until(&mut e0, &mut out, "slow to serve", &mut |e, _| {
        e.accepting()
    });
    // A long answer outlives the drain time: it fails, naming the server, and the slot frees.
    e0.add(request(1, vec![1, 2], 5_000, 0));
    until(&mut e0, &mut out, "the answer to start", &mut |e, _| {
        e.progress(1).is_some_and(|n| n > 0)
    });
    pool.set_members(&[]);
    until(&mut e0, &mut out, "request 1 to fail", &mut |_, o| {
        !o.is_empty()
    });
    let err = infra::error_chain(&out.remove(0).1.expect_err("cut at the drain time"));
    assert!(err.contains("left the pool"), "{err}");
    until(&mut e0, &mut out, "the slot to free", &mut |_, _| {
        pool.slots[0].held().is_none()
    });
    // A server that cannot install version 2 is healthy but never takes work.
    pool.set_members(&["http://stuck".into()]);
    let slot = pool
        .slots
        .iter()
        .position(|s| lock(&s.want).is_some())
        .unwrap();
    let e = if slot == 0 { &mut e0 } else { &mut e1 };
    until(e, &mut out, "stuck to be refused", &mut |_, _| {
        lock(&pool.slots[slot].refused).is_some()
    });
    assert!(!e.accepting());
    let why = lock(&pool.slots[slot].refused).clone().unwrap();
    assert!(why.contains("cannot install"), "{why}");
    // A request placed there anyway (no shard of the pool serves) waits, then fails.
    e.add(request(9, vec![1], 2, 0));
    until(e, &mut out, "request 9 to fail", &mut |_, o| !o.is_empty());
    let err = infra::error_chain(&out.remove(0).1.expect_err("no server"));
    assert!(err.contains("no inference server"), "{err}");
    assert_eq!(
        stuck.calls.load(Ordering::SeqCst),
        0,
        "it generated nothing"
    );
}
