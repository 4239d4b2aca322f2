//! One agent episode behind the gateway: its session (exact context, segments, version
//! floor), its budget, and how a call is served. Calls of one episode are served one at a
//! time, in arrival order (the session's context is one sequence); episodes run in parallel.

use std::collections::HashMap;
use std::sync::Arc;

use actors::agent::{Message, Renderer, Role, Session, tools};
use actors::generation::{FinishReason, GenError, GenOutput, GenRequest, SamplingParams};
use actors::types::{AgentCall, Turn};

use super::Generator;
use super::wire::{Answer, Call, ErrorKind, Finish, TokenInfo, WireError};

/// What the policy samples at: the job's, whatever the agent asks (training needs the
/// behaviour distribution to be the job's).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingPolicy {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
}

impl Default for SamplingPolicy {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
        }
    }
}

/// An episode's budget.
#[derive(Clone, Debug, PartialEq)]
pub struct EpisodeLimits {
    /// Model calls.
    pub max_calls: u32,
    /// Tokens generated over all calls.
    pub max_generated_tokens: u64,
    /// Context tokens of one call, prompt and answer (the model's own limit also applies).
    pub max_context: usize,
    /// Answer tokens of one call (the agent may ask for fewer).
    pub max_tokens_per_call: u32,
}

impl Default for EpisodeLimits {
    fn default() -> Self {
        Self {
            max_calls: 64,
            max_generated_tokens: 32_768,
            max_context: 8_192,
            max_tokens_per_call: 1_024,
        }
    }
}

/// How an episode is served.
#[derive(Clone)]
pub struct EpisodeOptions {
    pub renderer: Arc<Renderer>,
    /// The model name the episode's answers carry (and `GET /models` lists).
    pub model: String,
    pub sampling: SamplingPolicy,
    pub limits: EpisodeLimits,
    /// Seeds each call's sampling (with the call's number and the agent's `seed`, if any).
    pub seed: u64,
}

/// Which API a call came through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    ChatCompletions,
    Responses,
    Messages,
}

impl Api {
    pub fn name(self) -> &'static str {
        match self {
            Self::ChatCompletions => "chat.completions",
            Self::Responses => "responses",
            Self::Messages => "messages",
        }
    }
    fn id_prefix(self) -> &'static str {
        match self {
            Self::ChatCompletions => "chatcmpl-",
            Self::Responses => "resp_",
            Self::Messages => "msg_",
        }
    }
}

struct State {
    session: Session,
    turns: Vec<Turn>,
    calls: u32,
    generated: u64,
    /// Responses API: each answer's whole conversation, for `previous_response_id`.
    responses: HashMap<String, Vec<Message>>,
    /// The conversation of the last answered call, that answer appended.
    transcript: Vec<Message>,
    finished: bool,
}

/// Calls that failed, counted outside the session's lock (a refusal must not wait for the
/// call being served).
#[derive(Default)]
struct Failures {
    /// Calls refused for the episode's budget or the caller's input (4xx).
    refused: u32,
    /// Calls failed by the infrastructure (the shard unavailable after retries: 5xx).
    infra_errors: u32,
    /// The last budget refusal, if any.
    budget_spent: Option<String>,
}

/// What an episode left when it finished.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Finished {
    /// One turn per answered call.
    pub turns: Vec<Turn>,
    /// The conversation of the last answered call, that answer appended.
    pub transcript: Vec<Message>,
    /// Calls refused with a 4xx (budget, bad input).
    pub refused: u32,
    /// Calls failed by the infrastructure (5xx).
    pub infra_errors: u32,
    /// Why the episode's budget refused a call, if it did.
    pub budget_spent: Option<String>,
}

/// Generation attempts per call (the first and the retries after a shard stopped or failed).
pub const GENERATION_TRIES: u32 = 3;

/// Request ids of gateway calls: the top bit set, apart from the ids of a job's own episodes.
const REQUEST_BASE: u64 = 1 << 63;
/// Engine sessions of gateway episodes (prefix caches), likewise apart.
const SESSION_BASE: u64 = 1 << 62;

/// Calls of one episode that may wait for the one being served; past it a call is refused
/// with 429 (an agent's parallel calls are served one at a time: its context is one
/// sequence).
pub const MAX_WAITING_CALLS: usize = 16;

pub struct Episode {
    id: u64,
    opts: EpisodeOptions,
    generator: Arc<dyn Generator>,
    state: tokio::sync::Mutex<State>,
    /// Calls served or waiting now.
    in_flight: std::sync::atomic::AtomicUsize,
    started: tokio::time::Instant,
    /// Cancelled when the episode is closed (its job ended it): calls in flight or waiting
    /// end at once with 410, whatever their shard is doing.
    closed: tokio_util::sync::CancellationToken,
    failures: std::sync::Mutex<Failures>,
}

