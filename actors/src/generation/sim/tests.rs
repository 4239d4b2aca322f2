use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::device::{DeviceProfile, Efficiency, ModelProfile, WeightSync, prefill_seconds};
use crate::generation::{SamplingParams, spawn_engine};

fn cfg(model: &str, device: &str) -> SimEngineConfig {
    SimEngineConfig::new(
        DeviceProfile::builtin(device).unwrap(),
        ModelProfile::builtin(model).unwrap(),
    )
}

fn req(id: u64, session: u64, context: usize, answer: u32) -> GenRequest {
    GenRequest {
        id,
        session,
        context: Arc::new(vec![7; context].into()),
        params: SamplingParams {
            max_tokens: 4096,
            seed: id,
            ..SamplingParams::default()
        },
        sim_response_len: Some(answer),
        prefilled: false,
        reusable: None,
        carried: 0,
    }
}

#[test]
fn fused_iterations_cost_what_single_steps_cost_and_leave_the_same_state() {
    for (model, device, batch) in [
        ("qwen3-8b", "H20", 3usize),
        ("qwen3-32b", "H800", 40),
        ("qwen3-30b-a3b", "H20", 200),
    ] {
        let mut single = SimEngine::new(cfg(model, device));
        let mut fused = SimEngine::new(cfg(model, device));
        for i in 0..batch as u64 {
            single.add(req(i, i, 500 + 37 * i as usize, 300 + i as u32));
            fused.add(req(i, i, 500 + 37 * i as usize, 300 + i as u32));
        }
        // Prefill steps first (identical in both), until only decoding is left.
        while fused.fusable() < 2 {
            let a = fused.step();
            let b = single.step();
            assert_eq!(a.modelled, b.modelled);
        }
        let k = fused.fusable();
        let planned = fused.fused_time(k);
        let report = fused.advance(k);
        let mut sum = 0.0;
        let mut finished = Vec::new();
        for _ in 0..k {
            let r = single.step();
            sum += r.modelled.as_secs_f64();
            finished.extend(r.finished.into_iter().map(|(id, _)| id));
        }
        let got = report.modelled.as_secs_f64();
        assert!(
            (got - sum).abs() <= 1e-9 * sum.max(1.0),
            "{model} on {device}: fused {got} s vs {sum} s stepped"
        );
        assert_eq!(planned, report.modelled);
        assert_eq!(
            report
                .finished
                .iter()
                .map(|(id, _)| *id)
                .collect::<Vec<_>>(),
            finished
        );
        assert!(
            !finished.is_empty() || k == fused.cfg.max_fused_iterations,
            "{model}: a fused step runs up to the first sequence that finishes"
        );
        assert_eq!(
            fused.load(),
            single.load(),
            "{model}: same tokens, KV and counters"
        );
        // Prefix durations are monotone (the loop's cut relies on it).
        assert!((1..k).all(|j| fused_time_of(&single, j) <= fused_time_of(&single, j + 1)));
    }
}

fn fused_time_of(e: &SimEngine, j: u64) -> Duration {
    e.fused_time(j)
}

#[test]
fn a_fused_step_is_cut_at_the_iteration_boundary_after_a_command() {
    // One long answer decoding alone; a second request arrives mid-way. With fusion it must
    // start at the iteration boundary after its arrival, as with one iteration per step.
    let run = |fuse: u64| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(async move {
            let mut c = cfg("qwen3-8b", "H20");
            c.max_fused_iterations = fuse;
            let (h, _join) = spawn_engine(
                Box::new(SimEngine::new(c)),
                crate::generation::LoopPlacement::Task,
            );
            let t0 = tokio::time::Instant::now();
            let h2 = h.clone();
            let a = tokio::spawn(async move {
                let o = h2.generate(req(1, 1, 1000, 2000)).await.unwrap();
                (o.tokens.len(), t0.elapsed())
            });
            tokio::time::sleep(Duration::from_millis(1234)).await;
            let o = h.generate(req(2, 2, 200, 100)).await.unwrap();
            let b = (o.tokens.len(), t0.elapsed());
            (a.await.unwrap(), b)
        })
    };
    let (a1, b1) = run(1);
    let (a2, b2) = run(4096);
    assert_eq!((a1.0, b1.0), (2000, 100));
    assert_eq!((a2.0, b2.0), (2000, 100));
    // Stepping one iteration at a time, every step's sleep rounds up to the timer's
    // millisecond; fused steps sleep once. Agreement within that rounding:
    for ((n, x), (_, y)) in [(a1, a2), (b1, b2)] {
        let (x, y) = (x.as_secs_f64(), y.as_secs_f64());
        assert!(
            (x - y).abs() <= 0.001 * n as f64 + 0.002,
            "{x} s stepped vs {y} s fused"
        );
        assert!(
            y > 1.234,
            "the second request cannot finish before it arrived"
        );
    }
}

