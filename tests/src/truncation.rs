//! Context budgets: episodes longer than the model's context or the task's
//! `max_context_tokens` end as `truncated` — counted, reported, trained or masked per the
//! task — instead of failing and being retried until a short lucky episode survives.

use std::sync::Arc;

use actors::buffer::MemorySink;
use actors::types::FailureReason;

/// Two FrozenLake tasks on a tiny model whose context holds about two boards: `cut` ends at
/// the model's context (trained), `budget` at its own `max_context_tokens` (masked).
const SPEC: &str = r#"
seed = 9
[[tasks]]
domain = "cut"
group_size = 4
max_turns = 12
max_tokens_per_turn = 1
constrain_actions = true
env = { kind = "frozenlake", size = 4 }
[[tasks]]
domain = "budget"
group_size = 4
max_turns = 12
max_tokens_per_turn = 1
constrain_actions = true
max_context_tokens = 40
train_truncated = false
env = { kind = "frozenlake", size = 4 }
[[pools]]
name = "cpu"
device = "CPU"
count = 1
backend = { kind = "builtin", model = { d_model = 16, n_layers = 1, n_heads = 2, d_ff = 32, max_seq = 72 } }
[rollout]
batch_size = 4
steps = 4
filter_all_equal = false
[trainer]
kind = "builtin"
"#;

#[test]
fn episodes_past_the_context_end_truncated_without_retries_and_are_reported() {
    let spec = job::spec::parse(SPEC, job::spec::Format::Toml).expect("valid spec");
    let sink = Arc::new(MemorySink::default());
    let log = Arc::new(tests::BatchLog::default());
    let summary = job::simrun::run_blocking(spec, 0, 0, sink.clone(), log.clone(), None)
        .expect("the job runs");
    assert_eq!(summary.steps_done, 4);
    let all = sink.log.lock().unwrap().clone();
    let batches = log.batches.lock().unwrap().clone();
    let last = &batches.last().unwrap().0;
    // No retry: nothing failed for an infrastructure reason, and truncations are not retried.
    assert_eq!(last.buffer.retried, 0, "{:?}", last.buffer);
    // The model's context: truncated trajectories of `cut`, not failed, trained.
    let cut: Vec<_> = all
        .iter()
        .filter(|t| t.task == "cut" && t.truncated)
        .collect();
    assert!(
        !cut.is_empty(),
        "some episodes outgrow the 72-token context"
    );
    for t in &cut {
        assert_eq!(t.failure, None);
        assert!(t.reward.is_some() && !t.turns.is_empty());
        let len: usize = t
            .turns
            .iter()
            .map(|u| u.observation_tokens.len() + u.response_tokens.len())
            .sum();
        assert!(len <= 72, "{len}");
    }
    let trained_cut = batches
        .iter()
        .flat_map(|(_, b)| b.trajectories())
        .filter(|t| t.task == "cut" && t.truncated)
        .count();
    assert!(trained_cut > 0, "truncated trajectories train by default");
    // The task's own budget: every episode that lasts past one turn is cut at 40 tokens,
    // masked (train_truncated = false), never retried, never trained.
    let budget: Vec<_> = all
        .iter()
        .filter(|t| t.task == "budget" && t.truncated)
        .collect();
    assert!(!budget.is_empty());
    for t in &budget {
        assert!(
            matches!(&t.failure, Some(FailureReason::Truncated(why)) if why.contains("max_context_tokens is 40")),
            "{:?}",
            t.failure
        );
        let len: usize = t
            .turns
            .iter()
            .map(|u| u.observation_tokens.len() + u.response_tokens.len())
            .sum();
        assert!(len <= 40, "{len}");
    }
    assert!(
        batches
            .iter()
            .flat_map(|(_, b)| b.trajectories())
            .all(|t| !(t.task == "budget" && t.truncated))
    );
    // Counted and reported: the buffer's count, the per-task rate, the report.
    let truncated = all.iter().filter(|t| t.truncated).count() as u64;
    assert_eq!(last.buffer.truncated, truncated);
    let steps: Vec<_> = batches.iter().map(|(m, _)| m.clone()).collect();
    let report = lab::report::summarise("j", "succeeded", &steps);
    assert_eq!(report.truncated, truncated);
    assert!(report.tasks["cut"].truncation_rate > 0.0);
    assert_eq!(
        report
            .tasks
            .get("budget")
            .map_or(0.0, |t| t.truncation_rate),
        0.0,
        "masked: not trained"
    );
}

