use super::*;

fn minimal() -> &'static str {
    r#"
[[tasks]]
domain = "lake"
[tasks.env]
kind = "sim"
[[pools]]
name = "p"
device = "H20"
backend = { kind = "sim" }
"#
}

#[test]
fn a_minimal_spec_takes_the_rollarc_defaults() {
    let s = parse(minimal(), Format::Toml).unwrap();
    let k = s.knobs();
    assert_eq!(k.barrier, Barrier::None);
    assert_eq!(k.alpha, 1);
    assert!(k.overlap_training);
    assert_eq!(k.placement, RewardPlacement::Serverless);
    // No declared mapping: the cost model picks the pool.
    assert_eq!(k.mapping, MappingMode::CostModel);
    assert_eq!(s.tasks[0].group_size, 8);
}

#[test]
fn presets_expand_to_their_knobs_and_explicit_knobs_win() {
    let cases = [
        (
            Preset::Sync,
            Barrier::Batch,
            0,
            false,
            RewardPlacement::Local,
        ),
        (
            Preset::SyncPlus,
            Barrier::None,
            0,
            false,
            RewardPlacement::Serverless,
        ),
        (
            Preset::OneOff,
            Barrier::Wave,
            1,
            true,
            RewardPlacement::Serverless,
        ),
        (
            Preset::Rollarc,
            Barrier::None,
            1,
            true,
            RewardPlacement::Serverless,
        ),
        (
            Preset::Areal,
            Barrier::None,
            1,
            true,
            RewardPlacement::Local,
        ),
    ];
    for (p, barrier, alpha, overlap, placement) in cases {
        let body = format!("preset = \"{}\"\n{}", p.name(), minimal());
        let k = parse(&body, Format::Toml).unwrap().knobs();
        assert_eq!(
            (k.barrier, k.alpha, k.overlap_training, k.placement),
            (barrier, alpha, overlap, placement),
            "{p:?}"
        );
        // An explicit knob overrides the preset.
        let body = format!(
            "preset = \"{}\"\n{}\n[rollout]\nalpha = 3",
            p.name(),
            minimal()
        );
        assert_eq!(parse(&body, Format::Toml).unwrap().knobs().alpha, 3);
    }
}

#[test]
fn json_and_toml_give_the_same_spec() {
    let t = parse(minimal(), Format::Toml).unwrap();
    let j = parse(&serde_json::to_string(&t).unwrap(), Format::Json).unwrap();
    assert_eq!(t, j);
}

#[test]
fn every_problem_is_reported_in_one_pass() {
    // Structure first: every section that does not parse, and nothing derived from them.
    let broken = r#"
surprise = true
[[tasks]]
domain = "x"
max_turns = "many"
[tasks.env]
kind = "sim"
[[pools]]
name = "p"
device = "H20"
backend = { kind = "sim", modle = "gpt-9" }
"#;
    let errs = parse(broken, Format::Toml).unwrap_err().0;
    let fields: Vec<&str> = errs.iter().map(|e| e.field.as_str()).collect();
    assert_eq!(
        fields,
        ["surprise", "tasks[0].max_turns", "pools[0].backend"],
        "{errs:?}"
    );
    // A well-formed spec: every semantic problem at once.
    let body = r#"
[[tasks]]
domain = ""
group_size = 0
weight = -1
reward = ["nope"]
[tasks.env]
kind = "sim"
step_latency_s = { normal = { mean = 1.0, std = -2.0 } }
[[tasks]]
domain = "x"
[tasks.env]
kind = "sim"
[[pools]]
name = "p"
device = "Z80"
count = 0
backend = { kind = "sim", model = "gpt-9" }
[rollout]
batch_size = 0
[mapping]
fallback = "nowhere"
"#;
    let errs = parse(body, Format::Toml).unwrap_err().0;
    let fields: Vec<&str> = errs.iter().map(|e| e.field.as_str()).collect();
    for want in [
        "tasks[0].domain",
        "tasks[0].group_size",
        "tasks[0].weight",
        "tasks[0].reward[0]",
        "tasks[0].env.step_latency_s",
        "pools[0].device",
        "pools[0].count",
        "pools[0].backend.model",
        "rollout.batch_size",
        "mapping.fallback",
    ] {
        assert!(fields.contains(&want), "{want} missing from {fields:?}");
    }
}

/// A misspelt field is one problem, not a cascade ("at least one task is required", "no
/// task has domain …") of problems that follow from the task it broke.
#[test]
fn a_misspelt_field_is_one_problem() {
    let body = minimal().replace("domain = \"lake\"", "domain = \"lake\"\ngroup_szie = 4")
        + "\n[mapping]\ndeclared = { lake = \"p\" }\n";
    let errs = parse(&body, Format::Toml).unwrap_err().0;
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(errs[0].field, "tasks[0].group_szie");
    assert!(errs[0].message.contains("group_szie"), "{errs:?}");
    assert!(
        errs[0]
            .message
            .ends_with("did you mean `group_size`? (line 4, column 1)"),
        "{errs:?}"
    );
}

