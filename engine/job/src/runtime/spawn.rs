//! Builds a job's actors from its [`JobPlan`] under the job supervisor: weight store, shard
//! pools (each shard starts on the run's initial weights), environment pools with their
//! reward functions, sample buffer, trainer and scheduler.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use actors::buffer::{BufferArgs, BufferMsg, SampleBuffer};
use actors::env::{EnvCounters, EnvPool};
use actors::episode::{ByteFraming, ChatFraming, Framing};
use actors::episode::{EpisodeShared, EpisodeTask};
use actors::error::SharedError;
use actors::fault::{Fault, FaultPolicy, Faults, GuardedScorer};
use actors::generation::GenError;
use actors::generation::shard::{EngineFactory, ShardActor, ShardArgs, ShardHandle};
use actors::generation::sim::SimEngine;
use actors::generation::{InFlightPolicy, LoopPlacement};
use actors::model::runtime::{BuiltinParts, FailedEngine, LlmPolicy};
use actors::reward::{EnvRewardPassThrough, SharedScorer, SimFunction, SimReward};
use actors::trainer::{Trainer, TrainerActor, TrainerArgs, TrainerMsg};
use actors::weights::{WeightStore, WeightStoreArgs, WeightStoreMsg, Weights};
use infra::faas::Deployment;
use ractor::{Actor, ActorCell, ActorRef};

use super::metrics::PoolShards;
use super::protocol::install;
use super::scheduler::{PoolView, SchedArgs, SchedMsg, Scheduler, TaskView};
use super::{JobError, JobRun};
use crate::hub::FunctionHub;
use crate::spec::{Knobs, ModelChoice};
use crate::wiring::{
    EnginePlan, FunctionPlan, JobPlan, PoolPlan, ScorerPlan, TaskPlan, TrainerPlan,
};

/// The actors of a running job.
pub(super) struct JobActors {
    pub weights: ActorRef<WeightStoreMsg>,
    pub pools: Vec<PoolShards>,
    pub shard_restarts: Arc<AtomicU64>,
    pub buffer: ActorRef<BufferMsg>,
    pub trainer: ActorRef<TrainerMsg>,
    pub scheduler: ActorRef<SchedMsg>,
    pub env_counters: Vec<(String, Arc<EnvCounters>)>,
    pub tasks: Vec<EpisodeTask>,
    /// Fault budgets of the reward functions and environments; the driver fails the job on
    /// the first broken one.
    pub faults: Arc<Faults>,
    /// Watches the job's function deployments for crash loops (aborted when dropped).
    pub _crash_watch: Option<tokio_util::task::AbortOnDropHandle<()>>,
    /// How episodes frame observations for the built-in policy (`None`: simulated tokens).
    pub framing: Option<Arc<dyn Framing>>,
    /// Held-out evaluation, when the spec asks for it.
    pub evaluator: Option<super::eval::Evaluator>,
    /// The span episodes' trace spans hang under (the step driver moves it step by step).
    pub trace_parent: Arc<actors::episode::TraceParent>,
    /// Simulated function deployments with usage to report (scaled or on GPUs).
    pub sim_functions: Vec<(String, Arc<SimFunction>)>,
}

/// Instances in a row that die or never become ready before a deployment counts as
/// crash-looping (and the jobs using it fail).
pub(super) const CRASH_LOOP_INSTANCES: u32 = 3;

