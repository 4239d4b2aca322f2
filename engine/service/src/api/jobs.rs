//! The job routes: submit, list, one job, its spec, its random-policy baselines, its step
//! history, and cancel.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::{ApiError, ErrorBody, MAX_BODY_BYTES, page_limit, require, visible_job};
use crate::access::{Access, Principal, Role};
use crate::service::{Service, ServiceError};
use job::spec::{self, FieldError, Format};
use job::store::{JobRecord, JobState};

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Created {
    pub id: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct JobList {
    pub jobs: Vec<JobRecord>,
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
    responses((status = 201, body = Created), (status = 400, description = "invalid spec, or over the memory budget", body = ErrorBody), (status = 403, description = "the token may not submit, or the service policy forbids a program or a file of the spec", body = ErrorBody), (status = 413, body = ErrorBody), (status = 415, description = "a body that is neither JSON nor TOML (e.g. YAML)", body = ErrorBody), (status = 503, body = ErrorBody)))]
pub(super) async fn submit(
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
    let invalid = |fields: Vec<FieldError>| ApiError {
        status: StatusCode::BAD_REQUEST,
        code: "invalid_spec",
        message: format!("the job spec has {} problem(s)", fields.len()),
        fields,
        cause: None,
    };
    let forbidden = |fields: Vec<FieldError>| ApiError {
        status: StatusCode::FORBIDDEN,
        code: "forbidden",
        message: format!(
            "the service policy does not allow {} program(s) or file(s) of this spec",
            fields.len()
        ),
        fields,
        cause: None,
    };
    // The spec alone first, then the policy, and only then the host: no file is opened for
    // a spec the policy refuses.
    let format = body_format(&headers, text)?;
    let mut spec = job::spec::parse(text, format).map_err(|e| invalid(e.0))?;
    // A model named without a path (`SmolLM2-135M-Instruct.Q4_1.gguf`) is found in the
    // model cache that `make setup` fills.
    job::inputs::find_models(&mut spec, &job::inputs::model_dirs());
    let denied = access.check_programs(&spec);
    if !denied.is_empty() {
        return Err(forbidden(denied));
    }
    // Input files are opened once, under the policy, and copied for the job; the host
    // checks (a dataset's first row, a checkpoint's header) read the copies.
    let readable = access.readable_check();
    let service = s.clone();
    let (spec, staged, host) = tokio::task::spawn_blocking(move || {
        let original = spec.clone();
        let mut spec = spec;
        let staged = service.stage_inputs(&mut spec, &readable);
        let host = if staged.is_empty() {
            let paths = spec_paths(&original, &spec);
            job::resolve::check(&spec)
                .into_iter()
                .map(|e| job::inputs::in_terms_of(e, &paths))
                .collect()
        } else {
            Vec::new()
        };
        (spec, staged, host)
    })
    .await
    .map_err(|e| ApiError::internal(&e))?;
    let (policy, files): (Vec<_>, Vec<_>) = staged.into_iter().partition(|p| p.policy);
    if !policy.is_empty() {
        return Err(forbidden(policy.into_iter().map(|p| p.error).collect()));
    }
    if !files.is_empty() {
        return Err(invalid(files.into_iter().map(|p| p.error).collect()));
    }
    if !host.is_empty() {
        return Err(invalid(host));
    }
    let id = s.submit_as(spec, p.owner())?;
    let fmt = match format {
        job::spec::Format::Json => "json",
        job::spec::Format::Toml => "toml",
    };
    // The job is accepted by now: a spec text that cannot be kept costs only its display.
    if let Err(e) = s.store.set_submitted(&id, fmt, text) {
        tracing::warn!(job = %id, error = %e, "the spec as sent was not kept");
    }
    Ok((StatusCode::CREATED, Json(Created { id })))
}

/// (staged copy, original) of every dataset path the staging rewrote.
fn spec_paths(original: &job::spec::JobSpec, staged: &job::spec::JobSpec) -> Vec<(String, String)> {
    let paths = |s: &job::spec::JobSpec| -> Vec<Option<String>> {
        s.tasks
            .iter()
            .chain(s.eval.iter().flat_map(|e| e.tasks.iter()))
            .map(|t| t.dataset.as_ref().map(|d| d.path.clone()))
            .collect()
    };
    paths(staged)
        .into_iter()
        .zip(paths(original))
        .filter_map(|(s, o)| Some((s?, o?)))
        .filter(|(s, o)| s != o)
        .collect()
}

