//! Jobs on a real checkpoint (SmolLM2-135M-Instruct, fetched by `make setup`): built-in
//! shards serve it with the chat template framing each observation, the built-in trainer
//! trains LoRA adapters and engines install them, checkpoints resume.

use std::path::PathBuf;
use std::sync::Arc;

use actors::buffer::MemorySink;
use actors::model::llm::LlmTokenizer;
use tests::{BatchLog, SpecBuilder};

/// The checkpoint: `ROLLARC_SMOLLM2`, else where `make setup` puts it.
fn smollm2() -> PathBuf {
    let p = actors::model::llm::smollm2_path();
    assert!(p.is_file(), "{} is missing: run `make setup`", p.display());
    p
}

fn spec(steps: u64) -> job::spec::JobSpec {
    spec_at(steps, "f32")
}

/// The job of [`spec`], its engines generating at `precision`.
fn spec_at(steps: u64, precision: &str) -> job::spec::JobSpec {
    SpecBuilder::new()
        .raw_task(
            "[[tasks]]\ndomain = \"lake\"\ngroup_size = 2\nmax_turns = 2\nmax_tokens_per_turn = 10\nenv = { kind = \"frozenlake\", size = 4 }\n",
        )
        .rollout("batch_size = 1")
        .rollout(&format!("steps = {steps}"))
        .extra(&format!(
            "[[pools]]\nname = \"cpu\"\ndevice = \"CPU\"\ncount = 1\nbackend = {{ kind = \"builtin\", max_batch = 4, model = {{ path = {:?}, max_seq = 1024, precision = {precision:?} }} }}",
            smollm2().display().to_string()
        ))
        .extra("[trainer]\nkind = \"builtin\"\nlr = 0.001\nlora = { rank = 4, alpha = 8, targets = [\"attn_q\", \"attn_v\"] }")
        .build()
}