/// A generated spec with thousands of broken tables gets a bounded answer, and a list past
/// its bound is refused before its entries are read.
#[test]
fn problem_lists_and_spec_lists_are_bounded() {
    let many: String = (0..300).map(|_| "[[pools]]\nq = 1\n").collect();
    let body = format!("{}{many}", minimal().split("[[pools]]").next().unwrap());
    let errs = parse(&body, Format::Toml).unwrap_err().0;
    assert_eq!(errs.len(), 1, "{:?}", &errs[..errs.len().min(3)]);
    assert_eq!(errs[0].field, "pools");
    assert!(errs[0].message.contains("at most 256"), "{errs:?}");
    // 200 broken tables and 200 unknown top-level keys: 100 listed, plus a count.
    let tables: String = (0..200).map(|_| "[[tasks]]\nd = 1\n").collect();
    let keys: String = (0..200).map(|i| format!("k{i} = 1\n")).collect();
    let errs = parse(&format!("{keys}{tables}"), Format::Toml)
        .unwrap_err()
        .0;
    assert_eq!(errs.len(), MAX_PROBLEMS + 1);
    assert!(
        errs[MAX_PROBLEMS].message.contains("301 more"),
        "{:?}",
        errs.last()
    );
}

#[test]
fn reward_function_problems_name_their_fields() {
    let body = format!(
        "{}\n{}",
        minimal(),
        r#"
[reward.functions.a]
kind = "builtin"
function = "nope"
hedge_percentile = 2.0
[reward.functions.a.scaling]
min-scale = 5
max-scale = 2
[reward.functions.b]
kind = "http"
url = "ftp://x"
range = [1.0, 0.0]
[reward.functions.c]
kind = "command"
command = " "
timeout_s = 0
[reward.functions.g]
kind = "sim"
gpu = { device = "B200", model = "qwen3-9b", max_batch = 0 }
[reward.functions.h]
kind = "sim"
gpu = { device = "CPU", model = "qwen3-14b" }
"#
    );
    let errs = parse(&body, Format::Toml).unwrap_err();
    let fields: Vec<&str> = errs.0.iter().map(|e| e.field.as_str()).collect();
    for f in [
        "reward.functions.a.function",
        "reward.functions.a.hedge_percentile",
        "reward.functions.a.scaling.min-scale",
        "reward.functions.b.url",
        "reward.functions.b.range",
        "reward.functions.c.command",
        "reward.functions.c.timeout_s",
        "reward.functions.g.gpu.device",
        "reward.functions.g.gpu.model",
        "reward.functions.g.gpu.max_batch",
        "reward.functions.h.gpu.gpus_per_instance",
    ] {
        assert!(fields.contains(&f), "{f} not reported: {fields:?}");
    }
    let fit = errs
        .0
        .iter()
        .find(|e| e.field == "reward.functions.h.gpu.gpus_per_instance")
        .unwrap();
    assert!(
        fit.message
            .contains("qwen3-14b's weights (30 GB) do not fit in 1 × CPU (16 GB)"),
        "{}",
        fit.message
    );
    // Unknown knobs are refused by name (Knative's names only).
    let body = format!(
        "{}\n[reward.functions.a]\nkind = \"builtin\"\nfunction = \"math\"\nscaling = {{ stable_window = \"6s\" }}\n",
        minimal()
    );
    let errs = parse(&body, Format::Toml).unwrap_err();
    assert!(
        errs.0
            .iter()
            .any(|e| e.field.starts_with("reward") && e.message.contains("stable_window")),
        "{:?}",
        errs.0
    );
    // Real functions take the job off the virtual clock.
    let body = format!(
        "{}\n[reward.functions.m]\nkind = \"builtin\"\nfunction = \"math\"\n",
        minimal()
    );
    assert_eq!(parse(&body, Format::Toml).unwrap().clock(), Clock::Real);
}

#[test]
fn injected_latency_distributions_are_checked() {
    let body = minimal().replace("domain = \"lake\"\n", "domain = \"lake\"\ninject_latency = { step_s = { normal = { mean = 1.0, std = -1.0 } } }\n");
    assert!(body.contains("inject_latency"));
    let errs = parse(&body, Format::Toml).unwrap_err();
    assert!(
        errs.0
            .iter()
            .any(|e| e.field == "tasks[0].inject_latency.step_s"),
        "{:?}",
        errs.0
    );
}

#[test]
fn cluster_simulation_fields_are_checked_with_their_paths() {
    let body = r#"
[[tasks]]
domain = "lake"
context = { keep = 1.5 }
[tasks.env]
kind = "sim"
prompt_tokens = { normal = { mean = 10.0, std = -1.0 } }
[[pools]]
name = "p"
device = "B200"
backend = { kind = "sim", model = "moe", gpus_per_shard = 0, prefill_pool = "nope", block_tokens = 0 }
[trainer]
kind = "sim"
device = "H900"
mfu = 1.5
[sim]
devices = [{ name = "B200", tflops = -1, hbm_gb = 192, hbm_tbps = 8, cost = 6 }]
models = [{ name = "moe", params_b = 10, active_b = 20, layers = 0, kv_heads = 8, head_dim = 128 }]
faults = [{ pool = "q", shard = 0, hang_after_steps = 10 }, { pool = "p", shard = 5, hang_after_steps = 10 }]
weight_sync = { mode = "direct", bucket_gb = 0 }
"#;
    let errs = parse(body, Format::Toml).unwrap_err();
    let fields: Vec<&str> = errs.0.iter().map(|e| e.field.as_str()).collect();
    for f in [
        "tasks[0].env.prompt_tokens",
        "tasks[0].context.keep",
        "pools[0].backend.block_tokens",
        "pools[0].backend.gpus_per_shard",
        "pools[0].backend.prefill_pool",
        "trainer.device",
        "trainer.mfu",
        "sim.devices[0].tflops",
        "sim.models[0].active_b",
        "sim.models[0].layers",
        "sim.faults[0].pool",
        "sim.faults[1].shard",
        "sim.weight_sync.bucket_gb",
    ] {
        assert!(fields.contains(&f), "{f} not reported: {fields:?}");
    }
    // The custom device and model resolve (no error about them being unknown).
    assert!(
        !fields.contains(&"pools[0].device") && !fields.contains(&"pools[0].backend.model"),
        "{fields:?}"
    );
}