/// What a job list carries.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct ListQuery {
    /// Each job's full latest record: with its per-resource timeline (`metrics.timeline`,
    /// most of a record's size), the scheduler's bookkeeping (`metrics.scheduler`, its
    /// resume cursor), the buffer's counters, the critical path and each task's seeds. Off
    /// by default (under 2 KB a job).
    #[serde(default)]
    timeline: bool,
    /// Only the jobs whose spec carries this tag (`tags`).
    tag: Option<String>,
}

/// List jobs, oldest first; each with its latest metrics, without the per-resource timeline
/// and the scheduler's bookkeeping unless `timeline=true` (under 2 KB a job).
#[utoipa::path(get, path = "/v1/jobs", params(ListQuery), responses((status = 200, body = JobList), (status = 400, body = ErrorBody)))]
pub(super) async fn list_jobs(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    q: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<JobList>, ApiError> {
    let Query(q) = q.map_err(super::query_error)?;
    let mut jobs = s.store.list()?;
    jobs.retain(|j| p.owns(j.owner.as_deref()));
    if let Some(t) = &q.tag {
        jobs.retain(|j| j.tags.iter().any(|x| x == t));
    }
    if !q.timeline {
        for j in &mut jobs {
            compact(&mut j.metrics);
        }
    }
    Ok(Json(JobList { jobs }))
}

/// A list entry's metrics: without the per-resource timeline, the scheduler's bookkeeping,
/// the buffer's counters, the step's critical path and the seeds each task trained (the
/// job's own record and its step history keep them).
fn compact(metrics: &mut serde_json::Value) {
    let Some(m) = metrics.as_object_mut() else {
        return;
    };
    for k in ["timeline", "scheduler", "buffer"] {
        m.remove(k);
    }
    if let Some(r) = m.get_mut("rollout").and_then(|r| r.as_object_mut()) {
        r.remove("critical");
    }
    if let Some(tasks) = m.get_mut("tasks").and_then(|t| t.as_object_mut()) {
        for t in tasks.values_mut() {
            if let Some(t) = t.as_object_mut() {
                t.remove("seeds");
            }
        }
    }
}

/// One job: state, step, steps, latest metrics.
#[utoipa::path(get, path = "/v1/jobs/{id}", params(("id" = String, Path, description = "job id")), responses((status = 200, body = JobRecord), (status = 404, body = ErrorBody)))]
pub(super) async fn get_job(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<JobRecord>, ApiError> {
    visible_job(&s, &p, &id).map(Json)
}

/// Which form of a job's spec to return.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct SpecQuery {
    /// `resolved` (default): normalised JSON, every default filled in. `submitted`: the text
    /// the client sent, as TOML or JSON (`content-type` says which); 404 `not_recorded` for
    /// a job submitted before the service kept it, or run in process.
    form: Option<String>,
}

/// The job's spec: by default as the service stored it (normalised JSON: every default
/// filled in), e.g. for an external trainer to build the job's model; `form=submitted`, as
/// the client sent it.
#[utoipa::path(get, path = "/v1/jobs/{id}/spec", params(("id" = String, Path, description = "job id"), SpecQuery), responses((status = 200, body = spec::JobSpec, description = "the resolved spec; with form=submitted the text as sent (application/toml or application/json)"), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn get_job_spec(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
    q: Result<Query<SpecQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<axum::response::Response, ApiError> {
    use axum::response::IntoResponse;
    let Query(q) = q.map_err(super::query_error)?;
    visible_job(&s, &p, &id)?;
    match q.form.as_deref() {
        None | Some("resolved") => {
            let spec = s
                .store
                .spec(&id)?
                .ok_or_else(|| ServiceError::NotFound(id.clone()))?;
            Ok(Json(spec).into_response())
        }
        Some("submitted") => {
            let (format, text) = s.store.submitted(&id)?.ok_or_else(|| {
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    "not_recorded",
                    format!("{id} was submitted before the service kept specs as sent"),
                )
            })?;
            let ct = if format == "toml" {
                "application/toml"
            } else {
                "application/json"
            };
            Ok(([(axum::http::header::CONTENT_TYPE, ct)], text).into_response())
        }
        Some(other) => Err(ApiError {
            fields: vec![FieldError {
                field: "form".into(),
                message: format!("{other:?}: expected resolved or submitted"),
            }],
            ..ApiError::new(StatusCode::BAD_REQUEST, "bad_request", "unknown spec form")
        }),
    }
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
pub(super) async fn job_baselines(
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

/// A page of a job's step history.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct StepsQuery {
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
pub(super) async fn job_steps(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
    q: Result<Query<StepsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<StepPage>, ApiError> {
    let Query(q) = q.map_err(super::query_error)?;
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
pub(super) async fn cancel_job(
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
