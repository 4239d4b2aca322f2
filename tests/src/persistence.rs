//! Restart persistence: SIGKILL the service mid-job, start it again on the same data dir.

use std::time::Duration;

use tests::{page_all, wait_job};

use tests::server::{ServerProcess as Server, group_alive, ledger_groups};

fn start(dir: &std::path::Path) -> Server {
    Server::start(dir)
}

fn slow_spec(steps: u64) -> String {
    tests::wall_clock_job(steps, 2, 0.02)
}

/// An external environment of the protocol as a bash script that ends each episode in one
/// step; `prelude` runs first.
fn env_script(prelude: &str) -> String {
    format!(
        r#"{prelude}while read l; do
case "$l" in
  *reset*) echo '{{"v":1,"ok":true,"observation":"go"}}' ;;
  *step*) sleep 0.05; echo '{{"v":1,"ok":true,"observation":"","reward":1.0,"terminated":true,"info":{{"success":true}}}}' ;;
  *close*) echo '{{"v":1,"ok":true}}'; exit 0 ;;
esac
done"#
    )
}

/// A task of `envs` external environments running `script` in `sandbox` (`bwrap` or `none`).
fn external_task(domain: &str, sandbox: &str, envs: u32, script: &str) -> String {
    format!(
        "[[tasks]]\ndomain = \"{domain}\"\ngroup_size = 2\nmax_turns = 1\nenvs = {envs}\nenv = {{ kind = \"external\", sandbox = \"{sandbox}\", command = [\"bash\", \"-c\", '''{script}'''] }}\n"
    )
}

