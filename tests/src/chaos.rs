//! Chaos: a SIGKILL loop over a mix of jobs (simulated, scored by a real reward function,
//! external environments), with reward function instances killed under load in between.
//! After every restart it checks that no committed row was lost or changed, none is
//! duplicated, no prompt is trained twice, and no process of the killed service survived;
//! at the end, that every training step consumed exactly one batch, every row of the scored
//! job is scored or masked, and that a crash-looping function fails its job in bounded time
//! naming the function. `make chaos` runs the long form; the test suite a short one.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::server::{
    ServerProcess, descendants, describe, group_alive, group_members, ledger_groups, still_running,
};
use crate::{SpecBuilder, submit_job, wait_ended, wait_job};

/// What to run.
#[derive(Clone, Debug)]
pub struct ChaosOptions {
    /// Service SIGKILLs.
    pub kills: usize,
    pub seed: u64,
    /// Also the faults of hardening round 2 ([`round2`]): slow-body clients, killed
    /// function instances, quick restarts during a slow step.
    pub round2: bool,
}

pub mod round2;

/// What happened (every count but `kills`, `function_kills` and `rows` must be 0).
#[derive(Clone, Debug, Default, Serialize)]
pub struct ChaosReport {
    pub kills: usize,
    pub function_kills: usize,
    /// Processes the killed services were running (function instances, environments).
    pub processes_seen: usize,
    pub rows: usize,
    pub lost: usize,
    pub changed: usize,
    pub duplicated: usize,
    pub replayed: usize,
    pub orphans: usize,
    /// What each orphan was (pid, command line, parent).
    pub orphan_processes: Vec<String>,
    /// Steps whose trained rows are not exactly one batch.
    pub bad_steps: usize,
    /// Rows of the scored job with neither a reward nor a failure.
    pub unscored: usize,
    /// Steps completed per job.
    pub steps: BTreeMap<String, u64>,
    /// Seconds from submit to failure of the job with a crash-looping function, and its error.
    pub crash_loop_failed_after_s: Option<f64>,
    pub crash_loop_error: String,
    /// Round 2 (when asked for): `/healthz` under slow-body clients while the jobs run.
    pub slow_bodies: Option<round2::SlowBodies>,
    /// Round 2: a job whose function instances are killed about every second.
    pub killed_instances: Option<round2::KilledInstances>,
    /// Round 2: quick restarts during a slow job's step.
    pub quick_restarts: Option<round2::QuickRestarts>,
    pub problems: Vec<String>,
}

impl ChaosReport {
    pub fn clean(&self) -> bool {
        // Function instances were killed too (every other round), or the test proved less.
        let instances_killed = self.kills < 2 || self.function_kills > 0;
        instances_killed
            && (self.kills == 0 || self.processes_seen > 0)
            && self.lost + self.changed + self.duplicated + self.replayed + self.orphans == 0
            && self.bad_steps + self.unscored == 0
            && self.crash_loop_error.contains("reward function `broken`")
            && self.problems.is_empty()
            && self
                .slow_bodies
                .as_ref()
                .is_none_or(|s| s.unanswered == 0 && s.slowest_healthz_ms < 1000)
            && self
                .killed_instances
                .as_ref()
                .is_none_or(round2::KilledInstances::clean)
            && self
                .quick_restarts
                .as_ref()
                .is_none_or(|q| q.state == "succeeded")
    }
}

/// Room for the whole mix at once.
const CONFIG: &str = "max_running = 4\n";

/// A stored row: (cursor, trained step, trajectory).
type Row = (i64, Option<u64>, serde_json::Value);