#[test]
fn a_smollm2_job_generates_free_text_trains_lora_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let sink = Arc::new(MemorySink::default());
    let log = Arc::new(BatchLog::default());
    // One step, then a resumed run for a second: enough to train, checkpoint, resume and
    // export. One group of two per step: the trainer's forward and backward over each
    // trajectory are most of this test's time (81 s with two groups, 46 s with one). The
    // first run generates with q8_0 matrices (every token's span says so), the resumed one
    // in f32.
    let s = job::simrun::run_blocking(
        spec_at(1, "q8_0"),
        0,
        0,
        sink.clone(),
        log.clone(),
        Some(dir.path().to_path_buf()),
    )
    .expect("job runs");
    assert_eq!(s.steps_done, 1);
    let tok =
        LlmTokenizer::from_gguf(&actors::model::llm::Checkpoint::open_gguf(&smollm2()).unwrap())
            .unwrap();
    let im_start = tok.encode("<|im_start|>", true).unwrap()[0];
    let batches = log.batches.lock().unwrap();
    assert_eq!(batches.len(), 1);
    let mut multi_turn = 0;
    for (m, b) in batches.iter() {
        assert_eq!(m.version, b.step + 1);
        for t in b.trajectories() {
            assert!(t.reward.is_some());
            // The first observation is the chat template's system + user + assistant header.
            let first = tok.decode(&t.turns[0].observation_tokens).unwrap();
            assert!(
                first.starts_with("<|im_start|>system\n")
                    && first.ends_with("<|im_start|>assistant\n"),
                "{first:?}"
            );
            for u in &t.turns {
                assert!(!u.response_tokens.is_empty() && u.response_tokens.len() <= 10);
                assert_eq!(
                    u.versions
                        .iter()
                        .filter(|v| v.precision == Some(actors::types::Precision::Q8_0))
                        .map(|v| v.tokens as usize)
                        .sum::<usize>(),
                    u.response_tokens.len(),
                    "{:?}",
                    u.versions
                );
                assert_eq!(u.logprobs.len(), u.response_tokens.len());
                assert!(u.logprobs.iter().all(|l| *l <= 0.0 && l.is_finite()));
            }
            if t.turns.len() == 2 {
                multi_turn += 1;
                // Token-in/token-out: turn two's observation continues the chat after the
                // generated ids (a user message, then the assistant header), nothing re-tokenised.
                let second = tok.decode(&t.turns[1].observation_tokens).unwrap();
                assert!(
                    second.contains("<|im_start|>user\n")
                        && second.ends_with("<|im_start|>assistant\n"),
                    "{second:?}"
                );
                let all: Vec<u32> = t
                    .turns
                    .iter()
                    .flat_map(|u| {
                        u.observation_tokens
                            .iter()
                            .chain(&u.response_tokens)
                            .copied()
                    })
                    .collect();
                assert_eq!(
                    all.iter().filter(|&&x| x == im_start).count(),
                    5,
                    "{:?}",
                    tok.decode(&all)
                );
            }
        }
    }
    // A 4×4 lake is not solved in one move: a free-text walker needs a second turn now and then.
    let texts: Vec<String> = sink
        .log
        .lock()
        .unwrap()
        .iter()
        .map(|t| t.final_text.clone())
        .collect();
    assert!(
        texts.iter().any(|t| t.split_whitespace().count() > 1),
        "multi-token free text: {texts:?}"
    );
    eprintln!("{multi_turn} two-turn trajectories; answers: {texts:?}");
    // Adapter checkpoints are small, and the run resumes from them.
    let ck = dir.path().join("v1.safetensors");
    let size = std::fs::metadata(&ck).expect("checkpoint of v1").len();
    assert!(size < 20 << 20, "LoRA checkpoint of {size} bytes");
    let resumed = Arc::new(BatchLog::default());
    let s = job::simrun::run_blocking(
        spec(2),
        1,
        1,
        Arc::new(MemorySink::default()),
        resumed.clone(),
        Some(dir.path().to_path_buf()),
    )
    .expect("resumed run");
    assert_eq!(s.steps.first().map(|m| m.version), Some(2));
    // Export v1 (base + merged adapters) as GGUF: the exported model recomputes the
    // logprobs the engines generated with under v1 (the resumed run's first batch).
    let inputs = job::resolve::resolve_models(&spec(2), &job::resolve::Host::process()).unwrap();
    let trainer = job::wiring::plan_trainer(&spec(2), &inputs).unwrap();
    let ck = job::wiring::checkpoint_spec(&trainer).unwrap();
    let out = dir.path().join("v1.gguf");
    actors::model::runtime::export_policy(
        &ck,
        &ck_path(&dir, 1),
        actors::model::runtime::ExportFormat::Gguf,
        &out,
    )
    .unwrap();
    let (exported, _) = actors::model::llm::load(&out).unwrap();
    let batches = resumed.batches.lock().unwrap();
    let mut checked = 0;
    let mut worst = 0.0f64;
    for t in batches[0].1.trajectories() {
        let mut ctx: Vec<u32> = Vec::new();
        for u in &t.turns {
            ctx.extend_from_slice(&u.observation_tokens);
            assert!(
                u.versions
                    .iter()
                    .all(|v| v.precision == Some(actors::types::Precision::F32)),
                "{:?}",
                u.versions
            );
            if u.versions.iter().all(|v| v.version == 1) {
                let mut all = ctx.clone();
                all.extend_from_slice(&u.response_tokens);
                let logits: Vec<Vec<f32>> = exported.forward(&all).unwrap().to_vec2().unwrap();
                for (k, (&tok, &lp)) in u.response_tokens.iter().zip(&u.logprobs).enumerate() {
                    let row = &logits[ctx.len() + k - 1];
                    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
                    let z: f64 = row.iter().map(|&l| (l as f64 - max).exp()).sum();
                    let want = row[tok as usize] as f64 - max - z.ln();
                    worst = worst.max((want - lp as f64).abs());
                }
                checked += 1;
            }
            ctx.extend_from_slice(&u.response_tokens);
        }
    }
    assert!(checked > 0, "no turn generated entirely under v1");
    assert!(worst <= 1e-3, "exported v1 vs engine logprobs: {worst}");
    eprintln!("exported v1 recomputes {checked} turns' logprobs within {worst:.2e}");
}

