use std::collections::BTreeMap;

use super::timeline::timeline_rows;
use super::*;
use job::runtime::{StepMetrics, TaskMetrics};

fn step(i: u64, lake: f64) -> StepMetrics {
    let mut m = StepMetrics {
        step: i,
        elapsed_s: i as f64 * 2.0,
        trajectories: 8,
        ..StepMetrics::default()
    };
    m.tasks.insert(
        "lake".into(),
        TaskMetrics {
            trajectories: 8,
            success_rate: lake,
            mean_reward: lake,
            mean_turns: 3.0,
            seeds: Vec::new(),
            truncation_rate: 0.0,
        },
    );
    m
}

#[test]
fn start_and_end_are_window_means_and_a_ramp_to_one_never_holds_90_percent() {
    let steps: Vec<StepMetrics> = (0..20).map(|i| step(i, i as f64 / 19.0)).collect();
    let s = summarise("j", "succeeded", &steps);
    let lake = &s.tasks["lake"];
    assert!((lake.success_start - (0.0 + 1.0 + 2.0 + 3.0 + 4.0) / 19.0 / 5.0).abs() < 1e-12);
    assert!((lake.success_end - (15.0 + 16.0 + 17.0 + 18.0 + 19.0) / 19.0 / 5.0).abs() < 1e-12);
    // The trailing 5-step mean of i/19 reaches 0.9 only at i = 19.1: never within 20 steps.
    assert_eq!(lake.first_step_at_90, None);
    assert_eq!((s.steps, s.trajectories, lake.trajectories), (20, 160, 160));
    assert_eq!(s.rollarc_version, env!("CARGO_PKG_VERSION"));
    assert!(!s.commit.is_empty());
    assert_eq!(s.wall_s, 38.0);
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), &s).unwrap();
    let back: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    assert_eq!(
        back["tasks"]["lake"]["first_step_at_90"],
        serde_json::Value::Null
    );
    assert_eq!(back["commit"], s.commit.as_str());
    // Plots: PNG (with the shipped font) and SVG, one line per task.
    let random = BTreeMap::from([("lake".to_string(), 0.05)]);
    let files = plots(dir.path(), &steps, &random).unwrap();
    assert_eq!(files.len(), 4);
    let svg = std::fs::read_to_string(dir.path().join("success.svg")).unwrap();
    assert!(svg.contains("Success rate per task") && svg.contains("lake"));
    // The smoothed line and the random policy's level are labelled.
    assert!(svg.contains("lake (5-step mean)"), "no smoothed line");
    assert!(svg.contains("lake: random policy"), "no random baseline");
    let png = std::fs::read(dir.path().join("success.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(
        png.len() > 10_000,
        "an almost empty PNG ({} bytes)",
        png.len()
    );
    // With held-out evaluations, their plot too (pass@1 and pass@k per task).
    let mut steps = steps;
    for (i, at) in [(0usize, 0u64), (9, 10)] {
        let mut r = job::runtime::eval::EvalRecord {
            step: at,
            version: at,
            ..Default::default()
        };
        r.tasks.insert(
            "held".into(),
            job::runtime::eval::EvalTaskMetrics {
                pass_at_1: 0.2 + at as f64 / 20.0,
                pass_at_k: 0.4 + at as f64 / 20.0,
                k: 4,
                ..Default::default()
            },
        );
        steps[i].eval.push(r);
    }
    let files = plots(dir.path(), &steps, &random).unwrap();
    assert_eq!(files.len(), 6);
    let svg = std::fs::read_to_string(dir.path().join("eval.svg")).unwrap();
    assert!(
        svg.contains("Held-out evaluation")
            && svg.contains("held pass@1")
            && svg.contains("held pass@4")
    );
}

#[test]
fn the_timeline_has_a_row_per_resource_in_kind_order() {
    let mut steps: Vec<StepMetrics> = (1..=4).map(|i| step(i, 0.5)).collect();
    for (i, m) in steps.iter_mut().enumerate() {
        m.step_s = 2.0;
        m.timeline.insert("shard compute/0".into(), 0.25 * i as f64);
        m.timeline.insert("env lake/10".into(), 1.0);
        m.timeline.insert("env lake/9".into(), 0.5);
        m.timeline.insert("env lake/3".into(), 0.0);
        if i >= 2 {
            // A function instance that started late (grey before).
            m.timeline.insert("fn math-1/3".into(), 0.75);
        }
    }
    // Never-used environments are left out.
    assert_eq!(
        timeline_rows(&steps),
        [
            "shard compute/0",
            "env lake/9",
            "env lake/10",
            "fn math-1/3"
        ]
    );
    let dir = tempfile::tempdir().unwrap();
    let files = plots(dir.path(), &steps, &BTreeMap::new()).unwrap();
    assert_eq!(files.len(), 6);
    let svg = std::fs::read_to_string(dir.path().join("timeline.svg")).unwrap();
    for row in ["shard compute/0", "env lake/10", "fn math-1/3"] {
        assert!(svg.contains(row), "{row} missing from the timeline");
    }
    // Busy cells are filled in shades of blue, missing ones grey: both kinds appear.
    assert!(
        svg.contains("#E1E1E1"),
        "no grey cell for the late instance"
    );
    assert!(svg.contains("#08308C"), "no fully busy cell");
    let png = std::fs::read(dir.path().join("timeline.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
}

/// "Reached 90 %" is judged on the trailing 5-step mean: a single lucky step does not count
/// (a run was reported at 90 % at step 122 with a final success of 0.23), a plateau does.
#[test]
fn a_single_step_spike_is_not_reaching_90_percent() {
    let mut steps: Vec<StepMetrics> = (0..30).map(|i| step(i, 0.2)).collect();
    steps[7] = step(7, 1.0);
    let s = summarise("j", "succeeded", &steps);
    assert_eq!(s.tasks["lake"].first_step_at_90, None);
    // From step 20 on at 1.0: the trailing mean reaches 0.9 at step 24 (0.2 + 4 × 1.0 = 0.84
    // at 23, 1.0 at 24).
    for (i, m) in steps.iter_mut().enumerate().skip(20) {
        *m = step(i as u64, 1.0);
    }
    let s = summarise("j", "succeeded", &steps);
    assert_eq!(s.tasks["lake"].first_step_at_90, Some(24));
    assert_eq!(s.tasks["lake"].wall_s_at_90, Some(48.0));
}
