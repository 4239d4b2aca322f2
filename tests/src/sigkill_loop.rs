//! The short form of `make chaos`: a few SIGKILLs of the service over the mixed jobs.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkill_loop_loses_changes_duplicates_and_replays_nothing_and_orphans_no_process() {
    let dir = tempfile::tempdir().unwrap();
    let report = tests::chaos::run(
        &tests::chaos::ChaosOptions {
            kills: 4,
            seed: 3,
            round2: false,
        },
        dir.path(),
    )
    .await;
    eprintln!("{}", serde_json::to_string_pretty(&report).unwrap());
    assert!(report.clean(), "{report:?}");
    assert_eq!(report.kills, 4);
    assert!(report.rows > 0);
    assert!(
        report.steps.values().all(|&s| s > 0),
        "every job trained across the kills: {:?}",
        report.steps
    );
    assert!(report.crash_loop_failed_after_s.unwrap() < 60.0);
}
