//! Request/reply calls to actors with a timeout, and the one error type they fail with.
//!
//! `ractor`'s own error carries the unsent message (often holding reply ports and big
//! payloads), so it is turned into [`CallError`] at once: what went wrong, with the actor's
//! own failure kept as the source.

use std::time::Duration;

use ractor::rpc::CallResult;
use ractor::{ActorRef, RpcReplyPort};

/// Why a call to an actor produced no reply.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The actor has stopped (its mailbox is closed), before or while handling the call.
    #[error("the actor has stopped")]
    Stopped,
    /// No reply within the call's timeout.
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    /// The actor dropped the reply port without answering.
    #[error("the actor dropped the call without replying")]
    Dropped,
}

/// Sends the message built by `msg` and waits up to `timeout` for its reply.
pub async fn call<M, R>(
    actor: &ActorRef<M>,
    msg: impl FnOnce(RpcReplyPort<R>) -> M,
    timeout: Duration,
) -> Result<R, CallError>
where
    M: ractor::Message,
    R: Send + 'static,
{
    match actor.call(msg, Some(timeout)).await {
        Ok(CallResult::Success(r)) => Ok(r),
        Ok(CallResult::Timeout) => Err(CallError::Timeout(timeout)),
        Ok(CallResult::SenderError) => Err(CallError::Dropped),
        Err(_) => Err(CallError::Stopped),
    }
}
