//! Jobs on the built-in model: real generation threads, the built-in trainer, checkpoints.

use std::sync::Arc;

use actors::buffer::MemorySink;
use tests::{BatchLog, SpecBuilder};

fn builtin_spec(steps: u64) -> job::spec::JobSpec {
    SpecBuilder::new()
        .raw_task(
            r#"[[tasks]]
domain = "echo"
group_size = 2
max_turns = 2
max_tokens_per_turn = 6
[tasks.env]
kind = "sim"
turns = { constant = 2 }
"#,
        )
        .rollout("batch_size = 2")
        .rollout(&format!("steps = {steps}"))
        .extra("[[pools]]\nname = \"cpu\"\ndevice = \"CPU\"\ncount = 2\nbackend = { kind = \"builtin\", max_batch = 8, model = { d_model = 16, n_layers = 1, n_heads = 2, d_ff = 32, max_seq = 64 } }")
        .extra("[trainer]\nkind = \"builtin\"\nlr = 0.001")
        .build()
}

#[test]
fn a_builtin_job_generates_trains_and_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let sink = Arc::new(MemorySink::default());
    let log = Arc::new(BatchLog::default());
    let s = job::simrun::run_blocking(
        builtin_spec(3),
        0,
        0,
        sink.clone(),
        log.clone(),
        Some(dir.path().to_path_buf()),
    )
    .expect("job runs");
    assert_eq!(s.steps_done, 3);
    let batches = log.batches.lock().unwrap();
    assert_eq!(batches.len(), 3);
    for (m, b) in batches.iter() {
        assert!(m.version == b.step + 1);
        for t in b.trajectories() {
            let first = &t.turns[0];
            assert_eq!(
                first.observation_tokens.first(),
                Some(&actors::model::tokenizer::BOS),
                "observations are framed for the built-in tokenizer"
            );
            for u in &t.turns {
                assert!(!u.response_tokens.is_empty() && u.response_tokens.len() <= 6);
                assert_eq!(u.logprobs.len(), u.response_tokens.len());
                assert!(u.logprobs.iter().all(|l| *l <= 0.0 && l.is_finite()));
                assert!(u.versions.iter().all(|v| v.version <= b.step));
            }
        }
    }
    // The utilisation timeline: every shard and environment, busy fractions in [0, 1], and the
    // shards did work.
    let (last, _) = batches.last().unwrap();
    for k in ["shard cpu/0", "shard cpu/1", "env echo/0"] {
        assert!(
            last.timeline.contains_key(k),
            "{k} missing: {:?}",
            last.timeline.keys().collect::<Vec<_>>()
        );
    }
    assert!(last.timeline.values().all(|f| (0.0..=1.0).contains(f)));
    assert!(
        batches.iter().any(|(m, _)| m
            .timeline
            .iter()
            .any(|(k, f)| k.starts_with("shard ") && *f > 0.0)),
        "no shard was ever busy"
    );
    assert!(
        batches.iter().any(|(m, _)| m
            .timeline
            .iter()
            .any(|(k, f)| k.starts_with("env ") && *f > 0.0)),
        "no environment was ever held"
    );
    assert!(
        dir.path().join("v3.safetensors").exists() && dir.path().join("v2.safetensors").exists()
    );
    assert!(
        !dir.path().join("v1.safetensors").exists(),
        "only the two newest checkpoints are kept"
    );
}

#[test]
fn a_builtin_job_resumes_from_its_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let run = |steps: u64, start: u64, epoch: u64| {
        job::simrun::run_blocking(
            builtin_spec(steps),
            start,
            epoch,
            Arc::new(MemorySink::default()),
            Arc::new(BatchLog::default()),
            Some(dir.path().to_path_buf()),
        )
    };
    run(2, 0, 0).expect("first run");
    let s = run(4, 2, 1).expect("resumed run");
    assert_eq!(s.steps_done, 4);
    assert_eq!(
        s.steps.first().map(|m| m.version),
        Some(3),
        "the resumed run trains from version 2"
    );
    // Without its checkpoint a resume fails clearly instead of restarting from scratch.
    let empty = tempfile::tempdir().unwrap();
    let err = job::simrun::run_blocking(
        builtin_spec(4),
        2,
        1,
        Arc::new(MemorySink::default()),
        Arc::new(BatchLog::default()),
        Some(empty.path().to_path_buf()),
    )
    .unwrap_err();
    let chain = infra::error_chain(&err);
    assert!(chain.contains("checkpoint"), "{chain}");
}

#[test]
fn builtin_games_drive_the_builtin_model_end_to_end() {
    let spec = SpecBuilder::new()
        .raw_task("[[tasks]]\ndomain = \"lake\"\ngroup_size = 2\nmax_turns = 4\nmax_tokens_per_turn = 4\nenv = { kind = \"frozenlake\", size = 4 }\n")
        .raw_task("[[tasks]]\ndomain = \"sum\"\ngroup_size = 2\nmax_turns = 1\nmax_tokens_per_turn = 3\nenv = { kind = \"arithmetic\", max_operand = 5 }\n")
        .raw_task("[[tasks]]\ndomain = \"box\"\ngroup_size = 2\nmax_turns = 3\nmax_tokens_per_turn = 4\nenv = { kind = \"sokoban\", boxes = 1 }\n")
        .raw_task("[[tasks]]\ndomain = \"ttt\"\ngroup_size = 2\nmax_turns = 3\nmax_tokens_per_turn = 2\nenv = { kind = \"tictactoe\" }\n")
        .rollout("batch_size = 4")
        .rollout("steps = 2")
        .extra("[[pools]]\nname = \"cpu\"\ndevice = \"CPU\"\ncount = 1\nbackend = { kind = \"builtin\", model = { d_model = 16, n_layers = 1, n_heads = 2, d_ff = 32, max_seq = 256 } }")
        .extra("[trainer]\nkind = \"builtin\"")
        .build();
    let sink = Arc::new(MemorySink::default());
    let s = job::simrun::run_blocking(
        spec,
        0,
        0,
        sink.clone(),
        Arc::new(BatchLog::default()),
        None,
    )
    .expect("job runs");
    assert_eq!(s.steps_done, 2);
    let log = sink.log.lock().unwrap();
    let tok = actors::model::tokenizer::ByteTokenizer;
    let mut seen = std::collections::BTreeSet::new();
    for t in log.iter().filter(|t| t.failure.is_none()) {
        seen.insert(t.task.clone());
        let first = tok.decode(&t.turns[0].observation_tokens);
        match t.task.as_str() {
            "lake" => assert!(first.starts_with("P F F F\n"), "{first:?}"),
            "sum" => assert!(first.ends_with('=') && t.turns.len() == 1),
            "box" => assert!(first.starts_with("######\n")),
            "ttt" => assert_eq!(first, ". . .\n. . .\n. . .\n"),
            other => panic!("unexpected task {other}"),
        }
        // An untrained policy mostly answers garbage: invalid actions are counted, never fatal.
        assert!(t.reward.is_some());
    }
    assert!(log.iter().map(|t| t.invalid_actions).sum::<u32>() > 0);
    assert_eq!(seen.len(), 4, "every game produced trajectories: {seen:?}");
}
