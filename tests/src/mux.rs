//! Multiplexed environment programs (protocol version 3): many episodes over one process,
//! replies out of order, a late reply dropped, a wedged or crashed program killed and its
//! episodes failed, and a job whose bridged environments run in one process.

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use actors::env::mux::{MuxConfig, MuxEnv, MuxGroup};
use actors::env::{EnvError, Environment};
use tests::rollarc_bin;

fn group(command: Vec<String>, timeout_ms: u64, processes: usize) -> Arc<MuxGroup> {
    MuxGroup::new(MuxConfig {
        command,
        call_timeout: Duration::from_millis(timeout_ms),
        max_message_bytes: 1 << 20,
        workdir: None,
        processes,
    })
}

/// A version-3 program that answers each request on a thread of its own, so replies come
/// in the order they are ready. Actions: `sleep S` (answer after S seconds), `freeze` (stop
/// reading and answering for 30 s), `crash` (write to stderr and exit 3); anything else
/// ends the episode with reward 1.
const THREADED: &str = r#"
import json, os, sys, threading, time
lock = threading.Lock()
def reply(msg):
    with lock:
        sys.stdout.write(json.dumps(msg) + "\n"); sys.stdout.flush()
def handle(req):
    ep, op = req["episode"], req["op"]
    if op == "reset":
        return reply({"v": 3, "episode": ep, "ok": True, "observation": "pid %d seed %d" % (os.getpid(), req["seed"])})
    if op == "close":
        return reply({"v": 3, "episode": ep, "ok": True})
    a = req["action"]
    if a.startswith("sleep "):
        time.sleep(float(a.split()[1]))
    reply({"v": 3, "episode": ep, "ok": True, "observation": a, "reward": 1.0, "terminated": True})
for line in sys.stdin:
    req = json.loads(line)
    a = req.get("action", "")
    if a == "freeze":
        time.sleep(30)
    elif a == "crash":
        sys.stderr.write("boom: the program crashed on purpose\n"); sys.stderr.flush(); os._exit(3)
    else:
        threading.Thread(target=handle, args=(req,)).start()
"#;

fn threaded() -> Vec<String> {
    vec!["python3".into(), "-c".into(), THREADED.into()]
}

async fn step(e: &mut MuxEnv, a: &str) -> Result<String, EnvError> {
    e.step(a, &Default::default())
        .await
        .map(|s| s.observation.text)
}

#[tokio::test]
async fn many_episodes_share_one_program_and_play_the_builtin_game_exactly() {
    let spec = r#"{"kind":"frozenlake","size":4}"#;
    let g = group(
        vec![
            rollarc_bin().display().to_string(),
            "env-serve".into(),
            spec.into(),
        ],
        10_000,
        1,
    );
    // Eight environments play concurrently, each its own seeds and moves, all on one
    // program; every observation, reward and flag equals the built-in game's.
    let plays = (0..8u64).map(|i| {
        let g = Arc::clone(&g);
        async move {
            let mut remote = g.env(i);
            let mut local = job::envs::builtin(&serde_json::from_str(spec).unwrap()).unwrap();
            for episode in 0..3u64 {
                let seed = i * 10 + episode;
                assert_eq!(
                    remote.reset(seed).await.unwrap().text,
                    local.reset_boxed(seed, None).await.unwrap().text
                );
                let moves = ["down", "right", "jump", "down", "right", "down", "right"];
                for k in 0..(3 + (i + episode) as usize % 4) {
                    let a = moves[(k + i as usize) % moves.len()];
                    let (r, l) = (
                        remote.step(a, &Default::default()).await,
                        local.step_boxed(a, &Default::default()).await,
                    );
                    match (r, l) {
                        (Ok(r), Ok(l)) => assert_eq!(
                            (r.observation.text, r.reward, r.terminated, r.invalid_action),
                            (l.observation.text, l.reward, l.terminated, l.invalid_action),
                            "env {i} episode {episode} move {k}"
                        ),
                        (Err(r), Err(l)) => {
                            // Both refuse a step after the end; the remote says so in words.
                            assert!(infra::error_chain(&r).contains(&l.to_string()), "{r}");
                            break;
                        }
                        (r, l) => panic!("env {i}: remote {r:?}, local {l:?}"),
                    }
                }
            }
            remote.close().await;
        }
    });
    futures::future::join_all(plays).await;
    assert_eq!(g.started(), 1, "one program served every episode");
}

