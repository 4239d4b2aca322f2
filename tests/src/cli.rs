//! The command-line tools as a user meets them: help that works, and no library chatter.

use std::process::Command;

/// A one-step simulated job (virtual time: it runs in milliseconds).
fn sim_job() -> String {
    tests::SpecBuilder::new()
        .pool("h800", "H800", 1, "")
        .multi_turn("lake", "")
        .rollout("steps = 1")
        .toml()
}

/// Writes [`sim_job`] to `dir/job.toml`.
fn sim_job_file(dir: &std::path::Path) -> std::path::PathBuf {
    let job = dir.join("job.toml");
    std::fs::write(&job, sim_job()).unwrap();
    job
}

/// `rollarc run JOB [--set S]… --data-dir DATA --report REPORT`.
fn run(
    job: &std::path::Path,
    sets: &[&str],
    data: &std::path::Path,
    report: &std::path::Path,
) -> std::process::Output {
    let mut c = Command::new(tests::rollarc_bin());
    c.arg("run").arg(job);
    for s in sets {
        c.args(["--set", s]);
    }
    c.arg("--data-dir")
        .arg(data)
        .arg("--report")
        .arg(report)
        .env_remove("RUST_LOG")
        .output()
        .unwrap()
}

/// `rollarc-fn --help` answers (it used to fail as an unknown function name); without a name it
/// is a usage error.
#[test]
fn rollarc_fn_has_help_and_a_usage_error() {
    let out = Command::new(tests::fn_bin())
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let help = String::from_utf8_lossy(&out.stdout);
    for name in ["math", "format", "env", "code", "judge", "--config", "PORT"] {
        assert!(help.contains(name), "{name} missing from:\n{help}");
    }
    let out = Command::new(tests::fn_bin()).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("usage: rollarc-fn"));
}

/// Commands print their own output only: the OpenTelemetry crates' info lines ("Global meter
/// provider is set") used to open the output of every command that opens the service.
#[test]
fn commands_print_no_library_info_lines() {
    let dir = tempfile::tempdir().unwrap();
    let job = sim_job_file(dir.path());
    let out = run(
        &job,
        &[],
        &dir.path().join("data"),
        &dir.path().join("report"),
    );
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("meter provider"), "library chatter:\n{err}");
    // Quiet by default: no info lines on the terminal; the whole log is in the data dir.
    assert!(!err.contains(" INFO "), "info on the terminal:\n{err}");
    // Without a terminal, progress is a plain line per step (bars need one).
    let out_text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out_text.contains("step 1/1") && out_text.contains("lake: success"),
        "{out_text}"
    );
    let log = std::fs::read_to_string(dir.path().join("data/logs/rollarc.log")).unwrap();
    assert!(log.contains(" INFO ") && log.contains("job-1"), "{log}");
    assert!(!log.contains("meter provider"), "{log}");
    // `-v`: info on the terminal too.
    let out = Command::new(tests::rollarc_bin())
        .arg("-v")
        .arg("run")
        .arg(&job)
        .arg("--data-dir")
        .arg(dir.path().join("data-v"))
        .arg("--report")
        .arg(dir.path().join("report-v"))
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(" INFO "),
        "{out:?}"
    );
    // An unknown job's report is an error naming it (it used to succeed silently).
    let out = Command::new(tests::rollarc_bin())
        .args(["report", "job-none", "--data-dir"])
        .arg(dir.path().join("data"))
        .arg("--out")
        .arg(dir.path().join("r"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no job job-none"),
        "{out:?}"
    );
}

