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

/// Env workers hosting the environments of the tasks that name this pool; or, named
/// [`LOCAL_POOL`] and without workers, the service's own machine (the default pool), to set
/// its start control.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EnvPoolSpec {
    /// The pool's name (`tasks[i].env_pool`).
    pub name: String,
    /// Where its workers are (none for the `local` pool).
    #[serde(default)]
    pub workers: WorkersSpec,
    /// The service's environment variable holding the workers' shared token (never the
    /// token itself: a spec is stored and shown).
    #[serde(default = "default_token_env")]
    pub token_env: String,
    /// Environment programs of the pool starting at once, from their spawn to their first
    /// answer (default: no cap). The `local` pool: over all the job's local tasks; a pool of
    /// workers: per task on each worker (a worker's own `--max-concurrent-starts` caps it
    /// as a whole too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent_starts: Option<u32>,
    /// Programs each task keeps started ahead for its next episodes (protocols 1 and 2,
    /// one program per episode; multiplexed programs serve every episode once started).
    /// Default 0; on a pool of workers, each worker keeps this many per task.
    #[serde(default)]
    pub warm: u32,
    /// The service's base URL as the pool's workers reach it (`http://rollarc.ns.svc:8080`):
    /// managed agents on the workers call the gateway there, through their worker. Needed
    /// by a pool with managed agent tasks unless all its workers are listed on loopback
    /// addresses (then the job's own loopback gateway serves them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway_url: Option<String>,
}

/// The pool of the service's own machine: tasks that name no pool run there.
pub const LOCAL_POOL: &str = "local";
/// Most programs a task keeps warm.
pub const MAX_WARM: u32 = 1024;

/// A pool's workers: a fixed list (`urls`), every address a DNS name resolves to (`dns`, a
/// headless Service), looked up again every `refresh_s`, or the ready endpoints of the
/// EndpointSlices a label selector picks (`kubernetes`), followed by list and watch.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkersSpec {
    /// Base URLs (`http://10.0.0.7:7000`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub urls: Vec<String>,
    /// `host:port`: every A and AAAA record of `host` is a worker at `port`
    /// (`rollarc-env-worker.ns.svc:7000`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<String>,
    /// With `dns`: the name server to ask (`ip:port`); default: the service's resolver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nameserver: Option<String>,
    /// With `dns`: seconds between lookups (default 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refresh_s: Option<f64>,
    /// The ready endpoints of Kubernetes EndpointSlices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<KubernetesWorkers>,
}

/// Workers found through the Kubernetes API: every ready endpoint of the EndpointSlices that
/// `label_selector` picks in `namespace`, at `port`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct KubernetesWorkers {
    pub namespace: String,
    /// Which slices: `kubernetes.io/service-name=rollarc-env-worker` picks a Service's.
    pub label_selector: String,
    /// The workers' port.
    pub port: u16,
    /// The API's base URL, plain http: a `kubectl proxy` beside the service (the default,
    /// `http://127.0.0.1:8001`), which authenticates with the pod's service account.
    #[serde(default = "default_kube_api")]
    pub api: String,
}

/// Where `kubectl proxy` listens unless told otherwise.
pub const DEFAULT_KUBE_API: &str = "http://127.0.0.1:8001";

fn default_kube_api() -> String {
    DEFAULT_KUBE_API.into()
}

/// Seconds between DNS lookups of a pool's workers, unless it says.
pub const DEFAULT_REFRESH_S: f64 = 2.0;

impl WorkersSpec {
    /// `dns`'s host and port (checked: call after validation).
    pub fn dns_target(&self) -> Option<(String, u16)> {
        let (host, port) = self.dns.as_deref()?.rsplit_once(':')?;
        Some((host.to_string(), port.parse().ok()?))
    }
}

fn default_token_env() -> String {
    DEFAULT_WORKER_TOKEN_ENV.into()
}

impl EnvPoolSpec {
    /// Whether this is the service's own machine.
    pub fn is_local(&self) -> bool {
        self.name == LOCAL_POOL
    }

