//! `rollarc train` in its own process against a real `rollarc serve`: the built-in trainer
//! speaking only the trainer API trains a tiny-model job to the end, every version it
//! announces is installed, and a trainer killed with SIGKILL mid-run resumes from its own
//! checkpoint: every step trained exactly once across the two processes.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use serde_json::Value;
use tests::SpecBuilder;
use tests::server::ServerProcess;

fn tiny_job(steps: u64) -> String {
    SpecBuilder::new()
        .raw_task("[[tasks]]\ndomain = \"lake\"\ngroup_size = 4\nmax_turns = 4\nmax_tokens_per_turn = 1\nconstrain_actions = true\nenv = { kind = \"frozenlake\", size = 4, end_on_invalid = true }\n")
        .rollout("batch_size = 4")
        .rollout(&format!("steps = {steps}"))
        .rollout("alpha = 1")
        .extra("[[pools]]\nname = \"cpu\"\ndevice = \"CPU\"\ncount = 1\nbackend = { kind = \"builtin\", model = { d_model = 16, n_layers = 1, n_heads = 2, d_ff = 32, max_seq = 128 } }")
        .extra("[trainer]\nkind = \"external\"\nlease_s = 2")
        .toml()
}

/// Runs `rollarc train` until it exits, or until `kill_after` matches a line (then SIGKILL);
/// returns its stdout lines and whether it exited successfully.
fn train(
    base: &str,
    job: &str,
    out: &std::path::Path,
    kill_after: Option<&str>,
) -> (Vec<String>, bool) {
    let mut child = Command::new(tests::rollarc_bin())
        .args([
            "--service",
            base,
            "train",
            "--job",
            job,
            "--wait-s",
            "2",
            "--out",
        ])
        .arg(out)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn rollarc train");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = Vec::new();
    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
        let stop = kill_after.is_some_and(|k| line.starts_with(k));
        lines.push(line);
        if stop {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGKILL,
            )
            .expect("kill the trainer");
            break;
        }
    }
    let ok = child.wait().expect("wait for rollarc train").success();
    (lines, ok)
}

async fn get_json(client: &reqwest::Client, url: &str) -> Value {
    client.get(url).send().await.unwrap().json().await.unwrap()
}

/// The steps a run's output says it trained (lines without "announced before").
fn trained(lines: &[String]) -> Vec<u64> {
    lines
        .iter()
        .filter(|l| l.starts_with("step ") && !l.contains("announced before"))
        .map(|l| l[5..].split(' ').next().unwrap().parse().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollarc_train_trains_a_job_and_resumes_after_sigkill_without_training_a_step_twice() {
    const STEPS: u64 = 6;
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(&dir.path().join("data"));
    let client = reqwest::Client::new();
    let job = tests::submit_job(&client, &server.base, tiny_job(STEPS)).await;
    let out = dir.path().join("trainer");
    let (base, j, o) = (server.base.clone(), job.clone(), out.clone());
    let (first, killed_ok) =
        tokio::task::spawn_blocking(move || train(&base, &j, &o, Some("step 2 ")))
            .await
            .unwrap();
    assert!(!killed_ok, "the first trainer was killed: {first:?}");
    assert_eq!(trained(&first), [1, 2], "{first:?}");
    let (base, j, o) = (server.base.clone(), job.clone(), out.clone());
    let (second, ok) = tokio::task::spawn_blocking(move || train(&base, &j, &o, None))
        .await
        .unwrap();
    assert!(ok, "{second:?}");
    assert!(
        second[0].starts_with("resuming from the trainer checkpoint of version 2"),
        "{second:?}"
    );
    // Every step trained once, in order, across the two processes.
    assert_eq!(
        trained(&second),
        (3..=STEPS).collect::<Vec<_>>(),
        "{second:?}"
    );
    assert!(
        second.last().unwrap().contains("job ended succeeded"),
        "{second:?}"
    );
    // Each step's loss is a real number (the built-in trainer's objective).
    for l in first
        .iter()
        .chain(&second)
        .filter(|l| l.starts_with("step "))
    {
        let loss: f64 = l
            .split("loss ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(loss.is_finite(), "{l}");
        // Steps count from 1, as in the API: step k produces version k.
        let k = l[5..].split(' ').next().unwrap();
        assert!(l.starts_with(&format!("step {k} → v{k}")), "{l}");
    }
    // The job: every batch acknowledged once, the newest weights announced and installed.
    let st: Value = get_json(&client, &format!("{}/v1/jobs/{job}/staleness", server.base)).await;
    assert_eq!(st["batches_acked"], STEPS, "{st}");
    assert_eq!(st["batches_pending"], 0, "{st}");
    let events = client
        .get(format!("{}/v1/jobs/{job}/events", server.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(events.contains("succeeded"), "{events}");
    let rec: Value = get_json(&client, &format!("{}/v1/jobs/{job}", server.base)).await;
    assert_eq!(rec["state"], "succeeded");
    // The job took every version the trainer announced: v6 after the last step.
    assert_eq!(rec["metrics"]["version"], STEPS, "{}", rec["metrics"]);
    // The external trainer's diagnostics reached the job's step history.
    let steps: Value = get_json(&client, &format!("{}/v1/jobs/{job}/steps", server.base)).await;
    let steps = steps["steps"].as_array().unwrap();
    assert_eq!(steps.len() as u64, STEPS);
    for s in steps {
        let t = &s["metrics"]["trainer"];
        assert!(t["grad_norm"].as_f64().is_some_and(|g| g >= 0.0), "{t}");
        assert!(t["lr"].as_f64().is_some_and(|l| l > 0.0), "{t}");
        assert!(t["entropy"].as_f64().is_some_and(|e| e > 0.0), "{t}");
        assert!(t["response_len_mean"].as_f64().is_some(), "{t}");
    }
    // The three newest versions stay on disk for the service, the trainer's own checkpoints
    // beside them.
    let mut files: Vec<String> = std::fs::read_dir(out.join("weights"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    assert_eq!(
        files,
        ["v4.safetensors", "v5.safetensors", "v6.safetensors"]
    );
    assert!(out.join("trainer").join("v6.safetensors").is_file());
}
