//! Scheduler semantics on the virtual clock: staleness bound, barrier modes, in-flight policy
//! on weight updates, redundancy, masking, filtering, mapping, frozen shards, determinism.

use std::collections::{BTreeMap, BTreeSet};

use tests::{SpecBuilder, run_recorded};

fn two_pools() -> SpecBuilder {
    SpecBuilder::new()
        .pool("h800", "H800", 2, "")
        .pool("h20", "H20", 2, "")
}

#[test]
fn staleness_never_exceeds_alpha() {
    for alpha in [0u64, 1, 2] {
        let spec = two_pools()
            .multi_turn("lake", "")
            .single_turn("math", "")
            .rollout(&format!("alpha = {alpha}"))
            .rollout("barrier = \"none\"")
            .rollout(&format!("overlap_training = {}", alpha > 0))
            .rollout("batch_size = 4")
            .rollout("steps = 6")
            .extra("[trainer]\nkind = \"sim\"\nseconds_per_token = 0.002\ngpus = 1")
            .build();
        let r = run_recorded(spec);
        assert_eq!(r.batches.len(), 6);
        let mut max_seen = 0;
        for (m, b) in &r.batches {
            assert_eq!(b.groups.len(), 4, "a batch holds batch_size groups");
            for t in b.trajectories() {
                let age = b.step - t.start_version;
                assert!(
                    age <= alpha,
                    "alpha {alpha}: trajectory {} started at v{} trained at step {}",
                    t.id,
                    t.start_version,
                    b.step
                );
                assert!(
                    b.step - t.oldest_version() <= alpha,
                    "a token older than alpha in {}",
                    t.id
                );
                max_seen = max_seen.max(age);
            }
            assert!(m.staleness_max <= alpha);
        }
        // With overlap the bound is used, not just respected.
        if alpha > 0 {
            assert!(
                max_seen >= 1,
                "alpha {alpha}: rollout never ran ahead of training"
            );
        }
    }
}

#[test]
fn barrier_modes_order_the_work_as_documented() {
    let base = || {
        SpecBuilder::new()
            .pool("h800", "H800", 2, "")
            .raw_task(
                r#"[[tasks]]
domain = "lake"
group_size = 4
max_turns = 5
max_tokens_per_turn = 64
reward = ["judge"]
[tasks.env]
kind = "sim"
step_latency_s = { normal = { mean = 5.0, std = 3.0 } }
turns = { constant = 5 }
observation_tokens = { constant = 32 }
response_tokens = { constant = 32 }
"#,
            )
            .extra("[reward.functions.judge]\nkind = \"sim\"\nlatency_s = { constant = 1.0 }")
            .rollout("alpha = 0")
            .rollout("overlap_training = false")
            .rollout("batch_size = 4")
            .rollout("steps = 3")
    };
    let none = run_recorded(base().rollout("barrier = \"none\"").build());
    let turn = run_recorded(base().rollout("barrier = \"turn\"").build());
    let batch = run_recorded(base().rollout("barrier = \"batch\"").build());
    let waits = |r: &tests::Recorded| {
        r.batches
            .iter()
            .flat_map(|(_, b)| {
                b.trajectories()
                    .map(|t| t.timings.wait_s)
                    .collect::<Vec<_>>()
            })
            .sum::<f64>()
    };
    // Trajectory-level: nobody waits for anybody.
    assert_eq!(waits(&none), 0.0);
    // Turn barrier: episodes wait for the slowest each turn, so a group ends together.
    assert!(waits(&turn) > 0.0);
    // Turn barrier: every turn of a wave (here: a batch) starts at the same instant, because
    // the barrier releases all episodes at once when the slowest env step ends.
    for r in [&turn, &batch] {
        for (_, b) in &r.batches {
            for k in 1..5 {
                let starts: Vec<f64> = b
                    .trajectories()
                    .filter_map(|t| t.turns.get(k).map(|u| u.started_at_s))
                    .collect();
                assert!(starts.len() > 1);
                assert!(
                    starts.iter().all(|s| (s - starts[0]).abs() < 1e-9),
                    "turn {k} did not start together: {starts:?}"
                );
            }
        }
    }
    // Trajectory level: turns start whenever each episode is ready.
    let unsynchronised = none.batches.iter().any(|(_, b)| {
        let starts: Vec<f64> = b
            .trajectories()
            .filter_map(|t| t.turns.get(2).map(|u| u.started_at_s))
            .collect();
        starts.iter().any(|s| (s - starts[0]).abs() > 1e-3)
    });
    assert!(
        unsynchronised,
        "trajectory-level turns should not be synchronised"
    );
    // Batch barrier: no reward before the whole wave finished stepping, so every trajectory of
    // a batch is rewarded after the last one's env interaction ended.
    for (_, b) in &batch.batches {
        let last_env_end = b
            .trajectories()
            .map(|t| t.timings.ended_at_s - t.timings.reward_s)
            .fold(f64::MIN, f64::max);
        for t in b.trajectories() {
            let reward_start = t.timings.ended_at_s - t.timings.reward_s;
            assert!(
                reward_start + 1e-6 >= last_env_end,
                "reward of {} fired at {reward_start} before the batch finished at {last_env_end}",
                t.id
            );
        }
    }
    // Under the turn barrier rewards are not held: some fire before the batch's last env step.
    let early = turn.batches.iter().any(|(_, b)| {
        let last_env_end = b
            .trajectories()
            .map(|t| t.timings.ended_at_s - t.timings.reward_s)
            .fold(f64::MIN, f64::max);
        b.trajectories()
            .any(|t| t.timings.ended_at_s - t.timings.reward_s + 1e-6 < last_env_end)
    });
    assert!(
        early,
        "turn barrier: rewards should fire as each trajectory ends"
    );
    let (tn, tt, tb) = (
        none.summary.elapsed_s,
        turn.summary.elapsed_s,
        batch.summary.elapsed_s,
    );
    assert!(
        tn < tt && tt <= tb + 1e-9,
        "virtual time none {tn} < turn {tt} <= batch {tb}"
    );
}

