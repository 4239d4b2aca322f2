use actors::device::{DeviceProfile, Efficiency, ModelProfile, prefill_seconds};

use super::*;

fn pool(device: &str, shards: usize) -> PoolCost {
    PoolCost {
        device: DeviceProfile::builtin(device).unwrap(),
        model: ModelProfile::builtin("qwen3-8b").unwrap(),
        max_batch: 256,
        shards,
        prefill_from: None,
        prefill_only: false,
    }
}

fn task(prefill: f64, decode: f64) -> TaskLoad {
    TaskLoad {
        weight: 1.0,
        group: 8,
        tokens: Tokens::new(prefill, decode),
        tail: Tokens::new(2.0 * prefill, 2.0 * decode),
    }
}

#[test]
fn a_larger_decode_batch_makes_a_trajectory_cheaper_per_shard_but_slower() {
    let m = CostModel {
        pools: vec![pool("H20", 1)],
    };
    let t = Tokens::new(1_000.0, 2_000.0);
    let (c1, c64) = (m.trajectory_cost(0, t, 1.0), m.trajectory_cost(0, t, 64.0));
    let (l1, l64) = (
        m.trajectory_latency(0, t, 1.0),
        m.trajectory_latency(0, t, 64.0),
    );
    assert!(c64 < c1 / 4.0, "shard-seconds {c64} vs {c1}");
    assert!(l64 > l1, "latency {l64} vs {l1}");
}

#[test]
fn disaggregated_prefill_costs_the_prefill_pool_plus_the_kv_transfer() {
    let mut d = pool("H20", 2);
    d.prefill_from = Some(PrefillLink {
        pool: 1,
        bandwidth: 1e9,
        kv_bytes_per_token: 1e5,
        kv_return: false,
    });
    let mut p = pool("H800", 1);
    p.prefill_only = true;
    let m = CostModel {
        pools: vec![d, p.clone()],
    };
    let tokens = 10_000.0;
    let on_p = prefill_seconds(&p.device, &p.model, Efficiency::default(), tokens);
    let want = on_p + tokens * 1e5 / 1e9;
    assert!((m.prefill_s(0, tokens) - want).abs() < 1e-9 * want);
}

/// Rows of a split: (share of each task on each pool).
fn split(m: &CostModel, tasks: &[TaskLoad]) -> Vec<Vec<f64>> {
    let batches = vec![1.0; m.pools.len()];
    let x = m.plan_split(tasks, 16, 1, &batches).expect("a split");
    for row in &x {
        assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-9, "{row:?}");
    }
    x
}

#[test]
fn the_split_sends_prefill_heavy_work_to_compute_and_decode_heavy_work_to_bandwidth() {
    // Pool 0: compute-rich H800; pool 1: bandwidth-rich H20 (the paper's pairing).
    let m = CostModel {
        pools: vec![pool("H800", 4), pool("H20", 4)],
    };
    let multi_turn = task(60_000.0, 600.0);
    let reasoning = task(300.0, 6_000.0);
    let x = split(&m, &[multi_turn, reasoning]);
    assert!(x[0][0] > x[0][1], "prefill-heavy task {:?}", x[0]);
    assert!(x[1][1] > x[1][0], "decode-heavy task {:?}", x[1]);
}

#[test]
fn table_of_splits() {
    // (pools, tasks, what must hold of the split)
    type Check = fn(&[Vec<f64>]) -> bool;
    let cases: Vec<(&str, CostModel, Vec<TaskLoad>, Check)> = vec![
        (
            "one pool takes everything",
            CostModel {
                pools: vec![pool("H20", 2)],
            },
            vec![task(1_000.0, 1_000.0), task(5_000.0, 100.0)],
            |x| x.iter().all(|r| r[0] == 1.0),
        ),
        (
            "a prefill-only pool takes nothing",
            CostModel {
                pools: vec![pool("H20", 2), {
                    let mut p = pool("H800", 8);
                    p.prefill_only = true;
                    p
                }],
            },
            vec![task(50_000.0, 100.0)],
            |x| x[0][1] == 0.0,
        ),
        (
            "equal pools share one task's load",
            CostModel {
                pools: vec![pool("H20", 2), pool("H20", 2)],
            },
            vec![task(2_000.0, 2_000.0)],
            |x| (x[0][0] - 0.5).abs() < 0.05 || x[0][0] == 1.0 || x[0][1] == 1.0,
        ),
    ];
    for (name, m, tasks, check) in cases {
        let x = split(&m, &tasks);
        assert!(check(&x), "{name}: {x:?}");
    }
}

#[test]
fn too_many_assignments_leave_the_split_to_earliest_finish() {
    let m = CostModel {
        pools: vec![pool("H20", 1), pool("H800", 1)],
    };
    // 2^13 = 8,192 assignments > MAX_ASSIGNMENTS.
    let tasks = vec![task(100.0, 100.0); 13];
    assert!(m.plan_split(&tasks, 8, 1, &[1.0, 1.0]).is_none());
    let tasks = vec![task(100.0, 100.0); 12];
    assert!(m.plan_split(&tasks, 8, 1, &[1.0, 1.0]).is_some());
}

