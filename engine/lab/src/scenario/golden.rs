//! The simulator's outputs pinned: every run of every example scenario, cut to its first
//! steps, digested (every committed trajectory, token ids and log-probabilities included, in
//! commit order, and the job's whole summary). A change meant to make the simulator faster
//! must leave every digest as it was; `ROLLARC_BLESS=1` rewrites the file after a change
//! meant to alter the outputs.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use actors::buffer::{SinkError, TrajectorySink};
use actors::types::Trajectory;
use job::runtime::{JobRun, NoObserver};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::Scenario;

/// Steps of each run kept: enough for weight updates, staleness and the second step's
/// prefix-cache hits, few enough for a test.
const STEPS: u64 = 3;

/// 64-bit FNV-1a, continuing from `h`.
fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

/// Folds every committed trajectory (its JSON) into one digest, in commit order.
struct DigestSink {
    state: Mutex<(u64, u64, u64)>,
}

impl TrajectorySink for DigestSink {
    fn commit(&self, traj: &Trajectory) -> Result<u64, SinkError> {
        let json = serde_json::to_vec(traj).map_err(|e| SinkError {
            id: traj.id.clone(),
            message: e.to_string(),
        })?;
        let mut s = self.state.lock().map_err(|_| SinkError {
            id: traj.id.clone(),
            message: "digest lock poisoned".into(),
        })?;
        s.0 += 1;
        s.1 = fnv(s.1, &json);
        s.2 += traj.turns.iter().map(|t| t.response_tokens.len() as u64).sum::<u64>();
        Ok(s.0)
    }
}

/// What one run is pinned by.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct RunDigest {
    trajectories: u64,
    response_tokens: u64,
    trajectories_fnv: String,
    summary_fnv: String,
    elapsed_s: f64,
    steps: u64,
}

/// Runs every run of `sc` for its first [`STEPS`] steps and digests it (`scenario/run` key).
fn digests(sc: &Scenario) -> BTreeMap<String, RunDigest> {
    let mut out = BTreeMap::new();
    for r in &sc.runs {
        let mut spec = r.spec.clone();
        spec.rollout.steps = Some(spec.rollout.steps.map_or(STEPS, |s| s.min(STEPS)));
        let sink = Arc::new(DigestSink {
            state: Mutex::new((0, FNV_START, 0)),
        });
        let rt = job::simrun::virtual_runtime().expect("virtual runtime");
        let summaries = rt.block_on(futures::future::join_all((0..r.jobs.max(1)).map(|i| {
            let mut spec = spec.clone();
            spec.seed = spec.seed.wrapping_add(u64::from(i));
            job::runtime::run(JobRun {
                id: format!("sim-{i}"),
                spec,
                start_step: 0,
                epoch: 0,
                resume: None,
                sink: sink.clone(),
                observer: Arc::new(NoObserver),
                cancel: CancellationToken::new(),
                checkpoint_dir: None,
                functions: None,
                timeline: false,
                batches: None,
                shared_sim_functions: None,
                agents: None,
            })
        })));
        let mut summary_fnv = FNV_START;
        let (mut elapsed_s, mut steps) = (0.0_f64, 0);
        for s in summaries {
            let s = s.unwrap_or_else(|e| panic!("{}/{}: {e}", sc.name, r.name));
            summary_fnv = fnv(summary_fnv, &serde_json::to_vec(&s).expect("summary JSON"));
            elapsed_s = elapsed_s.max(s.elapsed_s);
            steps += s.steps_done;
        }
        let (trajectories, fnv_t, response_tokens) = *sink.state.lock().expect("digest");
        out.insert(
            format!("{}/{}", sc.name, r.name),
            RunDigest {
                trajectories,
                response_tokens,
                trajectories_fnv: format!("{fnv_t:016x}"),
                summary_fnv: format!("{summary_fnv:016x}"),
                elapsed_s,
                steps,
            },
        );
    }
    out
}

/// The digests of every example scenario in `dir`.
fn all_digests(dir: &Path) -> BTreeMap<String, RunDigest> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .expect("scenario directory")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    let mut out = BTreeMap::new();
    for f in files {
        let sc = Scenario::load(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let t = infra::clock::wall_now();
        out.extend(digests(&sc));
        eprintln!("{}: {} runs, {:.1} s", sc.name, sc.runs.len(), t.elapsed().as_secs_f64());
    }
    out
}

#[test]
fn every_scenario_gives_the_pinned_trajectories_and_summaries() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let pinned = root.join("engine/lab/tests/sim-digests.json");
    let now = all_digests(&root.join("examples/sim"));
    if std::env::var_os("ROLLARC_BLESS").is_some() {
        let mut text = serde_json::to_string_pretty(&now).expect("digests JSON");
        text.push('\n');
        std::fs::write(&pinned, text).expect("write the digests");
        return;
    }
    let want: BTreeMap<String, RunDigest> = serde_json::from_str(
        &std::fs::read_to_string(&pinned).expect("the pinned digests (ROLLARC_BLESS=1 writes them)"),
    )
    .expect("pinned digests parse");
    let mut diff = Vec::new();
    for (k, w) in &want {
        match now.get(k) {
            Some(n) if n == w => {}
            Some(n) => diff.push(format!("{k}: pinned {w:?}, now {n:?}")),
            None => diff.push(format!("{k}: no longer run")),
        }
    }
    for k in now.keys().filter(|k| !want.contains_key(*k)) {
        diff.push(format!("{k}: not pinned (ROLLARC_BLESS=1 adds it)"));
    }
    assert!(diff.is_empty(), "{}", diff.join("\n"));
    assert!(now.values().all(|d| d.trajectories > 0 && d.response_tokens > 0));
}
