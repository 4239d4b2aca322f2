//! Datasets and bridged environments in whole jobs: a reasoning-gym task, a user-defined
//! gymnasium environment loaded by `module:Class`, a failing one whose stderr reaches the
//! job's error, and dataset rows used exactly once per epoch across a SIGKILL of the service.

use std::sync::Arc;
use std::time::Duration;

use actors::buffer::MemorySink;
use actors::types::Trajectory;

const TINY: &str = "backend = { kind = \"builtin\", model = { d_model = 32, n_layers = 1, n_heads = 2, d_ff = 64, max_seq = 512 } }";

/// A job of `steps` steps on one built-in pool with the tiny byte-level model.
fn tiny_job(task: &str, steps: u64) -> String {
    format!(
        "seed = 3\n{task}\n[[pools]]\nname = \"cpu\"\ndevice = \"H800\"\ncount = 1\n{TINY}\n[rollout]\nbatch_size = 2\nsteps = {steps}\nfilter_all_equal = false\n[trainer]\nkind = \"builtin\"\n"
    )
}

fn run(toml: &str) -> (Result<job::runtime::JobSummary, String>, Vec<Trajectory>) {
    let spec = match job::spec::parse(toml, job::spec::Format::Toml) {
        Ok(s) => s,
        Err(e) => panic!("test spec is invalid: {e}\n{toml}"),
    };
    let sink = Arc::new(MemorySink::default());
    let r = job::simrun::run_blocking(
        spec,
        0,
        0,
        sink.clone(),
        Arc::new(tests::BatchLog::default()),
        None,
    )
    .map_err(|e| infra::error_chain(&e));
    let log = sink.log.lock().unwrap().clone();
    (r, log)
}

/// The first observation of a trajectory as the byte-level model saw it (BOS and SEP cut).
fn first_observation(t: &Trajectory) -> String {
    let ids = &t.turns[0].observation_tokens;
    let bytes: Vec<u8> = ids.iter().filter(|&&i| i < 256).map(|&i| i as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[test]
fn a_reasoning_gym_task_runs_with_its_own_verifier_and_references() {
    let task = "[[tasks]]\ndomain = \"arith\"\ngroup_size = 2\nmax_turns = 1\nmax_tokens_per_turn = 8\nenv = { kind = \"reasoning_gym\", dataset = \"basic_arithmetic\", size = 50, seed = 11, config = { min_terms = 2, max_terms = 2 } }\n";
    let (r, log) = run(&tiny_job(task, 2));
    let s = r.expect("the job runs");
    assert_eq!(s.steps_done, 2);
    let ok: Vec<&Trajectory> = log.iter().filter(|t| t.failure.is_none()).collect();
    assert!(ok.len() >= 4, "{} trajectories", ok.len());
    for t in ok {
        let obs = first_observation(t);
        assert!(
            obs.contains("Calculate") && obs.contains("<answer>"),
            "{obs}"
        );
        // The bridge's answer is the reference handed to reward functions; the verifier's
        // score is the reward (random bytes are not the answer).
        let answer = t.reference.as_ref().and_then(|r| r["answer"].as_str());
        assert!(
            answer.is_some_and(|a| a.parse::<i64>().is_ok()),
            "{:?}",
            t.reference
        );
        assert!(t.reward.is_some_and(|r| (0.0..=1.0).contains(&r)));
        assert_eq!(t.turns.len(), 1);
    }
}

const CORRIDOR: &str = r#"
import gymnasium as gym


class Corridor(gym.Env):
    metadata = {"render_modes": ["ansi"]}

    def __init__(self, render_mode=None, length=3):
        self.render_mode = render_mode
        self.length = length
        self.action_space = gym.spaces.Discrete(2)
        self.observation_space = gym.spaces.Discrete(length + 1)
        self.pos = 0

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = 0
        return self.pos, {}

    def step(self, action):
        self.pos = min(self.length, self.pos + int(action))
        done = self.pos == self.length
        return self.pos, float(done), done, False, {}

    def render(self):
        return "corridor " + "".join("P" if i == self.pos else "." for i in range(self.length + 1))


class Broken(Corridor):
    def reset(self, seed=None, options=None):
        raise RuntimeError("the corridor is flooded")


class Crashing(Corridor):
    def reset(self, seed=None, options=None):
        import os, sys
        sys.stderr.write("fatal: the corridor collapsed\n")
        sys.stderr.flush()
        os._exit(3)
"#;

fn corridor_module() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("corridor_env.py"), CORRIDOR).unwrap();
    dir
}