#[test]
fn earliest_finish_prefers_the_faster_pool_until_its_backlog_grows() {
    let m = CostModel {
        pools: vec![pool("H800", 1), pool("H20", 1)],
    };
    let tasks = [task(40_000.0, 200.0)];
    let batches = [1.0, 1.0];
    let idle = vec![vec![0], vec![0]];
    assert_eq!(m.earliest_finish(0, &tasks, &idle, &batches), 0);
    let busy_fast = vec![vec![10_000], vec![0]];
    assert_eq!(m.earliest_finish(0, &tasks, &busy_fast, &batches), 1);
}

/// A `rewrite` trajectory re-prefills its history every turn: its prefill count grows with
/// the square of its turns, its context does not. Two trajectories with the same context and
/// answers differ only by their prefill seconds, on every pool and batch; sizing decode by
/// the prefill count (the old `(prefill + decode) / 2`) made the SWE-like one's decode steps
/// several times too long.
#[test]
fn a_rewrite_context_costs_its_reprefills_but_decodes_at_its_length() {
    let m = CostModel {
        pools: vec![pool("H800", 1), pool("H20", 1)],
    };
    // hardware.toml's SWE task: ≈ 8.5 turns, 3,000-token prompt, ≈ 1,243-token tool
    // outputs, 160-token answers.
    let append = Tokens::new(3_000.0 + 7.5 * 1_243.0, 1_360.0);
    let rewrite = Tokens {
        prefill: 70_222.0,
        ..append
    };
    for p in 0..2 {
        for batch in [1.0, 32.0, 128.0] {
            let extra = m.prefill_s(p, rewrite.prefill) - m.prefill_s(p, append.prefill);
            for f in [CostModel::trajectory_latency, CostModel::trajectory_cost] {
                let (r, a) = (f(&m, p, rewrite, batch), f(&m, p, append, batch));
                assert!(
                    ((r - a) - extra).abs() < 1e-9 * r,
                    "pool {p} batch {batch}: {r} - {a} vs {extra}"
                );
            }
        }
    }
    // Read as a context, the re-prefill count makes decoding far slower than it is.
    let inflated = Tokens::new(rewrite.prefill, rewrite.decode);
    let decode = |t: Tokens| m.trajectory_latency(1, t, 64.0) - m.prefill_s(1, t.prefill);
    assert!(
        decode(inflated) > 2.0 * decode(rewrite),
        "{} vs {}",
        decode(inflated),
        decode(rewrite)
    );
}

fn load(tokens: Tokens, tail: Tokens) -> TaskLoad {
    TaskLoad {
        weight: 1.0,
        group: 8,
        tokens,
        tail,
    }
}

fn tokens(prefill: f64, decode: f64, context: f64) -> Tokens {
    Tokens {
        prefill,
        decode,
        context,
    }
}

/// e2e.toml at 32B (32 shards of 2 × H800, 16 of 2 × H20) with the token counts its tasks
/// showed: SWE re-prefills ≈ 150K tokens per trajectory, which keeps the H800 shards
/// prefilling most of every step. The multi-turn game decodes a few tokens per turn; put
/// beside the SWE work its decode steps wait behind prefill chunks. Simulated, moving it
/// there makes steps 1.30× longer (170 s against 131 s). Without the interference term the
/// model saw only the H800s' spare decode capacity and moved it.
#[test]
fn decode_on_a_pool_busy_prefilling_is_stretched_and_the_split_avoids_it() {
    let shard = |d: &str| {
        let mut p = pool(d, 1);
        p.device = p.device.group(2, 0.9);
        p.model = ModelProfile::builtin("qwen3-32b").unwrap();
        p
    };
    let m = CostModel {
        pools: vec![
            PoolCost {
                shards: 32,
                ..shard("H800")
            },
            PoolCost {
                shards: 16,
                ..shard("H20")
            },
        ],
    };
    let tasks = [
        load(
            tokens(152_214.0, 2_184.0, 11_712.0),
            tokens(165_061.0, 2_254.0, 12_932.0),
        ),
        load(
            tokens(2_515.0, 1_796.0, 2_364.0),
            tokens(2_560.0, 1_907.0, 2_457.0),
        ),
        load(
            tokens(423.0, 4_769.0, 2_807.0),
            tokens(579.0, 4_564.0, 2_785.0),
        ),
    ];
    let on_h20 = [vec![1.0, 0.0], vec![0.0, 1.0], vec![0.0, 1.0]];
    let game_on_h800 = [vec![1.0, 0.0], vec![1.0, 0.0], vec![0.0, 1.0]];
    let (a, b) = (
        m.estimate_step_s(&tasks, 64, 1, &on_h20),
        m.estimate_step_s(&tasks, 64, 1, &game_on_h800),
    );
    assert!(b > 1.1 * a, "game beside the SWE prefills {b} s vs {a} s");
    let x = m.plan_split(&tasks, 64, 1, &[1.0, 1.0]).expect("a split");
    assert!(x[0][0] > 0.99, "SWE on the H800s: {x:?}");
    assert!(
        x[1][1] > 0.5,
        "the game mostly off the prefilling H800s: {x:?}"
    );
}
