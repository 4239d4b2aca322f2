//! `make chaos`: the SIGKILL loop of `tests::chaos` in its long form; prints the report as
//! JSON and exits non-zero unless it is clean. Usage: `chaos [KILLS] [SEED]`.

#![allow(
    clippy::too_many_lines,
    reason = "test code: the 100-line limit is on shipped code; a test reads top to bottom"
)]

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let kills = args.next().and_then(|a| a.parse().ok()).unwrap_or(24);
    let seed = args.next().and_then(|a| a.parse().ok()).unwrap_or(7);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let dir = tempfile::tempdir().expect("temp dir");
    let (report, wall) = rt.block_on(async {
        let t0 = tokio::time::Instant::now();
        let r = tests::chaos::run(
            &tests::chaos::ChaosOptions {
                kills,
                seed,
                round2: true,
            },
            dir.path(),
        )
        .await;
        (r, t0.elapsed())
    });
    println!(
        "{}",
        serde_json::to_string_pretty(&report).unwrap_or_default()
    );
    let clean = report.clean();
    eprintln!(
        "chaos: {} kills, {} function instance kills, {} rows in {:.0} s: {}",
        report.kills,
        report.function_kills,
        report.rows,
        wall.as_secs_f64(),
        if clean { "clean" } else { "NOT CLEAN" }
    );
    if clean {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