fn gym_task(id: &str, dir: &std::path::Path, sandbox: &str) -> String {
    format!(
        "[[tasks]]\ndomain = \"corridor\"\ngroup_size = 2\nmax_turns = 3\nmax_tokens_per_turn = 4\nenv = {{ kind = \"gymnasium\", id = \"{id}\", kwargs = {{ length = 2 }}, python_path = [\"{}\"], sandbox = \"{sandbox}\" }}\n",
        dir.display()
    )
}

#[test]
fn a_user_gymnasium_class_runs_by_module_and_class_and_each_observation_is_sent_once() {
    let dir = corridor_module();
    for sandbox in ["none", "bwrap"] {
        if sandbox == "bwrap" && job::wiring::envs::check_sandbox().is_err() {
            continue;
        }
        let (r, log) = run(&tiny_job(
            &gym_task("corridor_env:Corridor", dir.path(), sandbox),
            2,
        ));
        r.unwrap_or_else(|e| panic!("{sandbox}: {e}"));
        let ok: Vec<&Trajectory> = log.iter().filter(|t| t.failure.is_none()).collect();
        assert!(!ok.is_empty(), "{sandbox}: {log:?}");
        for t in ok {
            let obs = first_observation(t);
            assert_eq!(obs.matches("corridor").count(), 1, "{obs:?}");
            assert!(obs.contains("corridor P.."), "{obs:?}");
            assert!(
                !obs.contains("observation:"),
                "sent once, not also raw: {obs:?}"
            );
        }
    }
}

#[test]
fn a_failing_environment_puts_its_error_in_the_job_error() {
    let dir = corridor_module();
    // An exception in reset: the bridge's report.
    let (r, _) = run(&tiny_job(
        &gym_task("corridor_env:Broken", dir.path(), "none"),
        2,
    ));
    let e = r.expect_err("the job fails");
    assert!(e.contains("the corridor is flooded"), "{e}");
    assert!(
        !e.contains("filter_all_equal"),
        "not the dynamic-sampling hint: {e}"
    );
    // A crash: the program's last words on stderr.
    let (r, _) = run(&tiny_job(
        &gym_task("corridor_env:Crashing", dir.path(), "none"),
        2,
    ));
    let e = r.expect_err("the job fails");
    assert!(e.contains("the corridor collapsed"), "{e}");
    // A class that does not exist: named with the module.
    let (r, _) = run(&tiny_job(
        &gym_task("corridor_env:Nope", dir.path(), "none"),
        2,
    ));
    let e = r.expect_err("the job fails");
    assert!(e.contains("corridor_env:Nope"), "{e}");
}

#[test]
fn a_relative_program_path_resolves_outside_the_sandbox() {
    // The command names the bridge relative to the working directory (the repository root,
    // as in docs/environments.md); inside the sandbox the working directory is a private /tmp, and
    // only the directories of absolute paths are bound.
    let root = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let cmd = |base: &std::path::Path| {
        job::resolve::absolute_args_in(
            &[
                "python3".into(),
                "envs/gymnasium_bridge.py".into(),
                "FrozenLake-v1".into(),
            ],
            base,
        )
    };
    // Where the file is not: kept as it is.
    assert_eq!(
        cmd(std::path::Path::new("/"))[1],
        "envs/gymnasium_bridge.py"
    );
    let cmd = cmd(root);
    assert!(
        cmd[1].starts_with('/') && cmd[1].ends_with("envs/gymnasium_bridge.py"),
        "{cmd:?}"
    );
    assert_eq!(cmd[0], "python3");
    assert_eq!(cmd[2], "FrozenLake-v1");
}

