//! The simulator's outputs pinned: every run of every example scenario, cut to its first
//! steps and to batches of at most 32 trajectories, digested (a CRC-32 of every committed
//! trajectory, its JSON and its token ids and log-probabilities, in commit order, and one of
//! the job's whole summary). A change meant to make the simulator faster must leave every
//! digest as it was; `ROLLARC_BLESS=1` re-pins them after a change meant to alter the outputs
//! (say why in its commit).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use actors::buffer::{SinkError, TrajectorySink};
use actors::types::{Logprobs, Tokens, Trajectory};
use serde::{Deserialize, Serialize};

use super::Scenario;

/// Steps of each run kept: enough for a weight update, staleness and the second step's
/// prefix-cache hits, few enough for a test.
const STEPS: u64 = 2;

/// Trajectories per step at most (of 32 to 128), for the same reason.
const BATCH: usize = 32;

/// Folds every committed trajectory (its JSON) into one CRC, in commit order.
#[derive(Default)]
struct DigestSink {
    state: Mutex<(u64, u64, crc32fast::Hasher)>,
}

impl TrajectorySink for DigestSink {
    fn commit(&self, traj: &Trajectory) -> Result<u64, SinkError> {
        // The JSON without the sequences, then the sequences' bytes (the same values, read
        // without formatting millions of numbers in an unoptimised test build).
        let mut bare = traj.clone();
        for t in &mut bare.turns {
            t.observation_tokens = Tokens::new();
            t.response_tokens = Tokens::new();
            t.logprobs = Logprobs::new();
        }
        let json = serde_json::to_vec(&bare).map_err(|e| SinkError {
            id: traj.id.clone(),
            message: e.to_string(),
        })?;
        let mut s = self.state.lock().map_err(|_| SinkError {
            id: traj.id.clone(),
            message: "digest lock poisoned".into(),
        })?;
        s.0 += 1;
        s.2.update(&json);
        for t in &traj.turns {
            s.1 += t.response_tokens.len() as u64;
            s.2.update(bytemuck::cast_slice(&t.observation_tokens[..]));
            s.2.update(bytemuck::cast_slice(&t.response_tokens[..]));
            s.2.update(bytemuck::cast_slice(&t.logprobs[..]));
        }
        Ok(s.0)
    }
}

/// What one run is pinned by.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct RunDigest {
    trajectories: u64,
    response_tokens: u64,
    trajectories_crc: String,
    summary_crc: String,
    elapsed_s: f64,
    steps: u64,
}

/// Runs every run of `sc` for its first [`STEPS`] steps and digests it.
fn digests(sc: &Scenario) -> BTreeMap<String, RunDigest> {
    let mut out = BTreeMap::new();
    for r in &sc.runs {
        let mut spec = r.spec.clone();
        spec.rollout.steps = Some(spec.rollout.steps.map_or(STEPS, |s| s.min(STEPS)));
        spec.rollout.batch_size = spec.rollout.batch_size.map(|b| b.min(BATCH));
        let sink = Arc::new(DigestSink::default());
        let (summaries, _) = super::run::simulate(spec, r.jobs, r.shared_functions, sink.clone())
            .unwrap_or_else(|e| panic!("{}/{}: {e}", sc.name, r.name));
        let mut summary = crc32fast::Hasher::new();
        let (mut elapsed_s, mut steps) = (0.0_f64, 0);
        for s in summaries {
            summary.update(&serde_json::to_vec(&s).expect("summary JSON"));
            elapsed_s = elapsed_s.max(s.elapsed_s);
            steps += s.steps_done;
        }
        let (trajectories, response_tokens, crc) =
            std::mem::take(&mut *sink.state.lock().expect("digest"));
        out.insert(
            r.name.clone(),
            RunDigest {
                trajectories,
                response_tokens,
                trajectories_crc: format!("{:08x}", crc.finalize()),
                summary_crc: format!("{:08x}", summary.finalize()),
                elapsed_s,
                steps,
            },
        );
    }
    out
}

/// Checks the scenario `examples/sim/{name}.toml` against its pinned digests
/// (`engine/lab/tests/sim-digests/{name}.json`), or pins them under `ROLLARC_BLESS`.
fn check(name: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let sc = Scenario::load(&root.join(format!("examples/sim/{name}.toml")))
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let pinned = root.join(format!("engine/lab/tests/sim-digests/{name}.json"));
    let now = digests(&sc);
    assert!(
        now.values()
            .all(|d| d.trajectories > 0 && d.response_tokens > 0),
        "{now:?}"
    );
    if std::env::var_os("ROLLARC_BLESS").is_some() {
        let mut text = serde_json::to_string_pretty(&now).expect("digests JSON");
        text.push('\n');
        std::fs::write(&pinned, text).expect("write the digests");
        return;
    }
    let want: BTreeMap<String, RunDigest> = serde_json::from_str(
        &std::fs::read_to_string(&pinned)
            .unwrap_or_else(|e| panic!("{}: {e} (ROLLARC_BLESS=1 pins it)", pinned.display())),
    )
    .expect("pinned digests parse");
    let mut diff = Vec::new();
    for (k, w) in &want {
        match now.get(k) {
            Some(n) if n == w => {}
            Some(n) => diff.push(format!("{name}/{k}: pinned {w:?}, now {n:?}")),
            None => diff.push(format!("{name}/{k}: no longer run")),
        }
    }
    for k in now.keys().filter(|k| !want.contains_key(*k)) {
        diff.push(format!("{name}/{k}: not pinned (ROLLARC_BLESS=1 pins it)"));
    }
    assert!(diff.is_empty(), "{}", diff.join("\n"));
}

/// One test per scenario file (so they run side by side).
macro_rules! pinned {
    ($($name:ident),* $(,)?) => {
        const PINNED: &[&str] = &[$(stringify!($name)),*];
        $(
            #[test]
            fn $name() {
                check(stringify!($name));
            }
        )*
    };
}

pinned!(
    alpha, e2e, hardware, pd, production, reward, sandboxes, sigma, stragglers, swe,
);

#[test]
fn every_example_scenario_is_pinned() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/sim");
    for e in std::fs::read_dir(&dir).expect("examples/sim") {
        let p = e.expect("entry").path();
        if p.extension().is_some_and(|x| x == "toml") {
            let stem = p.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
            assert!(PINNED.contains(&stem), "{stem}: add it to `pinned!`");
        }
    }
}
