//! The trainer API's batch fetch: `GET /v1/jobs/{id}/batches/next` and the acknowledgement,
//! over HTTP against an in-process service with its SQLite store, for a realistic batch
//! (512 samples × 4,096 tokens), as JSON and as MessagePack, alternating in one run.

use std::time::Duration;

use crate::service::{Service, ServiceConfig};
use job::store::Store;
use job::trainer_api::{BatchGroup, Sample, TrainingBatch};

#[derive(Debug, thiserror::Error)]
pub enum BatchesBenchError {
    #[error("bench I/O")]
    Io(#[from] std::io::Error),
    #[error("the service")]
    Service(#[from] crate::service::ServiceError),
    #[error("the store")]
    Store(#[from] job::store::StoreError),
    #[error("HTTP")]
    Http(#[from] reqwest::Error),
    #[error("decoding a fetched batch: {0}")]
    Decode(String),
}

const SAMPLES: usize = 512;
const TOKENS: usize = 4096;
const ROUNDS: u64 = 3;

/// A batch of `SAMPLES` samples of `TOKENS` tokens (a quarter observation, the rest
/// response), in groups of 8.
fn synthetic(step: u64) -> TrainingBatch {
    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ step;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let obs = TOKENS / 4;
    let groups = (0..SAMPLES / 8)
        .map(|g| BatchGroup {
            group_id: g as u64,
            task: "math".into(),
            prompt_id: g as u64,
            samples: (0..8)
                .map(|i| Sample {
                    dropped_turns: Vec::new(),
                    restarted_turns: Vec::new(),
                    trajectory_id: format!("g{g}-e{i}"),
                    tokens: (0..TOKENS).map(|_| (next() % 151_000) as u32).collect(),
                    loss_mask: (0..TOKENS).map(|t| u8::from(t >= obs)).collect(),
                    behaviour_logprobs: (0..TOKENS)
                        .map(|t| {
                            if t >= obs {
                                -((next() % 10_000) as f32) / 1000.0
                            } else {
                                0.0
                            }
                        })
                        .collect(),
                    version_spans: vec![actors::types::VersionSpan {
                        version: step,
                        tokens: (TOKENS - obs) as u32,
                        precision: None,
                    }],
                    turn_bounds: vec![[obs, TOKENS]],
                    reward: Some(1.0),
                    per_turn_rewards: vec![1.0],
                    advantage: 0.5,
                    status: "completed".into(),
                    allowed_tokens: None,
                    truncated: false,
                })
                .collect(),
        })
        .collect();
    TrainingBatch {
        step,
        policy_version_min: step,
        policy_version_max: step,
        groups,
    }
}

pub fn bench_batches() -> Result<(), BatchesBenchError> {
    fetch()?;
    bench_announce()
}

fn fetch() -> Result<(), BatchesBenchError> {
    let dir = std::env::temp_dir().join(format!("rollarc-bench-batches-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let r = rt.block_on(run(&dir));
    let _ = std::fs::remove_dir_all(&dir);
    r
}

async fn run(dir: &std::path::Path) -> Result<(), BatchesBenchError> {
    let store = Store::open(&dir.join("rollarc.db"))?;
    let service = Service::with_store(
        store.clone(),
        &ServiceConfig {
            data_dir: dir.to_path_buf(),
            max_running: 1,
            max_memory: None,
            test_hooks: false,
        },
    )?;
    let spec = job::spec::parse(
        "[[tasks]]\ndomain = \"math\"\n[tasks.env]\nkind = \"sim\"\n[[pools]]\nname = \"p\"\ndevice = \"H800\"\nbackend = { kind = \"sim\", model = \"qwen3-8b\" }\n[trainer]\nkind = \"external\"\n",
        job::spec::Format::Toml,
    )
    .map_err(|e| BatchesBenchError::Decode(e.to_string()))?;
    let job = store.create_job(&spec, 2 * ROUNDS, None)?;
    for step in 0..2 * ROUNDS {
        service.batches.offer(&job, &synthetic(step))?;
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let stop = tokio_util::sync::CancellationToken::new();
    let server = tokio::spawn(crate::server::serve_on(
        listener,
        crate::api::router(service.clone()),
        crate::server::EdgeLimits::default(),
        stop.clone(),
        Duration::from_secs(1),
    ));
    let client = reqwest::Client::new();
    let mut totals = [(0.0f64, 0usize); 2];
    for round in 0..ROUNDS {
        for (k, accept) in ["application/json", crate::api::MSGPACK]
            .into_iter()
            .enumerate()
        {
            let t = tokio::time::Instant::now();
            let r = client
                .get(format!("http://{addr}/v1/jobs/{job}/batches/next"))
                .header("accept", accept)
                .send()
                .await?;
            let bytes = r.bytes().await?;
            let v: serde_json::Value = if k == 0 {
                serde_json::from_slice(&bytes)
                    .map_err(|e| BatchesBenchError::Decode(e.to_string()))?
            } else {
                rmp_serde::from_slice(&bytes)
                    .map_err(|e| BatchesBenchError::Decode(e.to_string()))?
            };
            let secs = t.elapsed().as_secs_f64();
            let samples: usize = v["groups"]
                .as_array()
                .map(|g| {
                    g.iter()
                        .map(|g| g["samples"].as_array().map_or(0, Vec::len))
                        .sum()
                })
                .unwrap_or(0);
            if samples != SAMPLES {
                return Err(BatchesBenchError::Decode(format!(
                    "{samples} samples in round {round}"
                )));
            }
            let id = v["batch_id"].as_str().unwrap_or_default().to_string();
            client
                .post(format!("http://{addr}/v1/batches/{id}/ack"))
                .body("{}")
                .send()
                .await?
                .error_for_status()?;
            totals[k].0 += secs;
            totals[k].1 = bytes.len();
        }
    }
    stop.cancel();
    let _ = server.await;
    for (k, name) in ["JSON", "MessagePack"].into_iter().enumerate() {
        let (secs, bytes) = totals[k];
        let per = secs / ROUNDS as f64;
        println!(
            "batch fetch ({SAMPLES} samples × {TOKENS} tokens) as {name}: {:.1} MB, {:.2} s per fetch (lease, encode, transfer, decode) = {:.0} samples/s, {:.0} MB/s",
            bytes as f64 / 1e6,
            per,
            SAMPLES as f64 / per,
            bytes as f64 / 1e6 / per
        );
    }
    println!(
        "MessagePack vs JSON: {:.2}× the bytes, {:.2}× the fetch time",
        totals[1].1 as f64 / totals[0].1 as f64,
        totals[1].0 / totals[0].0
    );
    Ok(())
}

/// Weight announce → installed on the built-in engine: a tiny-model job with an external
/// trainer; per step the trainer leases the batch, announces the next version (the base
/// weights scaled, written as safetensors), acknowledges, and the time until the job's
/// `weights_installed` event is taken.
fn bench_announce() -> Result<(), BatchesBenchError> {
    let dir = std::env::temp_dir().join(format!("rollarc-bench-announce-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("data"))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let r = rt.block_on(announce_run(&dir));
    let _ = std::fs::remove_dir_all(&dir);
    r
}

async fn announce_run(dir: &std::path::Path) -> Result<(), BatchesBenchError> {
    const STEPS: u64 = 6;
    let decode = |e: String| BatchesBenchError::Decode(e);
    let toml = format!(
        "[[tasks]]\ndomain = \"lake\"\ngroup_size = 2\nmax_turns = 3\nmax_tokens_per_turn = 4\nenv = {{ kind = \"frozenlake\", size = 4 }}\n[[pools]]\nname = \"cpu\"\ndevice = \"CPU\"\ncount = 1\nbackend = {{ kind = \"builtin\", model = {{ d_model = 64, n_layers = 2, n_heads = 4, d_ff = 256, max_seq = 256 }} }}\n[rollout]\nbatch_size = 4\nsteps = {STEPS}\nalpha = 1\n[trainer]\nkind = \"external\"\n"
    );
    let spec =
        job::spec::parse(&toml, job::spec::Format::Toml).map_err(|e| decode(e.to_string()))?;
    let job::wiring::TrainerPlan::External {
        model: Some(job::spec::ModelChoice::Tiny(cfg)),
        ..
    } = job::resolve::resolve_models(&spec, &job::resolve::Host::process())
        .map_err(|e| decode(e.to_string()))
        .and_then(|r| job::wiring::plan_trainer(&spec, &r).map_err(|e| decode(e.to_string())))?
    else {
        return Err(decode("not a tiny external job".into()));
    };
    let base =
        actors::model::runtime::BuiltinParts::new(cfg, Default::default(), spec.seed, 0, None)
            .map_err(|e| decode(e.to_string()))?
            .initial
            .candle_tensors(&candle_core::Device::Cpu)
            .map_err(|e| decode(e.to_string()))?;
    let service = Service::open(&ServiceConfig {
        data_dir: dir.join("data"),
        max_running: 1,
        max_memory: None,
        test_hooks: false,
    })?;
    let job = service.submit(spec)?;
    let (_, rx) = service.subscribe(&job)?;
    let mut rx = rx.ok_or_else(|| decode("the job ended at once".into()))?;
    let mut latencies = Vec::new();
    for step in 0..STEPS {
        let b = service
            .batches
            .next(&job, Duration::from_secs(120), Duration::from_secs(300))
            .await?
            .ok_or_else(|| decode(format!("no batch for step {step}")))?;
        let version = step + 1;
        let path = dir.join(format!("v{version}.safetensors"));
        let scale = 1.0 - 0.01 * version as f64;
        let map: std::collections::HashMap<String, candle_core::Tensor> = base
            .iter()
            .map(|(n, t)| Ok((n.clone(), (t * scale)?)))
            .collect::<candle_core::Result<_>>()
            .map_err(|e| decode(e.to_string()))?;
        candle_core::safetensors::save(&map, &path).map_err(|e| decode(e.to_string()))?;
        let t = tokio::time::Instant::now();
        service.batches.announce(
            &job,
            version,
            &path.display().to_string(),
            "safetensors",
            None,
        )?;
        service
            .batches
            .ack(&job, b.step, b.offer, &serde_json::json!({}))?;
        if step + 1 == STEPS {
            break; // the last step's weights are never installed: the job ends
        }
        loop {
            match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await {
                Ok(Ok(crate::service::JobEvent::WeightsInstalled { version: v, .. }))
                    if v == version =>
                {
                    break;
                }
                Ok(Ok(_)) => continue,
                _ => return Err(decode(format!("version {version} was never installed"))),
            }
        }
        latencies.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    latencies.sort_by(f64::total_cmp);
    println!(
        "weight announce + ack → weights_installed on the built-in engine (tiny model, {} installs): median {:.1} ms, max {:.1} ms (load and check the file, publish, wait for the next batch, suspend → install → resume)",
        latencies.len(),
        latencies[latencies.len() / 2],
        latencies.last().copied().unwrap_or(0.0)
    );
    let _ = service.cancel(&job);
    Ok(())
}
