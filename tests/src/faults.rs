//! Bounded fault handling: a reward function or an environment that keeps failing fails its
//! job within seconds, with an error naming it, the instance failure and the last response —
//! instead of keeping the job busy (masking every trajectory) until someone cancels it.

use std::time::Duration;

use tests::{SpecBuilder, TestServer, wait_job};

/// The test function server (Python, stdlib only); see its modes there.
use tests::chaos::round2::SCORING_SERVER as BAD_FUNCTION;

/// A single-turn arithmetic job scored by the function `broken` (`command` + `args`), with a
/// fault budget of 3 failures over 2 s.
fn job_with_function(args: &str) -> String {
    SpecBuilder::new()
        .pool("h800", "H800", 1, "")
        .raw_task("[[tasks]]\ndomain = \"add\"\ngroup_size = 2\nmax_turns = 1\nreward = [\"broken\"]\n[tasks.env]\nkind = \"arithmetic\"\n")
        .rollout("batch_size = 2")
        .rollout("steps = 1000")
        .rollout("fault_window_s = 2")
        .rollout("fault_min_failures = 3")
        .extra(&format!(
            "[sim]\nclock = \"real\"\n[reward]\nplacement = \"local\"\n[reward.functions.broken]\nkind = \"command\"\ncommand = \"python3\"\nargs = {args}\ntimeout_s = 1\n"
        ))
        .toml()
}