fn long_generation(policy: &str) -> tests::Recorded {
    let spec = SpecBuilder::new()
        .pool("h20", "H20", 1, ", max_batch = 64")
        .raw_task(
            r#"[[tasks]]
domain = "long"
group_size = 2
max_turns = 1
max_tokens_per_turn = 8192
[tasks.env]
kind = "sim"
turns = { constant = 1 }
observation_tokens = { constant = 64 }
response_tokens = { uniform = { low = 1000, high = 8000 } }
"#,
        )
        .rollout("barrier = \"none\"")
        // With alpha = 1 the admission quota leaves nothing in flight at an update (anything
        // still running then would be too stale to train on); alpha = 2 lets partial rollouts
        // span an update.
        .rollout("alpha = 2")
        .rollout("overlap_training = true")
        .rollout("batch_size = 2")
        .rollout("steps = 6")
        .rollout(&format!("on_weight_update = \"{policy}\""))
        .build();
    run_recorded(spec)
}

#[test]
fn abort_regenerates_and_recompute_keeps_tokens_across_updates() {
    let abort = long_generation("abort");
    let recompute = long_generation("recompute");
    let spans = |r: &tests::Recorded| {
        r.committed
            .iter()
            .flat_map(|t| t.turns.iter().map(|u| u.versions.len()))
            .max()
            .unwrap_or(0)
    };
    // abort: the partial turn is dropped and regenerated under one version.
    assert_eq!(
        spans(&abort),
        1,
        "abort must never mix versions within a turn"
    );
    // recompute: tokens survive the update, so some turn spans two versions.
    assert!(
        spans(&recompute) >= 2,
        "recompute must keep tokens generated before the update"
    );
    for t in &recompute.committed {
        for u in &t.turns {
            let n: u32 = u.versions.iter().map(|s| s.tokens).sum();
            assert_eq!(
                n as usize,
                u.response_tokens.len(),
                "version spans cover every token"
            );
            assert!(u.versions.windows(2).all(|w| w[0].version < w[1].version));
        }
    }
}

#[test]
fn redundancy_cancels_extras_once_a_group_is_full() {
    let spec = two_pools()
        .multi_turn("lake", "redundancy = 2")
        .rollout("batch_size = 4")
        .rollout("steps = 4")
        .build();
    let r = run_recorded(spec);
    let last = &r.summary.steps.last().expect("steps").scheduler;
    assert!(last.cancelled_extras > 0, "extras were never cancelled");
    for (_, b) in &r.batches {
        for g in &b.groups {
            assert_eq!(
                g.trajectories.len(),
                4,
                "a group keeps exactly group_size trajectories"
            );
        }
    }
    // No group ever committed more than group_size valid trajectories.
    let mut per_group: BTreeMap<u64, usize> = BTreeMap::new();
    for t in r.committed.iter().filter(|t| t.failure.is_none()) {
        *per_group.entry(t.group_id).or_default() += 1;
    }
    assert!(per_group.values().all(|&n| n <= 4));
}

#[test]
fn infrastructure_failures_are_masked_and_retried_never_scored_zero() {
    let task = r#"[[tasks]]
domain = "flaky"
group_size = 4
max_turns = 3
[tasks.env]
kind = "sim"
step_latency_s = { constant = 1.0 }
turns = { constant = 3 }
failure_probability = 0.1
"#;
    let spec = SpecBuilder::new()
        .pool("h800", "H800", 1, "")
        .raw_task(task)
        .rollout("batch_size = 4")
        .rollout("steps = 5")
        .build();
    let r = run_recorded(spec);
    let m = &r.summary.steps.last().expect("steps");
    assert!(
        m.buffer.masked > 0 && m.buffer.retried > 0,
        "failures were injected: {:?}",
        m.buffer
    );
    for (_, b) in &r.batches {
        for g in &b.groups {
            assert!(g.trajectories.len() >= 2);
            for t in &g.trajectories {
                assert!(
                    t.failure.is_none(),
                    "a failed trajectory reached the trainer"
                );
                assert!(t.reward.is_some());
            }
        }
    }
    // Failed trajectories are in the durable log with their reason.
    assert!(r.committed.iter().any(|t| t.failure.is_some()));
}

#[test]
fn all_equal_groups_are_filtered_when_asked() {
    let task = r#"[[tasks]]
domain = "coin"
group_size = 2
max_turns = 1
[tasks.env]
kind = "sim"
turns = { constant = 1 }
success_rate = 0.5
"#;
    let spec = SpecBuilder::new()
        .pool("h20", "H20", 1, "")
        .raw_task(task)
        .rollout("batch_size = 4")
        .rollout("steps = 4")
        .rollout("filter_all_equal = true")
        .build();
    let r = run_recorded(spec);
    assert!(
        r.summary
            .steps
            .last()
            .expect("steps")
            .buffer
            .filtered_all_equal
            > 0
    );
    for (_, b) in &r.batches {
        for g in &b.groups {
            let rw = g.rewards();
            assert!(
                rw.iter().any(|x| (x - rw[0]).abs() > 1e-12),
                "an all-equal group reached the trainer"
            );
        }
    }
}