/// A YAML job is refused clearly: by the CLI (naming the file and what to do) and by the API
/// (415, instead of TOML parse errors about YAML syntax); TOML sent as plain text still works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn yaml_job_files_run_and_bad_yaml_is_named() {
    let dir = tempfile::tempdir().unwrap();
    // The same one-step simulated job as `sim_job`, written as YAML (anchors, comments and
    // flow mappings included).
    let yaml = dir.path().join("job.yaml");
    std::fs::write(
        &yaml,
        "# one step on one simulated H800\n\
         tasks:\n\
         \x20 - domain: lake\n\
         \x20   group_size: 4\n\
         \x20   max_turns: 6\n\
         \x20   max_tokens_per_turn: 128\n\
         \x20   env:\n\
         \x20     kind: sim\n\
         \x20     reset_latency_s: {lognormal: {mu: -1.0, sigma: 1.0}}\n\
         \x20     step_latency_s: &step {normal: {mean: 2.0, std: 1.5}}\n\
         \x20     turns: {uniform: {low: 2, high: 6}}\n\
         \x20     observation_tokens: {constant: 64}\n\
         \x20     response_tokens: {uniform: {low: 16, high: 128}}\n\
         \x20     success_rate: 0.5\n\
         pools:\n\
         \x20 - {name: h800, device: H800, count: 1, backend: {kind: sim, model: qwen3-8b}}\n\
         rollout:\n\
         \x20 steps: 1\n",
    )
    .unwrap();
    let out = run(
        &yaml,
        &["rollout.steps=2"],
        &dir.path().join("data"),
        &dir.path().join("report"),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("report/summary.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(summary["steps"], 2, "--set applies to a YAML file too");
    assert_eq!(summary["spec"]["pools"][0]["device"], "H800");

    let bad = dir.path().join("bad.yml");
    std::fs::write(&bad, "tasks: [unclosed\n").unwrap();
    let out = Command::new(tests::rollarc_bin())
        .args(["--server", "http://127.0.0.1:9", "submit"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad.yml") && err.contains("not valid YAML"),
        "{err}"
    );

    let t = tests::TestServer::start().await;
    let r = t
        .client
        .post(t.url("/v1/jobs"))
        .header("content-type", "application/yaml")
        .body("tasks:\n  - domain: lake\n")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 415);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "unsupported_media_type", "{v}");
    let toml = sim_job();
    let r = t
        .client
        .post(t.url("/v1/jobs"))
        .header("content-type", "text/plain; charset=utf-8")
        .body(toml)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    // A misspelt field (#38): `submit` prints one readable problem, as `run` does, with a
    // suggestion and the field's line (not the raw JSON answer and three derived errors).
    let typo = dir.path().join("typo.toml");
    let text = sim_job();
    assert!(text.contains("group_size"), "{text}");
    std::fs::write(&typo, text.replacen("group_size", "group_szie", 1)).unwrap();
    let out = Command::new(tests::rollarc_bin())
        .args(["--server", &t.url(""), "submit"])
        .arg(&typo)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("typo.toml was refused (400 Bad Request, invalid_spec)"),
        "{err}"
    );
    let problems: Vec<&str> = err.lines().filter(|l| l.starts_with("  ")).collect();
    assert_eq!(problems.len(), 1, "{err}");
    // Relative paths in a job file name files next to it, wherever `submit` runs from
    // (#38: they used to resolve against the service's working directory).
    let project = dir.path().join("project");
    std::fs::create_dir(&project).unwrap();
    std::fs::write(
        project.join("rows.jsonl"),
        "{\"prompt\": \"1+1?\", \"answer\": \"2\"}\n",
    )
    .unwrap();
    let rows_job = project.join("rows.toml");
    std::fs::write(
        &rows_job,
        "[[tasks]]\ndomain = \"rows\"\nenv = { kind = \"prompt\" }\ndataset = { path = \"rows.jsonl\" }\n[[pools]]\nname = \"p\"\ndevice = \"H800\"\nbackend = { kind = \"sim\" }\n[rollout]\nsteps = 1\n",
    )
    .unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let out = Command::new(tests::rollarc_bin())
        .current_dir(elsewhere.path())
        .args(["--server", &t.url(""), "submit"])
        .arg(&rows_job)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        problems[0].contains("group_szie")
            && problems[0].contains("did you mean `group_size`? (line"),
        "{err}"
    );
}

