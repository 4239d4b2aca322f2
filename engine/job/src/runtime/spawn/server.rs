//! Engine factories of inference-server shards: a managed server (llama.cpp, SGLang, vLLM)
//! started on the checkpoint, or the attached server of a shard.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use actors::error::SharedError;
use actors::generation::remote::elastic::{ClientFor, ElasticEngine, ElasticPool};
use actors::generation::remote::llamacpp::{LlamaCpp, Target};
use actors::generation::remote::managed::{LaunchSpec, ManagedServer};
use actors::generation::remote::sglang::Sglang;
use actors::generation::remote::vllm::Vllm;
use actors::generation::remote::{
    RemoteConfig, RemoteEngine, ServerClient, ServerError, WeightsExporter,
};
use actors::generation::shard::EngineFactory;
use actors::generation::{GenError, GenerationEngine};
use actors::model::runtime::FailedEngine;

use super::trainer::{ServedFiles, ShardStart};
use crate::spec::ModelChoice;
use crate::wiring::{ServerKind, ServerPlan};

/// An inference-server shard: a managed server started on the checkpoint, or the attached
/// server of shard `i`. Every later version is exported for it: llama.cpp restarts on the
/// GGUF file, SGLang and vLLM load the Hugging Face directory in place.
pub(super) fn server_factory(
    i: usize,
    model: &ModelChoice,
    plan: &ServerPlan,
    start: &ShardStart,
    elastic: Option<&Arc<ElasticPool>>,
) -> EngineFactory {
    let shard = Arc::new(ServerShard {
        i,
        rt: tokio::runtime::Handle::current(),
        // llama.cpp closes idle connections after 5 s: give them up sooner.
        http: reqwest::Client::builder()
            .pool_idle_timeout(Duration::from_secs(2))
            .build()
            .unwrap_or_default(),
        plan: plan.clone(),
        served: start.served.clone(),
        path: match model {
            ModelChoice::Checkpoint { path, .. } => path.clone(),
            ModelChoice::Tiny(_) => PathBuf::new(),
        },
    });
    match elastic {
        Some(pool) => {
            let pool = Arc::clone(pool);
            Arc::new(move || shard.elastic(&pool))
        }
        None => Arc::new(move || shard.engine()),
    }
}

/// How long a server that left an elastic pool may go on with the trajectories it holds.
const ELASTIC_DRAIN: Duration = Duration::from_secs(120);

/// What every (re)start of the engine of inference-server shard `i` needs.
struct ServerShard {
    i: usize,
    rt: tokio::runtime::Handle,
    http: reqwest::Client,
    plan: ServerPlan,
    served: Option<ServedFiles>,
    /// The checkpoint a managed server starts on.
    path: PathBuf,
}

impl ServerShard {
    /// A fresh engine on the shard's server, or a failed engine saying why there is none.
    fn engine(&self) -> Box<dyn GenerationEngine> {
        match self.client() {
            Ok(c) => {
                let cfg = RemoteConfig {
                    // A managed llama.cpp starts on the checkpoint file, and the job installs
                    // its current version (exported like every later one) before any request;
                    // SGLang and vLLM take every version, the first included, from disk. An
                    // attached llama.cpp serves the checkpoint as version 0.
                    serving: match (self.plan.kind, self.plan.urls.is_empty()) {
                        (ServerKind::Llamacpp, false) => Some(0),
                        _ => None,
                    },
                    ..Default::default()
                };
                Box::new(RemoteEngine::start(c, self.rt.clone(), cfg))
            }
            Err(e) => Box::new(FailedEngine::new(GenError::Backend(SharedError::new(e)))),
        }
    }

    /// The engine of the shard's slot in an elastic pool: the servers the pool's follower
    /// assigns it, in turn.
    fn elastic(self: &Arc<Self>, pool: &ElasticPool) -> Box<dyn GenerationEngine> {
        let me = Arc::clone(self);
        let client_for: ClientFor = Arc::new(move |url: &str| me.attached(url));
        let cfg = RemoteConfig {
            // An attached llama.cpp serves its checkpoint (version 0); SGLang and vLLM are
            // given the current version from disk before they serve.
            serving: (self.plan.kind == ServerKind::Llamacpp).then_some(0),
            ..Default::default()
        };
        Box::new(ElasticEngine::new(
            pool,
            self.i,
            client_for,
            self.rt.clone(),
            cfg,
            ELASTIC_DRAIN,
        ))
    }

    /// The client of the shard's attached server, or of a managed one started now.
    fn client(&self) -> Result<Arc<dyn ServerClient>, ServerError> {
        match (self.plan.urls.get(self.i), &self.served) {
            (Some(url), _) => Ok(self.attached(url)),
            (None, None) => Err(ServerError::Other(
                "a managed inference server needs the built-in trainer's policy".into(),
            )),
            (None, Some(files)) => self.managed(files),
        }
    }

    /// Where the job exports each version as a Hugging Face directory (SGLang, vLLM).
    fn hf(&self) -> Option<WeightsExporter> {
        self.served.as_ref().map(|f| f.export_hf.clone())
    }

    /// The client of the server at `url`.
    fn attached(&self, url: &str) -> Arc<dyn ServerClient> {
        let (http, hf) = (&self.http, self.hf());
        match self.plan.kind {
            ServerKind::Llamacpp => Arc::new(LlamaCpp::new(
                http.clone(),
                Target::Attached(url.to_string()),
            )),
            ServerKind::Sglang => Arc::new(Sglang::new(http.clone(), url, hf)),
            ServerKind::Vllm => Arc::new(Vllm::new(http.clone(), url, self.plan.slots, hf)),
        }
    }

    /// Starts a managed server for the shard; returns its client.
    fn managed(&self, files: &ServedFiles) -> Result<Arc<dyn ServerClient>, ServerError> {
        let (plan, http, hf) = (&self.plan, &self.http, self.hf());
        let launch = self.launch(files);
        let _rt = self.rt.enter();
        ManagedServer::start(launch, self.path.clone()).map(|server| -> Arc<dyn ServerClient> {
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
                ServerKind::Sglang => Arc::new(Sglang::new(http.clone(), "", hf).managed(server)),
                ServerKind::Vllm => {
                    Arc::new(Vllm::new(http.clone(), "", plan.slots, hf).managed(server))
                }
            }
        })
    }

    /// How the shard's managed server is launched: the plan's command with the launcher
    /// script filled in, on the shard's own GPUs, logging beside the script.
    fn launch(&self, files: &ServedFiles) -> LaunchSpec {
        let (plan, i) = (&self.plan, self.i);
        let name = match plan.kind {
            ServerKind::Llamacpp => "llamacpp",
            ServerKind::Sglang => "sglang",
            ServerKind::Vllm => "vllm",
        };
        let script = files.script.to_string_lossy();
        let command = plan
            .command
            .iter()
            .map(|a| a.replace(crate::wiring::XLLAMACPP_SCRIPT, &script))
            .collect();
        let g = plan.gpus_per_shard as usize;
        LaunchSpec {
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
        }
    }
}