#[test]
fn declared_and_cost_model_mapping_route_by_affinity() {
    let build = |mode: &str| {
        let mut b = two_pools().raw_task(
            r#"[[tasks]]
domain = "lake"
group_size = 4
max_turns = 8
max_tokens_per_turn = 32
[tasks.env]
kind = "sim"
turns = { constant = 8 }
observation_tokens = { constant = 2048 }
response_tokens = { constant = 16 }
"#,
        );
        b = b.single_turn("math", "");
        b = b.rollout("batch_size = 4").rollout("steps = 4");
        if mode == "declared" {
            b = b.extra(
                "[mapping]\nmode = \"declared\"\ndeclared = { lake = \"h800\", math = \"h20\" }",
            );
        } else {
            b = b.extra("[mapping]\nmode = \"cost_model\"");
        }
        run_recorded(b.build())
    };
    let share = |r: &tests::Recorded, task: &str, pool: &str| {
        let ts: Vec<_> = r.committed.iter().filter(|t| t.task == task).collect();
        ts.iter().filter(|t| t.pool == pool).count() as f64 / ts.len().max(1) as f64
    };
    let d = build("declared");
    assert_eq!(share(&d, "lake", "h800"), 1.0);
    assert_eq!(share(&d, "math", "h20"), 1.0);
    let c = build("cost_model");
    assert!(
        share(&c, "lake", "h800") > 0.7,
        "prefill-heavy task should go to the compute-rich pool"
    );
    assert!(
        share(&c, "math", "h20") > 0.7,
        "decode-heavy task should go to the bandwidth-rich pool"
    );
}

/// Bug 3 of #17: an SWE-like task whose agent re-renders its prompt every turn (`rewrite`)
/// re-prefills its history, so its prefill count is ≈ 9× its context. Sizing decode steps by
/// that count made its decode look bandwidth-bound and sent ≈ 18 % of its groups to the H20
/// pool, where the prefill is 6.7× slower and those trajectories held every step back
/// (344 s against 216 s for this run). Decoded at its real context it stays on the H800s.
#[test]
fn a_rewrite_context_task_stays_on_the_compute_rich_pool() {
    let run = SpecBuilder::new()
        .pool("h800", "H800", 16, "")
        .pool("h20", "H20", 6, "")
        .raw_task(
            r#"[[tasks]]
domain = "swe"
group_size = 8
max_turns = 30
max_tokens_per_turn = 1024
context = "rewrite"
[tasks.env]
kind = "sim"
reset_latency_s = { lognormal = { mu = 0.0, sigma = 0.5 } }
step_latency_s = { lognormal = { mu = -1.0, sigma = 0.5 } }
turns = { uniform = { low = 5, high = 12 } }
prompt_tokens = { uniform = { low = 2000, high = 4000 } }
observation_tokens = { lognormal = { mu = 7.0, sigma = 0.5 } }
response_tokens = { uniform = { low = 64, high = 256 } }
"#,
        )
        .rollout("batch_size = 8")
        .rollout("steps = 6")
        .seed(5)
        .extra("[mapping]\nmode = \"cost_model\"")
        .build();
    let r = run_recorded(run);
    assert!(r.committed.len() >= 6 * 8 * 8);
    let on_h20 = r.committed.iter().filter(|t| t.pool == "h20").count();
    assert!(
        on_h20 * 20 < r.committed.len(),
        "{on_h20} of {} trajectories on H20",
        r.committed.len()
    );
    // What the cost model saw: a context far below the re-prefill count.
    let t = &r.committed[0];
    assert!(
        (t.prefill_tokens() as f64) > 2.0 * t.decode_context(),
        "{} prefilled, context {}",
        t.prefill_tokens(),
        t.decode_context()
    );
}

#[test]
fn a_frozen_shard_is_detected_and_restarted() {
    let spec = SpecBuilder::new()
        .pool("h800", "H800", 2, ", hang_probability = 0.002")
        .multi_turn("lake", "")
        .rollout("batch_size = 4")
        .rollout("steps = 4")
        .rollout("frozen_after_s = 30")
        .build();
    let r = run_recorded(spec);
    let m = r.summary.steps.last().expect("steps");
    assert!(m.shard_restarts > 0, "no frozen shard was restarted");
    assert_eq!(
        r.summary.steps_done, 4,
        "the job completes despite frozen shards"
    );
}

#[test]
fn a_seed_fixes_the_whole_run() {
    let spec = || {
        two_pools()
            .multi_turn("lake", "redundancy = 1")
            .single_turn("math", "")
            .rollout("batch_size = 4")
            .rollout("steps = 4")
            .seed(42)
            .build()
    };
    let a = run_recorded(spec());
    let b = run_recorded(spec());
    assert_eq!(a.summary, b.summary);
    assert_eq!(a.committed, b.committed);
    let ids: BTreeSet<_> = a.committed.iter().map(|t| t.id.clone()).collect();
    assert_eq!(ids.len(), a.committed.len(), "trajectory ids are unique");
    let c = run_recorded(
        two_pools()
            .multi_turn("lake", "redundancy = 1")
            .single_turn("math", "")
            .rollout("batch_size = 4")
            .rollout("steps = 4")
            .seed(43)
            .build(),
    );
    assert_ne!(a.committed, c.committed, "another seed gives another run");
}

#[test]
fn trajectory_level_beats_the_turn_barrier_under_latency_variance() {
    let body = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/sim-sigma.toml"
    ))
    .expect("example");
    let spec = job::spec::parse(&body, job::spec::Format::Toml).expect("valid example");
    let with_barrier = |b: job::spec::Barrier| {
        let mut s = spec.clone();
        s.rollout.barrier = Some(b);
        s.rollout.alpha = Some(0);
        s.rollout.overlap_training = Some(false);
        s
    };
    let fast =
        job::simrun::run_virtual(with_barrier(job::spec::Barrier::None)).expect("trajectory-level");
    let slow =
        job::simrun::run_virtual(with_barrier(job::spec::Barrier::Turn)).expect("turn barrier");
    let ratio = slow.elapsed_s / fast.elapsed_s;
    assert!(
        ratio > 1.3,
        "trajectory-level should be well ahead of the turn barrier at sigma = 5 s, got {ratio:.2}"
    );
}

fn disaggregated(kv_gbps: f64) -> SpecBuilder {
    SpecBuilder::new()
        .pool("prefill", "H800", 2, "")
        .pool(
            "decode",
            "H20",
            2,
            &format!(", prefill_pool = \"prefill\", kv_transfer_gbps = {kv_gbps}"),
        )
        .raw_task(
            r#"[[tasks]]
domain = "agent"
group_size = 4
max_turns = 4
max_tokens_per_turn = 64
[tasks.env]
kind = "sim"
turns = { constant = 4 }
prompt_tokens = { constant = 4000 }
observation_tokens = { constant = 1000 }
response_tokens = { constant = 32 }
"#,
        )
        .rollout("batch_size = 4")
        .rollout("steps = 3")
        .extra("[mapping]\nmode = \"cost_model\"")
}

