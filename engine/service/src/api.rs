//! HTTP API v1 (axum). Errors are JSON `{"error": {"code", "message", "fields"}}` with a stable
//! machine `code`; request bodies are limited to [`MAX_BODY_BYTES`].

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Extension, Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::Stream;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, OpenApi, ToSchema};

use crate::access::{Access, Denied, Principal, Role};

mod trainer;
use crate::service::{JobEvent, Service, ServiceError};
use job::spec::{self, FieldError, Format};
use job::store::{JobRecord, JobState, TrainedFilter, TrajectoryRow};
pub use trainer::MSGPACK;

/// Largest accepted request body.
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// Largest page of trajectories.
pub const MAX_PAGE: usize = 1000;

/// The error body.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// Stable machine code: `invalid_spec`, `not_found`, `method_not_allowed`,
    /// `body_too_large`, `bad_request`, `unauthorized`, `forbidden`, `rate_limited`,
    /// `over_memory_budget`, `conflict`, `unsupported_media_type`, `shutting_down`,
    /// `internal`.
    pub code: &'static str,
    pub message: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub fields: Vec<FieldError>,
}

#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    fields: Vec<FieldError>,
    /// What went wrong inside (logged once, at the response; never sent to the client).
    cause: Option<String>,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            fields: Vec::new(),
            cause: None,
        }
    }

    /// An internal error: the client gets a generic 500, the log gets the whole chain.
    fn internal(cause: &dyn std::error::Error) -> Self {
        Self {
            cause: Some(infra::error_chain(cause)),
            ..Self::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "internal error",
            )
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            let error = self.cause.as_deref().unwrap_or(&self.message);
            tracing::error!(code = self.code, error, "request failed");
        }
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code,
                message: self.message,
                fields: self.fields,
            },
        };
        let mut r = (self.status, Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer realm=\"rollarc\""),
            );
        }
        if self.status == StatusCode::PAYLOAD_TOO_LARGE {
            // The unread body makes the connection unusable: tell the client not to pool it.
            r.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        r
    }
}

impl From<ServiceError> for ApiError {
    fn from(e: ServiceError) -> Self {
        match e {
            ServiceError::NotFound(id) => Self::new(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("job {id} not found"),
            ),
            ServiceError::ShuttingDown => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting_down",
                e.to_string(),
            ),
            ServiceError::Terminal { .. } => {
                Self::new(StatusCode::CONFLICT, "conflict", e.to_string())
            }
            ServiceError::NoText { .. } => Self {
                fields: vec![FieldError {
                    field: "text".into(),
                    message: e.to_string(),
                }],
                ..Self::new(StatusCode::BAD_REQUEST, "bad_request", e.to_string())
            },
            ServiceError::OverBudget { ref parts, .. } => Self {
                fields: parts
                    .iter()
                    .map(|(field, message)| FieldError {
                        field: field.clone(),
                        message: message.clone(),
                    })
                    .collect(),
                ..Self::new(StatusCode::BAD_REQUEST, "over_memory_budget", e.to_string())
            },
            // Internals are logged (once, by the response), not leaked.
            other => Self::internal(&other),
        }
    }
}