/// `append` and `rewrite` are the two ends of one kept share; a share in between parses.
#[test]
fn a_context_keeps_a_share_of_the_previous_turn() {
    use crate::spec::ContextMode;
    let with = |c: &str| {
        let body = minimal().replacen("[[tasks]]\n", &format!("[[tasks]]\ncontext = {c}\n"), 1);
        parse(&body, Format::Toml).unwrap().tasks[0].context
    };
    assert_eq!(with("\"append\"").keep(), 1.0);
    assert_eq!(with("\"rewrite\"").keep(), 0.0);
    assert_eq!(with("{ keep = 0.25 }"), ContextMode::Keep(0.25));
}

#[test]
fn custom_profiles_resolve_before_the_catalogue() {
    let body = format!(
        "{}\n[sim]\ndevices = [{{ name = \"H20\", tflops = 100, hbm_gb = 96, hbm_tbps = 4, cost = 1 }}]\nmodels = [{{ name = \"m\", params_b = 480, active_b = 35, layers = 62, kv_heads = 8, head_dim = 128, bytes_per_param = 1 }}]\n",
        minimal()
    );
    let s = parse(&body, Format::Toml).unwrap();
    assert_eq!(
        s.device_profile("h20").unwrap().flops,
        100e12,
        "sim.devices overrides the built-in H20"
    );
    let m = s.model_profile("m").unwrap();
    assert_eq!(
        (m.params, m.active_params, m.bytes_per_param),
        (480e9, 35e9, 1.0)
    );
    assert_eq!(m.kv_bytes_per_token, 2.0 * 62.0 * 8.0 * 128.0 * 2.0);
    assert_eq!(s.device_profile("A100").unwrap().name, "A100");
}

/// Hardening: durations past any sane bound, NaN and infinities are rejected with their path
/// (they used to be accepted and then panic converting to a `Duration`, or NaN became unset).
#[test]
fn extreme_floats_are_rejected_with_their_field_path() {
    let function = "\n[reward.functions.j]\nkind = \"sim\"\n";
    let cases: Vec<(String, &str)> = vec![
        (
            format!("{}\n[rollout]\nenv_call_timeout_s = 1e308\n", minimal()),
            "rollout.env_call_timeout_s",
        ),
        (
            format!("{}\n[rollout]\nfrozen_after_s = 1e308\n", minimal()),
            "rollout.frozen_after_s",
        ),
        (
            format!("{}\n[rollout]\nenv_call_timeout_s = nan\n", minimal()),
            "rollout.env_call_timeout_s",
        ),
        (
            format!("{}\n[rollout]\nfrozen_after_s = -inf\n", minimal()),
            "rollout.frozen_after_s",
        ),
        (
            format!(
                "{}\n[trainer]\nkind = \"sim\"\nstep_overhead_s = 1e308\n",
                minimal()
            ),
            "trainer.step_overhead_s",
        ),
        (
            format!("{}{function}cold_start_s = 1e308\n", minimal()),
            "reward.functions.j.cold_start_s",
        ),
        (
            format!("{}{function}scale_to_zero_after_s = 1e300\n", minimal()),
            "reward.functions.j.scale_to_zero_after_s",
        ),
        (
            format!(
                "{}\n[reward.functions.h]\nkind = \"http\"\nurl = \"http://127.0.0.1:9/\"\ntimeout_s = 1e308\n",
                minimal()
            ),
            "reward.functions.h.timeout_s",
        ),
    ];
    for (text, field) in cases {
        let errs = parse(&text, Format::Toml).expect_err(field).0;
        assert!(
            errs.iter().any(|e| e.field == field),
            "{field} not reported: {errs:?}"
        );
    }
    // The bound itself is accepted.
    let ok = format!(
        "{}\n[rollout]\nenv_call_timeout_s = {MAX_SECONDS}\n",
        minimal()
    );
    assert!(parse(&ok, Format::Toml).is_ok());
}