    /// Checks the start control: a cap of at least 1, a bounded warm pool.
    fn check_starts(&self, p: &str, problems: &mut Problems) {
        if self.max_concurrent_starts == Some(0) {
            problems.push(
                format!("{p}.max_concurrent_starts"),
                "must be at least 1 (leave it out for no cap)".into(),
            );
        }
        if self.warm > MAX_WARM {
            problems.push(
                format!("{p}.warm"),
                format!("at most {MAX_WARM} programs per task, got {}", self.warm),
            );
        }
    }

    /// Whether every worker is listed on a loopback address (so they reach the job's
    /// loopback gateway).
    pub fn all_loopback(&self) -> bool {
        let w = &self.workers;
        w.dns.is_none()
            && w.kubernetes.is_none()
            && !w.urls.is_empty()
            && w.urls.iter().all(|u| {
                let url = reqwest::Url::parse(u).ok();
                let host = url
                    .as_ref()
                    .and_then(reqwest::Url::host_str)
                    .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_string());
                host.is_some_and(|h| {
                    h == "localhost"
                        || h.parse::<std::net::IpAddr>()
                            .is_ok_and(|ip| ip.is_loopback())
                })
            })
    }

    /// Checks `gateway_url`: an http base URL, on a pool of workers.
    fn check_gateway_url(&self, p: &str, problems: &mut Problems) {
        let Some(u) = &self.gateway_url else { return };
        if self.is_local() {
            problems.push(
                format!("{p}.gateway_url"),
                "the local pool's agents reach the gateway on this machine".into(),
            );
        } else if let Err(why) = check_url(u) {
            problems.push(format!("{p}.gateway_url"), why);
        }
    }

    pub(super) fn check(&self, p: &str, problems: &mut Problems) {
        self.check_starts(p, problems);
        self.check_gateway_url(p, problems);
        let w = &self.workers;
        if self.is_local() {
            if *w != WorkersSpec::default() {
                problems.push(
                    format!("{p}.workers"),
                    "the local pool is the service's own machine: it takes no workers (name the \
                     pool otherwise)"
                        .into(),
                );
            }
            return;
        }
        check_workers(&format!("{p}.workers"), w, problems);
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

/// Checks where a pool's members are (`at`: the field, e.g. `env_pools[0].workers`): one of
/// `urls`, `dns` or `kubernetes`, each well formed.
pub(super) fn check_workers(at: &str, w: &WorkersSpec, problems: &mut Problems) {
    let given = [!w.urls.is_empty(), w.dns.is_some(), w.kubernetes.is_some()];
    if given.iter().filter(|&&g| g).count() != 1 {
        problems.push(
            at.to_string(),
            "give one of urls = [...], dns = \"host:port\" or kubernetes = { namespace, \
             label_selector, port }"
                .into(),
        );
    }
    if let Some(k) = &w.kubernetes {
        check_kubernetes(&format!("{at}.kubernetes"), k, problems);
    }
    match (w.urls.is_empty(), &w.dns) {
        (true, None) | (false, Some(_)) => {}
        (false, None) => {
            if w.urls.len() > MAX_POOL_WORKERS {
                problems.push(
                    format!("{at}.urls"),
                    format!("at most {MAX_POOL_WORKERS} workers, got {}", w.urls.len()),
                );
            }
            for (i, u) in w.urls.iter().enumerate() {
                if let Err(why) = check_url(u) {
                    problems.push(format!("{at}.urls[{i}]"), why);
                }
            }
        }
        (true, Some(d)) => {
            let host_ok = |h: &str| {
                !h.is_empty()
                    && h.len() <= 253
                    && h.split('.').all(|l| {
                        !l.is_empty()
                            && l.len() <= 63
                            && l.chars()
                                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
                    })
            };
            if !w
                .dns_target()
                .is_some_and(|(h, port)| host_ok(h.trim_end_matches('.')) && port > 0)
            {
                problems.push(
                    format!("{at}.dns"),
                    format!("{d:?} is not host:port (a DNS name and a port 1-65535)"),
                );
            }
        }
    }
    if let Some(ns) = &w.nameserver
        && ns.parse::<std::net::SocketAddr>().is_err()
    {
        problems.push(format!("{at}.nameserver"), format!("{ns:?} is not ip:port"));
    }
    if let Some(r) = w.refresh_s
        && !(r.is_finite() && r > 0.0 && r <= 3600.0)
    {
        problems.push(
            format!("{at}.refresh_s"),
            format!("must be a number of seconds in (0, 3600], got {r}"),
        );
    }
    if w.dns.is_none() && (w.nameserver.is_some() || w.refresh_s.is_some()) {
        problems.push(
            at.to_string(),
            "nameserver and refresh_s go with dns".into(),
        );
    }
}

fn check_kubernetes(p: &str, k: &KubernetesWorkers, problems: &mut Problems) {
    // A namespace is a DNS-1123 label.
    let ns = &k.namespace;
    if ns.is_empty()
        || ns.len() > 63
        || ns.starts_with('-')
        || ns.ends_with('-')
        || !ns
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    {
        problems.push(
            format!("{p}.namespace"),
            format!("{ns:?} is not a namespace name (lowercase letters, digits and -, at most 63)"),
        );
    }
    let sel = &k.label_selector;
    if sel.trim().is_empty() || sel.len() > 1024 || sel.chars().any(char::is_control) {
        problems.push(
            format!("{p}.label_selector"),
            format!(
                "{sel:?} is not a label selector (such as kubernetes.io/service-name=rollarc-env-worker)"
            ),
        );
    }
    if k.port == 0 {
        problems.push(format!("{p}.port"), "must be a port 1-65535".into());
    }
    match reqwest::Url::parse(&k.api) {
        Ok(u) if u.scheme() == "https" => problems.push(
            format!("{p}.api"),
            format!(
                "{:?}: the API is reached over plain http (no TLS client is built in): run \
                 kubectl proxy beside the service and give its address (the default, {DEFAULT_KUBE_API})",
                k.api
            ),
        ),
        _ => {
            if let Err(why) = check_url(&k.api) {
                problems.push(format!("{p}.api"), why);
            }
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
    for (prefix, tasks) in spec.task_lists() {
        for (i, t) in tasks.iter().enumerate() {
            let Some(name) = &t.env_pool else { continue };
            let p = format!("{prefix}[{i}].env_pool");
            if name == LOCAL_POOL {
                continue;
            }
            let pool = spec.env_pools.iter().find(|pl| &pl.name == name);
            if !names.contains(name.as_str()) {
                problems.push(p, format!("no env pool is named {name:?}"));
            } else if matches!(&t.env, EnvSpec::Agent(a) if a.mode == super::AgentMode::External) {
                problems.push(
                    p,
                    "an external agent task's harness claims its episodes from the service; \
                     it has no env pool"
                        .into(),
                );
            } else if !remote_capable(&t.env) {
                problems.push(
                    p,
                    format!(
                        "{} environments run on the service, not on an env worker",
                        t.env.kind_name()
                    ),
                );
            } else if matches!(t.env, EnvSpec::Agent(_))
                && let Some(pl) = pool
                && pl.gateway_url.is_none()
                && !pl.all_loopback()
            {
                let pi = spec
                    .env_pools
                    .iter()
                    .position(|x| x.name == pl.name)
                    .unwrap_or(0);
                problems.push(
                    format!("env_pools[{pi}].gateway_url"),
                    format!(
                        "{prefix}[{i}] runs managed agents on pool {name:?}: give the service's \
                         URL as its workers reach it (they forward the agents' model calls there)"
                    ),
                );
            }
        }
    }
}

/// Whether an env worker can host this environment: a program (external, bridged, a managed
/// agent) or a built-in game; not the simulator, the dataset environments or external agents.
pub fn remote_capable(env: &EnvSpec) -> bool {
    match env {
        EnvSpec::Sim { .. } | EnvSpec::Prompt { .. } | EnvSpec::Chat { .. } => false,
        EnvSpec::Agent(a) => a.mode == super::AgentMode::Managed,
        _ => true,
    }
}
