//! Managed agents on env workers (`rollarc env-worker` processes on loopback): an unmodified
//! agent runs in a worker's sandbox, reaches the job's gateway only through its worker's
//! forwarder (which puts the episode's key on every call) and nothing else on the worker's
//! host; a worker SIGKILLed while it runs agents fails their episodes as infrastructure
//! (masked, retried, never rewarded) and the job goes on with the other worker.

use std::sync::Arc;

use actors::types::{FailureReason, Trajectory};
use serde_json::Value;

use crate::env_workers::{WorkerProc, start_worker_on, wait_for, worker_state};
use tests::{agent_python, repo, tokenizer};

/// A managed agent task on pool `fleet` running `episode_agents.py MODE`.
fn task(domain: &str, mode: &str, extra: &str) -> String {
    format!(
        "[[tasks]]\ndomain = \"{domain}\"\ngroup_size = 2\nmax_tokens_per_turn = 8\n\
         env_pool = \"fleet\"\n[tasks.env]\nkind = \"agent\"\n\
         command = [\"{py}\", \"{script}\", \"{mode}\"]\ntokenizer = \"{tok}\"\n\
         timeout_s = 120\n{extra}\n",
        py = agent_python(),
        script = repo().join("tests/agents/episode_agents.py").display(),
        tok = tokenizer(),
    )
}

/// A job of `task` on one simulated shard (real clock) whose pool `fleet` lists `workers`
/// (and takes `pool_extra`).
fn builder(
    task: &str,
    workers: &[&WorkerProc],
    pool_extra: &str,
    rollout: &[&str],
) -> tests::SpecBuilder {
    let urls: Vec<String> = workers.iter().map(|w| format!("\"{}\"", w.url)).collect();
    let mut b = tests::SpecBuilder::new()
        .pool("h800", "H800", 1, "")
        .raw_task(task)
        .extra(&format!(
            "[[env_pools]]\nname = \"fleet\"\nworkers = {{ urls = [{}] }}\n{pool_extra}",
            urls.join(", ")
        ))
        .extra("[sim]\nclock = \"real\"");
    for r in rollout {
        b = b.rollout(r);
    }
    b
}