/// Spawns every actor of the plan, linked to `cell` (the job supervisor).
pub(super) async fn spawn(
    job: &JobRun,
    plan: JobPlan,
    cell: &ActorCell,
    hub: Option<&Arc<FunctionHub>>,
) -> Result<JobActors, JobError> {
    let start_version = job.start_step;
    let weight_bytes = plan.weight_bytes();
    let (start, trainer_impl) = trainer_and_weights(job, plan.trainer, plan.seed, weight_bytes)?;
    let initial = start.initial.clone();
    let framing: Option<Arc<dyn Framing>> = match &start.policy {
        Some(p) => Some(Arc::new(
            ChatFraming::new(p.tokenizer.clone(), None)
                .map_err(|e| JobError::Framing(Box::new(e)))?,
        )),
        None if plan
            .pools
            .iter()
            .any(|p| matches!(p.engine, EnginePlan::Builtin { .. })) =>
        {
            Some(Arc::new(ByteFraming))
        }
        None => None,
    };
    let (weights, _) = Actor::spawn_linked(
        None,
        WeightStore,
        WeightStoreArgs {
            keep: plan.knobs.alpha as usize + 2,
            initial: initial.clone(),
        },
        cell.clone(),
    )
    .await
    .map_err(JobError::spawn("weight store"))?;

    let shard_restarts = Arc::new(AtomicU64::new(0));
    let (views, pools) = spawn_pools(
        &plan.pools,
        plan.seed,
        job.epoch,
        cell,
        &start,
        &shard_restarts,
    )
    .await?;
    // Shards start at the resumed version.
    for p in &pools {
        for (i, a) in p.actors.iter().enumerate() {
            install(a, initial.clone(), InFlightPolicy::Abort, &p.name, i).await?;
        }
    }
    let faults = Faults::new(FaultPolicy {
        window: Duration::from_secs_f64(plan.knobs.fault_window_s),
        min_failures: plan.knobs.fault_min_failures,
    });
    // Training and held-out tasks are spawned together (they share function deployments);
    // the held-out ones are split off for the evaluator.
    let n_train = plan.tasks.len();
    let mut all: Vec<&TaskPlan> = plan.tasks.iter().collect();
    if let Some(e) = &plan.eval {
        all.extend(e.tasks.iter());
    }
    let (mut task_views, mut tasks, deployments, sim_functions) =
        spawn_tasks(&all, &plan.functions, &plan.knobs, cell, job, hub, &faults).await?;
    let eval_views = task_views.split_off(n_train);
    let mut eval_tasks = tasks.split_off(n_train);
    let eval_sizes: Vec<usize> = plan
        .eval
        .iter()
        .flat_map(|e| e.tasks.iter().map(|t| t.envs))
        .collect();
    if let Some(e) = &plan.eval {
        for t in &mut eval_tasks {
            t.temperature = e.temperature;
            if let Some(m) = e.max_tokens {
                t.max_tokens_per_turn = m;
            }
        }
    }
    let crash_watch = (!deployments.is_empty()).then(|| {
        tokio_util::task::AbortOnDropHandle::new(tokio::spawn(watch_crash_loops(
            deployments,
            faults.clone(),
        )))
    });
    let env_counters = tasks
        .iter()
        .map(|t| (t.domain.clone(), t.envs.counters.clone()))
        .collect();

    // The buffer tells the scheduler about closed groups; the scheduler is spawned after it.
    let sched_slot: Arc<OnceLock<ActorRef<SchedMsg>>> = Arc::new(OnceLock::new());
    let buffer = spawn_buffer(job, &plan.knobs, cell, sched_slot.clone()).await?;
    let (trainer, _) = Actor::spawn_linked(
        None,
        TrainerActor,
        TrainerArgs {
            trainer: trainer_impl,
            weights: weights.clone(),
            start_version,
        },
        cell.clone(),
    )
    .await
    .map_err(JobError::spawn("trainer"))?;
    // Evaluation episodes run on the shards that generate (not on prefill-only ones).
    let eval_shards: Vec<_> = views
        .iter()
        .filter(|v| !v.prefill_only)
        .flat_map(|v| v.shards.iter().cloned())
        .collect();
    let (scheduler, _) = Actor::spawn_linked(
        None,
        Scheduler,
        SchedArgs {
            knobs: plan.knobs.clone(),
            pools: views,
            tasks: task_views,
            buffer: buffer.clone(),
            seed: plan.seed,
            start_version,
            resume: job.resume.clone(),
        },
        cell.clone(),
    )
    .await
    .map_err(JobError::spawn("scheduler"))?;
    let _ = sched_slot.set(scheduler.clone());
    // The job's span until the first step starts.
    let trace_parent = Arc::new(actors::episode::TraceParent::new(tracing::Span::current()));
    let evaluator = plan.eval.as_ref().map(|e| {
        let shared = Arc::new(EpisodeShared {
            buffer: buffer.clone(),
            trace_parent: trace_parent.clone(),
            tasks: eval_tasks,
            epoch: job.epoch,
            started: tokio::time::Instant::now(),
            batch_barrier: false,
            framing: framing.clone(),
        });
        let problems = eval_views
            .iter()
            .zip(&eval_sizes)
            .map(|(v, &envs)| super::eval::EvalTask {
                domain: v.domain.clone(),
                problems: match (&v.dataset, v.seeds) {
                    (Some(d), _) => (0..d.len() as u64)
                        .map(|p| (p, Some(Arc::new(d.record(p)))))
                        .collect(),
                    (None, Some((start, count))) => {
                        (start..start + count).map(|s| (s, None)).collect()
                    }
                    (None, None) => Vec::new(),
                },
                envs,
            })
            .collect();
        super::eval::Evaluator::new(
            shared,
            problems,
            eval_shards,
            e.n,
            e.every,
            e.at_start,
            e.concurrency,
            plan.seed ^ 0xe7a1,
        )
    });
    Ok(JobActors {
        evaluator,
        trace_parent,
        sim_functions,
        framing,
        weights,
        pools,
        shard_restarts,
        buffer,
        trainer,
        scheduler,
        env_counters,
        tasks,
        faults,
        _crash_watch: crash_watch,
    })
}