#[test]
fn disaggregated_pools_prefill_on_one_decode_on_the_other_and_pay_the_kv_transfer() {
    let fast = run_recorded(disaggregated(100.0).build());
    let slow = run_recorded(disaggregated(0.05).build());
    assert!(!fast.committed.is_empty());
    assert!(
        fast.committed.iter().all(|t| t.pool == "decode"),
        "groups go to the decoding pool only"
    );
    let m = fast.summary.steps.last().expect("steps");
    let (p, d) = (&m.pools["prefill"], &m.pools["decode"]);
    assert!(
        p.prefill_tokens > 0 && p.decode_tokens == 0,
        "the prefill pool only prefills: {p:?}"
    );
    assert!(
        d.decode_tokens > 0 && d.prefill_tokens * 10 < p.prefill_tokens,
        "the decode pool only decodes (and recomputes after updates): {d:?}"
    );
    // Every turn's prefill is counted once, on the prefill side.
    let turns_prefill: u64 = fast
        .committed
        .iter()
        .map(|t| t.prefill_tokens() as u64)
        .sum();
    assert!(turns_prefill > 0 && turns_prefill <= p.prefill_tokens);
    // A slow KV link costs time: 4,000 tokens × 144 KiB at 50 MB/s is seconds per turn.
    assert!(
        slow.summary.elapsed_s > fast.summary.elapsed_s * 1.5,
        "{} vs {}",
        slow.summary.elapsed_s,
        fast.summary.elapsed_s
    );
    // Declaring a task on the prefill-only pool is rejected with its field.
    let bad = disaggregated(10.0)
        .extra("[mapping]\nmode = \"declared\"\ndeclared = { agent = \"prefill\" }")
        .toml();
    let bad = bad.replacen("[mapping]\nmode = \"cost_model\"\n", "", 1);
    let errs = job::spec::parse(&bad, job::spec::Format::Toml).expect_err("invalid");
    assert!(
        errs.0
            .iter()
            .any(|e| e.field == "mapping.declared.agent" && e.message.contains("only prefills")),
        "{errs:?}"
    );
}

/// The prefill tokens of every turn after the first, per trajectory, with each turn's full
/// context length (prompt 4,000; each turn adds a 32-token answer and a 1,000-token
/// observation).
fn later_turn_prefills(r: &tests::Recorded) -> Vec<(u32, u32)> {
    r.committed
        .iter()
        .flat_map(|t| {
            t.turns
                .iter()
                .enumerate()
                .skip(1)
                .map(|(k, turn)| (turn.prefill_tokens, 4_000 + 1_032 * k as u32))
        })
        .collect()
}

/// `kv_return`: before each later turn the decode side hands the session's KV (the last context
/// and its answer) back to the prefill side, so the turn prefills its 1,000-token observation
/// only, not the previous answer's 32 tokens too (1-token blocks make it exact); a turn after a
/// weight update prefills its whole context (the update made every cached KV stale).
#[test]
fn kv_return_leaves_the_prefill_side_only_the_new_observation_to_prefill() {
    let with = |kv_return: bool, gbps: f64| {
        let mut b = disaggregated(gbps);
        for p in &mut b.pools {
            *p = p.replace("qwen3-8b\"", "qwen3-8b\", block_tokens = 1");
        }
        if kv_return {
            b.pools[1] = b.pools[1].replace(" }\n", ", kv_return = true }\n");
        }
        run_recorded(b.build())
    };
    let (off, on) = (with(false, 100.0), with(true, 100.0));
    for (r, incremental) in [(&off, 1_032), (&on, 1_000)] {
        let turns = later_turn_prefills(r);
        let hits = turns.iter().filter(|(p, _)| *p == incremental).count();
        assert!(
            turns.iter().all(|&(p, full)| p == incremental || p == full),
            "each later turn prefills {incremental} tokens, or its whole context after an update: {turns:?}"
        );
        assert!(hits * 2 > turns.len(), "{hits} of {}", turns.len());
        let m = r.summary.steps.last().expect("steps");
        let (p, d) = (&m.pools["prefill"], &m.pools["decode"]);
        assert!(p.prefix_hit_rate > 0.5, "{p:?}");
        assert_eq!(
            d.prefix_lookup_tokens, 0,
            "decode requests arrive prefilled"
        );
        // The summary's step series carries each step's own hit rate.
        let steps: Vec<_> = r.batches.iter().map(|(m, _)| m.clone()).collect();
        let series = lab::report::summarise("j", "succeeded", &steps)
            .rollout
            .series;
        assert_eq!(series.prefix_hit_rate.len(), steps.len());
        assert!(
            series
                .prefix_hit_rate
                .iter()
                .all(|h| (0.0..=1.0).contains(h))
                && series.prefix_hit_rate.iter().any(|h| *h > 0.5),
            "{:?}",
            series.prefix_hit_rate
        );
    }
    // Without a prefill pool there is nothing to return to: the field is named.
    let bad = SpecBuilder::new()
        .pool("p", "H800", 1, ", kv_return = true")
        .multi_turn("a", "")
        .toml();
    let errs = job::spec::parse(&bad, job::spec::Format::Toml).expect_err("invalid");
    assert!(
        errs.0
            .iter()
            .any(|e| e.field == "pools[0].backend.kv_return"),
        "{errs:?}"
    );
}