/// Hardening: no field can size an allocation past a bound (each of these used to abort the
/// service with a failed allocation, grow memory without bound, or leave a job stuck).
#[test]
fn sizes_past_their_bounds_are_rejected_with_their_field_path() {
    let sim_env = |extra: &str| {
        format!(
            "[[tasks]]\ndomain = \"t\"\n[tasks.env]\nkind = \"sim\"\n{extra}\n[[pools]]\nname = \"p\"\ndevice = \"H20\"\nbackend = {{ kind = \"sim\" }}\n"
        )
    };
    let builtin = |model: &str| {
        format!(
            "[[tasks]]\ndomain = \"t\"\n[tasks.env]\nkind = \"arithmetic\"\n[[pools]]\nname = \"p\"\ndevice = \"CPU\"\nbackend = {{ kind = \"builtin\", model = {{ {model} }} }}\n[trainer]\nkind = \"builtin\"\n"
        )
    };
    let cases: Vec<(String, &str)> = vec![
        (
            sim_env("observation_tokens = { constant = 1e12 }"),
            "tasks[0].env.observation_tokens",
        ),
        (
            sim_env("prompt_tokens = { constant = 1e11 }"),
            "tasks[0].env.prompt_tokens",
        ),
        (
            sim_env("response_tokens = { lognormal = { mu = 20.0, sigma = 2.0 } }"),
            "tasks[0].env.response_tokens",
        ),
        (
            sim_env("step_latency_s = { constant = 1e300 }"),
            "tasks[0].env.step_latency_s",
        ),
        (
            format!(
                "{}\n[rollout]\nmax_concurrent_episodes = 1000000000000000000\n",
                minimal()
            ),
            "rollout.max_concurrent_episodes",
        ),
        (
            format!(
                "{}\n[rollout]\nbatch_size = 4611686018427387904\n",
                minimal()
            ),
            "rollout.batch_size",
        ),
        (
            // The default in-flight bound would be 60,000 × 8 × 2.
            format!("{}\n[rollout]\nbatch_size = 60000\n", minimal()),
            "rollout.max_concurrent_episodes",
        ),
        (
            minimal().replace(
                "domain = \"lake\"\n",
                "domain = \"lake\"\nenvs = 1000000000\n",
            ),
            "tasks[0].envs",
        ),
        (builtin("d_ff = 1125899906842624"), "pools[0].backend.model"),
        (
            builtin("max_seq = 1099511627776"),
            "pools[0].backend.model.max_seq",
        ),
        (
            builtin("d_model = 2147483648, n_heads = 2147483648"),
            "pools[0].backend.model",
        ),
    ];
    for (text, field) in cases {
        let errs = parse(&text, Format::Toml).expect_err(field).0;
        assert!(
            errs.iter().any(|e| e.field == field),
            "{field} not reported: {errs:?}"
        );
    }
}

/// Hardening: an external environment in an otherwise simulated job runs on the real clock
/// (it used to get the virtual one, where every call failed with "IO is disabled"); asking
/// for the virtual clock is rejected with the reason.
#[test]
fn an_external_environment_takes_the_real_clock() {
    let text = minimal().replace(
        "[tasks.env]\nkind = \"sim\"",
        "[tasks.env]\nkind = \"external\"\ncommand = [\"python3\", \"env.py\"]",
    );
    let s = parse(&text, Format::Toml).expect("valid");
    assert!(!s.all_simulated());
    assert_eq!(s.clock(), Clock::Real);
    let errs = parse(
        &format!("{text}\n[sim]\nclock = \"virtual\"\n"),
        Format::Toml,
    )
    .expect_err("virtual clock with an external environment")
    .0;
    assert!(
        errs.iter()
            .any(|e| e.field == "sim.clock" && e.message.contains("external environment")),
        "{errs:?}"
    );
    // Built-in environments stay on the virtual clock.
    assert_eq!(
        parse(minimal(), Format::Toml).unwrap().clock(),
        Clock::Virtual
    );
}