/// The jobs of the mix: (name, spec, groups per step, episodes per group).
fn jobs() -> Vec<(&'static str, String, u64, u64)> {
    let sim = crate::wall_clock_job(100_000, 2, 0.02);
    let scored = SpecBuilder::new()
        .pool("h800", "H800", 1, "")
        .raw_task("[[tasks]]\ndomain = \"add\"\ngroup_size = 2\nmax_turns = 1\nmax_tokens_per_turn = 8\nreward = [\"math\"]\n[tasks.env]\nkind = \"arithmetic\"\n")
        .rollout("batch_size = 2")
        .rollout("steps = 100000")
        .extra("[sim]\nclock = \"real\"\n[reward]\nplacement = \"local\"\n[reward.functions.math]\nkind = \"builtin\"\nfunction = \"math\"\ntimeout_s = 5\n[reward.functions.math.scaling]\nmin-scale = 2\ncontainer-concurrency = 4\n")
        .toml();
    let external = SpecBuilder::new()
        .pool("h20", "H20", 1, "")
        .raw_task(&format!(
            "[[tasks]]\ndomain = \"lake\"\ngroup_size = 2\nmax_turns = 4\nmax_tokens_per_turn = 8\nenvs = 2\nenv = {{ kind = \"external\", sandbox = \"none\", command = [\"{}\", \"env-serve\", '{{\"kind\":\"frozenlake\",\"size\":4}}'] }}\n",
            crate::rollarc_bin().display()
        ))
        .rollout("batch_size = 1")
        .rollout("steps = 100000")
        .toml();
    // Managed agents in the sandbox (a stdlib-only client: a step fits between kills): killed
    // with the service, resumed.
    let agent = SpecBuilder::new()
        .pool("h800", "H800", 1, "")
        .raw_task(&format!(
            "[[tasks]]\ndomain = \"agent\"\ngroup_size = 2\nmax_tokens_per_turn = 8\nenvs = 2\nenv = {{ kind = \"agent\", command = [\"{}\", \"{}\", \"plain\"], tokenizer = \"{}\", timeout_s = 60 }}\n",
            crate::agent_python(),
            crate::repo().join("tests/agents/episode_agents.py").display(),
            crate::tokenizer(),
        ))
        .rollout("batch_size = 1")
        .rollout("steps = 100000")
        .toml();
    vec![
        ("sim", sim, 2, 2),
        ("scored", scored, 2, 2),
        ("external", external, 1, 2),
        ("agent", agent, 1, 2),
    ]
}

/// Every row of a job, by trajectory id; duplicates (an id twice) counted.
async fn rows(client: &reqwest::Client, base: &str, id: &str) -> (BTreeMap<String, Row>, usize) {
    let mut out = BTreeMap::new();
    let mut dup = 0;
    let mut after = 0i64;
    loop {
        let r = client
            .get(format!(
                "{base}/v1/jobs/{id}/trajectories?after={after}&limit=1000"
            ))
            .send()
            .await
            .expect("page");
        assert_eq!(r.status(), 200, "paging {id}");
        let text = r.text().await.expect("body");
        let page: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("ndjson"))
            .collect();
        if page.is_empty() {
            return (out, dup);
        }
        for row in page {
            let cursor = row["cursor"].as_i64().expect("cursor");
            let trained = row["trained_step"].as_u64();
            let t = row["trajectory"].clone();
            let tid = t["id"].as_str().expect("id").to_string();
            if out.insert(tid, (cursor, trained, t)).is_some() {
                dup += 1;
            }
            after = cursor;
        }
    }
}

/// Compares a job's rows after a restart with the snapshot before it.
fn compare(
    before: &BTreeMap<String, Row>,
    after: &BTreeMap<String, Row>,
    report: &mut ChaosReport,
) {
    for (tid, (cursor, trained, body)) in before {
        match after.get(tid) {
            None => report.lost += 1,
            Some((c, t, b)) => {
                let trained_changed = trained.is_some() && t != trained;
                if c != cursor || b != body || trained_changed {
                    report.changed += 1;
                }
            }
        }
    }
}