/// A job of one external task (see [`external_task`]), one group per step, steps enough.
fn external_job(sandbox: &str, envs: u32, script: &str) -> String {
    tests::SpecBuilder::new()
        .pool("h20", "H20", 1, "")
        .raw_task(&external_task("ext", sandbox, envs, script))
        .rollout("batch_size = 1")
        .rollout("steps = 100000")
        .toml()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_job_loses_and_duplicates_nothing_and_the_job_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let client = reqwest::Client::new();
    let steps = 25u64;
    let first = start(dir.path());
    let id = tests::submit_job(&client, &first.base, slow_spec(steps)).await;
    wait_job(&client, &first.base, &id, Duration::from_secs(60), |v| {
        v["step"].as_u64().unwrap_or(0) >= 3
    })
    .await;
    let before = page_all(&client, &first.base, &id, 50).await;
    assert!(!before.is_empty());
    // SIGKILL: no chance to clean up.
    first.sigkill();

    let second = start(dir.path());
    let listed: serde_json::Value = client
        .get(format!("{}/v1/jobs", second.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        listed["jobs"][0]["id"],
        id.as_str(),
        "the job is still listed after the restart"
    );
    let job = wait_job(&client, &second.base, &id, Duration::from_secs(120), |v| {
        v["state"] == "succeeded" || v["state"] == "failed"
    })
    .await;
    assert_eq!(job["state"], "succeeded", "{job}");
    assert_eq!(job["step"], steps);
    let after = page_all(&client, &second.base, &id, 50).await;
    // Every trajectory committed before the kill is still there, at the same cursor.
    for row in &before {
        assert!(
            after.contains(row),
            "trajectory {row:?} lost or moved after the restart"
        );
    }
    let ids: std::collections::BTreeSet<_> = after.iter().map(|r| r.1.clone()).collect();
    assert_eq!(ids.len(), after.len(), "a trajectory is returned twice");
    assert!(after.windows(2).all(|w| w[0].0 < w[1].0));
    // The resumed run (epoch 1) produced the remaining steps' trajectories.
    assert!(
        after.iter().any(|r| r.1.starts_with("r1-")),
        "no trajectory from the resumed run"
    );
    // Group numbering continues across the restart: no group id is used by two attempts
    // (ids read `r{epoch}-g{group}-e{episode}`).
    let mut epochs_of_group: std::collections::BTreeMap<&str, std::collections::BTreeSet<&str>> =
        Default::default();
    for (_, tid) in &after {
        let mut parts = tid.split('-');
        let (epoch, group) = (parts.next().unwrap(), parts.next().unwrap());
        epochs_of_group.entry(group).or_default().insert(epoch);
    }
    let shared: Vec<_> = epochs_of_group
        .iter()
        .filter(|(_, e)| e.len() > 1)
        .collect();
    assert!(
        shared.is_empty(),
        "group ids reused by the resumed run: {shared:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_intake_and_leaves_running_jobs_resumable() {
    let dir = tempfile::tempdir().unwrap();
    let client = reqwest::Client::new();
    let mut s = start(dir.path());
    let id = tests::submit_job(&client, &s.base, slow_spec(1000)).await;
    wait_job(&client, &s.base, &id, Duration::from_secs(60), |v| {
        v["step"].as_u64().unwrap_or(0) >= 1
    })
    .await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(s.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    // Default grace is 10 s; the job cannot finish 1000 steps, so it is interrupted.
    let status = tokio::task::spawn_blocking(move || {
        let st = s.child.wait();
        (st, s)
    })
    .await
    .unwrap();
    assert!(status.0.unwrap().success(), "serve exits 0 after a signal");
    let store = job::store::Store::open(&dir.path().join("rollarc.db")).unwrap();
    let j = store.get(&id).unwrap().unwrap();
    assert_eq!(
        j.state,
        job::store::JobState::Running,
        "an interrupted job stays running, to resume at the next start"
    );
}

/// Hardening: a job during which the service process dies twice in a row before completing a
/// training step is failed at the next start (with the reason), instead of being resumed into
/// the same death again and again. (Deaths while the job makes progress are the chaos test's:
/// those jobs resume.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_keeps_killing_the_service_is_failed_not_crash_looped() {
    let dir = tempfile::tempdir().unwrap();
    let client = reqwest::Client::new();
    let kill = |s: Server| {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(s.child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        drop(s);
    };
    let first = start(dir.path());
    // Environment steps of 5 s: no training step completes before each kill.
    let id = tests::submit_job(&client, &first.base, tests::wall_clock_job(1000, 2, 5.0)).await;
    let mut server = first;
    for death in 1..=2u64 {
        let seen = wait_job(&client, &server.base, &id, Duration::from_secs(60), |v| {
            v["state"] == "running"
        })
        .await;
        assert_eq!(seen["step"], 0);
        // The attempt is recorded as the job's thread starts.
        tokio::time::sleep(Duration::from_millis(500)).await;
        kill(server);
        server = start(dir.path());
        if death == 1 {
            // One death: the job resumes.
            let v = wait_job(&client, &server.base, &id, Duration::from_secs(60), |v| {
                v["state"] == "running" || v["state"] == "failed"
            })
            .await;
            assert_eq!(v["state"], "running", "{v}");
        }
    }
    let v = wait_job(&client, &server.base, &id, Duration::from_secs(30), |v| {
        v["state"] == "failed" || v["state"] == "succeeded"
    })
    .await;
    assert_eq!(v["state"], "failed", "{v}");
    let why = v["error"].as_str().unwrap_or_default();
    assert!(
        why.contains("died 2 times in a row while this job ran alone"),
        "{v}"
    );
}

/// Round 2 (#35): deaths while several jobs run blame none of them. Two slow jobs (no step,
/// no trajectory before each kill) survive two SIGKILLs aimed at the service and resume;
/// under the old rule both were failed after the second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deaths_while_several_jobs_run_fail_none_of_them() {
    let dir = tempfile::tempdir().unwrap();
    let client = reqwest::Client::new();
    let mut server = start(dir.path());
    let ids = [
        tests::submit_job(&client, &server.base, tests::wall_clock_job(1000, 2, 5.0)).await,
        tests::submit_job(&client, &server.base, tests::wall_clock_job(1000, 2, 5.0)).await,
    ];
    for _ in 0..2 {
        for id in &ids {
            wait_job(&client, &server.base, id, Duration::from_secs(60), |v| {
                v["state"] == "running"
            })
            .await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(server.child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        drop(server);
        server = start(dir.path());
    }
    for id in &ids {
        let v = wait_job(&client, &server.base, id, Duration::from_secs(60), |v| {
            v["state"] == "running" || v["state"] == "failed"
        })
        .await;
        assert_eq!(v["state"], "running", "{v}");
        let _ = client
            .post(format!("{}/v1/jobs/{id}/cancel", server.base))
            .send()
            .await;
    }
}

/// Hardening: processes a SIGKILLed service started (here an external environment, as
/// function instances are) do not outlive the next start: each group is listed in the data
/// directory and killed when the service comes back (they used to keep running beside the
/// new ones).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_left_by_a_killed_service_are_ended_at_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let client = reqwest::Client::new();
    // Each environment leaves a helper running in its group (it outlives the program's stdin).
    let spec = external_job("none", 3, &env_script("sleep 300 &\n"));
    let first = start(dir.path());
    let id = tests::submit_job(&client, &first.base, spec).await;
    wait_job(&client, &first.base, &id, Duration::from_secs(60), |v| {
        v["step"].as_u64().unwrap_or(0) >= 2
    })
    .await;
    first.sigkill();
    // The ledger as the service left it: the groups it was running when it died (a group
    // closed normally takes its entry with it).
    let ledger = dir.path().join("processes");
    assert!(ledger.is_dir());
    let groups = ledger_groups(dir.path());
    assert!(
        !groups.is_empty(),
        "the running environments are not listed"
    );
    let alive = group_alive;
    // Their helpers outlive the killed service (nothing else would end them).
    assert!(
        groups.iter().any(|&g| alive(g)),
        "no environment survived the kill: the check below would prove nothing"
    );
    let second = start(dir.path());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while groups.iter().any(|&g| alive(g)) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "processes of the killed service still run: {:?}",
            groups.iter().filter(|&&g| alive(g)).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = client
        .post(format!("{}/v1/jobs/{id}/cancel", second.base))
        .send()
        .await;
}

/// The command line of process `pid`, split at its NULs.
fn cmdline(pid: u32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            b.split(|c| *c == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// A sandbox that bubblewrap was still setting up when the service was SIGKILLed has left the
/// service's process group and outlives it (bubblewrap asks for its death signal only after
/// the setup). A process carrying the sandboxes' mark in a group of its own stands in for it:
/// the next start on the data directory ends it. The mark is on bubblewrap's command line and
/// not in the sandboxed program's environment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_left_starting_by_a_killed_service_is_ended_at_the_next_start() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let client = reqwest::Client::new();
    let spec = external_job("bwrap", 2, &env_script(""));
    let first = start(dir.path());
    let id = tests::submit_job(&client, &first.base, spec).await;
    wait_job(&client, &first.base, &id, Duration::from_secs(60), |v| {
        v["step"].as_u64().unwrap_or(0) >= 1
    })
    .await;
    let procs = tests::server::descendants(first.child.id());
    let mark = procs
        .iter()
        .map(|(p, _)| cmdline(*p))
        .find_map(|c| {
            let i = c.iter().position(|a| a == "ROLLARC_SANDBOX")?;
            (c.get(i.checked_sub(1)?)? == "--setenv").then(|| c.get(i + 1).cloned())?
        })
        .expect("a running sandbox carries the mark on bubblewrap's command line");
    let program = procs
        .iter()
        .find(|(p, _)| cmdline(*p).first().is_some_and(|a| a == "bash"))
        .expect("the sandboxed environment runs")
        .0;
    let environ = std::fs::read(format!("/proc/{program}/environ")).unwrap();
    assert!(
        !String::from_utf8_lossy(&environ).contains("ROLLARC_SANDBOX"),
        "the mark stays out of the program's environment"
    );
    // Outside the service's groups and tree, as a sandbox caught starting is.
    let mut stray = std::process::Command::new("sh")
        .args([
            "-c",
            "sleep 300; :",
            "sh",
            "--setenv",
            "ROLLARC_SANDBOX",
            &mark,
        ])
        .process_group(0)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Its group (the stand-in's `sleep` too) goes when the test ends, whatever happens.
    let _stray_group = infra::process::GroupGuard::new(Some(stray.id()));
    first.sigkill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        stray.try_wait().unwrap().is_none(),
        "the stand-in outlives the killed service: the check below would prove nothing"
    );
    let second = start(dir.path());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while stray.try_wait().unwrap().is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "a marked process of the killed service still runs"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = client
        .post(format!("{}/v1/jobs/{id}/cancel", second.base))
        .send()
        .await;
}

/// Hardening (#35): a service SIGKILLed and never restarted leaves nothing running. Every
/// child asked the kernel to kill it when its parent died (see `infra::process::spawn`):
/// the function instances (`rollarc-fn`), a sandboxed environment (and everything in its
/// PID namespace) and an unsandboxed one all exit within 5 s. They used to run on for good
/// (the ledger only sweeps them at the next start on the same data directory).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_service_that_is_not_restarted_leaves_no_process_running() {
    let dir = tempfile::tempdir().unwrap();
    let client = reqwest::Client::new();
    let script = env_script("");
    let external = |domain: &str, sandbox: &str| external_task(domain, sandbox, 2, &script);
    let spec = tests::SpecBuilder::new()
        .pool("h20", "H20", 1, "")
        .raw_task(&external("boxed", "bwrap"))
        .raw_task(&external("open", "none"))
        .raw_task("[[tasks]]\ndomain = \"add\"\ngroup_size = 2\nmax_turns = 1\nmax_tokens_per_turn = 8\nreward = [\"math\"]\n[tasks.env]\nkind = \"arithmetic\"\n")
        .rollout("batch_size = 3")
        .rollout("steps = 100000")
        .extra("[sim]\nclock = \"real\"\n[reward]\nplacement = \"local\"\n[reward.functions.math]\nkind = \"builtin\"\nfunction = \"math\"\ntimeout_s = 5\n[reward.functions.math.scaling]\nmin-scale = 2\n")
        .toml();
    let server = start(dir.path());
    let id = tests::submit_job(&client, &server.base, spec).await;
    wait_job(&client, &server.base, &id, Duration::from_secs(90), |v| {
        v["step"].as_u64().unwrap_or(0) >= 2 || v["state"] == "failed"
    })
    .await;
    let pid = server.child.id();
    let started = tests::server::descendants(pid);
    let programs = |procs: &[(u32, u64)]| -> Vec<String> {
        procs
            .iter()
            .filter_map(|(p, _)| std::fs::read_to_string(format!("/proc/{p}/comm")).ok())
            .map(|c| c.trim().to_string())
            .collect()
    };
    let names = programs(&started);
    for want in ["rollarc-fn", "bwrap", "bash"] {
        assert!(
            names.iter().any(|n| n == want),
            "no {want} among the service's processes {names:?}: the check would prove nothing"
        );
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let left: Vec<(u32, u64)> = started
            .iter()
            .copied()
            .filter(|p| !tests::server::still_running(&[*p]).is_empty())
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "5 s after the service's death these still run: {:?}",
            programs(&left)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(server);
}

/// Round 2 (#35): two quick SIGKILL restarts while a job alone on the service is in a slow
/// training step (its trajectories are quick, its steps take 3 s): the job resumes both times
/// and succeeds. Under the old rule (two deaths before a step completed) it was failed as a
/// crash loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quick_restarts_during_a_slow_step_resume_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let seen = tests::chaos::round2::quick_restarts(dir.path(), 2, 3.0).await;
    assert_eq!(seen.restarts, 2);
    assert_eq!(seen.state, "succeeded", "{seen:?}");
    assert_eq!(seen.step, 3);
}