#[tokio::test]
async fn replies_come_out_of_order_and_a_late_reply_is_dropped() {
    let g = group(threaded(), 1_000, 1);
    let (mut a, mut b) = (g.env(0), g.env(1));
    let pid_a = a.reset(1).await.unwrap().text;
    let pid_b = b.reset(2).await.unwrap().text;
    assert_eq!(
        pid_a.split_whitespace().nth(1),
        pid_b.split_whitespace().nth(1),
        "one process"
    );
    // A's answer comes 0.5 s later than B's, though A asked first.
    let t0 = Instant::now();
    let (ra, rb) = tokio::join!(step(&mut a, "sleep 0.5"), async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let r = step(&mut b, "sleep 0").await;
        (r, t0.elapsed())
    });
    assert_eq!(ra.unwrap(), "sleep 0.5");
    assert_eq!(rb.0.unwrap(), "sleep 0");
    assert!(
        rb.1 < Duration::from_millis(400),
        "B waited for A: {:?}",
        rb.1
    );
    // A's call outlives the timeout while B keeps getting answers: only A fails, the program
    // lives on, and A's reply, when it comes, is dropped without disturbing B.
    a.reset(3).await.unwrap();
    let (ra, rb) = tokio::join!(step(&mut a, "sleep 2"), async {
        let mut answered = 0;
        for k in 0..12u64 {
            b.reset(10 + k).await.unwrap();
            assert_eq!(step(&mut b, "sleep 0.1").await.unwrap(), "sleep 0.1");
            answered += 1;
        }
        answered
    });
    assert!(matches!(ra, Err(EnvError::Timeout(_))), "{ra:?}");
    assert_eq!(rb, 12);
    tokio::time::sleep(Duration::from_millis(900)).await;
    b.reset(30).await.unwrap();
    assert_eq!(step(&mut b, "after").await.unwrap(), "after");
    assert_eq!(
        g.started(),
        1,
        "a timeout with progress does not restart it"
    );
}

#[tokio::test]
async fn a_wedged_program_is_killed_and_every_episode_it_held_fails() {
    let g = group(threaded(), 1_000, 1);
    let (mut a, mut b) = (g.env(0), g.env(1));
    a.reset(1).await.unwrap();
    b.reset(2).await.unwrap();
    let (ra, rb) = tokio::join!(step(&mut a, "freeze"), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        step(&mut b, "anything").await
    });
    assert!(matches!(ra, Err(EnvError::Timeout(_))), "{ra:?}");
    let rb = rb.unwrap_err();
    assert!(
        matches!(&rb, EnvError::ProcessLost(why) if why.contains("answered nothing")),
        "{rb:?}"
    );
    // B's episode does not continue on a new program; a new episode starts one.
    assert!(matches!(
        step(&mut b, "x").await,
        Err(EnvError::ProcessLost(_))
    ));
    b.reset(3).await.unwrap();
    assert_eq!(step(&mut b, "x").await.unwrap(), "x");
    assert_eq!(g.started(), 2);
}

#[tokio::test]
async fn a_crashed_program_fails_its_episodes_with_its_stderr_and_is_restarted() {
    let g = group(threaded(), 10_000, 2);
    // Environments 0 and 2 share program 0; environment 1 runs on program 1.
    let (mut a, mut b, mut c) = (g.env(0), g.env(2), g.env(1));
    a.reset(1).await.unwrap();
    b.reset(2).await.unwrap();
    c.reset(3).await.unwrap();
    assert_eq!(g.started(), 2);
    let (ra, rb) = tokio::join!(step(&mut a, "crash"), step(&mut b, "sleep 5"));
    for r in [ra, rb] {
        let e = r.unwrap_err();
        let why = infra::error_chain(&e);
        assert!(
            matches!(e, EnvError::ProcessLost(_))
                && why.contains("exit")
                && why.contains("boom: the program crashed on purpose"),
            "{why}"
        );
    }
    // The other program is untouched; the crashed one is restarted by the next reset.
    assert_eq!(step(&mut c, "fine").await.unwrap(), "fine");
    a.reset(4).await.unwrap();
    assert_eq!(step(&mut a, "again").await.unwrap(), "again");
    assert_eq!(g.started(), 3);
}