/// Submits `spec`, waits (at most 60 s) for the job to end; returns its error.
async fn fails_with(spec: String) -> String {
    let s = TestServer::start().await;
    let id = tests::submit_job(&s.client, &s.url(""), spec).await;
    let t0 = tokio::time::Instant::now();
    let job = wait_job(&s.client, &s.url(""), &id, Duration::from_secs(60), |v| {
        v["state"] != "queued" && v["state"] != "running"
    })
    .await;
    assert_eq!(job["state"], "failed", "{job}");
    let error = job["error"].as_str().unwrap_or_default().to_string();
    eprintln!("failed after {:.1} s: {error}", t0.elapsed().as_secs_f64());
    error
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_looping_function_fails_its_job_naming_it_and_its_stderr() {
    let crash = r#"["-c", "import sys; sys.stderr.write('cannot load the model weights\\n'); sys.stderr.flush(); sys.exit(3)"]"#;
    let error = fails_with(job_with_function(crash)).await;
    assert!(error.contains("reward function `broken`"), "{error}");
    assert!(error.contains("never became ready"), "{error}");
    assert!(error.contains("exit status: 3"), "{error}");
    assert!(error.contains("cannot load the model weights"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_that_never_becomes_ready_fails_its_job() {
    let idle = r#"["-c", "import time; time.sleep(600)"]"#;
    let error = fails_with(job_with_function(idle)).await;
    assert!(error.contains("reward function `broken`"), "{error}");
    // (The autoscaler may have asked for more than one instance by then.)
    assert!(error.contains("0 instance(s) ready"), "{error}");
    assert!(!error.contains(", 0 starting"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_returning_invalid_scores_fails_its_job_with_the_last_response() {
    let args = format!("['-c', '''{BAD_FUNCTION}''', 'invalid']");
    let error = fails_with(job_with_function(&args)).await;
    assert!(error.contains("reward function `broken`"), "{error}");
    assert!(error.contains("is 5, outside [0, 1]"), "{error}");
}

/// Round 2 (#35): with the default fault window (30 s), a function that answers every call
/// with HTTP 500 (or an invalid score) fails its job within seconds: a run of answers
/// breaks it after a tenth of the window. (It used to take 76–97 s and ~3,900 masked
/// trajectories.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_answering_errors_fails_its_job_within_a_tenth_of_the_window() {
    for mode in ["error500", "invalid"] {
        let args = format!("['-c', '''{BAD_FUNCTION}''', '{mode}']");
        let spec = job_with_function(&args)
            .replace("fault_window_s = 2\n", "")
            .replace("fault_min_failures = 3\n", "");
        let t0 = tokio::time::Instant::now();
        let error = fails_with(spec).await;
        let took = t0.elapsed();
        assert!(error.contains("reward function `broken`"), "{error}");
        assert!(took < Duration::from_secs(20), "{mode}: {took:?}: {error}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_that_times_out_fails_its_job() {
    let args = format!("['-c', '''{BAD_FUNCTION}''', 'sleep']");
    let error = fails_with(job_with_function(&args)).await;
    assert!(error.contains("reward function `broken`"), "{error}");
    assert!(
        error.contains("timed out") || error.contains("deadline"),
        "{error}"
    );
    assert!(error.contains("instance(s) ready"), "{error}");
    assert!(!error.contains("0 instance(s) ready"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_environment_that_keeps_crashing_fails_its_job() {
    let spec = SpecBuilder::new()
        .pool("h800", "H800", 1, "")
        .raw_task("[[tasks]]\ndomain = \"ext\"\ngroup_size = 2\nmax_turns = 2\nenvs = 2\nenv = { kind = \"external\", sandbox = \"none\", command = [\"python3\", \"-c\", \"import sys; sys.stderr.write('no such map: level-9\\\\n'); sys.exit(2)\"] }\n")
        .rollout("batch_size = 2")
        .rollout("steps = 1000")
        .rollout("fault_window_s = 2")
        .rollout("fault_min_failures = 3")
        .toml();
    let error = fails_with(spec).await;
    assert!(error.contains("environments of task `ext`"), "{error}");
    assert!(error.contains("consecutive failures"), "{error}");
}

/// Round 2 (#35): a healthy reward function whose ready instances are all SIGKILLed from
/// outside every 700 ms does not fail its job: an instance that became ready and was then
/// killed is replaced, not counted as a crash loop. The job succeeds with at least 99 % of
/// its trajectories scored. (`make chaos` also kills starting instances; before, that failed
/// the job after 3 kills: "its last 3 instances died".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_function_instances_from_outside_does_not_fail_the_job() {
    let s = TestServer::start().await;
    let seen = tests::chaos::round2::killed_instances(&s.url(""), 10, true).await;
    assert!(seen.kills >= 5, "{seen:?}");
    assert!(seen.clean(), "{seen:?}");
}

/// The first hour (#38): a reward written as one Python function (`kind = "python"`, a file
/// with `compute_score(row, answer, transcript)`) scores a job, in the sandbox (it scores 1
/// only where it sees what a sandbox shows: another uid, no home, no network), and one that
/// runs too long is timed out like any function: its job fails naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_reward_function_scores_in_the_sandbox_and_is_timed_out() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("my_reward.py");
    std::fs::write(
        &file,
        r#"import os, socket, time
def sandboxed():
    try:
        socket.create_connection(("1.1.1.1", 53), timeout=0.5)
        return False
    except OSError:
        pass
    return os.getuid() != 0 and not os.path.exists("/root/.cache")
def compute_score(row, answer, transcript):
    if row["answer"] == "slow":
        time.sleep(30)
    return {"score": 1.0 if sandboxed() else 0.0, "answer_seen": answer}
"#,
    )
    .unwrap();
    let job = |steps: u64| {
        SpecBuilder::new()
            .pool("h800", "H800", 1, "")
            .raw_task("[[tasks]]\ndomain = \"add\"\ngroup_size = 2\nmax_turns = 1\nreward = [\"mine\"]\n[tasks.env]\nkind = \"arithmetic\"\n")
            .rollout("batch_size = 2")
            .rollout(&format!("steps = {steps}"))
            .rollout("fault_window_s = 2")
            .rollout("fault_min_failures = 3")
            .extra(&format!(
                "[sim]\nclock = \"real\"\n[reward]\nplacement = \"local\"\n[reward.functions.mine]\nkind = \"python\"\nfile = \"{}\"\nitem_timeout_s = 2\ntimeout_s = 10\n",
                file.display()
            ))
            .toml()
    };
    let s = TestServer::start().await;
    let id = tests::submit_job(&s.client, &s.url(""), job(2)).await;
    let done = wait_job(&s.client, &s.url(""), &id, Duration::from_secs(120), |v| {
        v["state"] != "queued" && v["state"] != "running"
    })
    .await;
    assert_eq!(done["state"], "succeeded", "{done}");
    let rows = tests::all_rows(&s.client, &s.url(""), &id, 100).await;
    assert!(!rows.is_empty());
    for r in &rows {
        let t = &r["trajectory"];
        assert_eq!(t["reward"], 1.0, "scored outside a sandbox: {t}");
        // The verdict keeps what the function said: its name, score and details.
        let f = &t["verdict"]["functions"][0];
        assert!(f["name"].as_str().unwrap().starts_with("mine"), "{t}");
        assert_eq!(f["score"], 1.0, "{t}");
        let answer = t["final_text"].as_str().unwrap_or("");
        assert_eq!(f["details"]["answer_seen"], answer, "{t}");
    }
    // The stored spec shows the built-in form.
    let spec: serde_json::Value = s
        .client
        .get(s.url(&format!("/v1/jobs/{id}/spec")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(spec["reward"]["functions"]["mine"]["function"], "python");
    // A function that runs past its per-item limit.
    std::fs::write(
        &file,
        "import time\ndef compute_score(row, answer, transcript):\n    time.sleep(30)\n    return 1.0\n",
    )
    .unwrap();
    let error = fails_with(job(1000)).await;
    assert!(error.contains("reward function `mine`"), "{error}");
    // Its own per-item limit refuses the request, or the call's deadline ends it first
    // (the items of a request queue for the interpreter).
    assert!(
        error.contains("ran past timeout_s = 2 s") || error.contains("deadline exceeded"),
        "{error}"
    );
}