/// Breaks a reward function at once when its deployment crash-loops (calls would otherwise
/// wait for an instance until their deadline, each).
///
/// Only crashes during this job count: a shared deployment that crash-looped for an earlier
/// job gets fresh instances to prove itself.
async fn watch_crash_loops(deployments: Vec<(String, Arc<Deployment>)>, faults: Arc<Faults>) {
    use std::sync::atomic::Ordering;
    let base: Vec<u64> = deployments
        .iter()
        .map(|(_, d)| d.counters.crashed.load(Ordering::Relaxed))
        .collect();
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tick.tick().await;
        for ((name, d), base) in deployments.iter().zip(&base) {
            let ours = d.counters.crashed.load(Ordering::Relaxed) - base;
            if ours < u64::from(CRASH_LOOP_INSTANCES) {
                continue;
            }
            if let Some((crashes, last)) = d.crash_loop(CRASH_LOOP_INSTANCES) {
                faults.trip(Fault {
                    dependency: format!("reward function `{name}`"),
                    failures: u64::from(crashes),
                    over_s: 0.0,
                    last: format!(
                        "its last {crashes} instances died or never became ready (deployment \
                         {}); last: {last}",
                        d.cfg.name
                    ),
                });
                return;
            }
        }
    }
}

/// What every shard starts from: the run's initial weights and, for a checkpoint model,
/// the loaded policy engines serve.
struct ShardStart {
    initial: Arc<Weights>,
    policy: Option<Arc<LlmPolicy>>,
    /// Inference-server shards: where exported weights and the launcher script go.
    served: Option<ServedFiles>,
}

/// Files a job's managed inference servers use: the launcher script of the default command
/// and each version's exported weights (one export per version, shared by every shard).
#[derive(Clone)]
struct ServedFiles {
    script: std::path::PathBuf,
    export_f32: actors::generation::remote::WeightsExporter,
    export_q8: actors::generation::remote::WeightsExporter,
    /// Hugging Face directories (SGLang, vLLM).
    export_hf: actors::generation::remote::WeightsExporter,
}

