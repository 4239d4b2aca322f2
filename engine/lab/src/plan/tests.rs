use super::*;

#[test]
fn the_planner_finds_a_balanced_split_within_budget() {
    let body = r#"
[scenario]
name = "p"
title = "t"
figure = "f"
[base]
seed = 2
[[base.tasks]]
domain = "agent"
group_size = 4
max_turns = 4
max_tokens_per_turn = 512
env = { kind = "sim", turns = { constant = 3 }, prompt_tokens = { constant = 2000 }, observation_tokens = { constant = 500 }, response_tokens = { constant = 300 }, step_latency_s = { constant = 1.0 } }
[[base.pools]]
name = "h800"
device = "H800"
count = 8
backend = { kind = "sim", model = "qwen3-8b" }
[base.rollout]
batch_size = 16
steps = 6
[base.trainer]
kind = "sim"
device = "H800"
gpus = 8
[plan]
devices = ["H800", "H20"]
steps = 5
trainer_fractions = [0.1, 0.3, 0.6]
"#;
    let sc = Scenario::parse("p.toml", body).unwrap();
    let p = plan(&sc, Some(120.0), |_| {}).unwrap();
    assert!(p.candidates.len() >= 9, "{}", p.candidates.len());
    assert!(
        p.candidates.iter().all(|c| c.cost <= 120.0 + 1e-9),
        "every candidate fits the budget"
    );
    // Cheapest per step first, and the recommendation is the first; with GPUs only, the
    // price an hour is the GPUs' cost.
    assert!(
        p.candidates
            .windows(2)
            .all(|w| w[0].cost_per_step <= w[1].cost_per_step)
    );
    assert_eq!(p.best.cost_per_step, p.candidates[0].cost_per_step);
    for c in &p.candidates {
        assert!(
            (c.hourly - c.cost).abs() < 1e-9,
            "{} vs {}",
            c.hourly,
            c.cost
        );
        assert!((c.cost_per_step - c.hourly * c.step_s / 3600.0).abs() < 1e-12);
    }
    // The extremes lose: almost everything in training starves generation.
    let starved = p
        .candidates
        .iter()
        .filter(|c| c.trainer_gpus >= 24)
        .map(|c| c.step_s)
        .fold(f64::INFINITY, f64::min);
    assert!(
        p.best.step_s < starved,
        "best {} vs trainer-heavy {starved}",
        p.best.step_s
    );
    assert!(
        p.candidates
            .iter()
            .filter(|c| c.trainer_gpus >= 24)
            .all(|c| c.bottleneck != "trainer"),
        "a trainer-heavy split waits for generation"
    );
    assert!(render(&p).contains("recommended: trainer"));
}

/// An agentic scenario whose sandboxes share 4 cores (each step computes 2 s on one):
/// the environments bound the step. Without a GPU budget the planner keeps the GPUs, tries
/// the cores the table lists, and recommends more of them at a core's default price; at a
/// price that makes cores dearer than the GPUs' waiting, it keeps few.
fn sandboxed(cores: &str, core_price: Option<f64>) -> Scenario {
    let body = format!(
        r#"
[scenario]
name = "sandboxes"
title = "t"
figure = "f"
[base]
seed = 3
[[base.tasks]]
domain = "swe"
group_size = 4
envs = 32
max_turns = 8
max_tokens_per_turn = 256
env = {{ kind = "sim", turns = {{ constant = 6 }}, prompt_tokens = {{ constant = 2000 }}, observation_tokens = {{ constant = 300 }}, response_tokens = {{ constant = 128 }}, step_latency_s = {{ constant = 0.5 }}, sandbox = {{ cores = 4, step_cpu_s = {{ constant = 2.0 }} }} }}
[[base.pools]]
name = "h800"
device = "H800"
count = 4
backend = {{ kind = "sim", model = "qwen3-8b" }}
[base.rollout]
batch_size = 8
steps = 40
[base.trainer]
kind = "sim"
device = "H800"
gpus = 4
[plan]
steps = 5
env_cores = {cores}
{}
"#,
        core_price.map_or(String::new(), |p| format!("prices = {{ core = {p} }}"))
    );
    Scenario::parse("sandboxes.toml", &body).unwrap()
}

#[test]
fn the_planner_sizes_sandbox_cores_where_environments_bound_the_step() {
    let p = plan(&sandboxed("[4, 16, 64]", None), None, |_| {}).unwrap();
    let at = |cores: u32| {
        p.candidates
            .iter()
            .find(|c| c.resources.env_cores.get("swe") == Some(&cores))
            .or_else(|| {
                p.candidates
                    .iter()
                    .find(|c| cores == 4 && c.resources.env_cores.is_empty())
            })
            .unwrap_or_else(|| panic!("no candidate with {cores} cores"))
    };
    let (few, many) = (at(4), at(64));
    assert_eq!(few.bottleneck, "environments", "{few:?}");
    assert!(
        many.step_s < few.step_s / 2.0,
        "{} vs {}",
        many.step_s,
        few.step_s
    );
    // The GPUs stay as in the spec; cores are priced at the default.
    assert!(p.candidates.iter().all(|c| c.trainer_gpus == 4));
    assert!(
        (many.hourly - few.hourly - 60.0 * DEFAULT_CORE_PRICE).abs() < 1e-9,
        "{} vs {}",
        many.hourly,
        few.hourly
    );
    assert!(p.best.resources.env_cores["swe"] >= 16, "{:?}", p.best);
    let spec = recommended_spec(&sandboxed("[4, 16, 64]", None), &p);
    assert_eq!(
        spec.pointer("/tasks/0/env/sandbox/cores"),
        Some(&Value::from(p.best.resources.env_cores["swe"]))
    );
    assert_eq!(spec.pointer("/rollout/steps"), Some(&Value::from(40)));
    assert!(render(&p).contains("cores swe"));
    // Cores dearer than the waiting they save (16 times the price for less than 16 times
    // the speed): few of them.
    let dear = plan(&sandboxed("[4, 64]", Some(1000.0)), None, |_| {}).unwrap();
    assert_eq!(
        dear.best
            .resources
            .env_cores
            .get("swe")
            .copied()
            .unwrap_or(4),
        4,
        "{:?}",
        dear.best
    );
}