#[test]
fn the_prefix_cache_serves_the_next_turn_and_evicts_least_recently_used_sessions() {
    let mut c = cfg("qwen3-8b", "H800");
    c.max_fused_iterations = 1;
    c.block_tokens = 1;
    let mut e = SimEngine::new(c);
    let cap = e.kv_capacity();
    let drain = |e: &mut SimEngine| {
        let mut out = Vec::new();
        while e.has_work() {
            out.extend(
                e.step()
                    .finished
                    .into_iter()
                    .map(|(id, r)| (id, r.unwrap())),
            );
        }
        out
    };
    // Turn 1 of session 1, then turn 2 with the grown context: only the new tokens prefill.
    e.add(req(1, 1, 1000, 10));
    let t1 = drain(&mut e);
    assert_eq!(t1[0].1.prefill_tokens, 1000);
    e.add(req(2, 1, 1010 + 300, 10));
    let t2 = drain(&mut e);
    assert_eq!(
        t2[0].1.prefill_tokens, 300,
        "the cached 1,010 tokens are not prefilled again"
    );
    assert_eq!(e.cache_counters().0, 1);
    // Sessions that fill the memory evict session 1 (the least recently used).
    let big = (cap / 3) as usize;
    for s in 10..13 {
        e.add(req(s, s, big, 10));
        drain(&mut e);
    }
    assert!(e.cache_counters().1 >= 1, "something was evicted");
    e.add(req(3, 1, 1320 + 50, 10));
    let t3 = drain(&mut e);
    assert_eq!(
        t3[0].1.prefill_tokens, 1370,
        "an evicted session prefills its whole context"
    );
    // Never more KV than the memory holds.
    assert!(e.load().kv_tokens <= cap);
}

/// Runs `e` until it has no work; returns each finished request's prefilled tokens.
fn drain_prefills(e: &mut SimEngine) -> Vec<(u64, u32)> {
    let mut out = Vec::new();
    while e.has_work() {
        for (id, r) in e.step().finished {
            out.push((id, r.unwrap().prefill_tokens));
        }
    }
    out
}