impl ServedFiles {
    fn new(job: &JobRun, policy: &Arc<LlmPolicy>) -> Result<Self, JobError> {
        // Beside the trainer's checkpoints when the job keeps them, else a temporary folder.
        let dir = match &job.checkpoint_dir {
            Some(c) => c.join("served"),
            None => std::env::temp_dir().join(format!(
                "rollarc-served-{}-{}",
                std::process::id(),
                job.id
            )),
        };
        let script = dir.join("xllamacpp_serve.py");
        std::fs::create_dir_all(&dir)
            .and_then(|()| {
                std::fs::write(
                    &script,
                    actors::generation::remote::llamacpp::XLLAMACPP_SERVE,
                )
            })
            .map_err(|e| JobError::Served {
                path: script.clone(),
                source: e,
            })?;
        Ok(Self {
            script,
            export_f32: policy.gguf_exporter(dir.join("f32"), actors::model::llm::GgufType::F32),
            export_q8: policy.gguf_exporter(dir.join("q8_0"), actors::model::llm::GgufType::Q8_0),
            export_hf: policy.exporter(dir.join("hf"), None),
        })
    }
}

/// The run's initial weights and its trainer: the built-in trainer owns the real weights
/// (resumed from its checkpoint if any); a simulated one starts from modelled weights. A
/// checkpoint model also gives the policy its engines serve.
fn trainer_and_weights(
    job: &JobRun,
    trainer: TrainerPlan,
    seed: u64,
    weight_bytes: f64,
) -> Result<(ShardStart, Box<dyn Trainer>), JobError> {
    let start_version = job.start_step;
    Ok(match trainer {
        TrainerPlan::Builtin {
            model: ModelChoice::Tiny(model),
            config,
            ..
        } => {
            let parts = BuiltinParts::new(
                model,
                config,
                seed,
                start_version,
                job.checkpoint_dir.clone(),
            )
            .map_err(JobError::BuiltinModel)?;
            let start = ShardStart {
                initial: parts.initial,
                policy: None,
                served: None,
            };
            (start, parts.trainer)
        }
        plan @ TrainerPlan::Builtin {
            model: ModelChoice::Checkpoint { .. },
            ..
        } => {
            let spec = crate::wiring::checkpoint_spec(&plan).expect("a checkpoint plan");
            let TrainerPlan::Builtin { config, .. } = plan else {
                unreachable!("matched above")
            };
            let (parts, policy) =
                BuiltinParts::checkpoint(&spec, config, start_version, job.checkpoint_dir.clone())
                    .map_err(|e| JobError::Checkpoint(Box::new(e)))?;
            let served = Some(ServedFiles::new(job, &policy)?);
            let start = ShardStart {
                initial: parts.initial,
                policy: Some(policy),
                served,
            };
            (start, parts.trainer)
        }
        TrainerPlan::External {
            estimator, model, ..
        } => {
            let desk = job.batches.clone().ok_or(JobError::NoTrainerApi)?;
            // The base weights (no trainer state is kept: the trainer is elsewhere).
            let mut start = match model {
                None => ShardStart {
                    initial: Arc::new(Weights::simulated(0, weight_bytes)),
                    policy: None,
                    served: None,
                },
                Some(ModelChoice::Tiny(model)) => {
                    let parts = BuiltinParts::new(model, Default::default(), seed, 0, None)
                        .map_err(JobError::BuiltinModel)?;
                    ShardStart {
                        initial: parts.initial,
                        policy: None,
                        served: None,
                    }
                }
                Some(ModelChoice::Checkpoint { path, max_seq }) => {
                    let spec = actors::model::runtime::CheckpointSpec {
                        path,
                        max_seq,
                        lora: None,
                        micro_batch_rows: 1,
                    };
                    let (parts, policy) =
                        BuiltinParts::checkpoint(&spec, Default::default(), 0, None)
                            .map_err(|e| JobError::Checkpoint(Box::new(e)))?;
                    let served = Some(ServedFiles::new(job, &policy)?);
                    ShardStart {
                        initial: parts.initial,
                        policy: Some(policy),
                        served,
                    }
                }
            };
            let mut served = crate::trainer_api::ServedModel::of(&start.initial);
            if let Some(p) = &start.policy {
                served = served.with_hf_names(p.config());
            }
            // A resumed job serves the newest version its trainer announced.
            let mut version = 0;
            let newest = desk.newest_weights(&job.id).map_err(JobError::TrainerApi)?;
            if let Some(a) = newest {
                start.initial = Arc::new(
                    served
                        .load(&a)
                        .map_err(|e| JobError::Announced(Box::new(e)))?,
                );
                version = a.version;
            }
            let trainer = crate::trainer_api::ExternalTrainer {
                desk,
                job: job.id.clone(),
                estimator,
                served,
                version,
            };
            (start, Box::new(trainer))
        }
        TrainerPlan::Sim {
            mut trainer,
            panic_runs,
        } => {
            if job.epoch >= panic_runs {
                trainer.panic_at_step = None;
            }
            let w = Weights::simulated(start_version, weight_bytes);
            let start = ShardStart {
                initial: Arc::new(w),
                policy: None,
                served: None,
            };
            (start, Box::new(trainer))
        }
    })
}