/// One service per data directory: `rollarc run` on the directory of a running `rollarc
/// serve` is refused with the holder named (the two used to run each other's queued jobs and
/// end each other's processes), while `rollarc report` still reads it.
#[test]
fn a_second_service_on_a_data_directory_is_refused_naming_the_holder() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = tests::server::ServerProcess::start(&data);
    let job = sim_job_file(dir.path());
    let out = run(&job, &[], &data, &dir.path().join("report"));
    assert!(!out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("in use by another rollarc process"), "{err}");
    assert!(
        err.contains(&format!("pid {}", server.child.id())),
        "names the holder: {err}"
    );
    // A report reads the store under a running service (an unknown job is an error naming it).
    let out = Command::new(tests::rollarc_bin())
        .args(["report", "job-9", "--data-dir"])
        .arg(&data)
        .arg("--out")
        .arg(dir.path().join("r"))
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no job job-9"),
        "{out:?}"
    );
    drop(server);
    // Once the holder is gone the directory is free again.
    let out = run(&job, &[], &data, &dir.path().join("report"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `rollarc watch` without a terminal prints a plain line per step and the true final state
/// (it printed nothing, and filled the bar of a cancelled job); `rollarc status` prints a
/// table (`--json` the raw records).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_prints_plain_lines_and_status_a_table() {
    let dir = tempfile::tempdir().unwrap();
    let server = tests::server::ServerProcess::start(&dir.path().join("data"));
    let client = reqwest::Client::new();
    let job = tests::submit_job(&client, &server.base, tests::wall_clock_job(3, 1, 0.05)).await;
    let base = server.base.clone();
    let j = job.clone();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(tests::rollarc_bin())
            .args(["--server", &base, "watch", &j])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    for step in 1..=3 {
        assert!(text.contains(&format!("{job} step {step}/3 ")), "{text}");
    }
    assert!(
        text.trim_end()
            .ends_with(&format!("{job} succeeded after 3/3 steps")),
        "{text}"
    );
    // A cancelled job: the final line says where it stopped.
    let long = tests::submit_job(&client, &server.base, tests::wall_clock_job(1000, 1, 0.05)).await;
    tests::wait_job(
        &client,
        &server.base,
        &long,
        std::time::Duration::from_secs(60),
        |v| v["step"].as_u64().unwrap_or(0) >= 2,
    )
    .await;
    let r = client
        .post(format!("{}/v1/jobs/{long}/cancel", server.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let (base, l) = (server.base.clone(), long.clone());
    let out = tokio::task::spawn_blocking(move || {
        Command::new(tests::rollarc_bin())
            .args(["--server", &base, "watch", &l])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(!out.status.success(), "a cancelled job is not a success");
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.trim_end().lines().last().unwrap_or("");
    assert!(
        last.starts_with(&format!("{long} cancelled after ")),
        "{text}"
    );
    assert!(!last.contains("1000/1000"), "{text}");
    // status: a table with both jobs; --json the records.
    let base = server.base.clone();
    let (table, raw) = tokio::task::spawn_blocking(move || {
        let run = |extra: &[&str]| {
            let out = Command::new(tests::rollarc_bin())
                .args(["--server", &base, "status"])
                .args(extra)
                .output()
                .unwrap();
            assert!(out.status.success(), "{out:?}");
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        (run(&[]), run(&["--json"]))
    })
    .await
    .unwrap();
    let mut lines = table.lines();
    assert!(lines.next().unwrap().starts_with("ID"), "{table}");
    let rows: Vec<&str> = lines.collect();
    assert_eq!(rows.len(), 2, "{table}");
    assert!(rows[0].starts_with(&job) && rows[0].contains("succeeded") && rows[0].contains("3/3"));
    assert!(rows[1].starts_with(&long) && rows[1].contains("cancelled"));
    let v: serde_json::Value = serde_json::from_str(&raw).unwrap();
    assert_eq!(v["jobs"].as_array().unwrap().len(), 2);
}

/// `--set PATH=VALUE` changes a field of the job file for one run; a bad path or an unknown
/// field is an error naming it.
#[test]
fn set_overrides_a_field_of_the_job_file() {
    let dir = tempfile::tempdir().unwrap();
    let job = sim_job_file(dir.path());
    let (data, report) = (dir.path().join("data"), dir.path().join("report"));
    let run = |sets: &[&str]| run(&job, sets, &data, &report);
    let out = run(&["rollout.steps=3", "tasks[0].group_size=2"]);
    assert!(out.status.success(), "{out:?}");
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("report/summary.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(summary["steps"], 3);
    assert_eq!(summary["spec"]["tasks"][0]["group_size"], 2);
    let out = run(&["tasks[3].group_size=2"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no [3]"),
        "{out:?}"
    );
    let out = run(&["rollout.stepz=3"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("stepz"),
        "{out:?}"
    );
}

/// The service config the Kubernetes manifest carries (its ConfigMap) is one `rollarc serve`
/// starts with: ready, the API closed to callers without a token, `/metrics` open to the
/// scraper its pod annotations invite.
#[tokio::test]
async fn the_kubernetes_manifests_config_starts_the_service() {
    let manifest = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../infra/deploy/service/rollarc.yaml"
    ))
    .unwrap();
    let mut config = String::new();
    let mut inside = false;
    for line in manifest.lines() {
        if line.trim_end() == "  service.toml: |" {
            inside = true;
        } else if inside && (line.is_empty() || line.starts_with("    ")) {
            config.push_str(line.strip_prefix("    ").unwrap_or(""));
            config.push('\n');
        } else if inside {
            break;
        }
    }
    assert!(config.contains("[access]"), "{config}");
    let dir = tempfile::tempdir().unwrap();
    // `serve --addr` and `--data-dir` override the file's (the pod's) address and directory.
    let server = tests::server::ServerProcess::start_with(&dir.path().join("data"), Some(&config));
    let c = reqwest::Client::new();
    let get = |path: &str| c.get(format!("{}{path}", server.base)).send();
    assert_eq!(get("/readyz").await.unwrap().status(), 200);
    assert_eq!(get("/healthz").await.unwrap().status(), 200);
    assert_eq!(get("/v1/jobs").await.unwrap().status(), 401);
    assert_eq!(get("/metrics").await.unwrap().status(), 200);
}

/// `rollarc profile` turns a finished real job (a short quickstart) into a simulation spec
/// that `rollarc sim` runs; a job with too few steps is refused by name.
#[test]
fn a_real_job_profiles_into_a_spec_the_simulator_runs() {
    let dir = tempfile::tempdir().unwrap();
    let quickstart =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/quickstart.toml");
    let (data, report) = (dir.path().join("data"), dir.path().join("report"));
    let out = run(
        &quickstart,
        &["rollout.steps=4", "trainer.decay_steps=4"],
        &data,
        &report,
    );
    assert!(out.status.success(), "{out:?}");
    let spec = dir.path().join("profiled.json");
    let out = Command::new(tests::rollarc_bin())
        .args(["profile", "job-1", "--data-dir"])
        .arg(&data)
        .arg("--out")
        .arg(&spec)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("engine step") && said.contains("training"),
        "{said}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&spec).unwrap()).unwrap();
    assert_eq!(v["trainer"]["kind"], "sim");
    assert!(
        v["pools"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["backend"]["kind"] == "sim"
                && p["backend"]["measured"]["step_s"].as_f64().is_some())
    );
    assert!(
        v["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t["env"]["kind"] == "sim")
    );
    let out = Command::new(tests::rollarc_bin())
        .arg("sim")
        .arg(&spec)
        .args(["--set", "rollout.batch_size=24"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("traj/s"),
        "{out:?}"
    );
    // A simulated one-step job has too few steps to fit anything.
    let job = sim_job_file(dir.path());
    let other = dir.path().join("other");
    assert!(run(&job, &[], &other, &report).status.success());
    let out = Command::new(tests::rollarc_bin())
        .args(["profile", "job-1", "--data-dir"])
        .arg(&other)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("a profile needs at least 3"),
        "{out:?}"
    );
}

/// A dataset named relative to the job file is found there, wherever `rollarc run` and
/// `rollarc submit` are started from (they used to resolve it against the working directory,
/// or the server's, and say nothing of it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dataset_path_resolves_against_the_job_files_directory() {
    let jobs = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let rows: Vec<String> = (0..4)
        .map(|i| format!("{{\"prompt\": \"q{i}\", \"answer\": \"{i}\"}}"))
        .collect();
    std::fs::write(jobs.path().join("rows.jsonl"), rows.join("\n")).unwrap();
    let job = jobs.path().join("job.toml");
    std::fs::write(
        &job,
        "[[tasks]]\ndomain = \"rows\"\ngroup_size = 2\nmax_turns = 1\nenv = { kind = \"prompt\" }\ndataset = { path = \"rows.jsonl\" }\n[[pools]]\nname = \"h800\"\ndevice = \"H800\"\nbackend = { kind = \"sim\", model = \"qwen3-8b\" }\n[rollout]\nbatch_size = 2\nsteps = 1\n",
    )
    .unwrap();
    let out = Command::new(tests::rollarc_bin())
        .current_dir(elsewhere.path())
        .arg("run")
        .arg(&job)
        .args(["--data-dir", "data", "--report", "report"])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    // Against a running service, whose working directory is a third place.
    let server = tests::server::ServerProcess::start(&elsewhere.path().join("served"));
    let out = Command::new(tests::rollarc_bin())
        .current_dir(elsewhere.path())
        .args(["--server", &server.base, "submit"])
        .arg(&job)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("job-1"),
        "{out:?}"
    );
    // Without the job file's directory the same relative path is not found, and the error
    // names the field.
    let text = std::fs::read_to_string(&job).unwrap();
    let r = reqwest::Client::new()
        .post(format!("{}/v1/jobs", server.base))
        .header("content-type", "application/toml")
        .body(text)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("tasks[0].dataset.path"));
}