impl From<job::store::StoreError> for ApiError {
    fn from(e: job::store::StoreError) -> Self {
        ServiceError::Store(e).into()
    }
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Created {
    pub id: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct JobList {
    pub jobs: Vec<JobRecord>,
}

#[derive(Debug, Deserialize, IntoParams)]
pub struct PageQuery {
    /// Cursor of the last trajectory already seen (0 = from the start).
    pub after: Option<i64>,
    /// Page size, 1..=1000 (default 100).
    pub limit: Option<usize>,
    /// `true`: only rows a training step consumed; `false`: only rows none consumed.
    pub trained: Option<bool>,
    /// `true`: add each turn's observation and response as text (`text`), decoded by the
    /// job's tokenizer (400 for a job on simulated pools).
    pub text: Option<bool>,
    /// `true`: the newest `limit` rows after `after` instead of the oldest (still in cursor
    /// order), e.g. for a viewer that opens on the latest trajectories.
    pub newest: Option<bool>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    pub status: &'static str,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Cluster {
    pub jobs: Vec<ClusterJob>,
    /// Device classes the mapper knows.
    pub devices: Vec<DeviceView>,
    /// Function deployments of the local runtime (shared by all jobs): instances by phase,
    /// autoscaler decision and panic state, requests now and at peak, router counters.
    #[schema(value_type = Vec<Object>)]
    pub functions: Vec<job::hub::FunctionView>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ClusterJob {
    pub id: String,
    pub pools: Vec<ClusterPool>,
    pub environments: Vec<EnvView>,
    pub functions: Vec<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ClusterPool {
    pub name: String,
    pub device: String,
    pub shards: usize,
    pub backend: String,
    /// Busy fraction since the job started (from the latest step).
    pub utilisation: Option<f64>,
    pub groups: Option<u64>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct EnvView {
    pub task: String,
    pub kind: String,
    pub envs: Option<usize>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DeviceView {
    pub name: String,
    pub tflops: f64,
    pub bandwidth_tb_s: f64,
    pub memory_gb: f64,
    pub relative_cost: f64,
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "rollarc",
        description = "Rollout engine for agentic RL: job API v1"
    ),
    paths(
        submit,
        list_jobs,
        get_job,
        get_job_spec,
        job_steps,
        job_baselines,
        cancel_job,
        job_events,
        trajectories,
        trainer::next_batch,
        trainer::ack_batch,
        trainer::nack_batch,
        trainer::staleness,
        trainer::announce_weights,
        cluster,
        healthz,
        readyz,
        metrics
    ),
    components(schemas(
        Created,
        JobList,
        JobRecord,
        JobState,
        ErrorBody,
        ErrorDetail,
        FieldError,
        TrajectoryRow,
        job::store::TurnText,
        StepPage,
        StepRecord,
        Baselines,
        CancelAnswer,
        CancelInfo,
        actors::types::Trajectory,
        actors::types::Turn,
        actors::types::VersionSpan,
        actors::types::Timings,
        actors::types::FailureReason,
        trainer::LeasedBatchBody,
        trainer::BatchAck,
        trainer::Staleness,
        trainer::Announcement,
        trainer::WeightSource,
        trainer::Announced,
        job::trainer_api::TrainingBatch,
        job::trainer_api::BatchGroup,
        job::trainer_api::Sample,
        Cluster,
        ClusterJob,
        ClusterPool,
        EnvView,
        DeviceView,
        JobEvent,
        Health,
        spec::JobSpec
    )),
    modifiers(&Security)
)]
pub struct ApiDoc;

/// Declares the bearer scheme and, on every operation behind it, the answers of the access
/// layer: 401 (no or unknown token) and 429 (over the token's rate, with `Retry-After`).
struct Security;

impl utoipa::Modify for Security {
    fn modify(&self, api: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        use utoipa::openapi::{
            ContentBuilder, HeaderBuilder, Ref, ResponseBuilder, SecurityRequirement, Type,
            schema::ObjectBuilder,
        };
        let components = api.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        let error = |what: &str| {
            ResponseBuilder::new().description(what).content(
                "application/json",
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("ErrorBody")))
                    .build(),
            )
        };
        let retry_after = HeaderBuilder::new()
            .schema(
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .minimum(Some(1)),
            )
            .description(Some("seconds until the token may call again"))
            .build();
        for (path, item) in api.paths.paths.iter_mut() {
            if matches!(path.as_str(), "/healthz" | "/readyz" | "/openapi.json") {
                continue;
            }
            for op in [&mut item.get, &mut item.post].into_iter().flatten() {
                // `/metrics` may be configured open: the empty requirement says so.
                let mut security = vec![SecurityRequirement::new("bearer", Vec::<String>::new())];
                if path == "/metrics" {
                    security.push(SecurityRequirement::default());
                }
                op.security = Some(security);
                let r = &mut op.responses.responses;
                r.insert(
                    "401".into(),
                    error("missing or unknown bearer token").build().into(),
                );
                r.insert(
                    "429".into(),
                    error("over the token's rate limit")
                        .header("Retry-After", retry_after.clone())
                        .build()
                        .into(),
                );
            }
        }
    }
}

/// The API without access control (every caller is the local admin).
pub fn router(service: Arc<Service>) -> Router {
    router_with(service, Arc::new(Access::open()))
}

/// The API behind `access`: every route but `/healthz`, `/readyz`, `/openapi.json` (and
/// `/metrics` when configured open) needs a token, and each request counts against its
/// token's rate limit.
pub fn router_with(service: Arc<Service>, access: Arc<Access>) -> Router {
    Router::new()
        .route("/v1/jobs", post(submit).get(list_jobs))
        .route("/v1/jobs/{id}", get(get_job))
        .route("/v1/jobs/{id}/spec", get(get_job_spec))
        .route("/v1/jobs/{id}/steps", get(job_steps))
        .route("/v1/jobs/{id}/baselines", get(job_baselines))
        .route("/v1/jobs/{id}/cancel", post(cancel_job))
        .route("/v1/jobs/{id}/events", get(job_events))
        .route("/v1/jobs/{id}/trajectories", get(trajectories))
        .route("/v1/jobs/{id}/batches/next", get(trainer::next_batch))
        .route("/v1/jobs/{id}/staleness", get(trainer::staleness))
        .route("/v1/jobs/{id}/weights", post(trainer::announce_weights))
        .route("/v1/batches/{batch_id}/ack", post(trainer::ack_batch))
        .route("/v1/batches/{batch_id}/nack", post(trainer::nack_batch))
        .route("/v1/cluster", get(cluster))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        .route("/", get(crate::ui::index))
        .route("/ui/app.js", get(crate::ui::script))
        .route("/ui/app.css", get(crate::ui::style))
        .fallback(no_route)
        .method_not_allowed_fallback(no_method)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(
            access.clone(),
            authorize,
        ))
        .layer(Extension(access))
        .with_state(service)
}

/// Routes anyone may call.
fn is_open(path: &str, access: &Access) -> bool {
    matches!(path, "/healthz" | "/readyz" | "/openapi.json")
        || crate::ui::PATHS.contains(&path)
        || (path == "/metrics" && access.metrics_open())
}

/// Authenticates the caller (401 without a valid token, 429 over its rate) and hands the
/// handlers its [`Principal`].
async fn authorize(
    State(access): State<Arc<Access>>,
    mut req: Request,
    next: axum::middleware::Next,
) -> Response {
    if is_open(req.uri().path(), &access) {
        return next.run(req).await;
    }
    let auth = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    match access.authenticate(auth) {
        Ok(p) => {
            req.extensions_mut().insert(p);
            next.run(req).await
        }
        Err(Denied::Unauthenticated(why)) => {
            ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", why).into_response()
        }
        Err(Denied::RateLimited { retry_after_s }) => {
            let mut r = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limited",
                format!("too many requests for this token; retry in {retry_after_s} s"),
            )
            .into_response();
            r.headers_mut()
                .insert(header::RETRY_AFTER, retry_after_s.into());
            r
        }
    }
}