/// The sample buffer; it tells the scheduler (spawned after it, set in `scheduler`) about
/// closed and dropped groups.
async fn spawn_buffer(
    job: &JobRun,
    knobs: &Knobs,
    cell: &ActorCell,
    scheduler: Arc<OnceLock<ActorRef<SchedMsg>>>,
) -> Result<ActorRef<BufferMsg>, JobError> {
    let notify = Arc::new(move |ev| {
        if let Some(s) = scheduler.get() {
            let _ = s.cast(SchedMsg::Buffer(ev));
        }
    });
    let (buffer, _) = Actor::spawn_linked(
        None,
        SampleBuffer,
        BufferArgs {
            batch_size: knobs.batch_size,
            alpha: knobs.alpha,
            filter_all_equal: knobs.filter_all_equal,
            max_retries_per_group: knobs.max_retries_per_group,
            sink: job.sink.clone(),
            notify,
        },
        cell.clone(),
    )
    .await
    .map_err(JobError::spawn("sample buffer"))?;
    Ok(buffer)
}

/// Spawns every shard of every pool; returns the scheduler's views and the shards' actors.
async fn spawn_pools(
    plans: &[PoolPlan],
    seed: u64,
    epoch: u64,
    cell: &ActorCell,
    start: &ShardStart,
    restarts: &Arc<AtomicU64>,
) -> Result<(Vec<PoolView>, Vec<PoolShards>), JobError> {
    let mut views = Vec::with_capacity(plans.len());
    let mut all = Vec::with_capacity(plans.len());
    for (pi, p) in plans.iter().enumerate() {
        let mut handles = Vec::with_capacity(p.shards);
        let mut actors = Vec::with_capacity(p.shards);
        for i in 0..p.shards {
            let (factory, placement) = engine_factory(seed, epoch, pi, i, p, start, restarts);
            let (tx, rx) = tokio::sync::oneshot::channel::<ShardHandle>();
            let args = ShardArgs {
                pool: p.name.clone(),
                index: i,
                device: p.device.clone(),
                factory,
                placement,
                frozen_after: Duration::from_secs_f64(p.frozen_after_s),
                restarts: restarts.clone(),
            };
            let (a, _) = Actor::spawn_linked(None, ShardActor, (args, tx), cell.clone())
                .await
                .map_err(JobError::spawn(format!("shard {}[{i}]", p.name)))?;
            let h = rx.await.map_err(|_| JobError::Call {
                what: "shard",
                source: actors::call::CallError::Dropped,
            })?;
            handles.push(h);
            actors.push(a);
        }
        views.push(PoolView {
            name: p.name.clone(),
            device: p.device.clone(),
            model: p.model.clone(),
            max_batch: p.max_batch,
            shards: handles,
            prefill_from: p.prefill_from,
            prefill_only: p.prefill_only,
        });
        all.push(PoolShards {
            name: p.name.clone(),
            device: p.device.name.clone(),
            actors,
        });
    }
    Ok((views, all))
}