fn ck_path(dir: &tempfile::TempDir, v: u64) -> PathBuf {
    dir.path().join(format!("v{v}.safetensors"))
}

/// Process ids whose command line mentions `needle`.
fn processes_with(needle: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(needle))
                .unwrap_or(false)
        })
        .collect()
}

#[test]
fn a_smollm2_job_on_two_managed_llamacpp_shards_installs_every_version_and_survives_a_killed_server()
 {
    let dir = tempfile::tempdir().unwrap();
    let spec = SpecBuilder::new()
        .raw_task(
            "[[tasks]]\ndomain = \"lake\"\ngroup_size = 2\nmax_turns = 2\nmax_tokens_per_turn = 10\nenv = { kind = \"frozenlake\", size = 4 }\n",
        )
        .rollout("batch_size = 1")
        .rollout("steps = 3")
        .extra(&format!(
            "[[pools]]\nname = \"llama\"\ndevice = \"CPU\"\ncount = 2\nbackend = {{ kind = \"llamacpp\", slots = 2, model = {{ path = {:?}, max_seq = 1024 }} }}",
            smollm2().display().to_string()
        ))
        .extra("[trainer]\nkind = \"builtin\"\nlr = 0.001\nlora = { rank = 4, alpha = 8, targets = [\"attn_q\", \"attn_v\"] }")
        .build();
    let script = dir.path().join("served/xllamacpp_serve.py");
    let needle = script.to_string_lossy().into_owned();
    let log = Arc::new(BatchLog::default());
    // Once the first batch is trained, SIGKILL one server's process group mid-run.
    let killed = {
        let (log, needle) = (log.clone(), needle.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .unwrap();
            let nap = |ms| {
                rt.block_on(async {
                    tokio::time::sleep(std::time::Duration::from_millis(ms)).await
                })
            };
            // After the first batch the servers restart on v1; once both have, and generation
            // of the next batch is under way, one is killed.
            let mut before: Option<Vec<u32>> = None;
            for _ in 0..6000 {
                let now = processes_with(&needle);
                match &before {
                    None if !log.batches.lock().unwrap().is_empty() => before = Some(now),
                    Some(b) if now.len() == 2 && now.iter().all(|p| !b.contains(p)) => {
                        nap(1500);
                        let pid = *processes_with(&needle).first()?;
                        return infra::process::kill_group(pid).then_some(pid);
                    }
                    _ => {}
                }
                nap(20);
            }
            None
        })
    };
    let s = job::simrun::run_blocking(
        spec,
        0,
        0,
        Arc::new(MemorySink::default()),
        log.clone(),
        Some(dir.path().to_path_buf()),
    )
    .expect("job runs");
    assert_eq!(s.steps_done, 3);
    let pid = killed.join().unwrap().expect("a server was killed mid-run");
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists()
            || processes_with(&needle).iter().all(|&p| p != pid)
    );
    // Versions 1 and 2 were exported for the servers (v0 too: every served version is the
    // trainer's f32 weights).
    for v in 0..=2 {
        assert!(
            dir.path().join(format!("served/f32/v{v}.gguf")).is_file(),
            "v{v} exported"
        );
    }
    let batches = log.batches.lock().unwrap();
    let mut versions = std::collections::BTreeSet::new();
    for (m, b) in batches.iter() {
        assert_eq!(m.version, b.step + 1);
        for t in b.trajectories() {
            for u in &t.turns {
                assert!(!u.response_tokens.is_empty() && u.response_tokens.len() <= 10);
                assert_eq!(u.logprobs.len(), u.response_tokens.len());
                assert!(u.logprobs.iter().all(|l| *l <= 0.0 && l.is_finite()));
                let covered: u32 = u.versions.iter().map(|v| v.tokens).sum();
                assert_eq!(covered as usize, u.response_tokens.len());
                for v in &u.versions {
                    // Generated by a version the trainer had published by then.
                    assert!(v.version <= b.step, "{:?} in step {}", u.versions, b.step);
                    versions.insert(v.version);
                }
            }
        }
    }
    assert!(
        versions.len() >= 2,
        "trajectories from several versions: {versions:?}"
    );
    // The servers die with the job.
    assert!(
        processes_with(&needle).is_empty(),
        "server processes outlived the job"
    );
    // Each shard's server started on the checkpoint, then on every installed version; the
    // killed one once more.
    let logs: Vec<String> = (0..2)
        .map(|i| {
            std::fs::read_to_string(dir.path().join(format!("served/llamacpp-{i}.log")))
                .unwrap_or_default()
        })
        .collect();
    let count = |l: &str, what: &str| l.lines().filter(|x| x.starts_with(what)).count();
    let starts: Vec<usize> = logs.iter().map(|l| count(l, "listening on")).collect();
    let crashes: Vec<usize> = logs
        .iter()
        .map(|l| count(l, "rollarc: the server exited"))
        .collect();
    eprintln!("server starts per shard: {starts:?}, crash restarts: {crashes:?}");
    assert!(starts.iter().all(|&n| n >= 3), "{starts:?}");
    assert_eq!(
        crashes.iter().sum::<usize>(),
        1,
        "the killed server was restarted once"
    );
    eprintln!("versions served: {versions:?}; killed server {pid}");
}

