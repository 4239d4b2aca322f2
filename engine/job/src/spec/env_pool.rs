//! Env pools: machines that host a task's environments (`rollarc env-worker`), named by the
//! tasks that use them (`tasks[i].env_pool`).

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{EnvSpec, JobSpec, Problems};

/// Most workers one pool lists.
pub const MAX_POOL_WORKERS: usize = 256;
/// The service's environment variable holding the workers' token, unless a pool names
/// another.
pub const DEFAULT_WORKER_TOKEN_ENV: &str = "ROLLARC_ENV_WORKER_TOKEN";

/// Env workers hosting the environments of the tasks that name this pool.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EnvPoolSpec {
    /// The pool's name (`tasks[i].env_pool`).
    pub name: String,
    /// Where its workers are.
    pub workers: WorkersSpec,
    /// The service's environment variable holding the workers' shared token (never the
    /// token itself: a spec is stored and shown).
    #[serde(default = "default_token_env")]
    pub token_env: String,
}

/// A pool's workers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum WorkersSpec {
    /// A fixed list of base URLs (`http://10.0.0.7:7000`).
    Urls(Vec<String>),
}

fn default_token_env() -> String {
    DEFAULT_WORKER_TOKEN_ENV.into()
}

impl EnvPoolSpec {
    pub(super) fn check(&self, p: &str, problems: &mut Problems) {
        let WorkersSpec::Urls(urls) = &self.workers;
        if urls.is_empty() || urls.len() > MAX_POOL_WORKERS {
            problems.push(
                format!("{p}.workers.urls"),
                format!("list 1 to {MAX_POOL_WORKERS} workers, got {}", urls.len()),
            );
        }
        for (i, u) in urls.iter().enumerate() {
            if let Err(why) = check_url(u) {
                problems.push(format!("{p}.workers.urls[{i}]"), why);
            }
        }
        let t = &self.token_env;
        if t.is_empty()
            || t.len() > 128
            || t.starts_with(|c: char| c.is_ascii_digit())
            || !t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            problems.push(
                format!("{p}.token_env"),
                format!("{t:?} is not an environment variable name (letters, digits, _)"),
            );
        }
    }
}

/// An http base URL with a host and nothing after its path.
fn check_url(u: &str) -> Result<(), String> {
    let parsed = reqwest::Url::parse(u).map_err(|e| format!("{u:?} is not a URL: {e}"))?;
    // No TLS client is built in: encrypt between machines with the cluster's mesh (mTLS
    // sidecars) or a tunnel, and keep the token secret.
    if parsed.scheme() != "http" {
        return Err(format!(
            "{u:?}: the scheme must be http (no TLS client is built in; use the cluster's mTLS mesh)"
        ));
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(format!("{u:?} names no host"));
    }
    if parsed.query().is_some() || parsed.fragment().is_some() || !parsed.username().is_empty() {
        return Err(format!(
            "{u:?}: a base URL without query, fragment or credentials"
        ));
    }
    Ok(())
}

/// Checks the pools' names and each task's `env_pool` (an existing pool, an environment a
/// worker can host).
pub(super) fn check_pools(spec: &JobSpec, problems: &mut Problems) {
    let mut names = std::collections::BTreeSet::new();
    for (i, pl) in spec.env_pools.iter().enumerate() {
        let p = format!("env_pools[{i}]");
        if pl.name.trim().is_empty() {
            problems.push(format!("{p}.name"), "must not be empty".into());
        } else if !names.insert(pl.name.as_str()) {
            problems.push(
                format!("{p}.name"),
                format!("duplicate env pool name {:?}", pl.name),
            );
        }
        pl.check(&p, problems);
    }
    let eval = spec
        .eval
        .as_ref()
        .map(|e| e.tasks.as_slice())
        .unwrap_or(&[]);
    for (prefix, tasks) in [("tasks", spec.tasks.as_slice()), ("eval.tasks", eval)] {
        for (i, t) in tasks.iter().enumerate() {
            let Some(name) = &t.env_pool else { continue };
            let p = format!("{prefix}[{i}].env_pool");
            if !names.contains(name.as_str()) {
                problems.push(p, format!("no env pool is named {name:?}"));
            } else if !remote_capable(&t.env) {
                problems.push(
                    p,
                    format!(
                        "{} environments run on the service, not on an env worker",
                        t.env.kind_name()
                    ),
                );
            }
        }
    }
}

/// Whether an env worker can host this environment: a program (external, bridged) or a
/// built-in game; not the simulator, the dataset environments or agents.
pub fn remote_capable(env: &EnvSpec) -> bool {
    !matches!(
        env,
        EnvSpec::Sim { .. } | EnvSpec::Agent(_) | EnvSpec::Prompt { .. } | EnvSpec::Chat { .. }
    )
}