/// The engine factory of shard `i` of pool `pi` (called again for every restart).
fn engine_factory(
    seed: u64,
    epoch: u64,
    pi: usize,
    i: usize,
    p: &PoolPlan,
    start: &ShardStart,
    restarts: &Arc<AtomicU64>,
) -> (EngineFactory, LoopPlacement) {
    match &p.engine {
        EnginePlan::Sim { config, faults } => {
            let mut cfg = (**config).clone();
            cfg.seed = seed ^ ((pi as u64) << 40) ^ ((i as u64) << 20) ^ epoch;
            let counter = restarts.clone();
            // An injected fault fires in the shard's first engine only.
            let fault = std::sync::Mutex::new(faults.iter().find(|f| f.0 == i).map(|f| f.1));
            let f: EngineFactory = Arc::new(move || {
                let mut c = cfg.clone();
                // A restarted engine gets a fresh RNG stream (and so does not hang again at once).
                c.seed = c
                    .seed
                    .wrapping_add(counter.load(Ordering::Relaxed).wrapping_mul(0x9e37_79b9));
                c.hang_after_steps = fault.lock().map(|mut f| f.take()).unwrap_or(None);
                Box::new(SimEngine::new(c))
            });
            (f, LoopPlacement::Task)
        }
        EnginePlan::Builtin {
            model: ModelChoice::Tiny(config),
        } => {
            let (cfg, w, mb) = (*config, start.initial.clone(), p.max_batch);
            let f: EngineFactory = Arc::new(
                move || match actors::model::engine::BuiltinEngine::new(cfg, &w, mb) {
                    Ok(e) => Box::new(e),
                    Err(e) => Box::new(FailedEngine::new(e)),
                },
            );
            (f, LoopPlacement::Thread)
        }
        EnginePlan::Server { model, server } => (
            server_factory(i, model, server, start),
            LoopPlacement::Thread,
        ),
        EnginePlan::Builtin {
            model: ModelChoice::Checkpoint { .. },
        } => {
            let (policy, mb) = (start.policy.clone(), p.max_batch);
            // Every (re)started engine serves the loaded weights; the shard then installs the
            // job's current version.
            let f: EngineFactory = Arc::new(move || {
                let built = match &policy {
                    Some(p) => p
                        .engine(mb)
                        .map_err(|e| GenError::Backend(SharedError::new(e))),
                    None => Err(GenError::Backend(SharedError::new(NoPolicy))),
                };
                match built {
                    Ok(e) => Box::new(e),
                    Err(e) => Box::new(FailedEngine::new(e)),
                }
            });
            (f, LoopPlacement::Thread)
        }
    }
}