#[test]
fn llamacpp_pool_fields_are_checked_with_their_paths() {
    let pool = |count: usize, backend: &str| {
        format!(
            "[[tasks]]\ndomain = \"lake\"\n[tasks.env]\nkind = \"sim\"\n[[pools]]\nname = \"l\"\ndevice = \"CPU\"\ncount = {count}\nbackend = {backend}\n[trainer]\nkind = \"builtin\"\n"
        )
    };
    let cases = [
        (
            pool(
                2,
                "{ kind = \"llamacpp\", model = { path = \"/nonexistent/m.gguf\" } }",
            ),
            "pools[0].backend.model.path",
        ),
        (
            pool(1, "{ kind = \"llamacpp\", model = { tiny = {} } }"),
            "pools[0].backend.model.path",
        ),
        (
            pool(
                2,
                "{ kind = \"llamacpp\", model = { path = \"m.gguf\" }, urls = [\"http://a:1\"] }",
            ),
            "pools[0].backend.urls",
        ),
        (
            pool(
                1,
                "{ kind = \"llamacpp\", model = { path = \"m.gguf\" }, urls = [\"ftp://a\"] }",
            ),
            "pools[0].backend.urls[0]",
        ),
        (
            pool(
                1,
                "{ kind = \"llamacpp\", model = { path = \"m.gguf\" }, slots = 0 }",
            ),
            "pools[0].backend.slots",
        ),
        (
            pool(
                1,
                "{ kind = \"llamacpp\", model = { path = \"m.gguf\" }, launch = { port_range = [9000, 8000] } }",
            ),
            "pools[0].backend.launch.port_range",
        ),
        (
            pool(
                1,
                "{ kind = \"llamacpp\", model = { path = \"m.gguf\" }, launch = { export = \"q4\" } }",
            ),
            "pools[0].backend.launch.export",
        ),
        (
            pool(
                1,
                "{ kind = \"llamacpp\", model = { path = \"m.gguf\" }, launch = { threads = 0 } }",
            ),
            "pools[0].backend.launch.threads",
        ),
        (
            pool(
                1,
                "{ kind = \"llamacpp\", model = { path = \"m.gguf\" }, urls = [\"http://a:1\"], launch = {} }",
            ),
            "pools[0].backend.urls",
        ),
        (
            pool(1, "{ kind = \"sglang\", model = { path = \"m\" } }"),
            "pools[0].backend.launch.command",
        ),
        (
            pool(
                2,
                "{ kind = \"llamacpp\", model = { path = \"m.gguf\" }, urls = [\"http://a:1\", \"http://b:1\"], discover = { dns = \"llm.rl.svc:8080\" } }",
            ),
            "pools[0].backend.discover",
        ),
        (
            pool(
                2,
                "{ kind = \"sglang\", model = { path = \"m\" }, discover = { urls = [\"http://a:1\"] } }",
            ),
            "pools[0].backend.discover.urls",
        ),
        (
            pool(
                2,
                "{ kind = \"vllm\", model = { path = \"m\" }, discover = { dns = \"no-port\" } }",
            ),
            "pools[0].backend.discover.dns",
        ),
        (
            pool(
                2,
                "{ kind = \"vllm\", model = { path = \"m\" }, discover = { kubernetes = { namespace = \"Bad\", label_selector = \"app=vllm\", port = 8000 } } }",
            ),
            "pools[0].backend.discover.kubernetes.namespace",
        ),
        (
            pool(
                1,
                "{ kind = \"vllm\", model = { path = \"m\" }, launch = { env = { A = \"1\" } } }",
            ),
            "pools[0].backend.launch.command",
        ),
    ];
    // Validation and the resolve step's checks (the checkpoint's header), as specs are accepted.
    for (text, field) in cases {
        let errs = crate::resolve::accept(&text, Format::Toml)
            .expect_err(field)
            .0;
        assert!(
            errs.iter().any(|e| e.field == field),
            "{field} not reported: {errs:?}"
        );
    }
    // A pool that follows an inference Deployment takes no launch command.
    let found = pool(
        2,
        "{ kind = \"sglang\", model = { path = \"m\" }, discover = { dns = \"sglang.rl.svc:30000\", refresh_s = 5 } }",
    );
    let s = parse(&found, Format::Toml).expect("a discovered pool is valid");
    match &s.pools[0].backend {
        BackendSpec::Sglang(l) => {
            let d = l.discover.as_ref().unwrap();
            assert_eq!(d.dns_target(), Some(("sglang.rl.svc".into(), 30000)));
        }
        other => panic!("{other:?}"),
    }
    // A llama.cpp pool with the simulated trainer is refused too.
    let text = pool(1, "{ kind = \"llamacpp\", model = { path = \"m.gguf\" } }")
        .replace("kind = \"builtin\"\n", "kind = \"sim\"\n");
    let errs = parse(&text, Format::Toml).unwrap_err().0;
    assert!(
        errs.iter().any(|e| e.field == "pools[0].backend"),
        "{errs:?}"
    );
}

/// α = 0 under an overlapping preset trains without overlap (the next batch needs the
/// weights the step produces; overlapping used to wait for that batch before installing them,
/// and the job hung); asking for overlap with α = 0 is an error naming the field.
#[test]
fn alpha_zero_turns_overlap_off_and_refuses_it_when_asked() {
    let s = parse(
        &format!("{}[rollout]\nalpha = 0\n", minimal()),
        Format::Toml,
    )
    .unwrap();
    let k = s.knobs();
    assert_eq!(k.alpha, 0);
    assert!(!k.overlap_training);
    let e = parse(
        &format!(
            "{}[rollout]\nalpha = 0\noverlap_training = true\n",
            minimal()
        ),
        Format::Toml,
    )
    .unwrap_err();
    assert!(
        e.0.iter().any(|p| p.field == "rollout.overlap_training"),
        "{:?}",
        e.0
    );
    let ok = parse(
        &format!(
            "{}[rollout]\nalpha = 1\noverlap_training = true\n",
            minimal()
        ),
        Format::Toml,
    )
    .unwrap();
    assert!(ok.knobs().overlap_training);
}

