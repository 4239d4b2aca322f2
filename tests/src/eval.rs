//! Held-out evaluation during training: before the first step, every `every` steps and after
//! the last, on the policy just trained, never trained on.

use std::sync::Arc;

use actors::buffer::MemorySink;

const SPEC: &str = r#"
seed = 4
[[tasks]]
domain = "arith"
group_size = 4
max_turns = 1
max_tokens_per_turn = 3
constrain_actions = true
env = { kind = "arithmetic", max_operand = 4 }
[[pools]]
name = "cpu"
device = "CPU"
count = 1
backend = { kind = "builtin", model = { d_model = 16, n_layers = 1, n_heads = 2, d_ff = 32, max_seq = 64 } }
[rollout]
batch_size = 2
steps = 4
filter_all_equal = false
[trainer]
kind = "builtin"
[eval]
every = 2
n = 3
temperature = 0.5
[[eval.tasks]]
domain = "arith-heldout"
max_turns = 1
max_tokens_per_turn = 3
constrain_actions = true
seeds = { start = 1000, count = 6 }
env = { kind = "arithmetic", max_operand = 4 }
"#;

#[test]
fn held_out_tasks_are_evaluated_before_during_and_after_training_and_never_trained() {
    let spec = job::spec::parse(SPEC, job::spec::Format::Toml).expect("valid spec");
    let sink = Arc::new(MemorySink::default());
    let log = Arc::new(tests::BatchLog::default());
    let summary = job::simrun::run_blocking(spec, 0, 0, sink.clone(), log.clone(), None)
        .expect("the job runs");
    assert_eq!(summary.steps_done, 4);
    let steps: Vec<_> = log
        .batches
        .lock()
        .unwrap()
        .iter()
        .map(|(m, _)| m.clone())
        .collect();
    // Before training (carried by the first step's record), after step 2 and after step 4.
    let at: Vec<Vec<u64>> = steps
        .iter()
        .map(|m| m.eval.iter().map(|e| e.step).collect())
        .collect();
    assert_eq!(at, vec![vec![0], vec![2], vec![], vec![4]]);
    let evals: Vec<_> = steps.iter().flat_map(|m| m.eval.clone()).collect();
    // On the policy just trained: version 0, then the version after steps 2 and 4.
    assert_eq!(
        evals.iter().map(|e| e.version).collect::<Vec<_>>(),
        vec![0, 2, 4]
    );
    for e in &evals {
        let m = &e.tasks["arith-heldout"];
        assert_eq!(
            (m.problems, m.samples, m.failed, m.k),
            (6, 18, 0, 3),
            "{m:?}"
        );
        assert!((0.0..=1.0).contains(&m.pass_at_1));
        assert!(m.pass_at_k >= m.pass_at_1 - 1e-12, "{m:?}");
        assert!(m.mean_response_tokens >= 1.0);
    }
    // Nothing of the evaluation reaches the buffer, the store or a batch.
    let log = sink.log.lock().unwrap();
    assert!(!log.is_empty() && log.iter().all(|t| t.task == "arith"));
    // The report: every evaluation and the change of pass@1 from the first to the last.
    let report = lab::report::summarise("j", "succeeded", &steps);
    assert_eq!(report.eval.len(), 3);
    let c = &report.eval_change["arith-heldout"];
    assert_eq!((c.step_start, c.step_end), (0, 4));
    assert!((c.change_points - 100.0 * (c.pass_at_1_end - c.pass_at_1_start)).abs() < 1e-9);
}