/// An inference-server shard: a managed server started on the checkpoint, or the attached
/// server of shard `i`. Every later version is exported for it: llama.cpp restarts on the
/// GGUF file, SGLang and vLLM load the Hugging Face directory in place.
fn server_factory(
    i: usize,
    model: &ModelChoice,
    plan: &crate::wiring::ServerPlan,
    start: &ShardStart,
) -> EngineFactory {
    use crate::wiring::ServerKind;
    use actors::generation::remote::llamacpp::{LlamaCpp, Target};
    use actors::generation::remote::managed::{LaunchSpec, ManagedServer};
    use actors::generation::remote::sglang::Sglang;
    use actors::generation::remote::vllm::Vllm;
    use actors::generation::remote::{RemoteConfig, RemoteEngine, ServerClient, ServerError};
    let rt = tokio::runtime::Handle::current();
    // llama.cpp closes idle connections after 5 s: give them up sooner.
    let http = reqwest::Client::builder()
        .pool_idle_timeout(Duration::from_secs(2))
        .build()
        .unwrap_or_default();
    let (plan, served) = (plan.clone(), start.served.clone());
    let path = match model {
        ModelChoice::Checkpoint { path, .. } => path.clone(),
        ModelChoice::Tiny(_) => std::path::PathBuf::new(),
    };
    let name = match plan.kind {
        ServerKind::Llamacpp => "llamacpp",
        ServerKind::Sglang => "sglang",
        ServerKind::Vllm => "vllm",
    };
    Arc::new(move || {
        let hf = served.as_ref().map(|f| f.export_hf.clone());
        let attached = |url: &str| -> Arc<dyn ServerClient> {
            match plan.kind {
                ServerKind::Llamacpp => Arc::new(LlamaCpp::new(
                    http.clone(),
                    Target::Attached(url.to_string()),
                )),
                ServerKind::Sglang => Arc::new(Sglang::new(http.clone(), url, hf.clone())),
                ServerKind::Vllm => Arc::new(Vllm::new(http.clone(), url, plan.slots, hf.clone())),
            }
        };
        let client: Result<Arc<dyn ServerClient>, ServerError> = match (plan.urls.get(i), &served) {
            (Some(url), _) => Ok(attached(url)),
            (None, None) => Err(ServerError::Other(
                "a managed inference server needs the built-in trainer's policy".into(),
            )),
            (None, Some(files)) => {
                let script = files.script.to_string_lossy();
                let command = plan
                    .command
                    .iter()
                    .map(|a| a.replace(crate::wiring::XLLAMACPP_SCRIPT, &script))
                    .collect();
                let g = plan.gpus_per_shard as usize;
                let launch = LaunchSpec {
                    command,
                    env: plan.env.clone(),
                    ports: plan.ports,
                    gpus: (g > 0).then(|| {
                        (i * g..(i + 1) * g)
                            .map(|d| d.to_string())
                            .collect::<Vec<_>>()
                            .join(",")
                    }),
                    slots: plan.slots,
                    context: plan.context,
                    log: files
                        .script
                        .parent()
                        .map(|d| d.join(format!("{name}-{i}.log"))),
                };
                let _rt = rt.enter();
                ManagedServer::start(launch, path.clone()).map(|server| -> Arc<dyn ServerClient> {
                    match plan.kind {
                        ServerKind::Llamacpp => Arc::new(LlamaCpp::new(
                            http.clone(),
                            Target::Managed {
                                server,
                                export: if plan.export_q8 {
                                    files.export_q8.clone()
                                } else {
                                    files.export_f32.clone()
                                },
                            },
                        )),
                        // SGLang and vLLM load new versions in place; their process restarts
                        // only when it dies.
                        ServerKind::Sglang => {
                            Arc::new(Sglang::new(http.clone(), "", hf.clone()).managed(server))
                        }
                        ServerKind::Vllm => Arc::new(
                            Vllm::new(http.clone(), "", plan.slots, hf.clone()).managed(server),
                        ),
                    }
                })
            }
        };
        match client {
            Ok(c) => {
                let cfg = RemoteConfig {
                    // A managed llama.cpp starts on the checkpoint file, and the job installs
                    // its current version (exported like every later one) before any request;
                    // SGLang and vLLM take every version, the first included, from disk. An
                    // attached llama.cpp serves the checkpoint as version 0.
                    serving: match (plan.kind, plan.urls.is_empty()) {
                        (ServerKind::Llamacpp, false) => Some(0),
                        _ => None,
                    },
                    ..Default::default()
                };
                Box::new(RemoteEngine::start(c, rt.clone(), cfg))
            }
            Err(e) => Box::new(FailedEngine::new(GenError::Backend(SharedError::new(e)))),
        }
    })
}