#[test]
fn datasets_and_bridged_environments_are_checked_with_their_paths() {
    let dir = tempfile::tempdir().unwrap();
    let rows = dir.path().join("rows.jsonl");
    std::fs::write(&rows, "{\"question\": \"1+1?\", \"answer\": \"2\"}\n").unwrap();
    let with = |env: &str, dataset: &str| {
        minimal().replace(
            "[tasks.env]\nkind = \"sim\"",
            &format!("{dataset}\n[tasks.env]\n{env}"),
        )
    };
    let ds = format!("dataset = {{ path = \"{}\" }}", rows.display());
    // A prompt task on a JSONL file with the default keys (`question`, `answer`).
    // Validation and the resolve step's checks together, as the API and the CLI accept a spec.
    let accept = crate::resolve::accept;
    let s = accept(&with("kind = \"prompt\"", &ds), Format::Toml).expect("valid");
    assert_eq!(s.tasks[0].dataset.as_ref().unwrap().epochs, 1);
    assert!(s.tasks[0].dataset.as_ref().unwrap().shuffle);
    let cases: Vec<(String, &str, &str)> = vec![
        (
            with("kind = \"prompt\"", ""),
            "tasks[0].dataset",
            "give the task a dataset",
        ),
        (
            with(
                "kind = \"prompt\"",
                &format!("{ds}\nseeds = {{ start = 0, count = 4 }}"),
            ),
            "tasks[0].seeds",
            "remove seeds",
        ),
        (
            with(
                "kind = \"prompt\"",
                "dataset = { path = \"/no/such/rows.jsonl\" }",
            ),
            "tasks[0].dataset.path",
            "no such file",
        ),
        (
            with(
                "kind = \"prompt\"",
                &format!(
                    "dataset = {{ path = \"{}\", prompt_key = \"text\" }}",
                    rows.display()
                ),
            ),
            "tasks[0].dataset.prompt_key",
            "no prompt at `text`",
        ),
        (
            with(
                "kind = \"prompt\"",
                &format!(
                    "dataset = {{ path = \"{}\", answer_key = \"gt\" }}",
                    rows.display()
                ),
            ),
            "tasks[0].dataset.answer_key",
            "no answer at `gt`",
        ),
        (
            with(
                "kind = \"prompt\"",
                &format!("dataset = {{ path = \"{}\", epochs = 0 }}", rows.display()),
            ),
            "tasks[0].dataset.epochs",
            "1..=100000",
        ),
        (
            with("kind = \"reasoning_gym\"\ndataset = \"no such\"", ""),
            "tasks[0].env.dataset",
            "not a reasoning-gym dataset name",
        ),
        (
            with(
                "kind = \"reasoning_gym\"\ndataset = \"chain_sum\"\nsize = 0",
                "",
            ),
            "tasks[0].env.size",
            "1..=10000000",
        ),
        (
            with("kind = \"gymnasium\"\nid = \"\"", ""),
            "tasks[0].env.id",
            "module:Class",
        ),
        (
            with("kind = \"external\"\ncommand = [\"x\"]\nprotocol = 4", ""),
            "tasks[0].env.protocol",
            "1..=3",
        ),
        (
            with("kind = \"external\"\ncommand = [\"x\"]\nprocesses = 2", ""),
            "tasks[0].env.processes",
            "needs protocol = 3",
        ),
        (
            with(
                "kind = \"external\"\ncommand = [\"x\"]\nprotocol = 3\nprocesses = 0",
                "",
            ),
            "tasks[0].env.processes",
            "1..=256",
        ),
        (
            with(
                "kind = \"reasoning_gym\"\ndataset = \"chain_sum\"\nprocesses = 300",
                "",
            ),
            "tasks[0].env.processes",
            "1..=256",
        ),
    ];
    for (text, field, msg) in cases {
        let errs = accept(&text, Format::Toml).expect_err(field).0;
        assert!(
            errs.iter()
                .any(|e| e.field == field && e.message.contains(msg)),
            "{field}: {errs:?}"
        );
    }
    // Bridged environments are programs: the real clock.
    let rg = parse(
        &with("kind = \"reasoning_gym\"\ndataset = \"chain_sum\"", ""),
        Format::Toml,
    )
    .unwrap();
    assert_eq!(rg.clock(), Clock::Real);
    let gym = parse(
        &with("kind = \"gymnasium\"\nid = \"mod:Env\"", ""),
        Format::Toml,
    )
    .unwrap();
    assert_eq!(gym.clock(), Clock::Real);
}

#[test]
fn dropping_old_turns_needs_an_environment_that_allows_it_and_turns_to_drop() {
    let with = |task: &str, env: &str| {
        minimal().replace(
            "[tasks.env]\nkind = \"sim\"",
            &format!("{task}\ntruncation = \"drop_oldest_turns\"\n[tasks.env]\n{env}"),
        )
    };
    for ok in [
        with("max_turns = 8", "kind = \"frozenlake\""),
        with("max_turns = 8", "kind = \"sim\""),
        with(
            "max_turns = 8",
            "kind = \"external\"\ncommand = [\"x\"]\ndroppable_turns = true",
        ),
    ] {
        let s = parse(&ok, Format::Toml).expect("valid");
        assert_eq!(s.tasks[0].truncation, TruncationPolicy::DropOldestTurns);
    }
    let cases = [
        (
            with("max_turns = 8", "kind = \"external\"\ncommand = [\"x\"]"),
            "`external` does not",
        ),
        (with("max_turns = 8", "kind = \"chat\""), "`chat` does not"),
        (
            with("max_turns = 2", "kind = \"frozenlake\""),
            "at least 3, got 2",
        ),
    ];
    for (text, msg) in cases {
        let errs = parse(&text, Format::Toml).expect_err(msg).0;
        assert!(
            errs.iter()
                .any(|e| e.field == "tasks[0].truncation" && e.message.contains(msg)),
            "{msg}: {errs:?}"
        );
    }
    let errs = parse(
        &minimal().replace("[tasks.env]", "truncation = \"sometimes\"\n[tasks.env]"),
        Format::Toml,
    )
    .expect_err("unknown policy")
    .0;
    assert!(
        errs.iter().any(|e| e.field.contains("truncation")),
        "{errs:?}"
    );
}

