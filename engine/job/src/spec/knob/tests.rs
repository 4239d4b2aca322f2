use super::*;
use crate::spec::catalogue::{all, annotate_schema, markdown_table};
use crate::spec::{Format, parse};

#[test]
fn every_constant_default_is_in_range_and_is_what_a_spec_without_the_field_runs_with() {
    let spec = parse(
        "[[tasks]]\ndomain = \"t\"\n[tasks.env]\nkind = \"sim\"\n[[pools]]\nname = \"p\"\ndevice = \"H20\"\nbackend = { kind = \"sim\" }\n",
        Format::Toml,
    )
    .unwrap();
    let k = spec.knobs();
    let t = &spec.tasks[0];
    let ran = [
        ("tasks[i].group_size", t.group_size as f64),
        ("tasks[i].redundancy", t.redundancy as f64),
        ("tasks[i].weight", t.weight),
        ("tasks[i].max_turns", f64::from(t.max_turns)),
        (
            "tasks[i].max_tokens_per_turn",
            f64::from(t.max_tokens_per_turn),
        ),
        ("rollout.batch_size", k.batch_size as f64),
        ("rollout.steps", k.steps as f64),
        ("rollout.overprovision", k.overprovision as f64),
        (
            "rollout.max_retries_per_group",
            f64::from(k.max_retries_per_group),
        ),
        ("rollout.env_call_timeout_s", k.env_call_timeout_s),
        ("rollout.frozen_after_s", k.frozen_after_s),
        ("rollout.fault_window_s", k.fault_window_s),
        ("rollout.fault_min_failures", k.fault_min_failures as f64),
        ("pools[i].count", spec.pools[0].count as f64),
    ];
    // Sections the minimal spec leaves out: each as serde fills it from a minimal table.
    let server: crate::spec::ServerSpec = toml::from_str("model = {}").unwrap();
    let eval: crate::spec::EvalSpec = toml::from_str("tasks = []").unwrap();
    let lora: crate::spec::LoraSpec = toml::from_str("").unwrap();
    let dataset: crate::spec::DatasetSpec = toml::from_str("path = \"rows.jsonl\"").unwrap();
    let ran = ran.into_iter().chain([
        ("pools[i].backend.slots", server.slots as f64),
        ("eval.n", eval.n as f64),
        ("eval.temperature", eval.temperature),
        ("trainer.lora.rank", lora.rank as f64),
        ("tasks[i].dataset.epochs", f64::from(dataset.epochs)),
    ]);
    let external: crate::spec::EnvSpec =
        toml::from_str("kind = \"external\"\ncommand = [\"game\"]").unwrap();
    let crate::spec::EnvSpec::External {
        protocol,
        max_message_bytes,
        ..
    } = external
    else {
        panic!("an external environment");
    };
    let gym: crate::spec::EnvSpec =
        toml::from_str("kind = \"reasoning_gym\"\ndataset = \"chain_sum\"").unwrap();
    let crate::spec::EnvSpec::ReasoningGym {
        size, processes, ..
    } = gym
    else {
        panic!("a reasoning-gym environment");
    };
    let ran = ran.chain([
        ("tasks[i].env.protocol", f64::from(protocol)),
        ("tasks[i].env.max_message_bytes", max_message_bytes as f64),
        ("tasks[i].env.size", size as f64),
        ("tasks[i].env.processes", processes as f64),
    ]);
    let ran: Vec<(&str, f64)> = ran.collect();
    for info in all() {
        if let Some(d) = &info.default {
            let d: f64 = d.parse().unwrap();
            let low = if info.exclusive_min {
                d > info.min
            } else {
                d >= info.min
            };
            assert!(
                low && d <= info.max,
                "{}: default {d} outside {}",
                info.field,
                info.range
            );
            let (_, v) = ran
                .iter()
                .find(|(f, _)| *f == info.field)
                .unwrap_or_else(|| panic!("{} is not run with", info.field));
            assert_eq!(*v, d, "{}", info.field);
        } else {
            assert!(
                !info.default_note.is_empty(),
                "{}: say how it is derived",
                info.field
            );
        }
    }
    let real = crate::spec::REAL_STEP_TIMEOUT_S;
    assert!(
        crate::spec::STEP_TIMEOUT_S
            .default_note
            .starts_with(&format!("{real} s")),
        "the step timeout's note names its real-job default"
    );
}

#[test]
fn a_knob_refuses_each_side_of_its_range_naming_the_field() {
    let mut p = Problems::default();
    crate::spec::BATCH_SIZE.check(Some(0), &mut p);
    crate::spec::BATCH_SIZE.check(Some(crate::spec::MAX_BATCH_GROUPS), &mut p);
    crate::spec::ENV_CALL_TIMEOUT_S.check(Some(0.0), &mut p);
    crate::spec::ENV_CALL_TIMEOUT_S.check(Some(f64::NAN), &mut p);
    crate::spec::FAULT_WINDOW_S.check(Some(0.0), &mut p);
    let got: Vec<(String, String)> = p
        .into_vec()
        .into_iter()
        .map(|e| (e.field, e.message))
        .collect();
    assert_eq!(
        got,
        [
            (
                "rollout.batch_size".to_string(),
                "must be in 1..=65536, got 0".to_string()
            ),
            (
                "rollout.env_call_timeout_s".into(),
                "must be a number of seconds in (0, 2592000], got 0".into()
            ),
            (
                "rollout.env_call_timeout_s".into(),
                "must be a number of seconds in (0, 2592000], got NaN".into()
            ),
        ]
    );
}

#[test]
fn the_schema_and_the_manual_say_what_the_knobs_say() {
    let mut doc = serde_json::json!({"components": {"schemas": {"RolloutSpec": {"properties": {
        "batch_size": {"type": ["integer", "null"], "minimum": 0},
        "env_call_timeout_s": {"type": ["number", "null"]},
    }}}}});
    annotate_schema(&mut doc);
    let props = &doc["components"]["schemas"]["RolloutSpec"]["properties"];
    assert_eq!(props["batch_size"]["minimum"], 1);
    assert_eq!(props["batch_size"]["maximum"], 65536);
    assert_eq!(props["batch_size"]["default"], 8);
    assert_eq!(props["env_call_timeout_s"]["exclusiveMinimum"], 0);
    assert_eq!(props["env_call_timeout_s"]["maximum"], 2_592_000);
    assert_eq!(props["env_call_timeout_s"]["default"], 600.0);
    assert!(props["env_call_timeout_s"].get("minimum").is_none());
    // The manual carries the table as generated: edit the knobs, not the page.
    let manual = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/job-spec.md"
    ))
    .unwrap();
    let table = markdown_table();
    assert!(
        manual.contains(&table),
        "docs/job-spec.md must contain the knob table as generated; replace it with:\n{table}"
    );
}
