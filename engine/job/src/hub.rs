//! Reward functions of jobs: one `FunctionHub` per service owns the local function runtime
//! (shared by every job) and one router per deployment. A job's function is either
//! - `serverless` placement: a deployment shared by every job that asks for the same function
//!   and configuration, scaled by the KPA down to zero; or
//! - `local` placement: a deployment dedicated to the job (kept warm: `min-scale` ≥ 1),
//!   removed when the job ends;
//!
//! or a fixed URL (e.g. a Knative Service). All three are the same router and client code.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actors::reward::{FunctionReward, SharedScorer};
use functions::client::FunctionClient;
use infra::faas::{Deployment, DeploymentConfig, DeploymentStatus, FunctionRuntime, Scaling};
use infra::router::{Router, RouterConfig, RouterSnapshot, Target};
use serde::Serialize;

use crate::spec::{FunctionSpec, RewardPlacement};

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("cannot start the function runtime")]
    Runtime(#[source] std::io::Error),
    #[error("reward function {name}: simulated functions do not run on the runtime")]
    Simulated { name: String },
    #[error("reward function {name}: deployment failed")]
    Deploy {
        name: String,
        #[source]
        source: infra::faas::runtime::RuntimeError,
    },
}

pub struct FunctionHub {
    /// The hub's own tokio runtime: jobs run on runtimes of their own that end with them, but
    /// instances, autoscalers and routers outlive jobs.
    rt: Option<tokio::runtime::Runtime>,
    handle: tokio::runtime::Handle,
    runtime: Arc<FunctionRuntime>,
    routers: Mutex<HashMap<String, Arc<Router>>>,
    /// Dedicated deployments per job.
    dedicated: Mutex<HashMap<String, Vec<String>>>,
    fn_bin: PathBuf,
}

/// What `/v1/cluster` shows per function deployment.
#[derive(Clone, Debug, Serialize)]
pub struct FunctionView {
    #[serde(flatten)]
    pub deployment: DeploymentStatus,
    pub router: Option<RouterSnapshot>,
}

/// Where the `rollarc-fn` executable is: `$ROLLARC_FN_BIN`, else next to this executable (or
/// one folder up, where test binaries live).
pub fn default_fn_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("ROLLARC_FN_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe.parent().map(|p| p.to_path_buf()).unwrap_or_default();
    for d in [Some(dir.clone()), dir.parent().map(|p| p.to_path_buf())]
        .into_iter()
        .flatten()
    {
        let c = d.join("rollarc-fn");
        if c.is_file() {
            return c;
        }
    }
    PathBuf::from("rollarc-fn")
}

fn short_hash(s: &str) -> String {
    // FNV-1a, stable across runs (the name must be the same for the same configuration).
    let h = s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{:08x}", h as u32)
}

fn dns(s: &str) -> String {
    let mut out: String = s
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    out.truncate(40);
    out.trim_matches('-').to_string()
}

/// A job's scorer over `router`, validating scores against `range`.
fn reward(
    job: &str,
    name: &str,
    router: Arc<Router>,
    range: [f64; 2],
    timeout_s: f64,
) -> SharedScorer {
    let client = FunctionClient::new(
        router,
        format!("{name}@1"),
        (range[0], range[1]),
        Duration::from_secs_f64(timeout_s),
    );
    Arc::new(FunctionReward {
        client,
        key_prefix: job.to_string(),
    })
}

/// The deployment's name and the label of its metrics: the same function and configuration
/// share one serverless deployment whoever asks; a local one is the job's own (and kept warm:
/// `min-scale` ≥ 1), named after the job, its metrics labelled without it (bounded labels).
fn deployment_name(
    job: &str,
    name: &str,
    dep: &DeploymentConfig,
    scaling: &mut Scaling,
    placement: RewardPlacement,
) -> (String, Option<String>) {
    let identity = format!("{}|{:?}|{:?}|{:?}", dep.command, dep.args, dep.env, scaling);
    match placement {
        RewardPlacement::Serverless => (
            dns(&format!("{}-{}", dep.name, short_hash(&identity))),
            None,
        ),
        RewardPlacement::Local => {
            scaling.min_scale = scaling.min_scale.max(1);
            scaling.initial_scale = scaling.initial_scale.max(scaling.min_scale);
            let label = dns(&format!("{}-{}", dns(name), short_hash(&identity)));
            (dns(&format!("{}-{label}", dns(job))), Some(label))
        }
    }
}