/// Every number leaf of a normalised simulated spec, as a JSON pointer.
fn number_leaves(v: &serde_json::Value, at: String, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Number(_) => out.push(at),
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                number_leaves(v, format!("{at}/{k}"), out);
            }
        }
        serde_json::Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                number_leaves(v, format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

/// Hardening: numeric fuzz over every number field of a spec. Each field of the normalised
/// simulated example takes extreme values in turn; the spec is refused with an error, or
/// its job runs (virtual time) and ends with a result or a job error, never a panic or a
/// hang (`trainer.seconds_per_token = 1e308` used to panic in the job).
#[test]
fn extreme_numbers_in_any_field_are_refused_or_run_without_panicking() {
    let text = include_str!("../../../../examples/sim-small.toml")
        .replace("steps = 8", "steps = 2")
        .replace("count = 1000", "count = 4")
        .replace("latency_s = { lognormal = { mu = -3.0, sigma = 0.5 } }", "latency_s = { constant = 0.05 }")
        .replace("device = \"H800\"", "device = \"X1\"")
        .replace("model = \"qwen3-8b\" }\n\n[[pools]]", "model = \"m1\" }\n\n[[pools]]")
        .replace("batch_size = 8\n", "batch_size = 8\nenv_call_timeout_s = 30\nfrozen_after_s = 60\nfault_window_s = 30\nstep_timeout_s = 600\n")
        + r#"
[[sim.devices]]
name = "X1"
tflops = 900.0
hbm_gb = 80.0
hbm_tbps = 3.3
cost = 2.0
[[sim.models]]
name = "m1"
params_b = 8.0
active_b = 8.0
layers = 36
kv_heads = 8
head_dim = 128
[sim.weight_sync]
bucket_gb = 1.0
"#;
    let base = serde_json::to_value(parse(&text, Format::Toml).expect("example parses")).unwrap();
    let mut leaves = Vec::new();
    number_leaves(&base, String::new(), &mut leaves);
    assert!(leaves.len() > 30, "{leaves:?}");
    let mut ran = 0;
    let mut bad = Vec::new();
    for at in &leaves {
        for x in [1e300, -1e300, 1e-300, 1.5e19] {
            let mut v = base.clone();
            *v.pointer_mut(at).unwrap() = serde_json::json!(x);
            let Ok(spec) = from_value(v) else { continue };
            let (tx, rx) = std::sync::mpsc::channel();
            let what = format!("{at} = {x}");
            std::thread::spawn(move || {
                let r = std::panic::catch_unwind(|| crate::simrun::run_virtual(spec).map(|_| ()));
                let _ = tx.send(r.map_err(|_| "the job panicked".to_string()).and_then(|r| {
                    // An actor's panic surfaces as a job error: that is a panic too.
                    match r {
                        Err(e) if format!("{e:?}").contains("panic") => Err(format!("{e}")),
                        Err(crate::runtime::JobError::Call {
                            what,
                            source: actors::call::CallError::Dropped,
                        }) => Err(format!("the {what} actor died")),
                        _ => Ok(()),
                    }
                }));
            });
            match rx.recv_timeout(std::time::Duration::from_secs(20)) {
                Ok(Ok(_)) => ran += 1,
                Ok(Err(e)) => bad.push(format!("{what}: {e}")),
                Err(_) => panic!("{what}: the job did not end within 20 s of wall time"),
            }
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
    assert!(ran > 0);
}

#[test]
fn env_pool_problems_name_their_fields() {
    let body = format!(
        "{}\n{}",
        minimal(),
        r#"
[[env_pools]]
name = "both"
workers = { urls = ["http://a:7000"], kubernetes = { namespace = "rl", label_selector = "app=w", port = 7000 } }
[[env_pools]]
name = "k"
workers = { kubernetes = { namespace = "Bad_NS", label_selector = " ", port = 0, api = "https://kubernetes.default.svc" } }
[[env_pools]]
name = "d"
workers = { dns = "nohost", refresh_s = 0 }
max_concurrent_starts = 0
warm = 5000
[[env_pools]]
name = "local"
workers = { urls = ["http://a:7000"] }
"#
    );
    let errs = parse(&body, Format::Toml).unwrap_err();
    let fields: Vec<&str> = errs.0.iter().map(|e| e.field.as_str()).collect();
    for f in [
        "env_pools[0].workers",
        "env_pools[1].workers.kubernetes.namespace",
        "env_pools[1].workers.kubernetes.label_selector",
        "env_pools[1].workers.kubernetes.port",
        "env_pools[1].workers.kubernetes.api",
        "env_pools[2].workers.dns",
        "env_pools[2].workers.refresh_s",
        "env_pools[2].max_concurrent_starts",
        "env_pools[2].warm",
        "env_pools[3].workers",
    ] {
        assert!(fields.contains(&f), "{f} missing from {fields:?}");
    }
    let api = errs
        .0
        .iter()
        .find(|e| e.field == "env_pools[1].workers.kubernetes.api")
        .unwrap();
    assert!(api.message.contains("kubectl proxy"), "{}", api.message);
    // A well-formed Kubernetes pool passes, with kubectl proxy's address as its API.
    let ok = format!(
        "{}\n{}",
        minimal(),
        "[[env_pools]]\nname = \"k\"\nworkers = { kubernetes = { namespace = \"rl\", label_selector = \"kubernetes.io/service-name=rollarc-env-worker\", port = 7000 } }\n"
    );
    let s = parse(&ok, Format::Toml).unwrap();
    let k = s.env_pools[0].workers.kubernetes.as_ref().unwrap();
    assert_eq!(k.api, DEFAULT_KUBE_API);
    // The local pool takes no workers, only start control; a task may name it.
    let local = format!(
        "{}\n{}",
        minimal().replace("[[tasks]]", "[[tasks]]\nenv_pool = \"local\""),
        "[[env_pools]]\nname = \"local\"\nwarm = 4\nmax_concurrent_starts = 8\n"
    );
    let s = parse(&local, Format::Toml).unwrap();
    assert!(s.env_pools[0].is_local());
    assert_eq!(
        (s.env_pools[0].warm, s.env_pools[0].max_concurrent_starts),
        (4, Some(8))
    );
    assert_eq!(s.tasks[0].env_pool.as_deref(), Some(LOCAL_POOL));
}

#[test]
fn managed_agents_on_env_pools_need_a_gateway_url_the_workers_reach() {
    let spec = |mode: &str, workers: &str, pool_extra: &str| {
        minimal()
            .replace(
                "[tasks.env]\nkind = \"sim\"",
                &format!(
                    "env_pool = \"fleet\"\n[tasks.env]\nkind = \"agent\"\nmode = \"{mode}\"\n{}",
                    if mode == "managed" {
                        "command = [\"python3\", \"agent.py\"]"
                    } else {
                        ""
                    }
                ),
            )
            .to_string()
            + &format!("[[env_pools]]\nname = \"fleet\"\nworkers = {workers}\n{pool_extra}\n")
    };
    let problems = |body: &str| -> Vec<(String, String)> {
        match parse(body, Format::Toml) {
            Ok(_) => Vec::new(),
            Err(e) => e.0.into_iter().map(|e| (e.field, e.message)).collect(),
        }
    };
    let dns = "{ dns = \"envs.rl.svc:7000\" }";
    // Workers elsewhere must be told where the service is.
    let p = problems(&spec("managed", dns, ""));
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(p[0].0, "env_pools[0].gateway_url");
    assert!(p[0].1.contains("tasks[0]"), "{}", p[0].1);
    assert!(
        problems(&spec(
            "managed",
            dns,
            "gateway_url = \"http://rollarc.rl.svc:8080\""
        ))
        .is_empty()
    );
    // Workers listed on loopback reach the job's own loopback gateway.
    let local =
        "{ urls = [\"http://127.0.0.1:7000\", \"http://localhost:7001\", \"http://[::1]:7002\"] }";
    assert!(problems(&spec("managed", local, "")).is_empty());
    let p = problems(&spec("managed", dns, "gateway_url = \"ftp://rollarc:21\""));
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(p[0].0, "env_pools[0].gateway_url");
    // An external harness claims its episodes from the service: no pool.
    let p = problems(&spec("external", local, ""));
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(p[0].0, "tasks[0].env_pool");
    assert!(p[0].1.contains("claims its episodes"), "{}", p[0].1);
}

/// The generation precision of a built-in pool: named values parse (the default is f32); a
/// precision for the tiny model, or an unknown one, is refused at its field.
#[test]
fn a_builtin_precision_is_checked_at_its_field() {
    let spec = |model: &str| {
        format!(
            "[[tasks]]\ndomain = \"t\"\n[tasks.env]\nkind = \"arithmetic\"\n[[pools]]\nname = \"p\"\ndevice = \"CPU\"\nbackend = {{ kind = \"builtin\", model = {{ {model} }} }}\n[trainer]\nkind = \"builtin\"\n"
        )
    };
    let choice = |s: &JobSpec| match &s.pools[0].backend {
        BackendSpec::Builtin { model, .. } => model.choice(),
        other => panic!("{other:?}"),
    };
    for (text, want) in [
        ("q4_1", actors::types::Precision::Q4_1),
        ("q8_0", actors::types::Precision::Q8_0),
        ("f32", actors::types::Precision::F32),
    ] {
        let s = parse(
            &spec(&format!("path = \"m.gguf\", precision = \"{text}\"")),
            Format::Toml,
        )
        .expect(text);
        assert!(
            matches!(choice(&s), ModelChoice::Checkpoint { precision, .. } if precision == want),
            "{text}"
        );
    }
    let s = parse(&spec("path = \"m.gguf\""), Format::Toml).expect("no precision");
    assert!(matches!(
        choice(&s),
        ModelChoice::Checkpoint {
            precision: actors::types::Precision::F32,
            ..
        }
    ));
    let errs = parse(&spec("precision = \"q8_0\""), Format::Toml)
        .expect_err("tiny")
        .0;
    assert!(
        errs.iter()
            .any(|e| e.field == "pools[0].backend.model.precision" && e.message.contains("tiny")),
        "{errs:?}"
    );
    let errs = parse(
        &spec("path = \"m.gguf\", precision = \"q5_k\""),
        Format::Toml,
    )
    .expect_err("unknown")
    .0;
    assert!(errs.iter().any(|e| e.message.contains("q5_k")), "{errs:?}");
}
