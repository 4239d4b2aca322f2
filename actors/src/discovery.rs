//! Where a pool's workers come from: a fixed list, every address a DNS name resolves to (a
//! headless Service's ready pods), re-resolved while the job runs, or the ready endpoints of
//! Kubernetes EndpointSlices, followed by list and watch ([`kube`]). Env pools follow their
//! workers with it, elastic inference-server pools their servers.

mod kube;
pub use kube::KubeTarget;

use std::net::SocketAddr;
use std::time::Duration;

/// How long one resolution may take.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// A pool's membership.
#[derive(Clone, Debug, PartialEq)]
pub enum Membership {
    /// A fixed list of base URLs (`http://10.0.0.7:7000`).
    Urls(Vec<String>),
    /// Every address `host` resolves to, at `port`, resolved again every `every`: through
    /// `nameserver` when given, else through the system's resolver (its search domains, so
    /// `envs.ns.svc` works in a pod).
    Dns {
        host: String,
        port: u16,
        nameserver: Option<SocketAddr>,
        every: Duration,
    },
    /// The ready endpoints of the EndpointSlices a label selector picks, followed live.
    Kubernetes(kube::KubeTarget),
}

impl Membership {
    /// How often membership changes are looked for (`None`: a fixed list).
    pub fn every(&self) -> Option<Duration> {
        match self {
            // Kubernetes membership is followed by a watch, not looked up again.
            Self::Urls(_) | Self::Kubernetes(_) => None,
            Self::Dns { every, .. } => Some(*every),
        }
    }

    /// The workers' base URLs now, or why they could not be found.
    pub async fn resolve(&self) -> Result<Vec<String>, String> {
        let (host, port, nameserver) = match self {
            Self::Urls(u) => return Ok(u.clone()),
            Self::Kubernetes(k) => return k.resolve().await,
            Self::Dns {
                host,
                port,
                nameserver,
                ..
            } => (host, *port, nameserver),
        };
        let mut addrs: Vec<SocketAddr> = match nameserver {
            Some(ns) => infra::dns::lookup(*ns, host, RESOLVE_TIMEOUT)
                .await
                .map_err(|e| format!("dns {host}: {}", infra::error_chain(&e)))?
                .into_iter()
                .map(|ip| SocketAddr::new(ip, port))
                .collect(),
            None => {
                let looked = tokio::time::timeout(
                    RESOLVE_TIMEOUT,
                    tokio::net::lookup_host((host.as_str(), port)),
                )
                .await
                .map_err(|_| format!("dns {host}: no answer within {RESOLVE_TIMEOUT:?}"))?;
                match looked {
                    Ok(a) => a.collect(),
                    // The system resolver says so for a name without addresses too.
                    Err(e) => return Err(format!("dns {host}: {e}")),
                }
            }
        };
        addrs.sort();
        addrs.dedup();
        // `SocketAddr` writes an IPv6 address in brackets, as a URL needs.
        Ok(addrs.into_iter().map(|a| format!("http://{a}")).collect())
    }

    /// What the membership is, for an error.
    pub fn describe(&self) -> String {
        match self {
            Self::Urls(u) => format!("{} listed workers", u.len()),
            Self::Dns {
                host,
                port,
                nameserver: Some(ns),
                ..
            } => format!("dns {host}:{port} (asking {ns})"),
            Self::Dns { host, port, .. } => format!("dns {host}:{port}"),
            Self::Kubernetes(k) => k.describe(),
        }
    }
}
