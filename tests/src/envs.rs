//! External environments over the protocol: round trip against `rollarc env-serve`, malformed,
//! oversized and hanging programs, and the gymnasium bridge with four real environments.

use std::time::Duration;

use actors::env::external::{ExternalConfig, ExternalEnv};
use actors::env::protocol::ProtocolError;
use actors::env::{EnvError, Environment};
use tests::rollarc_bin;

fn external(command: Vec<String>, timeout_ms: u64, max_bytes: usize) -> ExternalEnv {
    ExternalEnv::new(ExternalConfig {
        command,
        call_timeout: Duration::from_millis(timeout_ms),
        max_message_bytes: max_bytes,
        workdir: None,
        protocol: 1,
    })
}

fn sh(script: &str) -> Vec<String> {
    vec!["sh".into(), "-c".into(), script.into()]
}

#[tokio::test]
async fn the_protocol_round_trips_a_builtin_game() {
    let spec = r#"{"kind":"frozenlake","size":4}"#;
    let mut remote = external(
        vec![
            rollarc_bin().display().to_string(),
            "env-serve".into(),
            spec.into(),
        ],
        10_000,
        1 << 20,
    );
    let mut local = job::envs::builtin(&serde_json::from_str(spec).unwrap()).unwrap();
    assert_eq!(
        remote.reset(3).await.unwrap().text,
        local.reset_boxed(3, None).await.unwrap().text
    );
    for a in ["down", "down", "jump", "right", "right", "down", "right"] {
        let (r, l) = (
            remote.step(a, &Default::default()).await.unwrap(),
            local.step_boxed(a, &Default::default()).await.unwrap(),
        );
        assert_eq!(
            (
                r.observation.text,
                r.reward,
                r.terminated,
                r.success,
                r.invalid_action
            ),
            (
                l.observation.text,
                l.reward,
                l.terminated,
                l.success,
                l.invalid_action
            ),
            "action {a}"
        );
    }
    remote.close().await;
}