/// A profile (measured engine costs, a trainer fitted per token on shared cores) rescaled
/// to Qwen3-8B on 8 + 8 H800s: the environments and tasks stay, the engines and the
/// trainer move to the roofline, and the plan runs on the rescaled GPUs.
#[test]
fn a_profile_is_rescaled_to_a_model_and_cluster() {
    let body = r#"
[[tasks]]
domain = "lake"
group_size = 4
max_turns = 4
max_tokens_per_turn = 8
env = { kind = "sim", turns = { constant = 3 }, step_latency_s = { constant = 0.2 } }
[[pools]]
name = "compute"
device = "H800"
count = 1
backend = { kind = "sim", measured = { step_s = 0.002, prefill_s_per_token = 0.00001, decode_s_per_token = 0.00001 } }
[rollout]
batch_size = 4
steps = 30
[trainer]
kind = "sim"
seconds_per_token = 0.0005
host_cores = 2
"#;
    let spec = job::spec::parse(body, job::spec::Format::Toml).unwrap();
    let table = serde_json::json!({
        "steps": 4,
        "rescale": {
            "model": "qwen3-8b",
            "pools": [{ "device": "H800", "count": 8 }],
            "trainer_device": "H800",
            "trainer_gpus": 8,
        },
    });
    let sc = Scenario::of_spec("profiled", spec.clone(), Some(table)).unwrap();
    let p = plan(&sc, None, |_| {}).unwrap();
    let b = &p.best;
    assert_eq!((b.trainer_gpus, b.rollout_gpus.get("H800")), (8, Some(&8)));
    let backend = &b.spec["pools"][0]["backend"];
    assert_eq!(backend["model"], "qwen3-8b");
    assert!(
        backend.get("measured").is_none_or(Value::is_null),
        "{backend}"
    );
    assert_eq!(b.spec["trainer"]["model"], "qwen3-8b");
    assert!(
        b.spec["trainer"]
            .get("host_cores")
            .is_none_or(Value::is_null)
    );
    // The environments are the profile's.
    assert_eq!(b.spec["tasks"][0]["env"], sc.base["tasks"][0]["env"]);
    // The same profile on its own engines predicts another step time.
    let own = plan(
        &Scenario::of_spec("profiled", spec, Some(serde_json::json!({ "steps": 4 }))).unwrap(),
        None,
        |_| {},
    )
    .unwrap();
    assert!((own.best.step_s - b.step_s).abs() > 1e-6);
    // A rescale to an unknown model names it.
    let bad = serde_json::json!({ "rescale": { "model": "nope", "pools": [{ "device": "H800", "count": 1 }], "trainer_device": "H800", "trainer_gpus": 1 } });
    let sc = Scenario::of_spec("profiled", sc.runs[0].spec.clone(), Some(bad)).unwrap();
    let e = plan(&sc, None, |_| {}).unwrap_err();
    assert!(
        matches!(&e, PlanError::Rescale(m) if m.contains("nope")),
        "{e}"
    );
}

#[test]
fn a_bad_plan_table_is_a_typed_error_naming_the_field() {
    let scenario = |plan: &str| {
        let body = format!(
            r#"
[scenario]
name = "p"
title = "t"
figure = "f"
[base]
seed = 2
[[base.tasks]]
domain = "agent"
group_size = 2
max_turns = 2
max_tokens_per_turn = 16
env = {{ kind = "sim", turns = {{ constant = 1 }} }}
[[base.pools]]
name = "h800"
device = "H800"
backend = {{ kind = "sim", model = "qwen3-8b" }}
[base.rollout]
batch_size = 2
steps = 3
[plan]
{plan}
"#
        );
        Scenario::parse("p.toml", &body).unwrap()
    };
    let e = plan(&scenario("devices = [\"H999\"]"), Some(100.0), |_| {}).unwrap_err();
    assert!(
        matches!(&e, PlanError::UnknownDevice(d) if d == "H999"),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "[plan].devices: unknown device class \"H999\""
    );
    let e = plan(
        &scenario("trainer_fractions = [0.5, 1.5]"),
        Some(100.0),
        |_| {},
    )
    .unwrap_err();
    assert!(matches!(e, PlanError::Fractions), "{e:?}");
    let e = plan(&scenario("gpus = 3"), Some(100.0), |_| {}).unwrap_err();
    assert!(matches!(e, PlanError::Table(_)), "{e:?}");
}