/// 403 unless the caller has at least `role`.
fn require(p: &Principal, role: Role) -> Result<(), ApiError> {
    if p.role >= role {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!(
                "this token's role ({:?}) may not do this; it needs {role:?}",
                p.role
            )
            .to_lowercase(),
        ))
    }
}

/// The job `id` if the caller may see it; another owner's job is as absent as a missing one
/// (404: ids of other owners are not revealed).
fn visible_job(s: &Service, p: &Principal, id: &str) -> Result<JobRecord, ApiError> {
    match s.store.get(id)? {
        Some(j) if p.owns(j.owner.as_deref()) => Ok(j),
        _ => Err(ServiceError::NotFound(id.to_string()).into()),
    }
}

/// The spec format of a submitted body: by its content type (JSON or TOML), sniffed when it
/// names none (or plain text); any other type (YAML, XML, …) is a 415.
fn body_format(headers: &HeaderMap, body: &str) -> Result<Format, ApiError> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    Ok(if ct.contains("json") {
        Format::Json
    } else if ct.contains("toml") {
        Format::Toml
    } else if matches!(ct.as_str(), "" | "text/plain" | "application/octet-stream") {
        if body.trim_start().starts_with('{') {
            Format::Json
        } else {
            Format::Toml
        }
    } else {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            format!(
                "content-type {ct} is not a job spec format: send application/json or \
                 application/toml (convert YAML to JSON first; the Python SDK does)"
            ),
        ));
    })
}

