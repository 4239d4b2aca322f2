//! `rollarc train`: the built-in trainer as an external process that speaks only the trainer
//! API. It reads the job's spec to build the same model from the same seed, then loops: lease
//! the next batch, rebuild it, take one optimiser step, checkpoint its own state, export the
//! new weights as safetensors to a shared directory, announce them, acknowledge the batch.
//!
//! Exactly-once per step: the trainer checkpoints (parameters and optimiser moments) before it
//! announces and acknowledges. A batch offered again whose step the checkpoint already covers
//! (the process died between checkpoint and acknowledgement) is announced and acknowledged
//! without training on it a second time.

use std::path::{Path, PathBuf};
use std::time::Duration;

use actors::model::runtime::{BuiltinParts, CheckpointSpec, checkpoint_path};
use actors::types::PolicyVersion;
use serde::Deserialize;

use job::spec::{BuiltinTrainerSpec, JobSpec, ModelChoice, TrainerSpec};
use job::trainer_api::TrainingBatch;
use job::wiring::{TrainerPlan, builtin_trainer_config};

mod session;

use session::{Lease, Session};

/// What `rollarc train` needs.
pub(crate) struct TrainOptions {
    /// The service's base URL.
    pub server: String,
    pub token: Option<String>,
    pub job: String,
    /// The trainer's directory: `trainer/` keeps its checkpoints (resume), `weights/` the
    /// exported versions the service reads (must be readable by the service, outside its data
    /// directory).
    pub out: PathBuf,
    pub trainer: BuiltinTrainerSpec,
    /// The base checkpoint when the service's path to it differs from this machine's.
    pub model: Option<PathBuf>,
    /// How long one `batches/next` call waits (≤ 60 s).
    pub wait: Duration,
    /// No line per step.
    pub quiet: bool,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum TrainClientError {
    #[error("{url}: {source}")]
    Http {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{url} answered {status}: {body}")]
    Status {
        url: String,
        status: reqwest::StatusCode,
        body: String,
    },
    #[error("the token is not a valid HTTP header value")]
    BadToken,
    #[error(
        "job {0} does not train through the trainer API: its spec has no trainer = {{ kind = \"external\" }}"
    )]
    NotExternal(String),
    #[error(
        "job {0} runs simulated pools: there are no weights to train (run `rollarc train` against jobs on builtin pools)"
    )]
    Simulated(String),
    #[error("the job's spec cannot be wired: {0}")]
    Wiring(String),
    #[error("building the job's model: {0}")]
    Model(String),
    #[error("training step {step}: {source}")]
    Step {
        step: u64,
        #[source]
        source: actors::trainer::TrainError,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--trainer {path}: {why}")]
    TrainerFile { path: PathBuf, why: String },
    #[error("the service sent a batch this trainer cannot read: {0}")]
    Decode(String),
}

/// What a `rollarc train` run did.
#[derive(Debug, Default)]
pub(crate) struct TrainSummary {
    /// Optimiser steps taken by this process.
    pub steps: u64,
    /// Batches acknowledged (steps taken, or taken before a restart and acknowledged now).
    pub acked: u64,
    /// Acknowledgements refused because the lease had ended (the batch comes back).
    pub leases_lost: u64,
    /// The newest version announced.
    pub version: PolicyVersion,
    /// The job's state when the trainer stopped.
    pub job_state: String,
}