/// End-of-run checks of one job's rows: one batch per completed step, no prompt trained
/// twice, no group id used by two attempts.
fn check_rows(
    rows: &BTreeMap<String, Row>,
    steps: u64,
    batch_rows: u64,
    scored: bool,
    report: &mut ChaosReport,
) {
    let mut per_step: BTreeMap<u64, u64> = BTreeMap::new();
    let mut trained_seeds: BTreeMap<u64, u64> = BTreeMap::new();
    let mut epochs_of_group: BTreeMap<u64, BTreeSet<String>> = BTreeMap::new();
    for (tid, (_, trained, t)) in rows {
        let group = t["group_id"].as_u64().unwrap_or(u64::MAX);
        let epoch = tid.split('-').next().unwrap_or_default().to_string();
        epochs_of_group.entry(group).or_default().insert(epoch);
        if let Some(s) = trained {
            *per_step.entry(*s).or_default() += 1;
            trained_seeds.insert(group, t["seed"].as_u64().unwrap_or_default());
        }
        if scored && t["reward"].is_null() && t["failure"].is_null() {
            report.unscored += 1;
        }
    }
    report.bad_steps += (1..=steps)
        .filter(|s| per_step.get(s).copied().unwrap_or(0) != batch_rows)
        .count();
    let mut seeds = BTreeSet::new();
    report.replayed += trained_seeds
        .values()
        .filter(|s| !seeds.insert(**s))
        .count();
    report.replayed += epochs_of_group.values().filter(|e| e.len() > 1).count();
}

/// Kills one ready function instance (SIGKILL), if any; returns whether it did.
async fn kill_function_instance(
    client: &reqwest::Client,
    base: &str,
    rng: &mut rand::rngs::SmallRng,
) -> bool {
    let Ok(r) = client.get(format!("{base}/v1/cluster")).send().await else {
        return false;
    };
    let Ok(c) = r.json::<serde_json::Value>().await else {
        return false;
    };
    let pids: Vec<i32> = c["functions"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|d| d["instances"].as_array().cloned().unwrap_or_default())
        .filter(|i| i["phase"] == "ready")
        .filter_map(|i| i["pid"].as_i64().map(|p| p as i32))
        .collect();
    if pids.is_empty() {
        return false;
    }
    let pid = pids[rng.random_range(0..pids.len())];
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .is_ok()
}