/// Submit a job (JSON or TOML body).
#[utoipa::path(post, path = "/v1/jobs", request_body(content = spec::JobSpec, description = "job spec as JSON or TOML"),
    responses((status = 201, body = Created), (status = 400, description = "invalid spec, or over the memory budget", body = ErrorBody), (status = 403, description = "the token may not submit, or the service policy forbids a program of the spec", body = ErrorBody), (status = 413, body = ErrorBody), (status = 415, description = "a body that is neither JSON nor TOML (e.g. YAML)", body = ErrorBody), (status = 503, body = ErrorBody)))]
async fn submit(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    Extension(access): Extension<Arc<Access>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<Created>), ApiError> {
    require(&p, Role::Submit)?;
    let body = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                format!("request body exceeds {MAX_BODY_BYTES} bytes"),
            )
        } else {
            ApiError::new(StatusCode::BAD_REQUEST, "bad_request", e.body_text())
        }
    })?;
    let text = std::str::from_utf8(&body)
        .map_err(|_| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", "body is not UTF-8"))?;
    let spec = job::resolve::accept(text, body_format(&headers, text)?).map_err(|e| ApiError {
        status: StatusCode::BAD_REQUEST,
        code: "invalid_spec",
        message: format!("the job spec has {} problem(s)", e.0.len()),
        fields: e.0,
        cause: None,
    })?;
    let denied = access.check_programs(&spec);
    if !denied.is_empty() {
        return Err(ApiError {
            status: StatusCode::FORBIDDEN,
            code: "forbidden",
            message: format!(
                "the service policy does not allow {} program(s) of this spec",
                denied.len()
            ),
            fields: denied,
            cause: None,
        });
    }
    let id = s.submit_as(spec, p.owner())?;
    Ok((StatusCode::CREATED, Json(Created { id })))
}

/// List jobs, oldest first.
#[utoipa::path(get, path = "/v1/jobs", responses((status = 200, body = JobList)))]
async fn list_jobs(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
) -> Result<Json<JobList>, ApiError> {
    let mut jobs = s.store.list()?;
    jobs.retain(|j| p.owns(j.owner.as_deref()));
    Ok(Json(JobList { jobs }))
}