/// Aborts a request on its shard if dropped while still set (the call's future was dropped
/// before the answer came: the client disconnected).
struct AbortOnDrop<'a>(Option<(&'a dyn Generator, u64)>);

impl Drop for AbortOnDrop<'_> {
    fn drop(&mut self) {
        if let Some((g, id)) = self.0.take() {
            g.abort(id);
        }
    }
}

/// Counts a call in flight until dropped.
struct InFlight<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

impl Episode {
    pub(super) fn new(id: u64, opts: EpisodeOptions, generator: Arc<dyn Generator>) -> Self {
        let session = Session::new(opts.renderer.clone());
        Self {
            id,
            opts,
            generator,
            state: tokio::sync::Mutex::new(State {
                session,
                turns: Vec::new(),
                calls: 0,
                generated: 0,
                responses: HashMap::new(),
                transcript: Vec::new(),
                finished: false,
            }),
            in_flight: std::sync::atomic::AtomicUsize::new(0),
            started: tokio::time::Instant::now(),
            closed: tokio_util::sync::CancellationToken::new(),
            failures: std::sync::Mutex::default(),
        }
    }

    /// Ends the calls in flight and waiting (410); later calls are refused too.
    pub(super) fn close(&self) {
        self.closed.cancel();
        // Its prefix cache is no longer needed (a call still in flight is aborted as its
        // future is dropped).
        self.generator.release(SESSION_BASE | self.id);
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn model(&self) -> &str {
        &self.opts.model
    }

    /// Ends the episode once the call in flight (if any) is answered; what it left.
    pub(super) async fn finish(&self) -> Finished {
        let mut st = self.state.lock().await;
        st.finished = true;
        self.generator.release(SESSION_BASE | self.id);
        let mut f = self.failures();
        Finished {
            turns: std::mem::take(&mut st.turns),
            transcript: std::mem::take(&mut st.transcript),
            refused: f.refused,
            infra_errors: f.infra_errors,
            budget_spent: f.budget_spent.take(),
        }
    }

    /// Segments so far (a new one at each diverged history).
    pub async fn segments(&self) -> u32 {
        self.state.lock().await.session.segments()
    }

    /// Serves one call: the conversation rendered against the session, the answer generated
    /// within the budget, its tool calls parsed, and the turn recorded.
    pub async fn call(
        &self,
        api: Api,
        call: Call,
        previous: Option<&str>,
    ) -> Result<Answer, WireError> {
        // Biased: a closed episode starts no more work.
        let r = tokio::select! {
            biased;
            () = self.closed.cancelled() => Err(WireError::new(
                ErrorKind::Gone,
                "this episode was ended by its job",
            )),
            r = self.serve(api, call, previous) => r,
        };
        if let Err(e) = &r
            && e.kind != ErrorKind::Gone
        {
            let mut f = self.failures();
            if e.status() >= 500 {
                f.infra_errors += 1;
            } else {
                f.refused += 1;
                if e.kind == ErrorKind::ContextLength {
                    f.budget_spent = Some(e.message.clone());
                }
            }
        }
        r
    }

    fn failures(&self) -> std::sync::MutexGuard<'_, Failures> {
        self.failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    async fn serve(
        &self,
        api: Api,
        mut call: Call,
        previous: Option<&str>,
    ) -> Result<Answer, WireError> {
        let arrived = tokio::time::Instant::now();
        let n = self
            .in_flight
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let _counted = InFlight(&self.in_flight);
        if n > MAX_WAITING_CALLS {
            return Err(WireError::new(
                ErrorKind::RateLimited,
                format!(
                    "this episode already has {n} calls in flight; its calls are served one at a time"
                ),
            ));
        }
        let mut st = self.state.lock().await;
        if st.finished {
            return Err(WireError::new(ErrorKind::Gone, "this episode is finished"));
        }
        if st.calls >= self.opts.limits.max_calls {
            return Err(WireError::new(
                ErrorKind::ContextLength,
                format!(
                    "the episode's budget of {} model calls is spent",
                    self.opts.limits.max_calls
                ),
            ));
        }
        if let Some(prev) = previous {
            continue_response(&st, &mut call, prev)?;
        }
        call.conv
            .check()
            .map_err(|e| WireError::invalid(e.param(), e.to_string()))?;
        let prepared = st.session.prepare(&call.conv).map_err(|e| match e {
            actors::agent::RenderError::Reserved(i) => {
                WireError::invalid(format!("messages[{i}].content"), e.to_string())
            }
            other => WireError::new(
                ErrorKind::Internal,
                format!("the chat template failed: {}", infra::error_chain(&other)),
            ),
        })?;
        let max_tokens = self.budget(&st, &call, prepared.context.len())?;
        // Counted against the budget once answered: a call the infrastructure failed (5xx)
        // is not the policy's.
        let n = st.calls;
        let req = GenRequest {
            id: REQUEST_BASE | (self.id << 20) | u64::from(n),
            session: SESSION_BASE | self.id,
            context: prepared.context.clone(),
            params: SamplingParams {
                temperature: self.opts.sampling.temperature,
                top_p: self.opts.sampling.top_p,
                top_k: self.opts.sampling.top_k,
                max_tokens,
                stop_tokens: self.opts.renderer.tokenizer().stop_ids.clone(),
                stop_strings: call.sampling.stop.clone(),
                ignore_eos: false,
                // The agent's seed varies the episode's stream without replacing it: the
                // episodes of a group must sample differently even when every agent sends
                // the same seed.
                seed: self.opts.seed
                    ^ call.sampling.seed.unwrap_or(0).rotate_left(17)
                    ^ (u64::from(n) << 40),
                allowed_tokens: None,
            },
            sim_response_len: None,
            prefilled: false,
            reusable: None,
            carried: 0,
        };
        let out = self.generate(req, &st.session).await?;
        st.calls += 1;
        let (answer, message, call_record) =
            self.answer(api, &call, &out, n, prepared.context.len())?;
        st.generated += out.tokens.len() as u64;
        st.session.commit(&prepared, &out, message.clone());
        let mut whole = std::mem::take(&mut call.conv.messages);
        whole.push(message);
        if api == Api::Responses {
            st.responses.insert(answer.id.clone(), whole.clone());
        }
        st.transcript = whole;
        let record = AgentCall {
            latency_s: arrived.elapsed().as_secs_f64(),
            ..call_record
        };
        st.turns.push(Turn {
            observation_tokens: prepared.observation.into(),
            response_tokens: out.tokens,
            logprobs: out.logprobs,
            versions: out.versions,
            prefill_tokens: out.prefill_tokens,
            started_at_s: arrived.duration_since(self.started).as_secs_f64(),
            restart: prepared.restart,
            call: Some(Box::new(record)),
            ..Turn::default()
        });
        Ok(answer)
    }

    /// Generates `req`; a shard that stopped (its engine restarted) or failed is asked again,
    /// up to [`GENERATION_TRIES`] times in all, so the client sees one answer. An answer from
    /// a version older than the session's newest is never accepted (503: the client retries).
    async fn generate(&self, req: GenRequest, session: &Session) -> Result<GenOutput, WireError> {
        // A client that goes away drops this future: the shard stops generating for it.
        let mut pending = AbortOnDrop(Some((self.generator.as_ref(), req.id)));
        let mut tries = 0;
        let out = loop {
            tries += 1;
            match self.generator.generate(req.clone()).await {
                Ok(out) => break out,
                Err(GenError::ShardStopped | GenError::Backend(_)) if tries < GENERATION_TRIES => {
                    tracing::debug!(episode = self.id, tries, "generation retried on the shard");
                }
                Err(e) => {
                    pending.0 = None;
                    return Err(gen_error(e));
                }
            }
        };
        pending.0 = None;
        session
            .check_versions(&out)
            .map_err(|e| WireError::new(ErrorKind::Unavailable, e.to_string()))?;
        Ok(out)
    }

    /// The answer's token budget: the agent's ask, the job's per-call cap, what the context
    /// budget leaves and what the episode's generated-token budget leaves.
    fn budget(&self, st: &State, call: &Call, context: usize) -> Result<u32, WireError> {
        let l = &self.opts.limits;
        if context >= l.max_context {
            return Err(WireError {
                param: Some("messages".into()),
                ..WireError::new(
                    ErrorKind::ContextLength,
                    format!(
                        "this model's maximum context length is {} tokens; the messages hold {context}",
                        l.max_context
                    ),
                )
            });
        }
        let left = l.max_generated_tokens.saturating_sub(st.generated);
        if left == 0 {
            return Err(WireError::new(
                ErrorKind::ContextLength,
                format!(
                    "the episode's budget of {} generated tokens is spent",
                    l.max_generated_tokens
                ),
            ));
        }
        let room = u32::try_from((l.max_context - context) as u64).unwrap_or(u32::MAX);
        let asked = call.sampling.max_tokens.unwrap_or(u32::MAX);
        Ok(asked
            .min(l.max_tokens_per_call)
            .min(room)
            .min(u32::try_from(left).unwrap_or(u32::MAX)))
    }

    /// The answer for the client, the message the session remembers, and the call record.
    fn answer(
        &self,
        api: Api,
        call: &Call,
        out: &GenOutput,
        n: u32,
        prompt_tokens: usize,
    ) -> Result<(Answer, Message, AgentCall), WireError> {
        let tok = self.opts.renderer.tokenizer();
        let body = match out.tokens.last() {
            Some(last) if tok.stop_ids.contains(last) => &out.tokens[..out.tokens.len() - 1],
            _ => &out.tokens[..],
        };
        let decode = |ids: &[u32]| {
            tok.decode(ids)
                .map_err(|e| WireError::new(ErrorKind::Internal, infra::error_chain(&e)))
        };
        let mut text = decode(body)?;
        // A stop sequence ends the text the client sees (the ids that completed it were
        // sampled and stay in the trajectory).
        let mut stop_sequence = None;
        if let Some((at, s)) = call
            .sampling
            .stop
            .iter()
            .filter_map(|s| text.find(s.as_str()).map(|i| (i, s)))
            .min()
        {
            text.truncate(at);
            stop_sequence = Some(s.clone());
        }
        let prefix = format!("call_{}_{n}", self.id);
        let parsed = tools::parse(
            self.opts.renderer.format,
            &text,
            call.conv.offered_tools(),
            |k| format!("{prefix}_{k}"),
        );
        let finish = if !parsed.calls.is_empty() {
            Finish::ToolCalls
        } else if out.finish == FinishReason::Length {
            Finish::Length
        } else {
            Finish::Stop
        };
        let tokens = match call.logprobs {
            Some(_) => out
                .tokens
                .iter()
                .zip(&out.logprobs)
                .map(|(&id, &lp)| {
                    Ok(TokenInfo {
                        text: decode(&[id])?,
                        logprob: lp,
                    })
                })
                .collect::<Result<_, WireError>>()?,
            None => Vec::new(),
        };
        let mut message = Message::new(Role::Assistant, parsed.content.clone());
        message.tool_calls = parsed.calls.clone();
        let last_assistant = call
            .conv
            .messages
            .iter()
            .rposition(|m| m.role == Role::Assistant);
        let tool_results = call.conv.messages[last_assistant.map_or(0, |i| i + 1)..]
            .iter()
            .filter(|m| m.role == Role::Tool)
            .cloned()
            .collect();
        let record = AgentCall {
            api: api.name().into(),
            stream: call.stream,
            tool_calls: parsed.calls.clone(),
            tool_results,
            invalid_tool_call: parsed.invalid,
            finish_reason: finish.openai().into(),
            latency_s: 0.0,
        };
        let answer = Answer {
            id: format!("{}{}-{n}", api.id_prefix(), self.id),
            model: self.opts.model.clone(),
            created: u64::try_from(infra::clock::unix_ms() / 1000).unwrap_or(0),
            content: parsed.content,
            tool_calls: parsed.calls,
            finish,
            stop_sequence,
            prompt_tokens: u32::try_from(prompt_tokens).unwrap_or(u32::MAX),
            completion_tokens: u32::try_from(out.tokens.len()).unwrap_or(u32::MAX),
            tokens,
        };
        Ok((answer, message, record))
    }
}

/// Responses' `previous_response_id`: the named response's whole conversation, then the new
/// input; the new instructions (if any) replace the old ones.
fn continue_response(st: &State, call: &mut Call, prev: &str) -> Result<(), WireError> {
    let history = st.responses.get(prev).ok_or_else(|| {
        WireError::invalid(
            "previous_response_id",
            format!("no response {prev:?} in this episode"),
        )
    })?;
    let system: Vec<Message> = call
        .conv
        .messages
        .iter()
        .take_while(|m| m.role == Role::System)
        .cloned()
        .collect();
    let rest = call.conv.messages.split_off(system.len());
    let old = history.iter().filter(|m| m.role != Role::System).cloned();
    call.conv.messages = system.into_iter().chain(old).chain(rest).collect();
    Ok(())
}

/// A generation failure as the client sees it: the model's context is full (400
/// `context_length_exceeded`), otherwise the shard is unavailable (503, retried by SDKs).
fn gen_error(e: GenError) -> WireError {
    match e {
        GenError::ContextTooLong { len, limit } => WireError {
            param: Some("messages".into()),
            ..WireError::new(
                ErrorKind::ContextLength,
                format!(
                    "this model's maximum context length is {limit} tokens; the messages hold {len}"
                ),
            )
        },
        other => WireError::new(
            ErrorKind::Unavailable,
            format!("generation failed: {other}"),
        ),
    }
}