/// A JSONL dataset of `n` rows `{"prompt": "q<i>", "answer": "<i>"}`.
fn rows_file(dir: &std::path::Path, n: usize) -> std::path::PathBuf {
    let path = dir.join("rows.jsonl");
    let text: Vec<String> = (0..n)
        .map(|i| {
            format!(
                "{{\"prompt\": \"q{i}\", \"answer\": \"{i}\", \"extra_info\": {{\"index\": {i}}}}}"
            )
        })
        .collect();
    std::fs::write(&path, text.join("\n")).unwrap();
    path
}

/// Seeds (dataset positions) trained per step, from the job's step history.
async fn trained_positions(client: &reqwest::Client, base: &str, id: &str) -> Vec<u64> {
    let v: serde_json::Value = client
        .get(format!("{base}/v1/jobs/{id}/steps?limit=1000"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut out = Vec::new();
    for s in v["steps"].as_array().unwrap() {
        for p in s["metrics"]["tasks"]["rows"]["seeds"]
            .as_array()
            .into_iter()
            .flatten()
        {
            out.push(p.as_u64().unwrap());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_epoch_then_resume_uses_every_row_once_per_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let n = 10usize;
    let path = rows_file(dir.path(), n);
    // 2 epochs of 10 rows, one row per group, 2 groups per step: exactly 10 steps. A slow
    // simulated environment so that the kill lands mid-epoch with groups in flight.
    let spec = format!(
        "seed = 5\n[[tasks]]\ndomain = \"rows\"\ngroup_size = 2\nmax_turns = 1\nreward = [\"env\"]\nenv = {{ kind = \"prompt\" }}\ndataset = {{ path = \"{}\", epochs = 2 }}\n[[pools]]\nname = \"h800\"\ndevice = \"H800\"\ncount = 1\nbackend = {{ kind = \"sim\", model = \"qwen3-8b\" }}\n[rollout]\nbatch_size = 2\nsteps = 10\nalpha = 1\nfilter_all_equal = false\n[sim]\nclock = \"real\"\n",
        path.display()
    );
    let client = reqwest::Client::new();
    // The data directory beside the dataset (a dataset inside it is refused).
    let data = dir.path().join("data");
    let first = tests::server::ServerProcess::start(&data);
    let id = tests::submit_job(&client, &first.base, spec).await;
    tests::wait_job(&client, &first.base, &id, Duration::from_secs(60), |v| {
        v["step"].as_u64().unwrap_or(0) >= 3
    })
    .await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(first.child.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    drop(first);
    let second = tests::server::ServerProcess::start(&data);
    let job = tests::wait_job(&client, &second.base, &id, Duration::from_secs(120), |v| {
        v["state"] == "succeeded" || v["state"] == "failed"
    })
    .await;
    assert_eq!(job["state"], "succeeded", "{job}");
    let mut used = trained_positions(&client, &second.base, &id).await;
    assert_eq!(used.len(), 2 * n, "{used:?}");
    used.sort_unstable();
    assert_eq!(
        used,
        (0..2 * n as u64).collect::<Vec<_>>(),
        "every position once: every row once in each epoch"
    );
    // The rows behind the positions: each epoch uses each row once (and the epochs'
    // orders differ: shuffled per epoch).
    let ds = job::dataset::Dataset::load(
        &job::spec::DatasetSpec {
            epochs: 2,
            ..job::spec::DatasetSpec::at(&path.display().to_string())
        },
        5,
    )
    .unwrap();
    for e in 0..2u64 {
        let mut rows: Vec<usize> = used
            .iter()
            .map(|&p| ds.locate(p))
            .filter(|(ep, _)| *ep == e)
            .map(|r| r.1)
            .collect();
        rows.sort_unstable();
        assert_eq!(rows, (0..n).collect::<Vec<_>>(), "epoch {e}");
    }
    // The stored trajectories carry their rows' answers as references.
    let rows = tests::page_all(&client, &second.base, &id, 50).await;
    assert!(!rows.is_empty());
    for (_, id) in &rows {
        assert!(id.contains("-g"), "{id}");
    }
}