/// A hand-computed workload on a 1,000-token cache of 16-token blocks: whole blocks are
/// cached and hit, eviction takes blocks from the end of the least recently used session (which
/// keeps its leading blocks), and a partly kept context (`reusable`) hits only its kept blocks.
#[test]
fn the_prefix_cache_holds_hits_and_evicts_whole_blocks_least_recently_used_first() {
    let mut c = cfg("qwen3-8b", "H800");
    c.max_fused_iterations = 1;
    c.block_tokens = 16;
    let mut e = SimEngine::new(c);
    e.kv_capacity = 1_000;
    let turn = |e: &mut SimEngine, id: u64, session: u64, context: usize, answer: u32| {
        e.add(req(id, session, context, answer));
        drain_prefills(e)[0].1
    };
    // A, turn 1: 320 + 10 tokens; the cache keeps 320 (20 whole blocks of 330).
    assert_eq!(turn(&mut e, 1, 1, 320, 10), 320);
    assert_eq!(e.cached(1), 320);
    // A, turn 2: 370 tokens; 320 hit, 50 prefilled; 368 of 380 cached after.
    assert_eq!(turn(&mut e, 2, 1, 370, 10), 50);
    assert_eq!(e.cached(1), 368);
    // B: 500 + 10 reserved beside A's 368 (878 ≤ 1,000): nothing evicted; 496 cached.
    assert_eq!(turn(&mut e, 3, 2, 500, 10), 500);
    assert_eq!((e.cached(1), e.cached(2)), (368, 496));
    // C: 408 reserved + 864 cached is 272 over: 17 blocks leave the end of A (the least
    // recently used), which keeps 96 tokens.
    assert_eq!(turn(&mut e, 4, 3, 400, 8), 400);
    assert_eq!(e.cached(1), 96);
    assert_eq!(e.cache_tokens().2, 17);
    assert_eq!(e.cache_counters().1, 0, "no session was evicted whole");
    // A, turn 3 (400 tokens): only its 96 surviving tokens hit.
    assert_eq!(turn(&mut e, 5, 1, 400, 10), 304);
    // D keeps half of its last context (176 tokens): 88 shared, 80 of them in whole blocks.
    assert_eq!(turn(&mut e, 6, 4, 160, 16), 160);
    assert_eq!(e.cached(4), 176);
    let mut r = req(7, 4, 200, 16);
    r.reusable = Some(88);
    e.add(r);
    assert_eq!(drain_prefills(&mut e)[0].1, 120);
    let (lookup, hit, _) = e.cache_tokens();
    assert_eq!(lookup, 320 + 370 + 500 + 400 + 400 + 160 + 200);
    assert_eq!(hit, 320 + 96 + 80);
    let l = e.load();
    assert_eq!((l.cache_lookup_tokens, l.cache_hit_tokens), (lookup, hit));
    assert!(l.kv_tokens <= 1_000);
}

/// The decode side of a P/D pair hands a session's KV back with the next prefill request: the
/// carried prefix is not prefilled, and counts as served; the cache's own prefix serves when it
/// is the longer one.
#[test]
fn carried_kv_is_not_prefilled() {
    let mut c = cfg("qwen3-8b", "H800");
    c.block_tokens = 1;
    let mut e = SimEngine::new(c);
    let prefill_only = |id: u64, context: usize, carried: u64| {
        let mut r = req(id, 9, context, 0);
        r.params.max_tokens = 0;
        r.carried = carried;
        r
    };
    e.add(prefill_only(1, 1_000, 0));
    assert_eq!(drain_prefills(&mut e), vec![(1, 1_000)]);
    assert_eq!(e.cached(9), 1_000);
    e.add(prefill_only(2, 1_300, 1_250));
    assert_eq!(drain_prefills(&mut e), vec![(2, 50)]);
    e.add(prefill_only(3, 1_400, 200));
    assert_eq!(
        drain_prefills(&mut e),
        vec![(3, 100)],
        "the cached 1,300 are longer"
    );
    let (lookup, hit, _) = e.cache_tokens();
    assert_eq!((lookup, hit), (3_700, 2_550));
}

#[test]
fn prefill_only_requests_return_after_prefill() {
    let mut e = SimEngine::new(cfg("qwen3-8b", "H800"));
    let mut r = req(1, 1, 4000, 100);
    r.params.max_tokens = 0;
    e.add(r);
    let rep = e.step();
    let (_, out) = &rep.finished[0];
    let out = out.as_ref().unwrap();
    assert!(out.tokens.is_empty());
    assert_eq!(out.prefill_tokens, 4000);
    let expect = prefill_seconds(
        &DeviceProfile::builtin("H800").unwrap(),
        &ModelProfile::builtin("qwen3-8b").unwrap(),
        Efficiency::default(),
        4000.0,
    );
    assert!((rep.modelled.as_secs_f64() - expect).abs() < 1e-9);
}

#[test]
fn admissions_wait_for_kv_memory() {
    // 32B weights on one H800 leave little KV: two 10k-token requests cannot run together.
    let mut c = cfg("qwen3-32b", "H800");
    c.max_fused_iterations = 1;
    let mut e = SimEngine::new(c);
    let cap = e.kv_capacity() as usize;
    e.add(req(1, 1, cap * 6 / 10, 10));
    e.add(req(2, 2, cap * 6 / 10, 10));
    e.step();
    assert_eq!((e.load().running, e.load().waiting), (1, 1));
    while e.load().waiting == 1 {
        e.step();
    }
    assert_eq!(
        e.load().running,
        1,
        "the second starts once the first has finished"
    );
}

