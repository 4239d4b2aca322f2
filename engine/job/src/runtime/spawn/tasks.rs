//! The job's tasks: its reward functions (simulated, or deployed through the function hub),
//! then each task's environment pool and what its episodes see; and the held-out tasks split
//! off for the evaluator.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use actors::env::EnvPool;
use actors::episode::{EpisodeShared, EpisodeTask};
use actors::fault::{Faults, GuardedScorer};
use actors::generation::shard::ShardHandle;
use actors::reward::{EnvRewardPassThrough, SharedScorer, SimFunction, SimReward};
use infra::faas::Deployment;
use ractor::ActorCell;

use crate::hub::FunctionHub;
use crate::runtime::eval::{EvalTask, Evaluator};
use crate::runtime::{JobError, JobRun};
use crate::spec::{FunctionSpec, Knobs};
use crate::wiring::{EvalPlan, FunctionPlan, ScorerPlan, TaskPlan, TaskView};

/// Reward functions, then each task's environment pool; returns the scheduler's task views
/// and what episodes see of each task.
pub(super) async fn spawn_tasks(
    plans: &[&TaskPlan],
    function_plans: &[(String, FunctionPlan)],
    knobs: &Knobs,
    cell: &ActorCell,
    job: &JobRun,
    hub: Option<&Arc<FunctionHub>>,
    faults: &Arc<Faults>,
) -> Result<SpawnedTasks, JobError> {
    let Functions {
        scorers: functions,
        deployments,
        sim_functions,
    } = deploy_functions(function_plans, knobs, job, hub, faults)?;
    let mut views = Vec::with_capacity(plans.len());
    let mut out = Vec::with_capacity(plans.len());
    for (ti, t) in plans.iter().enumerate() {
        out.push(spawn_task(ti, t, &functions, cell, faults).await?);
        views.push(t.view.clone());
    }
    Ok((views, out, deployments, sim_functions))
}

/// The scheduler's task views, what episodes see of each task, the local deployments of the
/// job's functions, and its simulated deployments with usage to report.
pub(super) type SpawnedTasks = (
    Vec<TaskView>,
    Vec<EpisodeTask>,
    Vec<(String, Arc<Deployment>)>,
    Vec<(String, Arc<SimFunction>)>,
);

/// The job's reward functions, ready to score.
struct Functions<'a> {
    /// Each function's scorer, by name.
    scorers: BTreeMap<&'a str, SharedScorer>,
    /// The local deployments of functions run through the hub (watched for crash loops).
    deployments: Vec<(String, Arc<Deployment>)>,
    /// Simulated deployments with usage to report (scaled or on GPUs).
    sim_functions: Vec<(String, Arc<SimFunction>)>,
}

/// Deploys (or, for shared simulated deployments, joins) every reward function of the job.
fn deploy_functions<'a>(
    function_plans: &'a [(String, FunctionPlan)],
    knobs: &Knobs,
    job: &JobRun,
    hub: Option<&Arc<FunctionHub>>,
    faults: &Arc<Faults>,
) -> Result<Functions<'a>, JobError> {
    let mut out = Functions {
        scorers: BTreeMap::new(),
        deployments: Vec::new(),
        sim_functions: Vec::new(),
    };
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
                out.sim_functions.push((name.clone(), f.clone()));
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
                let (scorer, deployment) = hub_scorer(hub, name, spec, knobs, job, faults)?;
                out.deployments
                    .extend(deployment.map(|d| (name.clone(), d)));
                scorer
            }
        };
        out.scorers.insert(name, scorer);
    }
    Ok(out)
}

/// A function deployed through the hub, guarded by its fault budget (a failure reports the
/// state of its deployment); returns its scorer and its local deployment, if any.
fn hub_scorer(
    hub: &FunctionHub,
    name: &str,
    spec: &FunctionSpec,
    knobs: &Knobs,
    job: &JobRun,
    faults: &Arc<Faults>,
) -> Result<(SharedScorer, Option<Arc<Deployment>>), JobError> {
    let (scorer, deployment) = hub
        .scorer(job.id.as_str(), name, spec, knobs.placement)
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
    let scorer = GuardedScorer::wrap(name, scorer, faults.clone(), context);
    Ok((scorer, deployment))
}

/// Task `ti`'s environment pool (checking the sandbox first, if it needs one) and what its
/// episodes see: the pool, its scorers and its limits.
async fn spawn_task(
    ti: usize,
    t: &TaskPlan,
    functions: &BTreeMap<&str, SharedScorer>,
    cell: &ActorCell,
    faults: &Arc<Faults>,
) -> Result<EpisodeTask, JobError> {
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
        Some(cell.clone()),
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
    Ok(EpisodeTask {
        domain: domain.clone(),
        envs,
        scorers,
        max_turns: t.max_turns,
        max_tokens_per_turn: t.max_tokens_per_turn,
        allowed_tokens: t.allowed_tokens.clone(),
        context_keep: t.context_keep,
        faults: Some(faults.clone()),
        max_context: t.max_context,
        train_truncated: t.train_truncated,
        truncation: t.truncation,
        temperature: 1.0,
        agent: None,
    })
}

/// The held-out tasks, spawned with the training ones and split off for the evaluator.
pub(super) struct HeldOut {
    views: Vec<TaskView>,
    /// Environments per held-out task.
    sizes: Vec<usize>,
}

impl HeldOut {
    /// Splits the tasks from `n_train` on off `views` and `tasks`; returns them, what episodes
    /// see of them taking the evaluation's sampling knobs.
    pub(super) fn split_off(
        views: &mut Vec<TaskView>,
        tasks: &mut Vec<EpisodeTask>,
        n_train: usize,
        eval: Option<&EvalPlan>,
    ) -> (Self, Vec<EpisodeTask>) {
        let eval_views = views.split_off(n_train);
        let mut eval_tasks = tasks.split_off(n_train);
        let sizes: Vec<usize> = eval
            .iter()
            .flat_map(|e| e.tasks.iter().map(|t| t.envs))
            .collect();
        if let Some(e) = eval {
            for t in &mut eval_tasks {
                t.temperature = e.temperature;
                if let Some(m) = e.max_tokens {
                    t.max_tokens_per_turn = m;
                }
            }
        }
        let held_out = Self {
            views: eval_views,
            sizes,
        };
        (held_out, eval_tasks)
    }

    /// The evaluator of `e` over these tasks (their episodes share `shared`), running on
    /// `shards`: each task's problems are its dataset's rows, or its seed range.
    pub(super) fn evaluator(
        self,
        e: &EvalPlan,
        shared: Arc<EpisodeShared>,
        shards: Vec<ShardHandle>,
        seed: u64,
    ) -> Evaluator {
        let problems = self
            .views
            .iter()
            .zip(&self.sizes)
            .map(|(v, &envs)| EvalTask {
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
        Evaluator::new(
            shared,
            problems,
            shards,
            e.n,
            e.every,
            e.at_start,
            e.concurrency,
            seed ^ 0xe7a1,
        )
    }
}