#[test]
fn a_job_whose_groups_are_all_filtered_fails_instead_of_spinning() {
    let task = r#"[[tasks]]
domain = "never"
group_size = 2
max_turns = 1
[tasks.env]
kind = "sim"
turns = { constant = 1 }
success_rate = 0.0
"#;
    let spec = SpecBuilder::new()
        .pool("h20", "H20", 1, "")
        .raw_task(task)
        .rollout("batch_size = 2")
        .rollout("steps = 2")
        .rollout("filter_all_equal = true")
        .build();
    match job::simrun::run_virtual(spec) {
        Err(e) => assert!(
            matches!(
                e,
                job::runtime::JobError::Escalated(_) | job::runtime::JobError::Call { .. }
            ),
            "{e}"
        ),
        Ok(s) => panic!("the job cannot succeed: {s:?}"),
    }
}

#[test]
fn injected_environment_latency_delays_every_call_in_virtual_time() {
    let spec = SpecBuilder::new()
        .pool("h800", "H800", 1, "")
        .raw_task("[[tasks]]\ndomain = \"lake\"\ngroup_size = 2\nmax_turns = 3\nmax_tokens_per_turn = 4\nenv = { kind = \"frozenlake\", size = 4 }\ninject_latency = { reset_s = { constant = 2.0 }, step_s = { constant = 1.0 } }\n")
        .rollout("batch_size = 2")
        .rollout("steps = 2")
        .build();
    let r = tests::run_recorded(spec);
    assert!(!r.committed.is_empty());
    for t in &r.committed {
        // Virtual time: the injected seconds are exact (the games themselves take none).
        assert!(
            (t.timings.reset_s - 2.0).abs() < 1e-6,
            "reset {}",
            t.timings.reset_s
        );
        assert!(
            (t.timings.env_step_s - t.turns.len() as f64).abs() < 1e-6,
            "{} s for {} steps",
            t.timings.env_step_s,
            t.turns.len()
        );
    }
}