/// Reward functions, then each task's environment pool; returns the scheduler's task views
/// and what episodes see of each task.
async fn spawn_tasks(
    plans: &[&TaskPlan],
    function_plans: &[(String, FunctionPlan)],
    knobs: &Knobs,
    cell: &ActorCell,
    job: &JobRun,
    hub: Option<&Arc<FunctionHub>>,
    faults: &Arc<Faults>,
) -> Result<SpawnedTasks, JobError> {
    let job_id = job.id.as_str();
    let mut functions: BTreeMap<&str, SharedScorer> = BTreeMap::new();
    let mut deployments = Vec::new();
    let mut sim_functions = Vec::new();
    for (name, f) in function_plans {
        let scorer: SharedScorer = match f {
            FunctionPlan::SimScaled {
                latency,
                cold_start,
                scaling,
                seed,
                gpu,
            } => {
                let make = || {
                    SimFunction::serving(
                        latency.clone(),
                        *cold_start,
                        scaling.clone(),
                        *seed,
                        gpu.clone(),
                    )
                };
                let f = match &job.shared_sim_functions {
                    Some(shared) => shared.get_or_deploy(name, make),
                    None => make(),
                };
                sim_functions.push((name.clone(), f.clone()));
                Arc::new(f)
            }
            FunctionPlan::SimSlots {
                latency,
                cold_start,
                concurrency,
                scale_to_zero_after,
                seed,
            } => Arc::new(SimReward::new(
                latency.clone(),
                *cold_start,
                *concurrency,
                *scale_to_zero_after,
                *seed,
            )),
            FunctionPlan::Hub(spec) => {
                let hub = hub.ok_or(JobError::NoFunctionRuntime)?;
                let (scorer, deployment) = hub
                    .scorer(job_id, name, spec, knobs.placement)
                    .map_err(JobError::Functions)?;
                let context = deployment.clone().map(|d| {
                    Box::new(move || {
                        let s = d.status();
                        format!(
                            "deployment {}: {} instance(s) ready, {} starting; last instance \
                             failure: {}",
                            s.name,
                            s.ready,
                            s.starting,
                            d.last_failure().as_deref().unwrap_or("none")
                        )
                    }) as actors::fault::Context
                });
                deployments.extend(deployment.map(|d| (name.clone(), d)));
                GuardedScorer::wrap(name, scorer, faults.clone(), context)
            }
        };
        functions.insert(name, scorer);
    }
    let mut views = Vec::with_capacity(plans.len());
    let mut out = Vec::with_capacity(plans.len());
    for (ti, t) in plans.iter().enumerate() {
        let domain = &t.view.domain;
        if t.sandboxed {
            crate::wiring::envs::check_sandbox().map_err(|source| JobError::Sandbox {
                task: ti,
                domain: domain.clone(),
                source,
            })?;
        }
        let envs = EnvPool::spawn(
            domain,
            t.envs,
            t.env.clone(),
            t.env_call_timeout,
            Duration::from_millis(100),
            cell.clone(),
        )
        .await
        .map_err(JobError::spawn(format!("environments of {domain}")))?;
        let scorers = t
            .scorers
            .iter()
            .map(|s| match s {
                ScorerPlan::Env => Arc::new(EnvRewardPassThrough) as SharedScorer,
                // Names were checked by the plan.
                ScorerPlan::Function(name) => functions[name.as_str()].clone(),
            })
            .collect();
        out.push(EpisodeTask {
            domain: domain.clone(),
            envs,
            scorers,
            max_turns: t.max_turns,
            max_tokens_per_turn: t.max_tokens_per_turn,
            allowed_tokens: t.allowed_tokens.clone(),
            rewrite_context: t.rewrite_context,
            faults: Some(faults.clone()),
            max_context: t.max_context,
            train_truncated: t.train_truncated,
            truncation: t.truncation,
            temperature: 1.0,
        });
        views.push(t.view.clone());
    }
    Ok((views, out, deployments, sim_functions))
}

/// The scheduler's task views, what episodes see of each task, the local deployments of the
/// job's functions, and its simulated deployments with usage to report.
type SpawnedTasks = (
    Vec<TaskView>,
    Vec<EpisodeTask>,
    Vec<(String, Arc<Deployment>)>,
    Vec<(String, Arc<SimFunction>)>,
);

/// A checkpoint pool without a loaded checkpoint (the trainer plan always loads one).
#[derive(Debug, thiserror::Error)]
#[error("no checkpoint was loaded for this pool")]
struct NoPolicy;