#[tokio::test]
async fn malformed_and_oversized_replies_are_errors_with_the_line() {
    let mut e = external(
        sh("read l; echo 'this is not json'; sleep 5"),
        5_000,
        1 << 20,
    );
    let err = e.reset(0).await.unwrap_err();
    let chain = infra::error_chain(&err);
    assert!(
        matches!(err, EnvError::Protocol(ProtocolError::Malformed { .. }))
            && chain.contains("malformed")
            && chain.contains("this is not json"),
        "{chain}"
    );
    let mut e = external(
        sh("read l; head -c 300000 /dev/zero | tr '\\0' a; echo"),
        5_000,
        100_000,
    );
    let err = e.reset(0).await.unwrap_err();
    let chain = infra::error_chain(&err);
    assert!(
        matches!(
            err,
            EnvError::Protocol(ProtocolError::Oversized { limit: 100_000, .. })
        ) && chain.contains("more than 100000 bytes")
            && chain.contains("aaaa"),
        "{chain}"
    );
    let mut e = external(sh(r#"read l; echo '{"v":7,"ok":true}'"#), 5_000, 1 << 20);
    let err = e.reset(0).await.unwrap_err();
    assert!(
        matches!(
            err,
            EnvError::Protocol(ProtocolError::Version { got: 7, .. })
        ),
        "{}",
        infra::error_chain(&err)
    );
    let mut e = external(
        sh(r#"read l; echo '{"v":1,"ok":false,"error":"no such level"}'"#),
        5_000,
        1 << 20,
    );
    let err = e.reset(0).await.unwrap_err();
    assert!(
        matches!(&err, EnvError::Reported(why) if why == "no such level"),
        "{err}"
    );
    let mut e = external(vec!["/nonexistent/program".into()], 5_000, 1 << 20);
    let err = e.reset(0).await.unwrap_err();
    let chain = infra::error_chain(&err);
    assert!(
        matches!(err, EnvError::Spawn(_))
            && chain.contains("cannot start /nonexistent/program")
            && chain.contains("No such file"),
        "{chain}"
    );
}

#[tokio::test]
async fn a_hanging_program_times_out_and_its_process_group_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("pids");
    // The program starts a grandchild, records both pids, then hangs.
    let script = format!(
        "sleep 1000 & echo $! > {p}; echo $$ >> {p}; read l; sleep 1000",
        p = pidfile.display()
    );
    let mut e = external(sh(&script), 300, 1 << 20);
    let err = e.reset(0).await.unwrap_err();
    assert!(matches!(err, EnvError::Timeout(_)), "{err}");
    let pids: Vec<i32> = std::fs::read_to_string(&pidfile)
        .unwrap()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 2);
    // Both the program and its grandchild are gone (reaped or killed) within a second.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let alive: Vec<_> = pids
            .iter()
            .filter(|p| {
                std::fs::read_to_string(format!("/proc/{p}/stat"))
                    .map(|s| !s.contains(") Z "))
                    .unwrap_or(false)
            })
            .collect();
        if alive.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "processes {alive:?} survived the kill"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn bridge(env_id: &str, kwargs: Option<&str>) -> ExternalEnv {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../envs/gymnasium_bridge.py");
    let mut cmd = vec![
        "python3".to_string(),
        script.to_string(),
        env_id.to_string(),
    ];
    if let Some(k) = kwargs {
        cmd.extend(["--kwargs".to_string(), k.to_string()]);
    }
    external(cmd, 60_000, 1 << 20)
}

#[tokio::test]
async fn the_gymnasium_bridge_serves_four_real_environments() {
    // FrozenLake (not slippery): the known path reaches the goal.
    let mut e = bridge("FrozenLake-v1", Some(r#"{"is_slippery": false}"#));
    assert!(e.reset(1).await.unwrap().text.starts_with("[S]FFF"));
    let mut last = None;
    for a in ["down", "down", "right", "right", "down", "right"] {
        last = Some(e.step(a, &Default::default()).await.unwrap());
    }
    let last = last.unwrap();
    assert!(last.terminated && last.success && last.reward == 1.0);
    e.close().await;
    // Taxi: moves by name, invalid actions reported, never fatal.
    let mut e = bridge("Taxi-v3", None);
    assert!(e.reset(2).await.unwrap().text.contains("+---------+"));
    let s = e.step("north", &Default::default()).await.unwrap();
    assert!(!s.invalid_action && s.reward == -1.0);
    assert!(
        e.step("teleport", &Default::default())
            .await
            .unwrap()
            .invalid_action
    );
    e.close().await;
    // CliffWalking: stepping right from the start falls off the cliff (−100).
    let mut e = bridge("CliffWalking-v0", None);
    e.reset(0).await.unwrap();
    assert_eq!(
        e.step("right", &Default::default()).await.unwrap().reward,
        -100.0
    );
    assert_eq!(
        e.step("1", &Default::default()).await.unwrap().reward,
        -100.0,
        "indices work too"
    );
    e.close().await;
    // Blackjack (no text rendering: the raw observation), one decision ends it.
    let mut e = bridge("Blackjack-v1", None);
    assert!(e.reset(1).await.unwrap().text.starts_with("observation: "));
    let s = e.step("stick", &Default::default()).await.unwrap();
    assert!(s.terminated);
    e.close().await;
}

#[test]
fn a_job_runs_on_an_external_environment() {
    let spec = tests::SpecBuilder::new()
        .pool("h20", "H20", 1, "")
        .raw_task(&format!(
            "[[tasks]]\ndomain = \"remote\"\ngroup_size = 2\nmax_turns = 3\nenv = {{ kind = \"external\", sandbox = \"none\", command = [\"{}\", \"env-serve\", '{{\"kind\":\"tictactoe\"}}'] }}\n",
            rollarc_bin().display()
        ))
        .rollout("batch_size = 2")
        .rollout("steps = 2")
        .extra("[sim]\nclock = \"real\"")
        .build();
    let sink = std::sync::Arc::new(actors::buffer::MemorySink::default());
    let s = job::simrun::run_blocking(
        spec,
        0,
        0,
        sink.clone(),
        std::sync::Arc::new(tests::BatchLog::default()),
        None,
    )
    .expect("job runs");
    assert_eq!(s.steps_done, 2);
    assert!(sink.log.lock().unwrap().iter().any(|t| t.failure.is_none()));
}

/// The external-environment example of docs/environments.md as a user writes it: `python3`
/// (here a pyenv interpreter under the hidden home, with gymnasium in its site-packages) and
/// a script reached through a symbolic link into `/tmp`, sandboxed by default. The
/// interpreter is asked where it lives and the link is resolved, as for the bridges; before,
/// the sandbox hid the interpreter's packages (`No module named 'gymnasium'`) and the
/// linked script (`can't open file`).
#[test]
fn an_external_python_environment_runs_sandboxed_with_its_interpreter_and_a_linked_script() {
    let dir = tempfile::Builder::new()
        .prefix("rollarc-linked-envs")
        .tempdir_in("/tmp")
        .unwrap();
    let real = dir.path().join("real");
    std::fs::create_dir(&real).unwrap();
    std::fs::copy(
        concat!(env!("CARGO_MANIFEST_DIR"), "/../envs/gymnasium_bridge.py"),
        real.join("gymnasium_bridge.py"),
    )
    .unwrap();
    let link = dir.path().join("envs");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let spec = tests::SpecBuilder::new()
        .pool("h20", "H20", 1, "")
        .raw_task(&format!(
            "[[tasks]]\ndomain = \"taxi\"\ngroup_size = 2\nmax_turns = 2\nenv = {{ kind = \"external\", command = [\"python3\", \"{}\", \"Taxi-v3\"] }}\n",
            link.join("gymnasium_bridge.py").display()
        ))
        .rollout("batch_size = 2")
        .rollout("steps = 1")
        .extra("[sim]\nclock = \"real\"")
        .build();
    let sink = std::sync::Arc::new(actors::buffer::MemorySink::default());
    let s = job::simrun::run_blocking(
        spec,
        0,
        0,
        sink.clone(),
        std::sync::Arc::new(tests::BatchLog::default()),
        None,
    )
    .expect("job runs");
    assert_eq!(s.steps_done, 1);
    let log = sink.log.lock().unwrap();
    let ok = log.iter().filter(|t| t.failure.is_none()).count();
    assert!(
        ok >= 2,
        "episodes failed in the sandbox: {:?}",
        log.iter().filter_map(|t| t.failure.as_ref()).next()
    );
}

#[tokio::test]
async fn a_sandboxed_program_is_contained() {
    job::envs::check_sandbox().expect("make setup installs bubblewrap; the sandbox must work here");
    // A listener on the host's loopback: reachable from outside the sandbox only.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    // A data directory outside /tmp, /root and /home (like the README's `--data-dir data`),
    // holding a database file and a unix socket.
    let data = tempfile::Builder::new()
        .prefix("rollarc-data-")
        .tempdir_in(std::env::current_dir().unwrap())
        .unwrap();
    std::fs::write(data.path().join("rollarc.db"), "every job's spec").unwrap();
    let sock = data.path().join("sock");
    let _unix = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    // The probe program answers the protocol with what it could do, as the observation.
    let probe = r#"read l
r=""
cat /etc/shadow >/dev/null 2>&1 && r="$r shadow-read"
ls /root/.cargo >/dev/null 2>&1 && r="$r home-read"
touch /var/tmp/rollarc-escape-PORT 2>/dev/null && r="$r wrote-outside"
touch /tmp/ok 2>/dev/null || r="$r no-tmp"
(exec 3<>/dev/tcp/127.0.0.1/PORT) 2>/dev/null && r="$r network"
[ "$(id -u)" = 0 ] && r="$r root"
[ $$ -lt 10 ] || r="$r host-pids"
env | grep -q '^CARGO' && r="$r env-leak"
cat DATA/rollarc.db >/dev/null 2>&1 && r="$r data-read"
[ -S DATA/sock ] && r="$r socket-visible"
perl -e 'exit(syscall(250, 0, -3, 0) >= 0 ? 0 : 1)' 2>/dev/null && r="$r keyring"
unshare -Ur true 2>/dev/null && r="$r userns"
echo "{\"v\":1,\"ok\":true,\"observation\":\"contained:$r\"}""#
        .replace("PORT", &port.to_string())
        .replace("DATA", &data.path().to_string_lossy());
    let cmd = job::envs::sandboxed(&["bash".to_string(), "-c".to_string(), probe.clone()], &[]);
    let mut e = external(cmd, 10_000, 1 << 20);
    assert_eq!(e.reset(0).await.unwrap().text, "contained:");
    e.close().await;
    // The same probe outside the sandbox sees everything (so the checks can fail).
    let mut bare = external(
        vec!["bash".to_string(), "-c".to_string(), probe],
        10_000,
        1 << 20,
    );
    let seen = bare.reset(0).await.unwrap().text;
    for probe in [
        "network",
        "host-pids",
        "home-read",
        "env-leak",
        "data-read",
        "socket-visible",
        "keyring",
        "userns",
    ] {
        assert!(
            seen.contains(probe),
            "unsandboxed probe {probe} not seen: {seen}"
        );
    }
    bare.close().await;
    assert!(seen.contains("wrote-outside"), "{seen}");
    let _ = std::fs::remove_file(format!("/var/tmp/rollarc-escape-{port}"));
    drop(listener);
}

/// Runs `script` (bash) in the sandbox as an environment program and returns the reset result.
async fn sandboxed_reset(script: &str, timeout_ms: u64) -> (Result<String, EnvError>, ExternalEnv) {
    let cmd = job::envs::sandboxed(
        &["bash".to_string(), "-c".to_string(), script.to_string()],
        &[],
    );
    let mut e = external(cmd, timeout_ms, 1 << 20);
    let r = e.reset(0).await.map(|o| o.text);
    (r, e)
}

/// A shell command answering the protocol with `text` (shell variables in it expand).
fn reply(text: &str) -> String {
    format!(r#"echo "{{\"v\":1,\"ok\":true,\"observation\":\"{text}\"}}""#)
}

pub(crate) fn processes_with(marker: &str) -> Vec<String> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        if !name.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        if let Ok(cmd) = std::fs::read(entry.path().join("cmdline"))
            && String::from_utf8_lossy(&cmd).contains(marker)
            && !std::fs::read_to_string(entry.path().join("stat"))
                .unwrap_or_default()
                .contains(") Z ")
        {
            out.push(name);
        }
    }
    out
}

#[tokio::test]
async fn containment_matrix() {
    job::envs::check_sandbox().expect("the sandbox must work here");
    // Fork bomb: process creation stops at the rlimit (512 per sandbox uid); the count uses
    // shell builtins only, since nothing more can fork.
    let bomb = format!(
        "read l; (b() {{ b | b & }}; b) 2>/dev/null & sleep 2; c=0; for p in /proc/[0-9]*; do c=$((c+1)); done; {}",
        reply("procs:$c")
    );
    let (r, mut e) = sandboxed_reset(&bomb, 20_000).await;
    let procs: usize = r.unwrap().trim_start_matches("procs:").parse().unwrap();
    eprintln!("fork bomb: {procs} processes in the sandbox after 2 s");
    assert!(
        procs > 50 && procs <= 520,
        "fork bomb not capped (or never ran): {procs} processes"
    );
    e.close().await;
    // Memory hog: the address-space limit stops it; it cannot take the machine's memory.
    let (r, mut e) = sandboxed_reset(
        &format!(
            "read l; awk 'BEGIN{{s=\"x\"; while (1) s = s s}}' 2>/dev/null; {}",
            reply("awk-exit:$?")
        ),
        20_000,
    )
    .await;
    let r = r.unwrap();
    eprintln!("memory hog: {r}");
    assert_ne!(r, "awk-exit:0", "unbounded allocation did not fail");
    e.close().await;
    // Infinite loop: the call's wall-clock timeout fires and the program is killed.
    let (r, mut e) = sandboxed_reset("read l; while :; do :; done", 500).await;
    let err = r.unwrap_err();
    assert!(matches!(err, EnvError::Timeout(_)), "{err}");
    e.close().await;
    // A gigabyte of output: cut at the message cap, not buffered.
    let (r, mut e) = sandboxed_reset(
        "read l; head -c 1000000000 /dev/zero | tr '\\0' x; echo",
        20_000,
    )
    .await;
    let err = r.unwrap_err();
    assert!(
        matches!(
            err,
            EnvError::Protocol(ProtocolError::Oversized {
                limit: 1_048_576,
                ..
            })
        ),
        "{}",
        infra::error_chain(&err)
    );
    e.close().await;
    // Writing a large file: the file-size limit stops it at 100 MB.
    let (r, mut e) = sandboxed_reset(
        &format!(
            "read l; head -c 200000000 /dev/zero > /tmp/big 2>/dev/null; {}",
            reply("size:$(stat -c %s /tmp/big)")
        ),
        20_000,
    )
    .await;
    assert_eq!(r.unwrap(), "size:104857600");
    e.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_sandboxes_leave_no_process_behind() {
    job::envs::check_sandbox().expect("the sandbox must work here");
    let marker = format!("rollarc-leak-check-{}", std::process::id());
    let script = format!(
        "read l; sleep 300 & {}; read l; echo '{{\"v\":1,\"ok\":true}}'; sleep 300",
        reply("up")
    );
    let mut tasks = tokio::task::JoinSet::new();
    for worker in 0..8 {
        let (script, marker) = (script.clone(), marker.clone());
        tasks.spawn(async move {
            for _ in 0..125 {
                let cmd = job::envs::sandboxed(
                    &[
                        "bash".to_string(),
                        "-c".to_string(),
                        script.clone(),
                        marker.clone(),
                    ],
                    &[],
                );
                let mut e = external(cmd, 10_000, 1 << 20);
                assert_eq!(e.reset(worker).await.unwrap().text, "up");
                e.close().await;
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    // A killed group can take a while to be reaped on a loaded machine (CI runs servers and
    // jobs beside this test); a leaked one would live for its `sleep 300`.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let left = processes_with(&marker);
        if left.is_empty() {
            break;
        }
        let states: Vec<String> = left
            .iter()
            .map(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default())
            .collect();
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} processes left behind: {states:?}",
            left.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A protocol-1 bash program that answers resets and, on a step, exits (crashes) one time
/// in three, else ends the episode with reward 1.
pub(crate) const CRASHING_PROGRAM: &str = r#"while read l; do
case "$l" in
  *reset*) echo '{"v":1,"ok":true,"observation":"go"}' ;;
  *step*) if [ $((RANDOM % 3)) = 0 ]; then exit 3; fi; echo '{"v":1,"ok":true,"observation":"","reward":1.0,"terminated":true,"info":{"success":true}}' ;;
  *close*) echo '{"v":1,"ok":true}'; exit 0 ;;
esac
done"#;

#[test]
fn crashing_environment_processes_are_replaced_and_their_trajectories_masked() {
    let script = CRASHING_PROGRAM;
    let spec = tests::SpecBuilder::new()
        .pool("h20", "H20", 1, "")
        .raw_task(&format!("[[tasks]]\ndomain = \"flaky\"\ngroup_size = 2\nmax_turns = 2\nenvs = 4\nenv = {{ kind = \"external\", sandbox = \"none\", command = [\"bash\", \"-c\", '''{script}'''] }}\n"))
        .rollout("batch_size = 2")
        .rollout("steps = 3")
        .rollout("max_retries_per_group = 4")
        .extra("[sim]\nclock = \"real\"")
        .build();
    let sink = std::sync::Arc::new(actors::buffer::MemorySink::default());
    let log = std::sync::Arc::new(tests::BatchLog::default());
    let s = job::simrun::run_blocking(spec, 0, 0, sink.clone(), log.clone(), None)
        .expect("job completes despite crashes");
    let last = s.steps.last().unwrap();
    assert!(
        last.env_restarts > 0,
        "crashed environments were not replaced"
    );
    assert!(last.buffer.masked > 0 && last.buffer.retried > 0);
    for (_, b) in log.batches.lock().unwrap().iter() {
        assert!(
            b.trajectories()
                .all(|t| t.failure.is_none() && t.reward == Some(1.0)),
            "a crashed trajectory was scored"
        );
    }
    assert!(
        sink.log
            .lock()
            .unwrap()
            .iter()
            .any(|t| matches!(t.failure, Some(actors::types::FailureReason::EnvFailed(_))))
    );
}

/// Review finding: a command-line argument or a `readable_paths` entry under (or above) the
/// data directory used to bind it into the sandbox; once the directory is protected, no bind
/// reaches it, however the path is written — while an unprotected directory stays readable
/// (so the probe can succeed).
#[tokio::test]
async fn no_path_binds_the_protected_data_directory_into_a_sandbox() {
    let data = tempfile::tempdir().unwrap();
    let open = tempfile::tempdir().unwrap();
    for d in [&data, &open] {
        std::fs::write(d.path().join("secret"), "s3cret").unwrap();
    }
    infra::sandbox::protect(data.path()).unwrap();
    let probe = |file: std::path::PathBuf, readable: Vec<String>| {
        let script = format!(
            "read l; if cat '{}' >/dev/null 2>&1; then o=read; else o=denied; fi; echo \"{{\\\"v\\\":1,\\\"ok\\\":true,\\\"observation\\\":\\\"$o\\\"}}\"",
            file.display()
        );
        // The file as an argument makes its directory one of the program's own.
        let mut cmd = vec!["bash".to_string(), "-c".to_string(), script];
        cmd.push(file.to_string_lossy().into_owned());
        job::envs::sandboxed(&cmd, &readable)
    };
    let dd = data.path().to_string_lossy().into_owned();
    let parent = data.path().parent().unwrap().to_string_lossy().into_owned();
    for (what, file, readable) in [
        ("own directory", data.path().join("secret"), vec![]),
        (
            "readable path",
            data.path().join("secret"),
            vec![dd.clone()],
        ),
        ("its parent", data.path().join("secret"), vec![parent]),
        (
            "written with ..",
            data.path().join("secret"),
            vec![format!(
                "{dd}/../{}",
                data.path().file_name().unwrap().to_string_lossy()
            )],
        ),
        (
            "written with //",
            data.path().join("secret"),
            vec![format!("/{dd}")],
        ),
    ] {
        let mut e = external(probe(file, readable), 10_000, 1 << 20);
        assert_eq!(e.reset(0).await.unwrap().text, "denied", "{what}");
        e.close().await;
    }
    let mut e = external(probe(open.path().join("secret"), vec![]), 10_000, 1 << 20);
    assert_eq!(
        e.reset(0).await.unwrap().text,
        "read",
        "an unprotected directory"
    );
    e.close().await;
}