impl FunctionHub {
    pub fn new(fn_bin: PathBuf) -> Result<Arc<Self>, HubError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("rollarc-functions")
            .enable_all()
            .build()
            .map_err(HubError::Runtime)?;
        let handle = rt.handle().clone();
        Ok(Arc::new(Self {
            runtime: FunctionRuntime::on(handle.clone()),
            rt: Some(rt),
            handle,
            routers: Mutex::new(HashMap::new()),
            dedicated: Mutex::new(HashMap::new()),
            fn_bin,
        }))
    }

    pub fn runtime(&self) -> &Arc<FunctionRuntime> {
        &self.runtime
    }

    fn router_for(&self, key: &str, make: impl FnOnce() -> Arc<Router>) -> Arc<Router> {
        let mut m = self.routers.lock().unwrap_or_else(|p| p.into_inner());
        let _on_hub = self.handle.enter();
        m.entry(key.to_string()).or_insert_with(make).clone()
    }

    /// The deployment (or URL) and router for one of a job's reward functions; the
    /// deployment too when the function runs here (to watch its instances).
    pub fn scorer(
        &self,
        job: &str,
        name: &str,
        spec: &FunctionSpec,
        placement: RewardPlacement,
    ) -> Result<(SharedScorer, Option<Arc<Deployment>>), HubError> {
        let (mut dep, mut scaling, timeout_s, range, hedge) = match spec {
            FunctionSpec::Sim { .. } => {
                return Err(HubError::Simulated { name: name.into() });
            }
            FunctionSpec::Http {
                url,
                timeout_s,
                range,
                hedge_percentile,
            } => {
                let router = self.router_for(&format!("url:{url}:{hedge_percentile:?}"), || {
                    Router::new(
                        name,
                        Target::Url(url.clone()),
                        RouterConfig {
                            per_try_timeout: Duration::from_secs_f64(*timeout_s),
                            hedge_percentile: hedge_percentile.map(|h| h as f32),
                            ..RouterConfig::default()
                        },
                    )
                });
                return Ok((reward(job, name, router, *range, *timeout_s), None));
            }
            FunctionSpec::Builtin {
                function,
                config,
                scaling,
                timeout_s,
                range,
                hedge_percentile,
            } => {
                let mut args = vec![function.clone()];
                if let Some(c) = config {
                    args.extend(["--config".to_string(), c.to_string()]);
                }
                let d = DeploymentConfig::new(
                    function.clone(),
                    self.fn_bin.to_string_lossy().into_owned(),
                    args,
                );
                (d, scaling.clone(), *timeout_s, *range, *hedge_percentile)
            }
            FunctionSpec::Command {
                command,
                args,
                env,
                scaling,
                timeout_s,
                range,
                hedge_percentile,
            } => {
                let mut d = DeploymentConfig::new(dns(name), command.clone(), args.clone());
                d.env = env.clone();
                (d, scaling.clone(), *timeout_s, *range, *hedge_percentile)
            }
        };
        dep.timeout_seconds = timeout_s.ceil() as u64;
        (dep.name, dep.metrics_name) = deployment_name(job, name, &dep, &mut scaling, placement);
        let cc = scaling.container_concurrency;
        dep.scaling = scaling;
        let deployment = self
            .runtime
            .deploy(dep.clone())
            .map_err(|source| HubError::Deploy {
                name: name.into(),
                source,
            })?;
        if placement == RewardPlacement::Local {
            self.dedicated
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(job.to_string())
                .or_default()
                .push(dep.name.clone());
        }
        let router = self.router_for(&dep.name, || {
            Router::new(
                &dep.name,
                Target::Local(deployment.clone()),
                RouterConfig {
                    per_try_timeout: Duration::from_secs_f64(timeout_s),
                    container_concurrency: cc,
                    buffer: dep.activator_capacity,
                    hedge_percentile: hedge.map(|h| h as f32),
                    ..RouterConfig::default()
                },
            )
        });
        Ok((
            reward(job, name, router, range, timeout_s),
            Some(deployment),
        ))
    }

    /// Removes the job's dedicated deployments (shared ones stay and scale to zero).
    pub async fn release(&self, job: &str) {
        let names = self
            .dedicated
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(job)
            .unwrap_or_default();
        for n in names {
            self.routers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&n);
            self.runtime.remove(&n).await;
        }
    }

    pub fn view(&self) -> Vec<FunctionView> {
        let routers = self.routers.lock().unwrap_or_else(|p| p.into_inner());
        let by_name: BTreeMap<&str, &Arc<Router>> =
            routers.iter().map(|(k, r)| (k.as_str(), r)).collect();
        self.runtime
            .status()
            .into_iter()
            .map(|d| FunctionView {
                router: by_name.get(d.name.as_str()).map(|r| r.stats().snapshot()),
                deployment: d,
            })
            .collect()
    }

    /// Every function instance alive now (`deployment/id`), with the seconds it has had at
    /// least one request in flight since it started (for utilisation timelines).
    pub fn instance_busy(&self) -> BTreeMap<String, f64> {
        self.view()
            .into_iter()
            .flat_map(|v| {
                let busy = v.router.map(|r| r.busy_s).unwrap_or_default();
                let name = v.deployment.name;
                v.deployment
                    .instances
                    .into_iter()
                    .map(move |i| {
                        (
                            format!("{name}/{}", i.id),
                            busy.get(&i.id).copied().unwrap_or(0.0),
                        )
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    pub async fn shutdown(&self) {
        self.runtime.shutdown().await;
    }
}

impl Drop for FunctionHub {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            // Allowed in async contexts; instance processes die with their tasks (kill on drop).
            rt.shutdown_background();
        }
    }
}