/// `drop_oldest_turns`: FrozenLake boards carry the state, so old turns may leave the context.
/// `window` keeps the first turn and about two more within 64 tokens; `model` learns the
/// model's 72-token limit from the engine's refusal and fits to it.
const DROP_SPEC: &str = r#"
seed = 5
[[tasks]]
domain = "window"
group_size = 4
max_turns = 12
max_tokens_per_turn = 1
constrain_actions = true
max_context_tokens = 100
truncation = "drop_oldest_turns"
env = { kind = "frozenlake", size = 4 }
[[tasks]]
domain = "model"
group_size = 4
max_turns = 12
max_tokens_per_turn = 1
constrain_actions = true
truncation = "drop_oldest_turns"
env = { kind = "frozenlake", size = 4 }
[[pools]]
name = "cpu"
device = "CPU"
count = 1
backend = { kind = "builtin", model = { d_model = 16, n_layers = 1, n_heads = 2, d_ff = 32, max_seq = 128 } }
[rollout]
batch_size = 4
steps = 4
filter_all_equal = false
[trainer]
kind = "builtin"
"#;

#[test]
fn dropping_the_oldest_turns_keeps_long_episodes_going_within_the_context() {
    let spec = job::spec::parse(DROP_SPEC, job::spec::Format::Toml).expect("valid spec");
    let sink = Arc::new(MemorySink::default());
    let log = Arc::new(tests::BatchLog::default());
    let summary = job::simrun::run_blocking(spec, 0, 0, sink.clone(), log.clone(), None)
        .expect("the job runs");
    assert_eq!(summary.steps_done, 4);
    let all = sink.log.lock().unwrap().clone();
    for (task, budget) in [("window", 100), ("model", 128)] {
        let ts: Vec<_> = all.iter().filter(|t| t.task == task).collect();
        let long: Vec<_> = ts
            .iter()
            .filter(|t| t.turns.iter().any(|u| u.dropped > 0))
            .collect();
        assert!(
            !long.is_empty(),
            "{task}: some episodes outgrow {budget} tokens; turn lengths: {:?}",
            ts.iter()
                .map(|t| t
                    .turns
                    .iter()
                    .map(|u| u.observation_tokens.len() + u.response_tokens.len())
                    .collect::<Vec<_>>())
                .collect::<Vec<_>>()
        );
        for t in &ts {
            // Nothing ends truncated: there is always an old turn to leave out.
            assert!(!t.truncated, "{task}: {:?}", t.failure);
            assert_eq!(t.failure, None, "{task}");
            // Drops only grow, never touch the first turn, and each context fits.
            let drops: Vec<u32> = t.turns.iter().map(|u| u.dropped).collect();
            assert!(drops.windows(2).all(|w| w[0] <= w[1]), "{drops:?}");
            assert_eq!(drops[0], 0);
            let segments = t.segments();
            assert_eq!(
                segments.len(),
                1 + drops.windows(2).filter(|w| w[0] != w[1]).count()
            );
            for (toks, train, _) in &segments {
                assert!(toks.len() <= budget, "{task}: a context of {}", toks.len());
                assert_eq!(toks.len(), train.len());
            }
            // Every answer trains exactly once, under its own context.
            let trained: usize = segments
                .iter()
                .map(|s| s.1.iter().filter(|&&x| x).count())
                .sum();
            assert_eq!(trained, t.response_tokens());
        }
        // What `end` would have cut: whole histories past the budget, finished instead.
        let past = long
            .iter()
            .filter(|t| {
                t.turns
                    .iter()
                    .map(|u| u.observation_tokens.len() + u.response_tokens.len())
                    .sum::<usize>()
                    > budget
            })
            .count();
        assert!(past > 0, "{task}");
    }
    // They train: one row per context, each response once.
    let batches = log.batches.lock().unwrap().clone();
    assert!(
        batches
            .iter()
            .flat_map(|(_, b)| b.trajectories())
            .any(|t| t.segments().len() > 1),
        "trajectories with dropped turns reach the trainer"
    );
}
