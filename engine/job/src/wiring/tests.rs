use std::time::Duration;

use actors::device::DeviceProfile;

use super::*;
use crate::spec::{self, Format};

/// A spec deserialised without validation (so the wiring's own guards are reached).
fn raw(toml_text: &str) -> JobSpec {
    toml::from_str(toml_text).expect("spec parses")
}

/// Plans `spec` with its inputs resolved on this process, as a job does when it starts.
fn plan(spec: &JobSpec) -> Result<JobPlan, WiringError> {
    let inputs = crate::resolve::resolve(spec, &crate::resolve::Host::process())
        .expect("the spec's inputs resolve");
    super::plan(spec, &inputs)
}

fn valid(toml_text: &str) -> JobSpec {
    spec::parse(toml_text, Format::Toml).expect("spec is valid")
}

const TASK: &str = r#"
[[tasks]]
domain = "t"
[tasks.env]
kind = "sim"
"#;

fn with_pools(pools: &str) -> String {
    format!("{TASK}\n{pools}")
}

#[test]
fn the_example_spec_is_wired_pool_by_pool_and_task_by_task() {
    let s = valid(&std::fs::read_to_string("../../examples/sim-small.toml").unwrap());
    let p = plan(&s).unwrap();
    assert_eq!(p.pools.len(), 2);
    assert_eq!(p.pools[0].device.name, "H800");
    assert_eq!(p.pools[1].device.name, "H20");
    assert!(p.pools.iter().all(|q| q.shards == 2));
    assert!(matches!(p.pools[0].engine, EnginePlan::Sim { .. }));
    // Declared mapping: each task to its pool.
    assert_eq!(p.tasks[0].view.declared_pool, Some(0));
    assert_eq!(p.tasks[1].view.declared_pool, Some(1));
    assert_eq!(
        p.tasks[1].scorers,
        vec![ScorerPlan::Function("math_judge".into())]
    );
    assert!(
        p.pools
            .iter()
            .all(|p| matches!(p.engine, EnginePlan::Sim { .. }))
    );
    assert!(matches!(p.trainer, TrainerPlan::Sim { .. }));
}

#[test]
fn a_tensor_parallel_shard_is_its_whole_group() {
    let s = valid(&with_pools(
        r#"
[[pools]]
name = "p"
device = "H800"
count = 2
backend = { kind = "sim", model = "qwen3-32b", gpus_per_shard = 4, tp_efficiency = 0.8 }
"#,
    ));
    let p = plan(&s).unwrap();
    let one = DeviceProfile::builtin("H800").unwrap();
    let shard = &p.pools[0].device;
    assert!((shard.flops - 4.0 * 0.8 * one.flops).abs() < 1e-6 * one.flops);
    assert!((shard.memory - 4.0 * one.memory).abs() < 1e-6 * one.memory);
}

#[test]
fn disaggregated_pools_are_linked_and_the_prefill_pool_takes_no_groups() {
    let s = valid(&with_pools(
        r#"
[[pools]]
name = "p"
device = "H800"
backend = { kind = "sim", model = "qwen3-8b" }
[[pools]]
name = "d"
device = "H20"
count = 3
backend = { kind = "sim", model = "qwen3-8b", prefill_pool = "p", kv_transfer_gbps = 25.0 }
"#,
    ));
    let p = plan(&s).unwrap();
    assert!(p.pools[0].prefill_only && !p.pools[1].prefill_only);
    let link = p.pools[1].prefill_from.expect("a prefill link");
    assert_eq!(link.pool, 0);
    assert!((link.bandwidth - 25e9).abs() < 1.0);
    assert_eq!(link.kv_bytes_per_token, p.pools[1].model.kv_bytes_per_token);
}

#[test]
fn names_the_catalogue_does_not_know_are_errors_not_fallbacks() {
    // (spec, the field the error must name)
    let cases = [
        (
            with_pools(
                "[[pools]]\nname = \"p\"\ndevice = \"Z100\"\nbackend = { kind = \"sim\" }\n",
            ),
            "pools[0].device",
        ),
        (
            with_pools(
                "[[pools]]\nname = \"p\"\ndevice = \"H20\"\nbackend = { kind = \"sim\", model = \"gpt-9\" }\n",
            ),
            "pools[0].backend.model",
        ),
        (
            format!(
                "{}\n[trainer]\nkind = \"sim\"\ndevice = \"Z100\"\n",
                with_pools(
                    "[[pools]]\nname = \"p\"\ndevice = \"H20\"\nbackend = { kind = \"sim\" }\n"
                )
            ),
            "trainer.device",
        ),
    ];
    for (text, field) in cases {
        let err = plan(&raw(&text)).err().expect("an error");
        assert!(err.to_string().starts_with(field), "{field}: {err}");
    }
}