/// The built-in trainer's settings from a file: the `[trainer]` table of a job spec (kind
/// `builtin`), or a file that is that table alone (TOML or JSON).
pub(crate) fn trainer_from_file(path: &Path) -> Result<BuiltinTrainerSpec, TrainClientError> {
    let bad = |why: String| TrainClientError::TrainerFile {
        path: path.to_path_buf(),
        why,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let value: serde_json::Value = if path.extension().is_some_and(|e| e == "json") {
        serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?
    } else {
        let t: toml::Value = toml::from_str(&text).map_err(|e| bad(e.to_string()))?;
        serde_json::to_value(t).map_err(|e| bad(e.to_string()))?
    };
    match value.get("trainer") {
        Some(t) => match serde_json::from_value::<TrainerSpec>(t.clone()) {
            Ok(TrainerSpec::Builtin(b)) => Ok(b),
            Ok(_) => Err(bad("its [trainer] is not kind = \"builtin\"".into())),
            Err(e) => Err(bad(format!("[trainer]: {e}"))),
        },
        None => {
            let mut t = value;
            if let Some(o) = t.as_object_mut() {
                o.remove("kind");
            }
            serde_json::from_value(t).map_err(|e| bad(e.to_string()))
        }
    }
}

/// The built-in trainer's defaults (as a job's `[trainer] kind = "builtin"` with no other key).
pub(crate) fn default_trainer() -> BuiltinTrainerSpec {
    serde_json::from_value(serde_json::json!({})).expect("every field has a default")
}

/// The lease as `batches/next` sends it.
#[derive(Deserialize)]
struct Leased {
    batch_id: String,
    #[serde(flatten)]
    batch: TrainingBatch,
}

/// The service's trainer API over HTTP.
struct Api {
    client: reqwest::Client,
    server: String,
}

impl Api {
    /// The client of the service at `o.server`, sending `o.token`.
    fn connect(o: &TrainOptions) -> Result<Self, TrainClientError> {
        let client = crate::cli::api_client(o.token.as_deref()).map_err(|e| match e {
            crate::cli::WatchError::Http(source) => TrainClientError::Http {
                url: o.server.clone(),
                source,
            },
            _ => TrainClientError::BadToken,
        })?;
        Ok(Self {
            client,
            server: o.server.trim_end_matches('/').to_string(),
        })
    }

    async fn send(
        &self,
        req: reqwest::RequestBuilder,
        url: &str,
    ) -> Result<reqwest::Response, TrainClientError> {
        req.send().await.map_err(|source| TrainClientError::Http {
            url: url.into(),
            source,
        })
    }

    async fn fail(url: &str, r: reqwest::Response) -> TrainClientError {
        let status = r.status();
        TrainClientError::Status {
            url: url.into(),
            status,
            body: r.text().await.unwrap_or_default(),
        }
    }

    async fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
    ) -> Result<T, TrainClientError> {
        let url = format!("{}{path}", self.server);
        let r = self.send(self.client.get(&url), &url).await?;
        if !r.status().is_success() {
            return Err(Self::fail(&url, r).await);
        }
        r.json()
            .await
            .map_err(|source| TrainClientError::Http { url, source })
    }

    /// POSTs `body`; `Ok(None)` for a 409 (the caller decides what it means).
    async fn post(
        &self,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<Option<serde_json::Value>, TrainClientError> {
        let url = format!("{}{path}", self.server);
        let r = self.send(self.client.post(&url).json(body), &url).await?;
        if r.status() == reqwest::StatusCode::CONFLICT {
            return Ok(None);
        }
        if !r.status().is_success() {
            return Err(Self::fail(&url, r).await);
        }
        r.json()
            .await
            .map(Some)
            .map_err(|source| TrainClientError::Http { url, source })
    }
}

/// The newest checkpoint version in `dir` (0: none).
fn newest_checkpoint(dir: &Path) -> PolicyVersion {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let n = e.file_name();
            let n = n.to_str()?;
            n.strip_prefix('v')?
                .strip_suffix(".safetensors")?
                .parse::<u64>()
                .ok()
        })
        .filter(|&v| checkpoint_path(dir, v).is_file())
        .max()
        .unwrap_or(0)
}

fn weights_path(dir: &Path, version: PolicyVersion) -> PathBuf {
    dir.join(format!("v{version}.safetensors"))
}