/// Chaos at the episode level: the llama.cpp server of a managed agent's shard is SIGKILLed
/// while the agent's streamed answer is being generated. The call is retried on the
/// restarted server (or its episode masked as infrastructure and the group retried, never
/// rewarded 0); the job trains its step with every row, and nothing hangs.
#[test]
fn an_agent_episode_survives_its_llamacpp_shard_killed_mid_stream() {
    let dir = tempfile::tempdir().unwrap();
    let marks = tempfile::tempdir().unwrap();
    let model = smollm2().display().to_string();
    let task = format!(
        "[[tasks]]\ndomain = \"stream\"\ngroup_size = 2\nmax_tokens_per_turn = 256\n\
         [tasks.env]\nkind = \"agent\"\ncommand = [\"{py}\", \"{script}\", \"stream\"]\n\
         tokenizer = {model:?}\ntimeout_s = 240\nsandbox = \"none\"\nenv = {{ STREAM_DIR = {marks:?} }}\n",
        py = tests::agent_python(),
        script = tests::repo()
            .join("tests/agents/episode_agents.py")
            .display(),
        marks = marks.path().display().to_string(),
    );
    let spec = SpecBuilder::new()
        .raw_task(&task)
        .rollout("batch_size = 1")
        .rollout("steps = 1")
        .rollout("max_retries_per_group = 2")
        .extra(&format!(
            "[[pools]]\nname = \"llama\"\ndevice = \"CPU\"\ncount = 1\nbackend = {{ kind = \"llamacpp\", slots = 2, model = {{ path = {model:?}, max_seq = 1024 }} }}"
        ))
        .extra("[trainer]\nkind = \"builtin\"\nlr = 0.001\nlora = { rank = 4, alpha = 8, targets = [\"attn_q\", \"attn_v\"] }")
        .build();
    let needle = dir
        .path()
        .join("served/xllamacpp_serve.py")
        .to_string_lossy()
        .into_owned();
    // 300 ms after the first agent sent its request (it is on the server by then, and a
    // 200-token answer takes seconds), SIGKILL the server: whether the answer was still being
    // generated then (no agent had a chunk of it yet).
    let killer = {
        let (marks, needle) = (marks.path().to_path_buf(), needle.clone());
        // Real processes on the real clock, beside a blocking job run.
        #[allow(clippy::disallowed_methods)]
        std::thread::spawn(move || {
            let seen = |prefix: &str| {
                std::fs::read_dir(&marks).is_ok_and(|d| {
                    d.flatten()
                        .any(|e| e.file_name().to_string_lossy().starts_with(prefix))
                })
            };
            for _ in 0..30_000 {
                if seen("sent-") {
                    std::thread::sleep(std::time::Duration::from_millis(300));
                    let pid = *processes_with(&needle).first()?;
                    let mid_stream = !seen("first-");
                    return infra::process::kill_group(pid).then_some((pid, mid_stream));
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            None
        })
    };
    let sink = Arc::new(MemorySink::default());
    let log = Arc::new(BatchLog::default());
    let s = job::simrun::run_blocking(
        spec,
        0,
        0,
        sink.clone(),
        log.clone(),
        Some(dir.path().to_path_buf()),
    )
    .expect("the job runs through the kill");
    let (pid, mid_stream) = killer.join().unwrap().expect("the server was killed");
    assert!(mid_stream, "the kill landed after the answer was generated");
    assert_eq!(s.steps_done, 1);
    let rows = sink.log.lock().unwrap();
    for t in rows.iter() {
        eprintln!(
            "{}: {} turns, reward {:?}, failure {:?}, info {:?}",
            t.id,
            t.turns.len(),
            t.reward,
            t.failure,
            t.agent.as_ref().and_then(|a| a.info.clone())
        );
        match &t.failure {
            None => {
                assert!(t.reward.is_some());
                for u in &t.turns {
                    assert_eq!(u.logprobs.len(), u.response_tokens.len());
                    let covered: u32 = u.versions.iter().map(|v| v.tokens).sum();
                    assert_eq!(covered as usize, u.response_tokens.len());
                }
            }
            Some(
                actors::types::FailureReason::GenerationFailed(_)
                | actors::types::FailureReason::AgentFailed(_),
            ) => assert!(
                t.reward.is_none(),
                "an infrastructure failure is never rewarded"
            ),
            Some(other) => panic!("not an infrastructure failure: {other:?}"),
        }
    }
    // Every row of the trained group is there.
    let batches = log.batches.lock().unwrap();
    assert_eq!(batches.len(), 1);
    let trained: Vec<_> = batches[0].1.trajectories().collect();
    assert_eq!(trained.len(), 2, "the group trained whole");
    assert!(trained.iter().all(|t| t.failure.is_none()));
    // The killed server was restarted once, and the servers died with the job.
    let log0 = std::fs::read_to_string(dir.path().join("served/llamacpp-0.log")).unwrap();
    let crashes = log0
        .lines()
        .filter(|l| l.starts_with("rollarc: the server exited"))
        .count();
    assert_eq!(crashes, 1, "the killed server {pid} was restarted once");
    assert!(processes_with(&needle).is_empty());
}

/// What a trainer of a checkpoint job may announce: a safetensors file with the model's own
/// names, one with Hugging Face names (a PyTorch `state_dict`, q/k rows in the halves layout),
/// or a GGUF checkpoint — each loads as exactly the served tensors; the tiny model's file
/// layout is refused for it with the tensor named.
#[test]
fn announced_checkpoint_weights_load_from_gguf_hugging_face_names_and_model_names() {
    use job::store::AnnouncedWeights;
    use job::trainer_api::ServedModel;
    let path = smollm2();
    let spec = actors::model::runtime::CheckpointSpec {
        path: path.clone(),
        max_seq: 64,
        lora: None,
        micro_batch_rows: 1,
    };
    let (parts, policy) =
        actors::model::runtime::BuiltinParts::checkpoint(&spec, Default::default(), 0, None)
            .unwrap();
    let served = ServedModel::of(&parts.initial).with_hf_names(policy.config());
    let base: std::collections::HashMap<String, candle_core::Tensor> = parts
        .initial
        .candle_tensors(&candle_core::Device::Cpu)
        .unwrap()
        .into_iter()
        .collect();
    let same = |w: &actors::weights::Weights, what: &str| {
        let got = w.candle_tensors(&candle_core::Device::Cpu).unwrap();
        assert_eq!(got.len(), base.len(), "{what}");
        for (n, t) in got {
            let d = (&t - &base[&n])
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert_eq!(d, 0.0, "{what}: {n} differs by {d}");
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let ann = |version: u64, uri: &std::path::Path, format: &str| AnnouncedWeights {
        version,
        uri: uri.display().to_string(),
        format: format.into(),
        identity: None,
    };
    // The GGUF itself (Q4_1, dequantised as the engines dequantise it).
    let w = served.load(&ann(1, &path, "gguf")).unwrap();
    assert_eq!(w.version, 1);
    same(&w, "gguf");
    // Hugging Face names, as `save_hf` (and `transformers`) write them.
    let (weights, tok) = actors::model::llm::load(&path).unwrap();
    weights.save_hf(&tok, &dir.path().join("hf")).unwrap();
    let hf = dir.path().join("hf").join("model.safetensors");
    same(
        &served.load(&ann(2, &hf, "safetensors")).unwrap(),
        "hf names",
    );
    // The model's own names.
    let own = dir.path().join("own.safetensors");
    candle_core::safetensors::save(&base, &own).unwrap();
    same(
        &served.load(&ann(3, &own, "safetensors")).unwrap(),
        "own names",
    );
    // A file missing a tensor is refused with its name.
    let mut fewer = base.clone();
    fewer.remove("blk.0.attn_q");
    candle_core::safetensors::save(&fewer, &own).unwrap();
    let e = served.load(&ann(4, &own, "safetensors")).unwrap_err();
    assert!(e.to_string().contains("blk.0.attn_q"), "{e}");
}

/// An external trainer drives a managed llama.cpp shard: the weights it announces (a GGUF
/// file) are exported for the server, which restarts on them, and the next batch is generated
/// by the new version; `weights_installed` goes out on the event stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_external_trainer_drives_a_managed_llamacpp_shard() {
    let t = tests::TestServer::start().await;
    let toml = SpecBuilder::new()
        .raw_task(
            "[[tasks]]\ndomain = \"lake\"\ngroup_size = 2\nmax_turns = 2\nmax_tokens_per_turn = 8\nenv = { kind = \"frozenlake\", size = 4 }\n",
        )
        .rollout("batch_size = 2")
        .rollout("steps = 2")
        .rollout("alpha = 0")
        .extra(&format!(
            "[[pools]]\nname = \"llama\"\ndevice = \"CPU\"\ncount = 1\nbackend = {{ kind = \"llamacpp\", slots = 2, model = {{ path = {:?}, max_seq = 1024 }} }}",
            smollm2().display().to_string()
        ))
        .extra("[trainer]\nkind = \"external\"\nlease_s = 600")
        .toml();
    let job = tests::submit_job(&t.client, &t.url(""), toml).await;
    let events = t
        .client
        .get(t.url(&format!("/v1/jobs/{job}/events")))
        .send()
        .await
        .unwrap();
    let next = |wait: u32| {
        let (c, u) = (
            t.client.clone(),
            t.url(&format!("/v1/jobs/{job}/batches/next?wait_s={wait}")),
        );
        async move {
            for _ in 0..4 {
                let r = c.get(&u).send().await.unwrap();
                if r.status() == 200 {
                    return r.json::<serde_json::Value>().await.unwrap();
                }
                assert_eq!(r.status(), 204);
            }
            panic!("no batch within 4 × {wait} s");
        }
    };
    let versions = tests::batch_versions;
    let ack = |b: &serde_json::Value| {
        let (c, u) = (
            t.client.clone(),
            t.url(&format!(
                "/v1/batches/{}/ack",
                b["batch_id"].as_str().unwrap()
            )),
        );
        async move {
            let r = c.post(u).body("{}").send().await.unwrap();
            assert_eq!(r.status(), 200);
        }
    };
    let b0 = next(60).await;
    assert_eq!(b0["step"], 1);
    assert_eq!(versions(&b0), [0].into());
    let r = t
        .client
        .post(t.url(&format!("/v1/jobs/{job}/weights")))
        .json(&serde_json::json!({"version": 1, "source": {"kind": "path", "uri": smollm2(), "format": "gguf"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202, "{}", r.text().await.unwrap());
    ack(&b0).await;
    let b1 = next(60).await;
    assert_eq!(b1["step"], 2);
    // α = 0: the second batch was generated by v1 alone.
    assert_eq!(versions(&b1), [1].into());
    ack(&b1).await;
    let text = tokio::time::timeout(std::time::Duration::from_secs(120), events.text())
        .await
        .expect("the stream ends with the job")
        .unwrap();
    assert!(text.contains("event: weights_installed"), "{text}");
    assert!(text.contains("\"version\":1"), "{text}");
    assert!(text.contains("succeeded"), "{text}");
    assert!(
        walk(t.dir.path()).iter().any(|p| p.ends_with("v1.gguf")),
        "v1 exported for the server under {}",
        t.dir.path().display()
    );
}

fn walk(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// A llama.cpp server on SmolLM2 listening on `ip:port` (the `xllamacpp` wheel's, as an
/// inference Deployment's replica would be); killed when dropped.
struct Replica {
    child: std::process::Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Replica {
    fn start(ip: &str, port: u16) -> Self {
        use actors::generation::remote::llamacpp::{XLLAMACPP_SERVE, xllamacpp_command};
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("xllamacpp_serve.py");
        std::fs::write(&script, XLLAMACPP_SERVE).unwrap();
        let python = job::resolve::xllamacpp_python(&infra::env::ProcessEnv);
        let argv: Vec<String> = xllamacpp_command(&python, &script, 1)
            .into_iter()
            .map(|a| {
                a.replace("{model}", &smollm2().display().to_string())
                    .replace("{host}", ip)
                    .replace("{port}", &port.to_string())
                    .replace("{slots}", "2")
                    .replace("{total_context}", "2048")
            })
            .collect();
        let child = std::process::Command::new(&argv[0])
            .args(&argv[1..])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("llama.cpp starts");
        Self {
            child,
            url: format!("http://{ip}:{port}"),
            _dir: dir,
        }
    }

    /// Waits until it answers `/health`.
    async fn healthy(&self) {
        let c = reqwest::Client::new();
        for _ in 0..1200 {
            if c.get(format!("{}/health", self.url))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
            {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        panic!("{} never became healthy", self.url);
    }

    /// Whether one of its slots is generating.
    async fn busy(&self) -> bool {
        let Ok(r) = reqwest::get(format!("{}/slots", self.url)).await else {
            return true;
        };
        let v: serde_json::Value = r.json().await.unwrap_or_default();
        v.as_array()
            .is_none_or(|s| s.iter().any(|s| s["is_processing"] == true))
    }
}

/// A pool that follows llama.cpp replicas by DNS (dnsmasq answering a name the test
/// rewrites) grows from one server to two while a job runs, then shrinks back: the new
/// server takes trajectories once healthy, the leaving one finishes those it holds and gets
/// no new ones (killed after that, no trajectory fails), and every token's version is
/// recorded. An external trainer (this test) acks batches without new weights: an attached
/// llama.cpp serves its checkpoint, version 0, and cannot take another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_elastic_llamacpp_pool_follows_its_replicas_up_and_down_without_losing_an_episode() {
    use crate::env_workers::{Dns, NAME, free_port};
    let _ = tracing_subscriber::fmt()
        .with_env_filter("actors=info,job=info")
        .with_writer(std::io::stderr)
        .try_init();
    let port = free_port();
    let (ip_a, ip_b) = ("127.0.0.2", "127.0.0.3");
    let a = Replica::start(ip_a, port);
    let mut b = Some(Replica::start(ip_b, port));
    let dns = Dns::start(&[ip_a]);
    a.healthy().await;
    b.as_ref().unwrap().healthy().await;
    eprintln!("both replicas are healthy");
    let t = tests::TestServer::start().await;
    let steps = 12;
    let toml = SpecBuilder::new()
        .raw_task(
            "[[tasks]]\ndomain = \"lake\"\ngroup_size = 2\nmax_turns = 2\nmax_tokens_per_turn = 8\nenv = { kind = \"frozenlake\", size = 4 }\n",
        )
        .rollout("batch_size = 2")
        .rollout(&format!("steps = {steps}"))
        // The policy stays at version 0 (no weights are announced): a bound past the run's
        // steps lets rollout go on.
        .rollout("alpha = 100")
        // Few trajectories at a time: they are placed as the run goes, not all at its start.
        .rollout("max_concurrent_episodes = 4")
        .extra(&format!(
            "[[pools]]\nname = \"llama\"\ndevice = \"CPU\"\ncount = 2\nbackend = {{ kind = \"llamacpp\", slots = 2, model = {{ path = {:?}, max_seq = 1024 }}, discover = {{ dns = \"{NAME}:{port}\", nameserver = \"{}\", refresh_s = 1 }} }}",
            smollm2().display().to_string(),
            dns.addr
        ))
        .extra("[trainer]\nkind = \"external\"\nlease_s = 600")
        .toml();
    let base = t.url("");
    let job = tests::submit_job(&t.client, &base, toml).await;
    eprintln!("job {job} submitted");
    let t0 = tokio::time::Instant::now();
    let shards_seen = |rows: &[serde_json::Value]| -> std::collections::BTreeSet<u64> {
        rows.iter()
            .filter_map(|r| r["trajectory"]["shard"].as_u64())
            .collect()
    };
    // Phases: 0 one server; 1 the second joined the name; 2 it left the name; 3 it is gone.
    let mut phase = 0;
    let mut first_shard = None;
    let mut left_at_rows = 0;
    let mut quiet = 0;
    for step in 1..=steps {
        let batch = loop {
            let r = t
                .client
                .get(t.url(&format!("/v1/jobs/{job}/batches/next?wait_s=30")))
                .send()
                .await
                .unwrap();
            if r.status() == 200 {
                break r.json::<serde_json::Value>().await.unwrap();
            }
            assert_eq!(r.status(), 204, "step {step}");
            let state: serde_json::Value = t
                .client
                .get(t.url(&format!("/v1/jobs/{job}")))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            assert_eq!(state["state"], "running", "step {step}: {state}");
        };
        eprintln!("step {step}: a batch at {:?}", t0.elapsed());
        assert_eq!(tests::batch_versions(&batch), [0].into());
        let r = t
            .client
            .post(t.url(&format!(
                "/v1/batches/{}/ack",
                batch["batch_id"].as_str().unwrap()
            )))
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let rows = tests::all_rows(&t.client, &base, &job, 500).await;
        let seen = shards_seen(&rows);
        match phase {
            0 if step >= 2 => {
                assert_eq!(seen.len(), 1, "one server, one shard: {seen:?}");
                first_shard = seen.first().copied();
                dns.set(&[ip_a, ip_b], true);
                phase = 1;
            }
            1 if seen.len() == 2 => {
                eprintln!("step {step}: the second server took trajectories");
                dns.set(&[ip_a], true);
                left_at_rows = rows.len();
                phase = 2;
            }
            2 => {
                // Once it has been idle for two steps, it is let go: killed.
                let idle = !b.as_ref().unwrap().busy().await;
                quiet = if idle { quiet + 1 } else { 0 };
                if quiet >= 2 {
                    eprintln!("step {step}: the second server is idle; killing it");
                    drop(b.take());
                    phase = 3;
                }
            }
            _ => {}
        }
    }
    assert_eq!(phase, 3, "the scenario did not finish within {steps} steps");
    let done = tests::wait_ended(&t.client, &base, &job, std::time::Duration::from_secs(120)).await;
    assert_eq!(done["state"], "succeeded", "{done}");
    let rows = tests::all_rows(&t.client, &base, &job, 500).await;
    assert!(rows.len() > left_at_rows);
    let second = shards_seen(&rows)
        .into_iter()
        .find(|s| Some(*s) != first_shard)
        .expect("two shards");
    for r in &rows {
        let tr = &r["trajectory"];
        assert!(tr["failure"].is_null(), "an episode was lost: {tr}");
        for turn in tr["turns"].as_array().unwrap() {
            let tokens = turn["response_tokens"].as_array().unwrap().len() as u64;
            let spans: u64 = turn["versions"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| {
                    assert_eq!(v["version"], 0);
                    v["tokens"].as_u64().unwrap()
                })
                .sum();
            assert_eq!(spans, tokens, "every token's version: {turn}");
        }
    }
    // Trajectories after the leaving server went idle ran on the first shard only.
    let late: Vec<u64> = rows[rows.len().saturating_sub(4)..]
        .iter()
        .filter_map(|r| r["trajectory"]["shard"].as_u64())
        .collect();
    assert!(
        late.iter().all(|s| *s != second),
        "shard {second} took trajectories after its server left: {late:?}"
    );
}