#[test]
fn trainer_and_pools_must_agree_on_the_built_in_model() {
    let builtin_pool =
        "[[pools]]\nname = \"p\"\ndevice = \"CPU\"\nbackend = { kind = \"builtin\" }\n";
    let sim_pool = "[[pools]]\nname = \"p\"\ndevice = \"H20\"\nbackend = { kind = \"sim\" }\n";
    let e = plan(&raw(&with_pools(builtin_pool))).err().unwrap();
    assert!(matches!(e, WiringError::BuiltinModelWithoutTrainer), "{e}");
    let e = plan(&raw(&format!(
        "{}\n[trainer]\nkind = \"builtin\"\n",
        with_pools(sim_pool)
    )))
    .err()
    .unwrap();
    assert!(matches!(e, WiringError::BuiltinTrainerWithoutModel), "{e}");
    let ok = plan(&raw(&format!(
        "{}\n[trainer]\nkind = \"builtin\"\n",
        with_pools(builtin_pool)
    )))
    .unwrap();
    assert!(matches!(
        ok.pools[0].engine,
        EnginePlan::Builtin {
            model: crate::spec::ModelChoice::Tiny(_)
        }
    ));
    assert!(matches!(ok.trainer, TrainerPlan::Builtin { .. }));
}

#[test]
fn simulated_functions_follow_the_reward_placement() {
    let base =
        with_pools("[[pools]]\nname = \"p\"\ndevice = \"H20\"\nbackend = { kind = \"sim\" }\n");
    let f = |placement: &str, scaling: &str| {
        let text = format!(
            "{base}\n[reward]\nplacement = \"{placement}\"\n[reward.functions.j]\nkind = \"sim\"\ncold_start_s = 3.0\n{scaling}"
        );
        plan(&valid(&text)).unwrap().functions.remove(0).1
    };
    match f("serverless", "") {
        FunctionPlan::SimSlots {
            cold_start,
            scale_to_zero_after,
            ..
        } => {
            assert_eq!(cold_start, Duration::from_secs(3));
            assert!(scale_to_zero_after.is_some());
        }
        _ => panic!("serverless without scaling: fixed slots that scale to zero"),
    }
    assert!(matches!(
        f("serverless", "scaling = {}\n"),
        FunctionPlan::SimScaled { .. }
    ));
    match f("local", "") {
        FunctionPlan::SimSlots {
            cold_start,
            scale_to_zero_after,
            ..
        } => {
            assert_eq!(cold_start, Duration::ZERO);
            assert!(scale_to_zero_after.is_none());
        }
        _ => panic!("local: warm fixed slots"),
    }
}

/// The cost model's prior for a sim environment: a `rewrite` context prefills its whole
/// history every turn (≈ turns² / 2 of it) but attends to it once, so it decodes at the same
/// context as an `append` one.
#[test]
fn a_rewrite_prior_prefills_the_history_every_turn_but_decodes_at_its_context() {
    let task = |context: &str| {
        raw(&format!(
            r#"
[[tasks]]
domain = "swe"
max_turns = 30
max_tokens_per_turn = 1024
context = {context}
[tasks.env]
kind = "sim"
turns = {{ constant = 10 }}
prompt_tokens = {{ constant = 3000 }}
observation_tokens = {{ constant = 300 }}
response_tokens = {{ constant = 160 }}
[[pools]]
name = "p"
device = "H800"
count = 1
backend = {{ kind = "sim" }}
"#
        ))
        .tasks
        .remove(0)
    };
    let (append, rewrite) = (
        prior_tokens(&task("\"append\"")),
        prior_tokens(&task("\"rewrite\"")),
    );
    // Prompt then nine observations, against ten whole contexts.
    assert_eq!(append.prefill, 3_000.0 + 9.0 * 300.0);
    assert_eq!(rewrite.prefill, 10.0 * 3_000.0 + 460.0 * 45.0);
    assert_eq!(append.decode, 1_600.0);
    assert_eq!(rewrite.decode, 1_600.0);
    // Turn k's answer sees the prompt, k turns of history and half of itself.
    let context = 3_000.0 + 4.5 * 460.0 + 80.0;
    assert_eq!(append.context, context);
    assert_eq!(rewrite.context, context);
    assert!(rewrite.prefill > 9.0 * rewrite.context);
    // A kept share re-prefills the rest of each turn's history: a quarter kept, three
    // quarters of the way from `append` to `rewrite`.
    let kept = prior_tokens(&task("{ keep = 0.25 }"));
    assert_eq!(kept.prefill, 0.25 * append.prefill + 0.75 * rewrite.prefill);
    assert_eq!(kept.context, context);
}