/// One job: state, step, steps, latest metrics.
#[utoipa::path(get, path = "/v1/jobs/{id}", params(("id" = String, Path, description = "job id")), responses((status = 200, body = JobRecord), (status = 404, body = ErrorBody)))]
async fn get_job(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<JobRecord>, ApiError> {
    visible_job(&s, &p, &id).map(Json)
}

/// The job's spec as the service stored it (normalised JSON: every default filled in), e.g.
/// for an external trainer to build the job's model.
#[utoipa::path(get, path = "/v1/jobs/{id}/spec", params(("id" = String, Path, description = "job id")), responses((status = 200, body = spec::JobSpec), (status = 404, body = ErrorBody)))]
async fn get_job_spec(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<spec::JobSpec>, ApiError> {
    visible_job(&s, &p, &id)?;
    let spec = s
        .store
        .spec(&id)?
        .ok_or_else(|| ServiceError::NotFound(id.clone()))?;
    Ok(Json(spec))
}

/// What a uniformly random policy scores on each task, the baseline of its success curve.
#[derive(Debug, Serialize, ToSchema)]
pub struct Baselines {
    /// Success rate of a random policy per task (measured on the environment itself, 4,000
    /// episodes from the job's seed); `null` where it is not defined (tasks whose answers
    /// are not single actions from an alphabet).
    pub tasks: BTreeMap<String, Option<f64>>,
}

/// The random-policy baseline of each task of the job.
#[utoipa::path(get, path = "/v1/jobs/{id}/baselines", params(("id" = String, Path, description = "job id")), responses((status = 200, body = Baselines), (status = 404, body = ErrorBody)))]
async fn job_baselines(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<Baselines>, ApiError> {
    visible_job(&s, &p, &id)?;
    let spec = s
        .store
        .spec(&id)?
        .ok_or_else(|| ServiceError::NotFound(id.clone()))?;
    let tasks = tokio::task::spawn_blocking(move || {
        spec.tasks
            .iter()
            .map(|t| {
                (
                    t.domain.clone(),
                    job::baseline::random_policy_success(t, 4000, spec.seed),
                )
            })
            .collect()
    })
    .await
    .map_err(|e| ApiError::internal(&e))?;
    Ok(Json(Baselines { tasks }))
}

/// A page size (`limit`, default 100) within 1..=`MAX_PAGE`.
fn page_limit(limit: Option<usize>) -> Result<usize, ApiError> {
    let limit = limit.unwrap_or(100);
    if (1..=MAX_PAGE).contains(&limit) {
        return Ok(limit);
    }
    Err(ApiError {
        fields: vec![FieldError {
            field: "limit".into(),
            message: format!("must be in 1..={MAX_PAGE}"),
        }],
        ..ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("limit {limit} out of range"),
        )
    })
}

/// A page of a job's step history.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct StepsQuery {
    /// The last step already seen (0 = from the first).
    after: Option<u64>,
    /// Page size, 1..=1000 (default 100).
    limit: Option<usize>,
}

/// One completed training step.
#[derive(Debug, Serialize, ToSchema)]
pub struct StepRecord {
    /// Steps completed by then (1 = the first step).
    pub step: u64,
    /// The step's full record (the progress event's metrics plus the per-resource
    /// `timeline`).
    #[schema(value_type = Object)]
    pub metrics: serde_json::Value,
}

/// Steps after `after`, oldest first.
#[derive(Debug, Serialize, ToSchema)]
pub struct StepPage {
    pub steps: Vec<StepRecord>,
    /// The job's newest event id when the page was read: resume the events after it
    /// (`Last-Event-ID`) to get every later step (a step already on a page may come again:
    /// keep one per `step`).
    pub event_id: String,
}

/// The job's step history (the learning curve), paged.
#[utoipa::path(get, path = "/v1/jobs/{id}/steps", params(("id" = String, Path, description = "job id"), StepsQuery), responses((status = 200, body = StepPage), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn job_steps(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
    q: Result<Query<StepsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<StepPage>, ApiError> {
    let Query(q) =
        q.map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", e.body_text()))?;
    let limit = page_limit(q.limit)?;
    visible_job(&s, &p, &id)?;
    // The id first: every step after the ones read here has its event after it.
    let event_id = s.last_event_id(&id);
    let steps = s
        .store
        .step_page(&id, q.after.unwrap_or(0), limit)?
        .into_iter()
        .map(|(step, metrics)| StepRecord { step, metrics })
        .collect();
    Ok(Json(StepPage { steps, event_id }))
}

/// The answer to a cancel: the job as it is now, and what the cancel does to it.
#[derive(Debug, Serialize, ToSchema)]
pub struct CancelAnswer {
    #[serde(flatten)]
    pub job: JobRecord,
    pub cancel: CancelInfo,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CancelInfo {
    /// `stopping`: the job was running; it stops now and its state becomes `cancelled` once
    /// its actors and processes are down (watch the job or its events). `cancelled`: it was
    /// queued and never started.
    pub outcome: &'static str,
    /// The step (1-based) that was in flight: it is not recorded; the steps before it and
    /// their trajectories are kept.
    pub in_flight_step: Option<u64>,
    pub message: String,
}

/// Cancel a queued or running job.
#[utoipa::path(post, path = "/v1/jobs/{id}/cancel", params(("id" = String, Path, description = "job id")), responses((status = 202, body = CancelAnswer), (status = 403, description = "a read token", body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
async fn cancel_job(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<CancelAnswer>), ApiError> {
    visible_job(&s, &p, &id)?;
    require(&p, Role::Submit)?;
    s.cancel(&id)?;
    let job = s
        .store
        .get(&id)?
        .ok_or_else(|| ServiceError::NotFound(id.clone()))?;
    let cancel = if job.state.is_terminal() {
        CancelInfo {
            outcome: "cancelled",
            in_flight_step: None,
            message: format!("{id} was cancelled before it started"),
        }
    } else {
        let in_flight =
            (job.state == JobState::Running && job.step < job.steps).then_some(job.step + 1);
        CancelInfo {
            outcome: "stopping",
            in_flight_step: in_flight,
            message: match in_flight {
                Some(n) => format!(
                    "{id} is stopping: step {n} of {} was in flight and is not recorded; steps 1–{} and their trajectories are kept. Its state becomes cancelled once its actors and processes are down",
                    job.steps, job.step
                ),
                None => format!(
                    "{id} is stopping; its state becomes cancelled once its actors and processes are down"
                ),
            },
        }
    };
    Ok((StatusCode::ACCEPTED, Json(CancelAnswer { job, cancel })))
}

/// Where a reconnecting events client resumes.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
struct EventsQuery {
    /// Resume after this event id (as the `Last-Event-ID` header does; the header wins).
    after: Option<String>,
}

/// Server-sent events: `state` on every transition, `progress` after every step and
/// `weights_installed` after every weight update, each with an `id`. The stream starts with
/// the current state — or, given the id of an event it sent (`Last-Event-ID` header or
/// `after`), with the events since that one while this process holds them (the newest 256
/// of a running job) — and ends after a terminal state.
#[utoipa::path(get, path = "/v1/jobs/{id}/events", params(("id" = String, Path, description = "job id"), EventsQuery, ("Last-Event-ID" = Option<String>, Header, description = "resume after this event id")), responses((status = 200, description = "text/event-stream of JobEvent"), (status = 404, body = ErrorBody)))]
async fn job_events(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    Extension(access): Extension<Arc<Access>>,
    Path(id): Path<String>,
    Query(q): Query<EventsQuery>,
    headers: HeaderMap,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    visible_job(&s, &p, &id)?;
    let guard = access.open_stream(&p).ok_or_else(|| {
        ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limited",
            format!(
                "this owner already has {} event streams open",
                crate::access::MAX_STREAMS_PER_OWNER
            ),
        )
    })?;
    let after = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or(q.after);
    let sub = s.subscribe_after(&id, after.as_deref())?;
    let stream = async_stream(move |tx| async move {
        let _guard = guard;
        let terminal =
            |e: &JobEvent| matches!(e, JobEvent::State { state, .. } if state.is_terminal());
        let mut sub = sub;
        for (eid, e) in std::mem::take(&mut sub.replay) {
            let end = terminal(&e);
            if tx.send(to_event(&e).id(eid)).await.is_err() || end {
                return;
            }
        }
        let Some(mut rx) = sub.rx.take() else {
            return;
        };
        let mut seq = sub.next;
        loop {
            match rx.recv().await {
                Ok(e) => {
                    let end = terminal(&e);
                    let eid = sub.event_id(seq);
                    seq += 1;
                    if tx.send(to_event(&e).id(eid)).await.is_err() || end {
                        return;
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                    seq += n;
                    let ev = Event::default()
                        .event("lagged")
                        .data(format!("{{\"skipped\":{n}}}"));
                    if tx.send(ev).await.is_err() {
                        return;
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            }
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

fn to_event(e: &JobEvent) -> Event {
    let name = match e {
        JobEvent::State { .. } => "state",
        JobEvent::Progress { .. } => "progress",
        JobEvent::WeightsInstalled { .. } => "weights_installed",
    };
    Event::default()
        .event(name)
        .data(serde_json::to_string(e).unwrap_or_default())
}

/// A stream fed by a task through a bounded channel (capacity 64: the producer waits for a
/// slow client).
fn async_stream<F, Fut>(f: F) -> impl Stream<Item = Result<Event, Infallible>>
where
    F: FnOnce(tokio::sync::mpsc::Sender<Event>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(f(tx));
    futures::stream::unfold(
        rx,
        |mut rx| async move { rx.recv().await.map(|e| (Ok(e), rx)) },
    )
}

/// Trajectories after a cursor, as NDJSON in durable order.
#[utoipa::path(get, path = "/v1/jobs/{id}/trajectories", params(("id" = String, Path, description = "job id"), PageQuery), responses((status = 200, description = "one TrajectoryRow per line (NDJSON)", content_type = "application/x-ndjson", body = TrajectoryRow), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn trajectories(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
    q: Result<Query<PageQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) =
        q.map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "bad_request", e.body_text()))?;
    let limit = page_limit(q.limit)?;
    let after = q.after.unwrap_or(0);
    if after < 0 {
        return Err(ApiError {
            fields: vec![FieldError {
                field: "after".into(),
                message: "must be >= 0".into(),
            }],
            ..ApiError::new(StatusCode::BAD_REQUEST, "bad_request", "negative cursor")
        });
    }
    visible_job(&s, &p, &id)?;
    let filter = match q.trained {
        None => TrainedFilter::All,
        Some(true) => TrainedFilter::Trained,
        Some(false) => TrainedFilter::Untrained,
    };
    let mut rows = s
        .store
        .trajectories(&id, after, limit, filter, q.newest == Some(true))?;
    if q.text == Some(true) {
        let svc = s.clone();
        let job = id.clone();
        let tok = tokio::task::spawn_blocking(move || svc.tokenizer(&job))
            .await
            .map_err(|e| ApiError::internal(&e))??;
        for r in &mut rows {
            r.text = Some(tok.turns(&r.trajectory));
        }
    }
    let mut out = String::new();
    for r in &rows {
        out.push_str(&serde_json::to_string(r).unwrap_or_default());
        out.push('\n');
    }
    let next = rows.last().map_or(after, |r| r.cursor);
    Ok((
        [
            (header::CONTENT_TYPE, "application/x-ndjson".to_string()),
            (
                header::HeaderName::from_static("x-next-cursor"),
                next.to_string(),
            ),
        ],
        out,
    )
        .into_response())
}

/// Pools, shards, environments and functions of the running jobs, and the device catalogue.
#[utoipa::path(get, path = "/v1/cluster", responses((status = 200, body = Cluster)))]
async fn cluster(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
) -> Result<Json<Cluster>, ApiError> {
    let mut jobs = Vec::new();
    for id in s.running_ids() {
        let Some(spec) = s.store.spec(&id)? else {
            continue;
        };
        let rec = s.store.get(&id)?;
        if !rec.as_ref().is_some_and(|r| p.owns(r.owner.as_deref())) {
            continue;
        }
        let metrics = rec.map(|r| r.metrics).unwrap_or_default();
        let knobs = spec.knobs();
        jobs.push(ClusterJob {
            id: id.clone(),
            pools: spec
                .pools
                .iter()
                .map(|p| ClusterPool {
                    name: p.name.clone(),
                    device: p.device.clone(),
                    shards: p.count,
                    backend: match &p.backend {
                        spec::BackendSpec::Sim { model, .. } => format!("sim:{model}"),
                        spec::BackendSpec::Builtin { model, .. } => match model.choice() {
                            spec::ModelChoice::Tiny(c) => {
                                format!("builtin:d{}-l{}", c.d_model, c.n_layers)
                            }
                            spec::ModelChoice::Checkpoint { path, .. } => format!(
                                "builtin:{}",
                                path.file_name().unwrap_or_default().to_string_lossy()
                            ),
                        },
                        spec::BackendSpec::Llamacpp(l)
                        | spec::BackendSpec::Sglang(l)
                        | spec::BackendSpec::Vllm(l) => format!(
                            "{}:{}",
                            match &p.backend {
                                spec::BackendSpec::Sglang(_) => "sglang",
                                spec::BackendSpec::Vllm(_) => "vllm",
                                _ => "llamacpp",
                            },
                            std::path::Path::new(l.model.path.as_deref().unwrap_or_default())
                                .file_name()
                                .unwrap_or_default()
                                .to_string_lossy()
                        ),
                    },
                    utilisation: metrics
                        .pointer(&format!("/pools/{}/utilisation", p.name))
                        .and_then(|v| v.as_f64()),
                    groups: metrics
                        .pointer(&format!("/pools/{}/groups", p.name))
                        .and_then(|v| v.as_u64()),
                })
                .collect(),
            environments: spec
                .tasks
                .iter()
                .map(|t| EnvView {
                    task: t.domain.clone(),
                    kind: t.env.kind_name().into(),
                    envs: Some(t.envs.unwrap_or(knobs.max_concurrent_episodes)),
                })
                .collect(),
            functions: spec.reward.functions.keys().cloned().collect(),
        });
    }
    let devices = actors::device::DeviceProfile::BUILTIN_NAMES
        .iter()
        .filter_map(|n| actors::device::DeviceProfile::builtin(n))
        .map(|d| DeviceView {
            name: d.name,
            tflops: d.flops / 1e12,
            bandwidth_tb_s: d.bandwidth / 1e12,
            memory_gb: d.memory / 1e9,
            relative_cost: d.cost,
        })
        .collect();
    Ok(Json(Cluster {
        jobs,
        devices,
        // Deployments are shared by every owner's jobs and name them (with their instances'
        // URLs and pids): the admin's view only.
        functions: if p.role == Role::Admin {
            s.functions.view()
        } else {
            Vec::new()
        },
    }))
}

/// Liveness.
#[utoipa::path(get, path = "/healthz", responses((status = 200, body = Health)))]
async fn healthz() -> Json<Health> {
    Json(Health { status: "ok" })
}

/// Readiness: 503 once shutdown began.
#[utoipa::path(get, path = "/readyz", responses((status = 200, body = Health), (status = 503, body = Health)))]
async fn readyz(State(s): State<Arc<Service>>) -> (StatusCode, Json<Health>) {
    if s.intake.is_cancelled() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(Health {
                status: "shutting_down",
            }),
        )
    } else {
        (StatusCode::OK, Json(Health { status: "ready" }))
    }
}

/// Prometheus text exposition, fed from the OpenTelemetry metrics pipeline.
#[utoipa::path(get, path = "/metrics", responses((status = 200, description = "Prometheus text format")))]
async fn metrics() -> Result<Response, ApiError> {
    let text = infra::telemetry::Metrics::global()
        .render()
        .map_err(|e| ApiError::internal(&e))?;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

async fn no_route(uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no route for {}", uri.path()),
    )
}

async fn no_method(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{method} is not allowed on {}", uri.path()),
    )
}

async fn openapi() -> Json<serde_json::Value> {
    Json(openapi_document())
}

/// The OpenAPI document `/openapi.json` serves.
pub fn openapi_document() -> serde_json::Value {
    let mut doc = serde_json::to_value(ApiDoc::openapi()).unwrap_or_default();
    // The id a submit returns feeds the operations on one job (clients and API fuzzers follow
    // these links; the event stream is left out: it lasts as long as the job). Written as JSON:
    // utoipa 5.5 serialises a link's `operationId` as `operation_id`, which is not OpenAPI.
    if let Some(created) = doc.pointer_mut("/paths/~1v1~1jobs/post/responses/201") {
        let link = |op: &str| serde_json::json!({"operationId": op, "parameters": {"id": "$response.body#/id"}});
        created["links"] = serde_json::json!({
            "job": link("get_job"),
            "trajectories": link("trajectories"),
            "cancel": link("cancel_job"),
        });
    }
    // A small valid spec: a simulated cluster, two steps in virtual time.
    if let Some(spec) = doc.pointer_mut("/components/schemas/JobSpec") {
        spec["examples"] = serde_json::json!([{
            "tasks": [{"domain": "math", "env": {"kind": "arithmetic"}}],
            "pools": [{"name": "h800", "device": "H800", "count": 1,
                       "backend": {"kind": "sim", "model": "qwen3-8b"}}],
            "rollout": {"batch_size": 2, "steps": 2},
        }]);
    }
    doc
}
