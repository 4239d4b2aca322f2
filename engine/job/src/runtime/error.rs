//! Why a job run ended without finishing its steps.

use actors::call::CallError;

/// What a [`super::StepObserver`] may fail with (the store, an encoder, …), kept as the
/// source of [`JobError::Record`].
pub type ObserverError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("the job spec cannot be wired")]
    Wiring(#[from] crate::wiring::WiringError),
    #[error(transparent)]
    Resolve(#[from] crate::resolve::ResolveError),
    #[error(
        "trainer.kind = \"external\" needs the service's trainer API (run the job with `rollarc serve`)"
    )]
    NoTrainerApi,
    #[error("the trainer API's store failed")]
    TrainerApi(#[source] crate::store::StoreError),
    #[error("cannot serve the announced weights")]
    Announced(#[source] Box<crate::trainer_api::AnnouncedError>),
    #[error("could not start actor {what}")]
    Spawn {
        what: String,
        #[source]
        source: ractor::SpawnErr,
    },
    #[error("actor call to {what} failed")]
    Call {
        what: &'static str,
        #[source]
        source: CallError,
    },
    #[error("training failed")]
    Train(#[source] actors::trainer::TrainError),
    #[error("generation shard {pool}[{index}] failed to install weights")]
    Install {
        pool: String,
        index: usize,
        #[source]
        source: actors::generation::GenError,
    },
    #[error("the built-in model could not be set up")]
    BuiltinModel(#[source] candle_core::Error),
    #[error("the checkpoint model could not be set up")]
    Checkpoint(#[source] Box<actors::model::runtime::PolicyError>),
    #[error("task {task} (`{domain}`): {message}")]
    Agents {
        task: usize,
        domain: String,
        message: String,
    },
    #[error("the checkpoint's chat template cannot frame observations")]
    Framing(#[source] Box<actors::episode::FramingError>),
    #[error("cannot write the inference servers' files at {path}")]
    Served {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the job names reward functions that run as processes but has no function runtime")]
    NoFunctionRuntime,
    #[error("the function runtime could not be set up")]
    Functions(#[source] crate::hub::HubError),
    #[error("tasks[{task}] ({domain}): the environment sandbox is not usable")]
    Sandbox {
        task: usize,
        domain: String,
        #[source]
        source: infra::sandbox::SandboxError,
    },
    #[error("could not build the job's runtime")]
    Runtime(#[source] std::io::Error),
    #[error("could not record step {step}")]
    Record {
        step: u64,
        #[source]
        source: ObserverError,
    },
    #[error("an actor of the job failed beyond its restart policy: {0}")]
    Escalated(String),
    /// A reward function or a task's environments kept failing past the fault budget.
    #[error(transparent)]
    Dependency(#[from] actors::fault::Fault),
    #[error("the job runtime panicked: {0}")]
    Panicked(String),
    #[error("generation pool {pool}: no inference server served within {seconds:.0} s ({why})")]
    NoServer {
        pool: String,
        seconds: f64,
        why: String,
    },
    #[error("the job was cancelled")]
    Cancelled,
}

impl JobError {
    /// Maps a failed call to `what` (for `map_err`).
    pub(crate) fn call(what: &'static str) -> impl FnOnce(CallError) -> JobError {
        move |source| JobError::Call { what, source }
    }

    /// Maps a failed spawn of `what` (for `map_err`).
    pub(crate) fn spawn(what: impl Into<String>) -> impl FnOnce(ractor::SpawnErr) -> JobError {
        let what = what.into();
        move |source| JobError::Spawn { what, source }
    }
}