/// Writes `w` as safetensors (through a temporary file, so the service never reads half a
/// file) and keeps the three newest versions.
fn export(
    dir: &Path,
    w: &actors::weights::Weights,
    version: PolicyVersion,
) -> Result<PathBuf, TrainClientError> {
    let path = weights_path(dir, version);
    let io = |source| TrainClientError::Io {
        path: path.clone(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    let tensors: std::collections::HashMap<String, candle_core::Tensor> = w
        .candle_tensors(&candle_core::Device::Cpu)
        .map_err(|e| TrainClientError::Model(e.to_string()))?
        .into_iter()
        .collect();
    let tmp = dir.join(format!(".v{version}.safetensors.tmp"));
    candle_core::safetensors::save(&tensors, &tmp).map_err(|e| TrainClientError::Io {
        path: tmp.clone(),
        source: std::io::Error::other(e.to_string()),
    })?;
    std::fs::rename(&tmp, &path).map_err(io)?;
    if version > 3 {
        let _ = std::fs::remove_file(weights_path(dir, version - 3));
    }
    Ok(path)
}

/// Trains job `o.job` until it ends (or fails, or is cancelled).
pub(crate) async fn train(o: TrainOptions) -> Result<TrainSummary, TrainClientError> {
    let api = Api::connect(&o)?;
    let job = o.job.as_str();
    let spec: JobSpec = api.get_json(&format!("/v1/jobs/{job}/spec")).await?;
    let model = external_model(&spec, job)?;
    let state_dir = o.out.join("trainer");
    let weights_dir = o.out.join("weights");
    let start = newest_checkpoint(&state_dir);
    let parts = builtin_parts(&o, &spec, model, &state_dir, start)?;
    // A restart after the checkpoint of `start` but before its export: export it now.
    if start > 0 && !weights_path(&weights_dir, start).is_file() {
        export(&weights_dir, &parts.initial, start)?;
    }
    let mut session = Session {
        api,
        job,
        weights_dir,
        trainer: parts.trainer,
        version: start,
        out: TrainSummary {
            version: start,
            ..Default::default()
        },
    };
    if !o.quiet && start > 0 {
        println!("resuming from the trainer checkpoint of version {start}");
    }
    let wait_s = o.wait.as_secs_f64().clamp(0.0, 60.0);
    loop {
        let leased = match session.lease(wait_s).await? {
            Lease::Batch(leased) => leased,
            Lease::None => continue,
            Lease::JobEnded(state) => {
                session.out.job_state = state;
                return Ok(session.out);
            }
        };
        let step = leased.batch.step;
        let next = step;
        let t = tokio::time::Instant::now();
        let stats = session.train_on(&leased.batch).await?;
        // Announce (again, after a restart: a 409 says it was) then acknowledge. A batch
        // trained long ago (its version's file pruned) has a newer version announced.
        let announced = session.announce(next).await?;
        session.out.version = session.out.version.max(next);
        let lease_lost = !session.acknowledge(&leased.batch_id, &stats).await?;
        if !o.quiet {
            print_step(step, &stats, t, announced.is_none(), lease_lost);
        }
    }
}

/// The model an external trainer of `spec` trains (none for simulated pools); an error when
/// the job does not train through the trainer API.
fn external_model(spec: &JobSpec, job: &str) -> Result<Option<ModelChoice>, TrainClientError> {
    let inputs = job::resolve::resolve_models(spec, &job::resolve::Host::process())
        .map_err(|e| TrainClientError::Wiring(infra::error_chain(&e)))?;
    let plan = job::wiring::plan_trainer(spec, &inputs)
        .map_err(|e| TrainClientError::Wiring(e.to_string()))?;
    let TrainerPlan::External { model, .. } = plan else {
        return Err(TrainClientError::NotExternal(job.into()));
    };
    Ok(model)
}

/// The built-in trainer of `model` with `o`'s settings, from the checkpoint of `start` in
/// `state_dir` when there is one.
fn builtin_parts(
    o: &TrainOptions,
    spec: &JobSpec,
    model: Option<ModelChoice>,
    state_dir: &Path,
    start: PolicyVersion,
) -> Result<BuiltinParts, TrainClientError> {
    let cfg = builtin_trainer_config(&o.trainer);
    let model_err = |e: String| TrainClientError::Model(e);
    match model {
        None => Err(TrainClientError::Simulated(o.job.clone())),
        Some(ModelChoice::Tiny(m)) => {
            BuiltinParts::new(m, cfg, spec.seed, start, Some(state_dir.to_path_buf()))
                .map_err(|e| model_err(e.to_string()))
        }
        Some(ModelChoice::Checkpoint { path, max_seq, .. }) => {
            let c = CheckpointSpec {
                path: o.model.clone().unwrap_or(path),
                max_seq,
                lora: o
                    .trainer
                    .lora
                    .as_ref()
                    .map(|l| actors::model::llm::LoraConfig {
                        rank: l.rank,
                        alpha: l.alpha,
                        targets: l.targets.clone(),
                        seed: spec.seed,
                    }),
                micro_batch_rows: o
                    .trainer
                    .micro_batch_rows
                    .unwrap_or(actors::model::llm::train::MICRO_BATCH_ROWS),
            };
            BuiltinParts::checkpoint(&c, cfg, start, Some(state_dir.to_path_buf()))
                .map(|(p, _)| p)
                .map_err(|e| model_err(e.to_string()))
        }
    }
}

/// The line of one acknowledged step: its version, stats and time, and whether it was
/// announced before or its lease had ended.
fn print_step(
    step: u64,
    stats: &serde_json::Value,
    t: tokio::time::Instant,
    announced_before: bool,
    lease_lost: bool,
) {
    println!(
        "step {step} → v{}{}: loss {:.4} · reward {:.3} · {} trajectories · {:.2} s{}",
        step,
        if announced_before {
            " (announced before)"
        } else {
            ""
        },
        stats["loss"].as_f64().unwrap_or(0.0),
        stats["mean_reward"].as_f64().unwrap_or(0.0),
        stats["trajectories"].as_u64().unwrap_or(0),
        t.elapsed().as_secs_f64(),
        if lease_lost {
            " · the lease had ended: the batch comes back"
        } else {
            ""
        }
    );
}
