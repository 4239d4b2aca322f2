use std::collections::BTreeMap;

use super::*;

/// An error with its causes, as `rollarc` prints it.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

const BASE: &str = r#"
[scenario]
name = "t"
title = "test"
figure = "Fig. 0"

[base]
seed = 3
[[base.tasks]]
domain = "agent"
group_size = 2
max_turns = 3
max_tokens_per_turn = 32
env = { kind = "sim", turns = { constant = 2 }, step_latency_s = { normal = { mean = 2.0, std = 1.0 } } }
[[base.pools]]
name = "p"
device = "H800"
backend = { kind = "sim", model = "qwen3-8b" }
[base.rollout]
batch_size = 2
steps = 3
"#;

fn parse(extra: &str) -> Result<Scenario, ScenarioError> {
    Scenario::parse("t.toml", &format!("{BASE}{extra}"))
}

#[test]
fn set_path_walks_tables_and_arrays_and_names_what_is_wrong() {
    let mut v = serde_json::json!({ "tasks": [{ "env": { "kind": "sim" } }] });
    set_path(
        &mut v,
        "tasks[0].env.step_latency_s.normal.std",
        serde_json::json!(3.0),
    )
    .unwrap();
    set_path(&mut v, "rollout.alpha", serde_json::json!(2)).unwrap();
    assert_eq!(v["tasks"][0]["env"]["step_latency_s"]["normal"]["std"], 3.0);
    assert_eq!(v["rollout"]["alpha"], 2);
    let e = set_path(&mut v, "tasks[4].env", serde_json::json!(1)).unwrap_err();
    assert!(
        matches!(
            e,
            SetPathError::OutOfRange {
                index: 4,
                len: 1,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("index 4 out of range"), "{e}");
    let e = set_path(&mut v, "rollout.alpha.x", serde_json::json!(1)).unwrap_err();
    assert!(matches!(e, SetPathError::NotInTable { .. }), "{e:?}");
    assert!(e.to_string().contains("not inside a table"), "{e}");
}

#[test]
fn matrices_expand_runs_and_checks_with_substituted_values() {
    let sc = parse(
        r#"
[[runs]]
name = "{mode}-s{sigma}"
matrix = { sigma = [1, 5], mode = ["turn", "none"] }
set = { "tasks[0].env.step_latency_s.normal.std" = "{sigma}", "rollout.barrier" = "{mode}" }

[[checks]]
name = "σ = {sigma}"
matrix = { sigma = [1, 5] }
ratio = ["turn-s{sigma}", "none-s{sigma}"]
paper = [1.2, 1.7]
tolerance = 0.1

[[checks]]
name = "order"
order = ["none-s1", "turn-s5"]
"#,
    )
    .unwrap();
    let names: Vec<_> = sc.runs.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        names,
        ["turn-s1", "turn-s5", "none-s1", "none-s5"],
        "variables by name, the last fastest"
    );
    // Numbers stay numbers when a string is exactly "{var}".
    match &sc.runs[1].spec.tasks[0].env {
        job::spec::EnvSpec::Sim {
            step_latency_s: Some(actors::dist::Dist::Normal { std, .. }),
            ..
        } => assert_eq!(*std, 5.0),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        sc.runs[0].spec.rollout.barrier,
        Some(job::spec::Barrier::Turn)
    );
    assert_eq!(sc.checks.len(), 3);
    assert_eq!(sc.checks[1].name, "σ = 5");
    let b = sc.checks[1].band.unwrap();
    assert!((b[0] - 1.53).abs() < 1e-9 && (b[1] - 1.87).abs() < 1e-9);
}

#[test]
fn bad_runs_and_checks_are_reported_with_their_names_and_fields() {
    let e = parse("[[runs]]\nname = \"x\"\nset = { \"rollout.batch_size\" = 0 }\n").unwrap_err();
    assert!(
        matches!(
            &e,
            ScenarioError::Run {
                source: RunError::Spec(BuildSpecError::Invalid(_)),
                ..
            }
        ),
        "{e:?}"
    );
    let e = chain(&e);
    assert!(
        e.contains("run \"x\"") && e.contains("rollout.batch_size"),
        "{e}"
    );
    let e = parse(
        "[[runs]]\nname = \"x\"\n[[checks]]\nname = \"c\"\nratio = [\"x\", \"y\"]\nband = [1, 2]\n",
    )
    .unwrap_err();
    assert!(
        matches!(&e, ScenarioError::Check { check, source: CheckError::UnknownRun(r), .. }
            if check == "c" && r == "y"),
        "{e:?}"
    );
    let e = chain(&e);
    assert!(
        e.contains("check \"c\"") && e.contains("no run is named \"y\""),
        "{e}"
    );
    let e = parse("[[runs]]\nname = \"x\"\n[[checks]]\nname = \"c\"\nratio = [\"x\", \"x\"]\n")
        .unwrap_err();
    assert!(
        matches!(
            &e,
            ScenarioError::Check {
                source: CheckError::NoBand,
                ..
            }
        ),
        "{e:?}"
    );
    let e = chain(&e);
    assert!(e.contains("needs band or tolerance"), "{e}");
    let e = parse("[[runs]]\nname = \"x\"\nset = { \"pools[0]\" = { name = \"p\", device = \"CPU\", backend = { kind = \"builtin\" } }, \"trainer\" = { kind = \"builtin\" } }\n").unwrap_err();
    assert!(
        matches!(
            e,
            ScenarioError::Run {
                source: RunError::NotSimulated,
                ..
            }
        ),
        "{e:?}"
    );
    let e = chain(&e);
    assert!(e.contains("simulated"), "{e}");
}

fn result(name: &str, step_s: f64) -> RunResult {
    RunResult {
        name: name.into(),
        preset: None,
        metrics: [("step_s".to_string(), step_s)].into(),
        steps: 1,
        simulated_s: step_s,
        wall_s: 0.0,
        events: 0,
        pools: BTreeMap::new(),
        pool_groups: BTreeMap::new(),
        prefill_tokens: 0,
        decode_tokens: 0,
        stale_aborted: 0,
        stale_evicted: 0,
        rollout: Default::default(),
        jobs: 1,
        functions: BTreeMap::new(),
    }
}

#[test]
fn checks_compare_ratios_with_bands_best_of_and_orders() {
    let runs = [result("a", 20.0), result("b", 10.0), result("c", 8.0)];
    let check = |kind, band| CheckDef {
        name: "c".into(),
        metric: Metric::StepS,
        kind,
        paper: None,
        band,
        note: None,
    };
    let out = evaluate(
        &[
            check(
                CheckKind::Ratio(Side::One("a".into()), Side::One("b".into())),
                Some([1.9, 2.1]),
            ),
            check(
                CheckKind::Ratio(Side::One("a".into()), Side::One("b".into())),
                Some([1.0, 1.5]),
            ),
            check(
                CheckKind::Ratio(
                    Side::BestOf(vec!["a".into(), "b".into()]),
                    Side::One("c".into()),
                ),
                Some([1.2, 1.3]),
            ),
            check(
                CheckKind::Order(vec!["c".into(), "b".into(), "a".into()]),
                None,
            ),
            check(
                CheckKind::Order(vec!["a".into(), "b".into(), "c".into()]),
                None,
            ),
            check(CheckKind::Value("c".into()), Some([7.0, 9.0])),
            check(CheckKind::Value("a".into()), Some([7.0, 9.0])),
        ],
        &runs,
    );
    assert_eq!(
        out.iter().map(|c| c.pass).collect::<Vec<_>>(),
        [true, false, true, true, false, true, false]
    );
    assert_eq!(out[0].ours, Some(2.0));
    assert_eq!(out[2].ours, Some(1.25), "best of a, b is b's 10 s");
    assert_eq!(out[4].order.as_deref().unwrap(), ["c", "b", "a"]);
}

#[test]
fn a_small_scenario_runs_in_virtual_time_and_its_checks_hold() {
    let sc = parse(
        r#"
[[runs]]
name = "{b}"
matrix = { b = ["turn", "none"] }
set = { "rollout.barrier" = "{b}" }

[[checks]]
name = "trajectory-level beats the turn barrier"
ratio = ["turn", "none"]
band = [1.0, 10.0]
"#,
    )
    .unwrap();
    let res = run(&sc, |_| {}).unwrap();
    assert_eq!(res.runs.len(), 2);
    assert!(
        res.runs
            .iter()
            .all(|r| r.steps == 3 && r.events > 0 && r.simulated_s > 0.0)
    );
    assert!(res.checks[0].pass, "{:?}", res.checks[0]);
    // Deterministic: the same scenario gives the same figures.
    let again = run(&sc, |_| {}).unwrap();
    assert_eq!(res.runs[0].metrics, again.runs[0].metrics);
    assert!(table(&[res]).contains("trajectory-level beats"));
}

#[test]
fn jobs_on_one_clock_share_one_gpu_judge_deployment_or_each_deploy_their_own() {
    let judge = r#"set = { "tasks[0].reward" = ["judge"], "reward.placement" = "PLACEMENT", "reward.functions" = { judge = { kind = "sim", cold_start_s = 5.0, gpu = { device = "H800", model = "qwen3-8b", gpus_per_instance = 2, instances = 2, max_batch = 4 }, scaling = { container-concurrency = 4, min-scale = 0, max-scale = 2, initial-scale = 0 } } } }"#;
    let serverless = judge.replace("PLACEMENT", "serverless");
    let local = judge.replace("PLACEMENT", "local");
    let sc = parse(&format!(
        r#"
[[runs]]
name = "own"
jobs = 3
{serverless}

[[runs]]
name = "shared"
jobs = 3
shared_functions = true
{serverless}

[[runs]]
name = "dedicated"
{local}
"#
    ))
    .unwrap();
    let res = run(&sc, |_| {}).unwrap();
    let [own, shared, dedicated] = &res.runs[..] else {
        panic!("three runs")
    };
    assert_eq!((own.jobs, shared.jobs, dedicated.jobs), (3, 3, 1));
    assert_eq!(
        (own.steps, shared.steps),
        (9, 9),
        "three jobs of three steps"
    );
    let (o, s, d) = (
        &own.functions["judge"],
        &shared.functions["judge"],
        &dedicated.functions["judge"],
    );
    // Three deployments of at least one instance each, against one capped at two.
    assert!(o.peak_instances >= 3, "{o:?}");
    assert!(s.peak_instances <= 2, "{s:?}");
    // Every job's trajectories were judged, by the shared deployment too.
    assert!(
        s.calls >= 3 * 3 * 2 * 2 && o.calls >= 3 * 3 * 2 * 2,
        "{s:?} {o:?}"
    );
    for u in [o, s, d] {
        assert_eq!(u.gpus_per_instance, 2);
        assert!(
            u.batches > 0 && u.mean_batch >= 1.0 && u.mean_batch <= 4.0,
            "{u:?}"
        );
        assert!(
            u.busy_instance_s > 0.0 && u.busy_instance_s <= u.instance_s,
            "{u:?}"
        );
    }
    // Dedicated: two instances of two GPUs held from their deployment (after the shards'
    // first weights) to the job's end.
    let held = dedicated.metrics["reward_gpu_s"];
    let whole = 2.0 * 2.0 * dedicated.simulated_s;
    assert!(held <= whole && held > 0.95 * whole, "{held} vs {whole}");
    let util = shared.metrics["reward_gpu_util"];
    assert!(util > 0.0 && util <= 1.0, "{util}");
    // Deterministic with several jobs on one clock.
    let again = run(&sc, |_| {}).unwrap();
    for (a, b) in res.runs.iter().zip(&again.runs) {
        assert_eq!(a.metrics, b.metrics, "{}", a.name);
        assert_eq!(a.functions, b.functions, "{}", a.name);
    }
    let e = parse("[[runs]]\nname = \"x\"\njobs = 0\n").unwrap_err();
    assert!(
        chain(&e).contains("jobs: must be in 1..=64, got 0"),
        "{}",
        chain(&e)
    );
}

/// Every scenario `make bench-sim` runs parses, with its runs' specs and checks (a typo in one
/// would otherwise surface only in the benchmark).
#[test]
fn every_example_scenario_parses() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/sim");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|x| x == "toml") {
            let sc = Scenario::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(
                !sc.runs.is_empty() && !sc.checks.is_empty(),
                "{}",
                path.display()
            );
            n += 1;
        }
    }
    assert!(n >= 9, "{n} scenarios");
}