/// Hardening: a run resumed after a crash continues admission from the cursor stored with its
/// last completed step. No prompt trained before the crash is generated or trained again (a
/// resumed run used to restart its seeds and group numbering at 0), and group ids stay above
/// every id of the interrupted attempt.
#[test]
fn a_resumed_run_continues_the_seed_sequence_and_group_numbering() {
    use actors::buffer::MemorySink;
    use std::sync::Arc;
    use tests::BatchLog;
    let spec = |steps: u64| {
        SpecBuilder::new()
            .pool("h800", "H800", 1, "")
            .multi_turn("seeded", "seeds = { start = 0, count = 1000000 }")
            .single_turn("drawn", "")
            .rollout("batch_size = 2")
            .rollout(&format!("steps = {steps}"))
            .rollout("alpha = 1")
            .build()
    };
    let trained = |log: &BatchLog| -> BTreeSet<(String, u64)> {
        log.batches
            .lock()
            .unwrap()
            .iter()
            .flat_map(|(_, b)| {
                b.trajectories()
                    .map(|t| (t.task.clone(), t.seed))
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    // The first attempt: 3 steps, then it "crashes" (the run ends).
    let sink1 = Arc::new(MemorySink::default());
    let log1 = Arc::new(BatchLog::default());
    let first = job::simrun::run_blocking(spec(3), 0, 0, sink1.clone(), log1.clone(), None)
        .expect("first attempt");
    let mut cursor = first.steps.last().unwrap().scheduler.cursor.clone();
    assert!(cursor.next_group > 0 && cursor.rng_draws > 0, "{cursor:?}");
    let max_gid = sink1
        .log
        .lock()
        .unwrap()
        .iter()
        .map(|t| t.group_id)
        .max()
        .unwrap();
    cursor.next_group = cursor.next_group.max(max_gid + 1);
    // The resumed attempt: steps 3..6 in epoch 1 from the cursor.
    let sink2 = Arc::new(MemorySink::default());
    let log2 = Arc::new(BatchLog::default());
    let start = job::simrun::Start {
        step: 3,
        epoch: 1,
        cursor: Some(cursor),
    };
    let second = job::simrun::run_from(spec(6), start, sink2.clone(), log2.clone(), None)
        .expect("resumed attempt");
    assert_eq!(second.steps_done, 6);
    let (before, after) = (trained(&log1), trained(&log2));
    assert!(!after.is_empty());
    let again: Vec<_> = before.intersection(&after).collect();
    assert!(again.is_empty(), "prompts trained twice: {again:?}");
    // Nothing generated after the resume repeats a prompt trained before it.
    let regenerated: Vec<_> = sink2
        .log
        .lock()
        .unwrap()
        .iter()
        .map(|t| (t.task.clone(), t.seed))
        .filter(|k| before.contains(k))
        .collect();
    assert!(regenerated.is_empty(), "regenerated: {regenerated:?}");
    let min_gid_after = sink2
        .log
        .lock()
        .unwrap()
        .iter()
        .map(|t| t.group_id)
        .min()
        .unwrap();
    assert!(
        min_gid_after > max_gid,
        "group ids collide: {min_gid_after} <= {max_gid}"
    );
}

/// A step longer than an hour of virtual time (a production iteration) used to fail the run on
/// a fixed one-hour control timeout; simulated jobs now allow 30 days by default, and
/// `rollout.step_timeout_s` sets the limit (a step over it fails naming the buffer).
#[test]
fn a_step_longer_than_an_hour_of_virtual_time_completes() {
    let job = |extra: &str| {
        SpecBuilder::new()
            .pool("h800", "H800", 1, "")
            .raw_task(
                "[[tasks]]\ndomain = \"slow\"\ngroup_size = 2\nmax_turns = 1\n[tasks.env]\nkind = \"sim\"\nstep_latency_s = { constant = 5400.0 }\nturns = { constant = 1 }\nobservation_tokens = { constant = 8 }\nresponse_tokens = { constant = 8 }\n",
            )
            .rollout("batch_size = 1")
            .rollout("steps = 2")
            // Environment calls of 1.5 h (a long tool run) within their own timeout.
            .rollout("env_call_timeout_s = 7200")
            .rollout(extra)
            .build()
    };
    let r = run_recorded(job(""));
    assert_eq!(r.summary.steps_done, 2);
    // Each step waited 1.5 h for its batch (the two overlap under α = 1).
    assert!(r.summary.elapsed_s > 5400.0, "{}", r.summary.elapsed_s);
    // The limit is a setting: an hour fails this workload, with the reason.
    let e = job::simrun::run_virtual_with(
        job("step_timeout_s = 3600"),
        std::sync::Arc::new(actors::buffer::MemorySink::default()),
        std::sync::Arc::new(tests::BatchLog::default()),
    )
    .unwrap_err();
    assert!(e.to_string().contains("sample buffer"), "{e}");
}

/// Same seed → the same run, bit for bit, under every barrier mode and every preset. Waves
/// release many episodes at one virtual instant; the order they wake in must not depend on
/// anything but the seed.
#[test]
fn every_barrier_mode_and_preset_is_deterministic_for_a_seed() {
    let base = || {
        two_pools()
            .multi_turn("swe", "envs = 16\ncontext = \"rewrite\"")
            .single_turn("math", "envs = 16")
            .rollout("batch_size = 6")
            .rollout("steps = 3")
            .seed(7)
    };
    let mut specs: Vec<(String, job::spec::JobSpec)> = Vec::new();
    for barrier in ["none", "wave", "turn", "batch"] {
        specs.push((
            format!("barrier {barrier}"),
            base().rollout(&format!("barrier = \"{barrier}\"")).build(),
        ));
    }
    for preset in ["sync", "sync_plus", "one_off", "rollarc", "areal"] {
        specs.push((format!("preset {preset}"), base().preset(preset).build()));
    }
    // A shard that freezes and is restarted: its in-flight requests fail together, and the
    // episodes must wake in the same order every time (they woke in a per-process hash order).
    let frozen = "frozen shard";
    specs.push((
        frozen.into(),
        base()
            .rollout("frozen_after_s = 30")
            .extra("[[sim.faults]]\npool = \"h20\"\nshard = 0\nhang_after_steps = 40")
            .build(),
    ));
    for (name, spec) in specs {
        let a = run_recorded(spec.clone());
        if name == frozen {
            let restarts = a.summary.steps.last().map_or(0, |m| m.shard_restarts);
            assert!(restarts > 0, "the fault froze no shard");
        }
        for _ in 0..2 {
            let b = run_recorded(spec.clone());
            assert_eq!(a.summary, b.summary, "{name}");
            assert_eq!(a.committed, b.committed, "{name}");
            let steps = |r: &tests::Recorded| -> Vec<String> {
                r.batches
                    .iter()
                    .map(|(m, b)| format!("{:?} {:?}", serde_json::to_string(m).unwrap(), b))
                    .collect()
            };
            assert_eq!(steps(&a), steps(&b), "{name}");
        }
    }
}

/// Correlated difficulty: one factor per prompt scales every episode of its group — turns,
/// answer lengths, environment latency — so groups differ and their episodes agree.
#[test]
fn a_prompts_difficulty_scales_every_episode_of_its_group() {
    let spec = SpecBuilder::new()
        .pool("h20", "H20", 2, "")
        .extra(
            r#"[[tasks]]
domain = "swe"
group_size = 4
max_turns = 100
max_tokens_per_turn = 4096
[tasks.env]
kind = "sim"
step_latency_s = { constant = 1.0 }
turns = { constant = 8 }
observation_tokens = { constant = 50 }
response_tokens = { constant = 100 }
difficulty = { lognormal = { mu = 0.0, sigma = 0.6 } }
"#,
        )
        .rollout("batch_size = 6")
        .rollout("steps = 2")
        .rollout("filter_all_equal = false")
        .build();
    let r = run_recorded(spec);
    let mut groups: BTreeMap<u64, Vec<&actors::types::Trajectory>> = BTreeMap::new();
    for t in &r.committed {
        groups.entry(t.group_id).or_default().push(t);
    }
    assert!(groups.len() >= 12);
    let mut turns_per_group = BTreeSet::new();
    for ts in groups.values() {
        let shape = |t: &actors::types::Trajectory| {
            (
                t.turns.len(),
                t.turns
                    .iter()
                    .map(|u| u.response_tokens.len())
                    .collect::<Vec<_>>(),
                (t.timings.env_step_s * 1e6).round() as u64,
            )
        };
        for t in ts {
            assert_eq!(shape(t), shape(ts[0]), "group {}", t.group_id);
        }
        // Turns and answers scale together: 8 turns and 100 tokens at factor 1.
        let (turns, answers, _) = shape(ts[0]);
        let f = answers[0] as f64 / 100.0;
        assert!(
            ((turns as f64) - 8.0 * f).abs() <= 0.5 + 1e-9 || turns == 1,
            "{turns} turns at factor {f}"
        );
        turns_per_group.insert(turns);
    }
    assert!(
        turns_per_group.len() >= 4,
        "prompts differ: {turns_per_group:?}"
    );
}

/// Where a step's time went: each stage per trajectory, the batch's span, the trainer's wait
/// for its batch — per step and in the run's summary.
#[test]
fn rollout_metrics_break_each_step_down_by_stage() {
    let spec = SpecBuilder::new()
        .pool("h20", "H20", 2, "")
        .extra(
            r#"[[tasks]]
domain = "agent"
group_size = 4
max_turns = 10
max_tokens_per_turn = 256
[tasks.env]
kind = "sim"
reset_latency_s = { constant = 2.0 }
step_latency_s = { constant = 0.5 }
turns = { constant = 3 }
observation_tokens = { constant = 50 }
response_tokens = { constant = 100 }
[trainer]
kind = "sim"
seconds_per_token = 0.001
gpus = 1
"#,
        )
        .rollout("batch_size = 4")
        .rollout("steps = 4")
        .rollout("filter_all_equal = false")
        .build();
    let r = run_recorded(spec);
    for (m, b) in &r.batches {
        let s = m.rollout.stages;
        assert!((s.reset_s - 2.0).abs() < 1e-9, "{s:?}");
        assert!((s.env_step_s - 1.5).abs() < 1e-9, "{s:?}");
        assert!(s.generate_s > 0.0 && s.reward_s >= 0.0 && s.wait_s >= 0.0);
        // The batch's span covers its slowest trajectory.
        let longest = b
            .trajectories()
            .map(|t| t.timings.ended_at_s - t.timings.started_at_s)
            .fold(0.0, f64::max);
        assert!(m.rollout.rollout_s >= longest - 1e-9 && longest >= 3.5);
        assert!(m.wait_batch_s <= m.step_s + 1e-9);
    }
    let steps: Vec<_> = r.batches.iter().map(|(m, _)| m.clone()).collect();
    let sum = lab::report::summarise("j", "succeeded", &steps);
    let ro = &sum.rollout;
    assert!((ro.stages.reset_s - 2.0).abs() < 1e-9);
    let waits: Vec<f64> = steps.iter().map(|m| m.wait_batch_s).collect();
    assert_eq!(
        ro.wait_batch_s_max,
        waits.iter().copied().fold(0.0, f64::max)
    );
    let share = waits.iter().sum::<f64>() / steps.iter().map(|m| m.step_s).sum::<f64>();
    assert!((ro.wait_batch_share - share).abs() < 1e-12 && share > 0.0 && share <= 1.0);
    assert!(ro.rollout_s_mean >= 3.5);
}

/// A sim job whose episodes spend `reset_s` resetting and `step_s` per environment step
/// (3 turns), on a fast engine.
fn staged(reset_s: f64, step_s: f64) -> job::spec::JobSpec {
    SpecBuilder::new()
        .pool("h800", "H800", 2, "")
        .extra(&format!(
            "[[tasks]]\ndomain = \"agent\"\ngroup_size = 4\nmax_turns = 10\nmax_tokens_per_turn = 64\n[tasks.env]\nkind = \"sim\"\nreset_latency_s = {{ constant = {reset_s} }}\nstep_latency_s = {{ constant = {step_s} }}\nturns = {{ constant = 3 }}\nobservation_tokens = {{ constant = 20 }}\nresponse_tokens = {{ constant = 20 }}\n"
        ))
        .rollout("batch_size = 2")
        .rollout("steps = 4")
        .rollout("filter_all_equal = false")
        .build()
}

/// The critical path of each step: the trajectory that ended the rollout span, its stages,
/// and the one a constructed workload makes slowest; the summary carries it step by step.
#[test]
fn each_step_names_its_critical_trajectory_and_its_slowest_stage() {
    for (reset_s, step_s, want) in [(30.0, 0.1, "reset"), (0.1, 20.0, "env_step")] {
        let r = run_recorded(staged(reset_s, step_s));
        for (m, b) in &r.batches {
            let c = m.rollout.critical.as_ref().expect("a critical path");
            assert_eq!(c.bottleneck, want, "{c:?}");
            // It is the batch's last trajectory to end, with its own stage times.
            let last = b
                .trajectories()
                .max_by(|x, y| x.timings.ended_at_s.total_cmp(&y.timings.ended_at_s))
                .unwrap();
            assert_eq!(c.trajectory, last.id);
            assert!((c.stages.reset_s - last.timings.reset_s).abs() < 1e-12);
            assert!((c.stages.env_step_s - last.timings.env_step_s).abs() < 1e-12);
            let own: f64 = c.stages.named().iter().map(|(_, s)| s).sum();
            assert!(own <= c.span_s + 1e-9, "{c:?}");
        }
        let steps: Vec<_> = r.batches.iter().map(|(m, _)| m.clone()).collect();
        let sum = lab::report::summarise("j", "succeeded", &steps);
        let ro = &sum.rollout;
        assert_eq!(ro.critical_bottlenecks[want], steps.len() as u64);
        assert_eq!(ro.series.step, [1, 2, 3, 4]);
        assert_eq!(ro.series.critical_bottleneck, vec![want.to_string(); 4]);
        let key = if want == "reset" { "reset" } else { "env_step" };
        assert!(
            ro.series.critical_shares[key]
                .iter()
                .all(|x| *x > 0.5 && *x <= 1.0)
        );
        assert_eq!(ro.series.rollout_s.len(), 4);
        // Scenario checks read the same through their metrics.
        use lab::scenario::Metric;
        let m = |x: Metric| x.of(&r.summary, 0);
        let (reset, env) = (
            m(Metric::CriticalResetShare),
            m(Metric::CriticalEnvStepShare),
        );
        if want == "reset" {
            assert!(reset > 0.5 && env < reset, "{reset} {env}");
            assert!(m(Metric::CriticalResetShareMax) >= reset);
        } else {
            assert!(env > 0.5 && reset < env, "{reset} {env}");
        }
        let mean_span = steps.iter().map(|x| x.rollout.rollout_s).sum::<f64>() / 4.0;
        assert!((m(Metric::RolloutS) - mean_span).abs() < 1e-9);
        let wait = m(Metric::TrainerWaitShare);
        assert!((0.0..=1.0).contains(&wait) && m(Metric::TrainerWaitShareMax) >= wait);
    }
}

/// Over-provisioned waves: `batch_size + k` groups per wave, the first `batch_size` to finish
/// train, the stragglers are cancelled and their work reported as wasted. Under a
/// heavy-tailed environment the synchronous baseline's steps get shorter.
#[test]
fn overprovisioned_waves_train_the_first_groups_and_cancel_the_stragglers() {
    let run = |k: usize| {
        SpecBuilder::new()
            .pool("h20", "H20", 2, "")
            .extra(
                r#"[[tasks]]
domain = "agent"
group_size = 4
max_turns = 10
max_tokens_per_turn = 256
[tasks.env]
kind = "sim"
step_latency_s = { lognormal = { mu = 0.0, sigma = 1.0 } }
turns = { constant = 4 }
observation_tokens = { constant = 50 }
response_tokens = { constant = 100 }
difficulty = { lognormal = { mu = 0.0, sigma = 0.5 } }
"#,
            )
            .preset("sync")
            .rollout("batch_size = 4")
            .rollout("steps = 6")
            .rollout(&format!("overprovision = {k}"))
            .seed(4)
            .build()
    };
    let base = run_recorded(run(0));
    let over = run_recorded(run(3));
    for (m, b) in &over.batches {
        assert_eq!(b.groups.len(), 4, "a batch holds batch_size groups");
        assert_eq!(m.staleness_max, 0, "cancelled groups never train late");
    }
    let last = &over.batches.last().unwrap().0;
    let s = &last.scheduler;
    // Every wave admits batch + 3 (the wave after the last step has started by the time
    // its record is taken).
    assert!(
        s.admitted_groups.is_multiple_of(7) && s.admitted_groups >= 6 * 7,
        "{}",
        s.admitted_groups
    );
    assert_eq!(s.cancelled_groups, 6 * 3, "and cancels the 3 slowest");
    assert!(s.cancelled_tokens > 0 && s.cancelled_env_s > 0.0, "{s:?}");
    assert_eq!(last.rollout.cancelled_groups, s.cancelled_groups);
    assert_eq!(base.batches.last().unwrap().0.scheduler.cancelled_groups, 0);
    // The batch waits for the 4 fastest of 7 groups, not for all of 4.
    let mean = |r: &tests::Recorded| {
        r.batches.iter().map(|(m, _)| m.step_s).sum::<f64>() / r.batches.len() as f64
    };
    assert!(
        mean(&over) < 0.9 * mean(&base),
        "over-provisioned {:.1} s vs {:.1} s",
        mean(&over),
        mean(&base)
    );
    // Over-provisioning needs waves.
    let errs = job::spec::parse(
        &SpecBuilder::new()
            .pool("h20", "H20", 1, "")
            .single_turn("math", "")
            .rollout("barrier = \"none\"")
            .rollout("overprovision = 2")
            .toml(),
        job::spec::Format::Toml,
    )
    .expect_err("needs waves")
    .0;
    assert!(
        errs.iter()
            .any(|e| e.field == "rollout.overprovision" && e.message.contains("barrier")),
        "{errs:?}"
    );
}

/// A sandbox-bound task: 8 trajectories of 3 steps, each step computing 1 s on a core.
fn sandboxed(sandbox: &str, reset_s: f64) -> job::spec::JobSpec {
    SpecBuilder::new()
        .pool("p", "H800", 1, "")
        .raw_task(&format!(
            r#"[[tasks]]
domain = "swe"
group_size = 4
envs = 8
max_turns = 3
max_tokens_per_turn = 64
[tasks.env]
kind = "sim"
turns = {{ constant = 3 }}
reset_latency_s = {{ constant = {reset_s} }}
{sandbox}
"#
        ))
        .preset("sync")
        .rollout("batch_size = 2")
        .rollout("steps = 2")
        .build()
}

/// `env.sandbox`: the task's sandboxes share `cores` (a call computing on one waits for a free
/// one) and start `max_concurrent_starts` at a time; the step's critical path shows it.
#[test]
fn sandbox_cores_and_start_slots_bound_the_rollout() {
    let span = |r: &tests::Recorded| {
        r.summary
            .steps
            .iter()
            .map(|m| m.rollout.rollout_s)
            .fold(f64::INFINITY, f64::min)
    };
    let cpu = "sandbox = { cores = 2, step_cpu_s = { constant = 1.0 } }";
    let two = run_recorded(sandboxed(cpu, 0.0));
    let many = run_recorded(sandboxed(
        "sandbox = { cores = 64, step_cpu_s = { constant = 1.0 } }",
        0.0,
    ));
    // 8 × 3 core-seconds on 2 cores: at least 12 s; on enough cores, 3 s and generation.
    assert!(span(&two) >= 12.0, "{}", span(&two));
    assert!(span(&many) < 6.0, "{}", span(&many));
    for m in &two.summary.steps {
        let c = m.rollout.critical.as_ref().expect("a critical path");
        assert_eq!(c.bottleneck, "env_step", "{c:?}");
    }
    // Resets of 2 s, two at a time: the eighth starts after 6 s.
    let starts = run_recorded(sandboxed("sandbox = { max_concurrent_starts = 2 }", 2.0));
    let free = run_recorded(sandboxed("", 2.0));
    assert!(span(&starts) >= 8.0, "{}", span(&starts));
    assert!(span(&free) < 5.0, "{}", span(&free));
    // Eight sandboxes started ahead: the first eight resets take one each at no cost, and
    // their replacements start in the background (two at a time).
    let warm = run_recorded(sandboxed(
        "sandbox = { max_concurrent_starts = 2, warm = 8 }",
        2.0,
    ));
    let first = |r: &tests::Recorded| {
        let mut t: Vec<_> = r.committed.iter().collect();
        t.sort_by(|a, b| a.timings.started_at_s.total_cmp(&b.timings.started_at_s));
        t.iter()
            .take(8)
            .map(|t| t.timings.reset_s)
            .collect::<Vec<_>>()
    };
    assert!(first(&warm).iter().all(|r| *r == 0.0), "{:?}", first(&warm));
    assert!(
        first(&starts).iter().all(|r| *r >= 2.0),
        "{:?}",
        first(&starts)
    );
    assert!(
        span(&warm) < span(&starts),
        "{} vs {}",
        span(&warm),
        span(&starts)
    );
    // A machine without cores is refused, naming the field.
    let bad = SpecBuilder::new()
        .pool("p", "H800", 1, "")
        .raw_task(
            "[[tasks]]\ndomain = \"a\"\n[tasks.env]\nkind = \"sim\"\nsandbox = { cores = 0 }\n",
        )
        .toml();
    let errs = job::spec::parse(&bad, job::spec::Format::Toml).expect_err("invalid");
    assert!(
        errs.0
            .iter()
            .any(|e| e.field == "tasks[0].env.sandbox.cores"),
        "{errs:?}"
    );
}