#[test]
fn weight_sync_direct_pull_is_minutes_for_32b_and_the_relay_seconds() {
    let w = ModelProfile::builtin("qwen3-32b").unwrap().weight_bytes();
    let direct = WeightSync {
        mode: crate::device::SyncMode::Direct,
        shards: 32,
        gpus_per_shard: 2,
        ..WeightSync::default()
    };
    let relay = WeightSync {
        shards: 32,
        gpus_per_shard: 2,
        ..WeightSync::default()
    };
    let (d, r) = (direct.install_seconds(w), relay.install_seconds(w));
    assert!(d > 60.0 && r < 5.0, "direct {d} s, relay {r} s");
    assert!(relay.publish_seconds(w) < 0.1 && direct.publish_seconds(w) == 0.0);
}

/// P/D bug: a prefill-only request (no tokens to generate) retired after its first engine
/// step even when its context took several chunks, or shared the step's chunk budget, so the
/// decode shard admitted it with part of its prefill never done.
#[test]
fn prefill_only_requests_retire_only_when_their_whole_context_is_prefilled() {
    let mut e = SimEngine::new(cfg("qwen3-32b", "H800"));
    let chunk = e.cfg.prefill_chunk as usize;
    // Longer than two chunks, and two that share one step's budget.
    let mut long = req(1, 1, 2 * chunk + 1000, 100);
    long.params.max_tokens = 0;
    let mut a = req(2, 2, chunk / 2 + 100, 100);
    a.params.max_tokens = 0;
    let mut b = req(3, 3, chunk / 2 + 100, 100);
    b.params.max_tokens = 0;
    e.add(long);
    e.add(a);
    e.add(b);
    let mut done = std::collections::BTreeMap::new();
    let mut steps = 0;
    while done.len() < 3 && steps < 20 {
        steps += 1;
        for (id, out) in e.step().finished {
            let out = out.unwrap();
            assert!(out.tokens.is_empty());
            done.insert(id, (out.prefill_tokens, steps));
        }
    }
    assert_eq!(done[&1].0 as usize, 2 * chunk + 1000, "{done:?}");
    assert_eq!(done[&2].0 as usize, chunk / 2 + 100, "{done:?}");
    assert_eq!(done[&3].0 as usize, chunk / 2 + 100, "{done:?}");
    // 3 × chunk + 1200 tokens at `chunk` per step: four steps at least, the long one last.
    assert!(done[&1].1 >= 3, "{done:?}");
    assert!(done.values().map(|d| d.1).max().unwrap() >= 4, "{done:?}");
}

#[test]
fn measured_costs_replace_the_roofline_for_single_and_fused_steps() {
    let mut c = cfg("tiny", "CPU");
    c.measured = Some(MeasuredCost {
        step_s: 0.01,
        prefill_s_per_token: 2e-5,
        decode_s_per_token: 1e-4,
    });
    let mut e = SimEngine::new(c);
    e.add(req(1, 1, 300, 40));
    e.add(req(2, 2, 200, 40));
    // The first step prefills both contexts (500 tokens) and decodes nothing yet.
    let rep = e.step();
    assert_eq!(rep.prefill_tokens, 500);
    let expect = 0.01 + 2e-5 * 500.0 + 1e-4 * rep.decode_tokens as f64;
    assert!(
        (rep.modelled.as_secs_f64() - expect).abs() < 1e-9,
        "{rep:?}"
    );
    // Then decode steps of two sequences, fused or not: 10 ms + 2 × 100 µs each.
    let rep = e.step();
    let iterations = rep.decode_tokens as f64 / 2.0;
    assert!(iterations >= 1.0);
    let expect = iterations * (0.01 + 2.0 * 1e-4);
    assert!(
        (rep.modelled.as_secs_f64() - expect).abs() < 1e-9,
        "{rep:?}"
    );
}