fn spec(task: &str, workers: &[&WorkerProc], rollout: &[&str]) -> job::spec::JobSpec {
    builder(task, workers, "", rollout).build()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn agents_on(rt: &tokio::runtime::Runtime, w: &WorkerProc) -> Value {
    rt.block_on(worker_state(&w.url, ""))["agents"].clone()
}

#[test]
fn a_managed_agent_runs_in_a_workers_sandbox_and_reaches_only_the_gateway() {
    job::envs::check_sandbox().expect("the sandbox must work here");
    let w = start_worker_on("127.0.0.1:0", 4, None);
    // Targets on the worker's host the sandboxed agent must not reach.
    let loopback = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("host.sock");
    let _sock = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let env = format!(
        "env = {{ PROBE_PORT = \"{}\", PROBE_SOCK = \"{}\", PROBE_WRONG_KEY = \"1\" }}",
        loopback.local_addr().unwrap().port(),
        sock.display()
    );
    let spec = spec(
        &task("probe", "probe", &env),
        &[&w],
        &["batch_size = 1", "steps = 1"],
    );
    let sink = Arc::new(actors::buffer::MemorySink::default());
    let s = job::simrun::run_blocking(
        spec,
        0,
        0,
        sink.clone(),
        Arc::new(tests::BatchLog::default()),
        None,
    )
    .expect("the job runs");
    assert_eq!(s.steps_done, 1);
    let rows = sink.log.lock().unwrap();
    assert!(rows.len() >= 2, "{} trajectories", rows.len());
    for t in rows.iter() {
        assert!(t.failure.is_none(), "{:?}", t.failure);
        let a = t.agent.as_ref().expect("an agent summary");
        let reached = a.info.clone().expect("the probe's report");
        eprintln!("on the worker: {reached}");
        assert_eq!(reached["gateway"], true, "the gateway must be reachable");
        assert_eq!(
            reached["loopback"], false,
            "the sandbox reached the host's loopback"
        );
        assert_eq!(reached["unix"], false, "the sandbox reached a host socket");
        // The forwarder calls with the episode's key, whatever key the agent sends.
        assert_eq!(
            reached["wrong_key"], true,
            "the forwarder passed the agent's key on"
        );
        assert!(!t.turns.is_empty());
        for turn in &t.turns {
            assert!(!turn.versions.is_empty());
            assert_eq!(turn.logprobs.len(), turn.response_tokens.len());
        }
    }
    let rt = runtime();
    let agents = agents_on(&rt, &w);
    assert!(agents["runs"].as_u64().unwrap() >= 2, "{agents}");
    assert_eq!(agents["running"], 0, "{agents}");
    // Every model call (one per turn) and the probe's two model lists went through it.
    let calls: usize = rows.iter().map(|t| t.turns.len() + 2).sum();
    assert!(
        agents["forwarded_calls"].as_u64().unwrap() >= calls as u64,
        "{agents}, {calls} calls"
    );
}

#[test]
fn a_worker_killed_mid_episode_fails_its_agents_as_infrastructure_and_the_job_goes_on() {
    let ws = [
        start_worker_on("127.0.0.1:0", 4, None),
        start_worker_on("127.0.0.1:0", 4, None),
    ];
    let spec = spec(
        &task(
            "slow",
            "slow",
            "sandbox = \"none\"\nenv = { SLOW_S = \"3\" }",
        ),
        &[&ws[0], &ws[1]],
        &["batch_size = 2", "steps = 3", "max_retries_per_group = 4"],
    );
    let sink = Arc::new(actors::buffer::MemorySink::default());
    let log = Arc::new(tests::BatchLog::default());
    let job = {
        let (sink, log) = (sink.clone(), log.clone());
        std::thread::spawn(move || job::simrun::run_blocking(spec, 0, 0, sink, log, None))
    };
    let rt = runtime();
    // Once a step has trained (a job whose first groups all fail stops: its environment
    // looks broken), kill worker 0 while it runs agents.
    wait_for(&rt, "a trained step", &mut || {
        !log.batches.lock().unwrap().is_empty()
    });
    wait_for(&rt, "agents running on worker 0", &mut || {
        agents_on(&rt, &ws[0])["running"].as_u64().unwrap() > 0
    });
    let [mut killed, survivor] = ws;
    let killed_url = killed.url.clone();
    killed.child.kill().unwrap();
    let _ = killed.child.wait();
    let s = job.join().unwrap().expect("the job completes");
    assert_eq!(s.steps_done, 3);
    let rows = sink.log.lock().unwrap();
    let lost: Vec<&Trajectory> = rows.iter().filter(|t| t.failure.is_some()).collect();
    assert!(!lost.is_empty(), "the kill failed no episode");
    for t in &lost {
        match &t.failure {
            Some(FailureReason::AgentFailed(why)) => assert!(
                why.contains(&format!("worker {killed_url} lost the episode")),
                "{why}"
            ),
            other => panic!("an episode lost with its worker must be infrastructure: {other:?}"),
        }
        assert!(t.reward.is_none(), "never rewarded");
    }
    // The batches trained only completed episodes, each with its turns' versions.
    for (_, b) in log.batches.lock().unwrap().iter() {
        for t in b.trajectories() {
            assert!(t.failure.is_none());
            assert_eq!(t.turns.len(), 2, "both model calls recorded");
            assert!(t.turns.iter().all(|u| !u.versions.is_empty()));
        }
    }
    let agents = agents_on(&rt, &survivor);
    assert!(agents["runs"].as_u64().unwrap() > 0, "{agents}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_job_sends_its_workers_agents_to_the_gateway_on_the_services_port() {
    let srv = tests::TestServer::start().await;
    let base = srv.url("");
    let w = start_worker_on("127.0.0.1:0", 4, None);
    // The pool names the service's own address: the workers' forwarders call it there.
    let body = builder(
        &task("plain", "plain", ""),
        &[&w],
        &format!("gateway_url = \"{base}\""),
        &["batch_size = 1", "steps = 1"],
    )
    .toml();
    let job = tests::submit_job(&srv.client, &base, body).await;
    let done = tests::wait_ended(
        &srv.client,
        &base,
        &job,
        std::time::Duration::from_secs(120),
    )
    .await;
    assert_eq!(done["state"], "succeeded", "{done}");
    let rows = tests::all_rows(&srv.client, &base, &job, 100).await;
    let trained: Vec<&Value> = rows
        .iter()
        .filter(|r| r["trajectory"]["failure"].is_null())
        .collect();
    assert!(trained.len() >= 2, "{rows:?}");
    for r in &trained {
        let turns = r["trajectory"]["turns"].as_array().unwrap();
        assert_eq!(turns.len(), 1, "one model call each");
    }
    let agents = worker_state(&w.url, "").await["agents"].clone();
    assert!(
        agents["forwarded_calls"].as_u64().unwrap() >= trained.len() as u64,
        "{agents}"
    );
}