/// Waits (at most 10 s) for the groups of a killed service to die; names the survivors.
async fn survivors(groups: &[i32]) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let alive: Vec<i32> = groups.iter().copied().filter(|&g| group_alive(g)).collect();
        if alive.is_empty() || tokio::time::Instant::now() > deadline {
            return alive
                .iter()
                .map(|g| format!("group {g}: {}", group_members(*g)))
                .collect();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (at most 10 s) for the processes of a killed service to die; names the survivors.
async fn survivors_of(procs: &[(u32, u64)]) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let alive = still_running(procs);
        if alive.is_empty() || tokio::time::Instant::now() > deadline {
            return alive.iter().map(|p| describe(*p)).collect();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs the chaos loop on a fresh data directory under `dir`.
pub async fn run(opts: &ChaosOptions, dir: &Path) -> ChaosReport {
    let client = reqwest::Client::new();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(opts.seed);
    let mut report = ChaosReport::default();
    let mut server = ServerProcess::start_with(dir, Some(CONFIG));
    let mix = jobs();
    let mut ids = Vec::new();
    for (name, spec, groups, eps) in &mix {
        let id = submit_job(&client, &server.base, spec.clone()).await;
        ids.push((*name, id, groups * eps));
    }
    for (_, id, _) in &ids {
        wait_job(&client, &server.base, id, Duration::from_secs(60), |v| {
            v["state"] == "running"
        })
        .await;
    }
    if opts.round2 {
        // Slow-body clients (more than one address's share of connections) while the mix
        // runs: the health check is answered within 1 s throughout.
        report.slow_bodies = Some(round2::slow_bodies(&server.base, 300, 20).await);
    }
    let mut snapshot: BTreeMap<String, BTreeMap<String, Row>> = BTreeMap::new();
    for k in 0..opts.kills {
        // Long enough for every job to complete a step between kills (a job killed twice
        // before any step is a crash loop, and failed by design).
        tokio::time::sleep(Duration::from_millis(rng.random_range(1500..3000))).await;
        if k % 2 == 1 && kill_function_instance(&client, &server.base, &mut rng).await {
            report.function_kills += 1;
            tokio::time::sleep(Duration::from_millis(rng.random_range(100..500))).await;
        }
        for (_, id, _) in &ids {
            let (r, dup) = rows(&client, &server.base, id).await;
            report.duplicated += dup;
            snapshot.insert(id.clone(), r);
        }
        // What the server runs, seen from /proc (not from its own ledger).
        let procs = descendants(server.child.id());
        server.sigkill();
        report.kills += 1;
        report.processes_seen += procs.len();
        let groups = ledger_groups(dir);
        server = ServerProcess::start_with(dir, Some(CONFIG));
        let mut left = survivors(&groups).await;
        left.extend(survivors_of(&procs).await);
        report.orphans += left.len();
        report.orphan_processes.extend(left);
        for (_, id, _) in &ids {
            let (after, dup) = rows(&client, &server.base, id).await;
            report.duplicated += dup;
            compare(&snapshot[id], &after, &mut report);
        }
    }
    // Every job is still alive (resumed after each kill): stop them and check their rows.
    for (name, id, batch_rows) in &ids {
        let _ = client
            .post(format!("{}/v1/jobs/{id}/cancel", server.base))
            .send()
            .await;
        let job = wait_ended(&client, &server.base, id, Duration::from_secs(60)).await;
        if job["state"] != "cancelled" {
            report.problems.push(format!(
                "{name} ({id}) ended {}: {}",
                job["state"], job["error"]
            ));
        }
        let steps = job["step"].as_u64().unwrap_or(0);
        report.steps.insert((*name).to_string(), steps);
        let (all, dup) = rows(&client, &server.base, id).await;
        report.duplicated += dup;
        report.rows += all.len();
        check_rows(&all, steps, *batch_rows, *name == "scored", &mut report);
    }
    // A function that crash-loops fails its job within bounded time, naming it.
    let broken = SpecBuilder::new()
        .pool("h800", "H800", 1, "")
        .raw_task("[[tasks]]\ndomain = \"add\"\ngroup_size = 2\nmax_turns = 1\nreward = [\"broken\"]\n[tasks.env]\nkind = \"arithmetic\"\n")
        .rollout("batch_size = 2")
        .rollout("steps = 1000")
        .extra("[sim]\nclock = \"real\"\n[reward]\nplacement = \"local\"\n[reward.functions.broken]\nkind = \"command\"\ncommand = \"sh\"\nargs = [\"-c\", \"echo 'broken: no model' >&2; exit 1\"]\n")
        .toml();
    let t0 = tokio::time::Instant::now();
    let id = submit_job(&client, &server.base, broken).await;
    let job = wait_ended(&client, &server.base, &id, Duration::from_secs(120)).await;
    report.crash_loop_failed_after_s = Some(t0.elapsed().as_secs_f64());
    report.crash_loop_error = job["error"].as_str().unwrap_or_default().to_string();
    if opts.round2 {
        report.killed_instances = Some(round2::killed_instances(&server.base, 40, false).await);
    }
    // A clean stop leaves nothing running either.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let _ = tokio::task::spawn_blocking(move || {
        let mut server = server;
        let _ = server.child.wait();
    })
    .await;
    let left = survivors(&ledger_groups(dir)).await;
    report.orphans += left.len();
    report.orphan_processes.extend(left);
    if opts.round2 {
        let restarts = dir.join("restarts");
        report.quick_restarts = Some(round2::quick_restarts(&restarts, 2, 8.0).await);
    }
    report
}