#[tokio::test]
async fn a_request_to_a_closed_pipe_reports_the_exit_and_stderr_not_the_pipe() {
    // The program answers the reset, closes its input, says why on stderr and exits 0.3 s
    // later: the step meets a closed pipe, and the episode fails with the exit status and
    // the stderr line rather than "broken pipe".
    let script = r#"read l; echo '{"v":3,"episode":"0.1","ok":true,"observation":"hi"}'; exec 0<&-; echo 'closing up: no more input' >&2; sleep 0.3; exit 3"#;
    let g = group(vec!["sh".into(), "-c".into(), script.into()], 10_000, 1);
    let mut e = g.env(0);
    assert_eq!(e.reset(0).await.unwrap().text, "hi");
    tokio::time::sleep(Duration::from_millis(150)).await;
    let err = step(&mut e, "anything").await.unwrap_err();
    let why = infra::error_chain(&err);
    assert!(
        matches!(err, EnvError::ProcessLost(_))
            && why.contains("exit status 3")
            && why.contains("closing up: no more input")
            && !why.contains("Broken pipe"),
        "{why}"
    );
}

#[tokio::test]
async fn a_broken_stream_kills_the_program_and_names_the_line() {
    // Answers its first request with a line that is not a reply.
    let g = group(
        vec![
            "sh".into(),
            "-c".into(),
            "read l; echo 'not a reply'; sleep 30".into(),
        ],
        10_000,
        1,
    );
    let mut e = g.env(0);
    let t = Instant::now();
    let err = infra::error_chain(&e.reset(0).await.unwrap_err());
    assert!(
        err.contains("malformed") && err.contains("not a reply"),
        "{err}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "did not wait for the timeout"
    );
}

/// Programs whose command line names `marker`, counted by process group: each program
/// rollarc starts is a group of its own (a `python3` that is a pyenv shim runs the bridge
/// through a few shell processes of the same group).
fn program_groups(marker: &str) -> usize {
    let groups: std::collections::BTreeSet<String> = crate::envs::processes_with(marker)
        .iter()
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // After the command name in parentheses: state, ppid, pgrp.
            let rest = &stat[stat.rfind(')')? + 2..];
            rest.split_whitespace().nth(2).map(str::to_string)
        })
        .collect();
    groups.len()
}

/// The footprint of #34: a task with 8 environment slots runs one bridge process, not 8.
#[test]
fn a_bridged_task_runs_one_process_for_all_its_environments() {
    let marker = format!("rollarc-mux-marker-{}", std::process::id());
    let spec = tests::SpecBuilder::new()
        .pool("h20", "H20", 1, "")
        .raw_task(&format!(
            "[[tasks]]\ndomain = \"lake\"\ngroup_size = 4\nmax_turns = 3\nenvs = 8\nenv = {{ kind = \"gymnasium\", id = \"FrozenLake-v1\", sandbox = \"none\", python_path = [\"/nonexistent/{marker}\"] }}\n"
        ))
        .rollout("batch_size = 2")
        .rollout("steps = 3")
        .extra("[sim]\nclock = \"real\"")
        .build();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (done, marker) = (Arc::clone(&done), marker.clone());
        std::thread::spawn(move || {
            let mut most = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                most = most.max(program_groups(&marker));
                // Real processes, sampled on the real clock beside a blocking job run.
                #[allow(clippy::disallowed_methods)]
                std::thread::sleep(Duration::from_millis(20));
            }
            most
        })
    };
    let sink = Arc::new(actors::buffer::MemorySink::default());
    let s = job::simrun::run_blocking(
        spec,
        0,
        0,
        sink.clone(),
        Arc::new(tests::BatchLog::default()),
        None,
    )
    .expect("job runs");
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let most = sampler.join().unwrap();
    assert_eq!(s.steps_done, 3);
    let log = sink.log.lock().unwrap();
    assert!(log.len() >= 3 * 2 * 4, "{} trajectories", log.len());
    assert!(log.iter().all(|t| t.failure.is_none()), "no episode failed");
    assert_eq!(most, 1, "bridge programs alive at once");
    assert_eq!(
        program_groups(&marker),
        0,
        "the bridge is gone after the job"
    );
}
