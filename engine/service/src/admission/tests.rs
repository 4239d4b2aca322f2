use super::*;

fn parse(path: &str) -> JobSpec {
    let body = std::fs::read_to_string(format!("{}/../../{path}", env!("CARGO_MANIFEST_DIR")))
        .expect("example spec");
    job::spec::parse(&body, job::spec::Format::Toml).expect("valid example")
}

fn builtin(model: &str, extra_rollout: &str) -> JobSpec {
    let toml = format!(
        r#"
[[tasks]]
domain = "lake"
env = {{ kind = "frozenlake" }}
[[pools]]
name = "cpu"
device = "CPU"
count = 2
backend = {{ kind = "builtin", max_batch = 64, model = {{ {model} }} }}
[trainer]
kind = "builtin"
[rollout]
batch_size = 4
{extra_rollout}
"#
    );
    job::spec::parse(&toml, job::spec::Format::Toml).expect("valid spec")
}

#[test]
fn the_shipped_examples_fit_a_small_machine() {
    for path in [
        "examples/quickstart.toml",
        "examples/sim-small.toml",
        "examples/sim-sigma.toml",
    ] {
        let e = estimate(&parse(path));
        assert!(
            e.total() < 2 << 30,
            "{path}: {} ({:?})",
            human(e.total()),
            e.breakdown()
        );
        assert!(e.total() > JOB_BASE_BYTES);
    }
}

#[test]
fn the_kv_cache_of_a_big_builtin_model_dominates_and_names_its_pool() {
    let small = estimate(&builtin("d_model = 64", ""));
    let big = estimate(&builtin(
        "d_model = 2048, n_heads = 16, n_layers = 16, d_ff = 8192, max_seq = 8192",
        "",
    ));
    // KV alone: 2 shards × 64 slots × 16 layers × 2 × 8192 positions × 2048 × 4 bytes.
    let kv = 2u64 * 64 * 16 * 2 * 8192 * 2048 * 4;
    assert!(big.total() > kv, "{}", human(big.total()));
    assert!(small.total() < big.total() / 100);
    assert_eq!(big.breakdown()[0].0, "pools[0]", "{:?}", big.breakdown());
}

#[test]
fn more_episodes_and_envs_cost_more() {
    let a = estimate(&builtin("d_model = 64", "max_concurrent_episodes = 100"));
    let b = estimate(&builtin("d_model = 64", "max_concurrent_episodes = 10000"));
    assert!(b.total() > a.total());
    let part = |e: &MemoryEstimate, f: &str| {
        e.parts
            .iter()
            .filter(|p| p.field == f)
            .map(|p| p.bytes)
            .sum::<u64>()
    };
    assert_eq!(
        part(&b, "rollout.max_concurrent_episodes"),
        100 * part(&a, "rollout.max_concurrent_episodes")
    );
    // Without `envs`, a task gets one environment per concurrent episode.
    assert_eq!(part(&b, "tasks[0].envs"), 100 * part(&a, "tasks[0].envs"));
}

#[test]
fn the_default_budget_is_a_fraction_of_the_machine() {
    let m = machine_memory().expect("/proc/meminfo on Linux");
    assert_eq!(default_budget(), m / 5 * 3);
}

#[test]
fn no_trajectory_is_counted_longer_than_the_model_context_or_its_budget() {
    let part = |s: &JobSpec, field: &str| {
        estimate(s)
            .parts
            .iter()
            .find(|p| p.field == field)
            .map(|p| p.bytes)
            .unwrap_or(0)
    };
    // Ten turns of 256 observation and 128 answer tokens would be 3,840 tokens; the model
    // holds 128, so a trajectory in flight counts 128.
    let short = builtin(
        "d_model = 32, n_layers = 1, n_heads = 2, d_ff = 64, max_seq = 128",
        "",
    );
    let long = builtin(
        "d_model = 32, n_layers = 1, n_heads = 2, d_ff = 64, max_seq = 8192",
        "",
    );
    let (s, l) = (
        part(&short, "rollout.max_concurrent_episodes"),
        part(&long, "rollout.max_concurrent_episodes"),
    );
    assert!(s < l, "{s} vs {l}");
    assert!(part(&short, "trainer") < part(&long, "trainer"));
    // A task's own budget caps it too.
    let mut budget = long.clone();
    budget.tasks[0].max_context_tokens = Some(128);
    assert_eq!(
        part(&budget, "rollout.max_concurrent_episodes"),
        part(&short, "rollout.max_concurrent_episodes")
    );
}

/// A checkpoint trainer counts one pass of at most `MICRO_BATCH_TOKENS` tokens (its rows are
/// packed): a 16× larger batch does not grow it, and both SmolLM2 examples fit three fifths
/// of a 24 GB machine.
#[test]
fn a_checkpoint_trainer_counts_one_pass_of_its_token_budget() {
    let ck = actors::model::llm::smollm2_path();
    let trainer = |e: &MemoryEstimate| {
        e.parts
            .iter()
            .find(|p| p.field == "trainer")
            .map(|p| p.bytes)
            .expect("a trainer part")
    };
    for path in [
        "examples/smollm2-reasoning.toml",
        "examples/smollm2-tool-agent.toml",
    ] {
        let body = std::fs::read_to_string(format!("{}/../../{path}", env!("CARGO_MANIFEST_DIR")))
            .unwrap()
            .replace("SmolLM2-135M-Instruct.Q4_1.gguf", &ck.display().to_string());
        let spec = job::spec::parse(&body, job::spec::Format::Toml).expect("valid example");
        let mut bigger = spec.clone();
        bigger.rollout.batch_size = Some(spec.rollout.batch_size.unwrap_or(4) * 16);
        let (e, b) = (estimate(&spec), estimate(&bigger));
        assert_eq!(
            trainer(&e),
            trainer(&b),
            "{path}: the batch does not grow a pass"
        );
        assert!(
            e.total() < 24_000_000_000 / 5 * 3,
            "{path}: {} ({:?})",
            human(e.total()),
            e.breakdown()
        );
    }
}
