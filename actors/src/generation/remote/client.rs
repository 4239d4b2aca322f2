//! The contract between the remote engine and one inference server: the requests and
//! completions it exchanges, what the engine learns of the server, the server's errors, and
//! the [`ServerClient`] trait each server's protocol implements.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use crate::error::SharedError;
use crate::generation::{FinishReason, GenError, SamplingParams};
use crate::types::PolicyVersion;
use crate::weights::Weights;

/// A boxed future that owns what it needs.
pub type BoxFut<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Writes the weights of a version where a server can load them (a GGUF file, a Hugging
/// Face directory); returns the path.
pub type WeightsExporter = Arc<
    dyn Fn(PolicyVersion, Arc<Weights>) -> BoxFut<Result<std::path::PathBuf, ServerError>>
        + Send
        + Sync,
>;

/// What a server generated for one request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Completion {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub finish: Option<FinishReason>,
    /// Prompt tokens the server computed (not served from its prefix cache).
    pub prefill_tokens: u32,
    /// Tokens the server gave no log-probability for (reported as 0).
    pub missing_logprobs: u32,
}

/// Tokens a request has produced so far (written by the client as they stream in).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Progress {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
}

/// One request as sent to a server.
#[derive(Clone, Debug)]
pub struct ServerRequest {
    /// Request id on the server (unique per attempt, for servers that abort by id).
    pub rid: String,
    pub context: Arc<crate::tokens::Tokens>,
    pub params: SamplingParams,
    /// The server slot that holds this session's prefix (servers with slots).
    pub slot: Option<u32>,
    pub progress: Arc<Mutex<Progress>>,
}

/// Requests a server reports running and queued.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServerLoad {
    pub running: usize,
    pub waiting: usize,
}

/// What the engine needs to know about a server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerInfo {
    /// Requests it generates at once.
    pub slots: usize,
    /// Tokens (context + answer) one request may hold.
    pub context: usize,
}

/// Why a request to a server failed.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The server could not be reached or dropped the connection: it may come back.
    #[error("{server} is unreachable")]
    Unreachable {
        server: String,
        #[source]
        source: SharedError,
    },
    /// The server answered with an error status.
    #[error("{server} answered {status} to {path}: {body}")]
    Status {
        server: String,
        path: String,
        status: u16,
        body: String,
    },
    /// The server answered something this client cannot read.
    #[error("{server} answered {path} with an unexpected body: {detail}")]
    Protocol {
        server: String,
        path: String,
        detail: String,
    },
    #[error("{server} was not healthy within {seconds:.0} s")]
    NotHealthy { server: String, seconds: f64 },
    #[error("{server} cannot install weights: {reason}")]
    CannotInstall { server: String, reason: String },
    /// The server cannot take the request now (paused, overloaded): it may later.
    #[error("{server} is unavailable: {message}")]
    Unavailable { server: String, message: String },
    /// The server aborted the request (asked to, or on its own), with what it had generated.
    #[error("{server} aborted the request")]
    Aborted { server: String, partial: Completion },
    #[error("{0}")]
    Other(String),
}

impl ServerError {
    /// Whether the server may take the request again later (it went away, is busy, or
    /// aborted it).
    pub(super) fn transient(&self) -> bool {
        matches!(
            self,
            Self::Unreachable { .. } | Self::Unavailable { .. } | Self::Aborted { .. }
        )
    }
}

impl From<ServerError> for GenError {
    fn from(e: ServerError) -> Self {
        GenError::Backend(SharedError::new(e))
    }
}

/// The protocol of one inference server.
pub trait ServerClient: Send + Sync + 'static {
    /// The server, for messages ("llama.cpp at http://127.0.0.1:8080").
    fn describe(&self) -> String;
    /// Slots and context length (asked once the server is healthy).
    fn info(&self) -> BoxFut<Result<ServerInfo, ServerError>>;
    /// Generates for `req`, recording tokens in `req.progress` as they arrive. Dropping the
    /// future closes the request.
    fn generate(&self, req: ServerRequest) -> BoxFut<Result<Completion, ServerError>>;
    /// Teacher forcing: the log-probability of each of `tokens[1..]` given the tokens before
    /// it, from the server's untempered distribution (what the server would have sampled
    /// from at temperature 1); a trainer compares its own log-probabilities with these.
    fn prompt_logprobs(&self, tokens: Arc<[u32]>) -> BoxFut<Result<Vec<f32>, ServerError>>;
    /// Tells the server to drop request `rid` (servers that abort by id; closing the request
    /// is enough for the others).
    fn cancel(&self, _rid: &str) -> BoxFut<()> {
        Box::pin(async {})
    }
    /// Whether a cancelled request's `generate` returns what it had generated (servers with
    /// an abort endpoint); otherwise the engine closes the request and reads its progress.
    fn partial_on_cancel(&self) -> bool {
        false
    }
    /// Pauses generation on the server (where it has a pause); the engine stops admitting.
    fn pause(&self) -> BoxFut<Result<(), ServerError>> {
        Box::pin(async { Ok(()) })
    }
    fn resume(&self) -> BoxFut<Result<(), ServerError>> {
        Box::pin(async { Ok(()) })
    }
    /// Puts `weights` on the server as `version`. In-flight requests were closed first.
    fn install(
        &self,
        version: PolicyVersion,
        weights: Arc<Weights>,
    ) -> BoxFut<Result<(), ServerError>>;
    /// Whether the server answers (a managed server also restarts here when its process
    /// died).
    fn health(&self) -> BoxFut<Result<(), ServerError>>;
    /// What the server runs and queues, every client's requests included (llama.cpp's
    /// `/slots`, SGLang's `/v1/loads`, vLLM's `/metrics`); `None` where it cannot say.
    fn server_load(&self) -> BoxFut<Option<ServerLoad>> {
        Box::pin(async { None })
    }
}
