//! The trainer API (v1): an external trainer leases each step's batch, acknowledges it once
//! trained (or gives it back), and paces itself by the job's staleness counters. Batches are
//! durable in the store from assembly to acknowledgement.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::{Extension, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::{ApiError, require, visible_job};
use crate::access::{Principal, Role};
use crate::service::Service;
use job::spec::{FieldError, TrainerSpec};
use job::store::AckOutcome;

/// The binary encoding of a batch (`Accept: application/msgpack`).
pub const MSGPACK: &str = "application/msgpack";

/// The longest a `batches/next` call waits for a batch.
pub(super) const MAX_WAIT_S: f64 = 60.0;

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct NextQuery {
    /// Seconds to wait for a batch when none is ready (0..=60, default 0).
    pub wait_s: Option<f64>,
}

/// A leased batch: the step's [`job::trainer_api::TrainingBatch`] plus its lease.
#[derive(Debug, Serialize, ToSchema)]
pub(super) struct LeasedBatchBody {
    /// `{job}:{step}:{offer}`: acknowledge or give back exactly this lease.
    pub batch_id: String,
    /// When the lease ends (ms since the Unix epoch); then the batch is offered again.
    pub lease_until_ms: i64,
    #[serde(flatten)]
    pub batch: job::trainer_api::TrainingBatch,
}

/// The outcome of an acknowledgement or a give-back.
#[derive(Debug, Serialize, ToSchema)]
pub(super) struct BatchAck {
    pub batch_id: String,
    /// `acked` or `offered_again`.
    pub state: &'static str,
}

/// Where an external trainer stands against the job.
#[derive(Debug, Serialize, ToSchema)]
pub(super) struct Staleness {
    /// The job's staleness bound α (steps a trajectory's start version may lag).
    pub alpha: u64,
    /// Steps completed (batches acknowledged and recorded).
    pub step: u64,
    pub steps: u64,
    /// Batches assembled and not yet acknowledged (0 or 1 ready or leased).
    pub batches_pending: u64,
    pub batches_acked: u64,
    /// Trajectories stored so far.
    pub trajectories: u64,
    /// As of the last completed step: the policy version generating, groups admitted and
    /// batches consumed (the scheduler's counters; 0 before the first step).
    pub version: u64,
    pub admitted_groups: u64,
    pub consumed: u64,
}

/// The lease of the job's external trainer (404 for a job without one).
fn lease_of(s: &Service, id: &str) -> Result<Duration, ApiError> {
    match s.store.spec(id)?.map(|spec| spec.trainer) {
        Some(TrainerSpec::External(t)) => Ok(Duration::from_secs_f64(t.lease_s)),
        _ => Err(ApiError::new(
            StatusCode::CONFLICT,
            "not_an_external_trainer_job",
            format!(
                "job {id} trains in process; batches are offered only with trainer.kind = \"external\""
            ),
        )),
    }
}

/// Leases the job's next batch, waiting up to `wait_s` for one: 200 with the batch, 204 when
/// none is ready in time.
#[utoipa::path(get, path = "/v1/jobs/{id}/batches/next", params(("id" = String, Path, description = "job id"), NextQuery), responses((status = 200, body = LeasedBatchBody, description = "the leased batch as JSON, or with `Accept: application/msgpack` the same document as MessagePack"), (status = 204, description = "no batch within wait_s"), (status = 400, body = super::ErrorBody), (status = 403, description = "a read token", body = super::ErrorBody), (status = 404, body = super::ErrorBody), (status = 409, description = "the job has no external trainer", body = super::ErrorBody)))]
pub(super) async fn next_batch(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    headers: axum::http::HeaderMap,
    Path(id): Path<String>,
    q: Result<Query<NextQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = q.map_err(super::query_error)?;
    let wait = q.wait_s.unwrap_or(0.0);
    if !(wait.is_finite() && (0.0..=MAX_WAIT_S).contains(&wait)) {
        return Err(ApiError {
            fields: vec![FieldError {
                field: "wait_s".into(),
                message: format!("must be in 0..={MAX_WAIT_S} seconds"),
            }],
            ..ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("wait_s {wait} out of range"),
            )
        });
    }
    visible_job(&s, &p, &id)?;
    require(&p, Role::Submit)?;
    let lease = lease_of(&s, &id)?;
    let Some(b) = s
        .batches
        .next(&id, Duration::from_secs_f64(wait), lease)
        .await?
    else {
        return Ok(StatusCode::NO_CONTENT.into_response());
    };
    let batch = serde_json::from_str(&b.body).map_err(|e| ApiError::internal(&e))?;
    let body = LeasedBatchBody {
        batch_id: format!("{id}:{}:{}", b.step, b.offer),
        lease_until_ms: b.lease_until_ms,
        batch,
    };
    let wants_msgpack = headers
        .get(axum::http::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains(MSGPACK));
    if !wants_msgpack {
        return Ok(Json(body).into_response());
    }
    // The same document as MessagePack (maps with field names): no number printing or
    // parsing on either side.
    let bytes = rmp_serde::to_vec_named(&body).map_err(|e| ApiError::internal(&e))?;
    Ok(([(axum::http::header::CONTENT_TYPE, MSGPACK)], bytes).into_response())
}

/// `{job}:{step}:{offer}` → its parts (400 naming the id otherwise).
fn parse_batch_id(batch_id: &str) -> Result<(String, u64, u64), ApiError> {
    let mut parts = batch_id.rsplitn(3, ':');
    let (offer, step, job) = (parts.next(), parts.next(), parts.next());
    match (
        job,
        step.and_then(|x| x.parse().ok()),
        offer.and_then(|x| x.parse().ok()),
    ) {
        (Some(job), Some(step), Some(offer)) if !job.is_empty() => {
            Ok((job.to_string(), step, offer))
        }
        _ => Err(ApiError {
            fields: vec![FieldError {
                field: "batch_id".into(),
                message: "must be {job}:{step}:{offer}, as batches/next returned it".into(),
            }],
            ..ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("malformed batch id {batch_id:?}"),
            )
        }),
    }
}

fn answer(
    batch_id: String,
    out: AckOutcome,
    state: &'static str,
) -> Result<Json<BatchAck>, ApiError> {
    match out {
        AckOutcome::Done | AckOutcome::AlreadyAcked => Ok(Json(BatchAck { batch_id, state })),
        AckOutcome::LeaseLost => Err(ApiError::new(
            StatusCode::CONFLICT,
            "lease_lost",
            format!("the lease {batch_id} ended or was given back; the batch was offered again"),
        )),
        AckOutcome::Unknown => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no batch {batch_id}"),
        )),
    }
}

/// Acknowledges a leased batch as trained; the body (optional) is the trainer's stats
/// (`loss` is recorded in the step's metrics). Retrying an acknowledgement is harmless.
#[utoipa::path(post, path = "/v1/batches/{batch_id}/ack", params(("batch_id" = String, Path, description = "the lease, as batches/next returned it")), request_body(content = Object, description = "the trainer's stats, e.g. {\"loss\": 0.12}"), responses((status = 200, body = BatchAck), (status = 400, body = super::ErrorBody), (status = 403, description = "a read token", body = super::ErrorBody), (status = 404, body = super::ErrorBody), (status = 409, description = "the lease ended", body = super::ErrorBody)))]
pub(super) async fn ack_batch(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    Path(batch_id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Json<BatchAck>, ApiError> {
    let (job, step, offer) = parse_batch_id(&batch_id)?;
    visible_job(&s, &p, &job)?;
    require(&p, Role::Submit)?;
    let stats: serde_json::Value = if body.iter().all(u8::is_ascii_whitespace) {
        serde_json::json!({})
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("the stats are not JSON: {e}"),
            )
        })?
    };
    if !stats.is_object() {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "the stats must be a JSON object",
        ));
    }
    let out = s.batches.ack(&job, step, offer, &stats)?;
    answer(batch_id, out, "acked")
}

/// Gives a leased batch back untrained: it is offered again at once.
#[utoipa::path(post, path = "/v1/batches/{batch_id}/nack", params(("batch_id" = String, Path, description = "the lease, as batches/next returned it")), responses((status = 200, body = BatchAck), (status = 400, body = super::ErrorBody), (status = 403, description = "a read token", body = super::ErrorBody), (status = 404, body = super::ErrorBody), (status = 409, description = "the lease ended, or the batch was acknowledged", body = super::ErrorBody)))]
pub(super) async fn nack_batch(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    Path(batch_id): Path<String>,
) -> Result<Json<BatchAck>, ApiError> {
    let (job, step, offer) = parse_batch_id(&batch_id)?;
    visible_job(&s, &p, &job)?;
    require(&p, Role::Submit)?;
    match s.batches.nack(&job, step, offer)? {
        // Trained and recorded: nothing is offered again, and saying so would be a lie.
        AckOutcome::AlreadyAcked => Err(ApiError::new(
            StatusCode::CONFLICT,
            "already_acked",
            format!("the batch {batch_id} was acknowledged as trained; it is not offered again"),
        )),
        out => answer(batch_id, out, "offered_again"),
    }
}

/// The job's staleness bound and counters, for a trainer to pace itself.
#[utoipa::path(get, path = "/v1/jobs/{id}/staleness", params(("id" = String, Path, description = "job id")), responses((status = 200, body = Staleness), (status = 404, body = super::ErrorBody)))]
pub(super) async fn staleness(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<Staleness>, ApiError> {
    let j = visible_job(&s, &p, &id)?;
    let spec = s.store.spec(&id)?;
    let (pending, acked) = s.batches.counts(&id)?;
    let counter = |k: &str| j.metrics["scheduler"][k].as_u64().unwrap_or(0);
    Ok(Json(Staleness {
        alpha: spec.map_or(0, |sp| sp.knobs().alpha),
        step: j.step,
        steps: j.steps,
        batches_pending: pending,
        batches_acked: acked,
        trajectories: s.store.trajectory_count(&id)?,
        version: counter("version"),
        admitted_groups: counter("admitted_groups"),
        consumed: counter("consumed"),
    }))
}

/// Where an announced policy is.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub(super) enum WeightSource {
    /// A file the service can read: `uri` is a path (or `file://` URL); `format` is
    /// `safetensors` (every tensor of the served model, by its name or, for a checkpoint, by
    /// Hugging Face's) or `gguf` (a checkpoint of the served model's architecture, any
    /// quantisation); `sha256` is checked when given.
    Path {
        uri: String,
        format: String,
        #[serde(default)]
        sha256: Option<String>,
    },
    /// An NCCL group the trainer broadcasts into, for engines that join one; the shape is
    /// accepted so the refusal can say why (this version's engines load files).
    #[expect(dead_code, reason = "parsed for its shape; refused with a reason")]
    Nccl {
        master_addr: String,
        master_port: u16,
        group_name: String,
        world_size: u32,
        #[serde(default)]
        #[schema(value_type = Object)]
        buckets: serde_json::Value,
    },
}

/// `POST /v1/jobs/{id}/weights`: a new policy version from the external trainer.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct Announcement {
    /// Above every version announced before.
    pub version: u64,
    pub source: WeightSource,
}

#[derive(Debug, Serialize, ToSchema)]
pub(super) struct Announced {
    pub version: u64,
    /// `announced`: the job installs it at its next step boundary (after the trainer
    /// acknowledges its current batch) and then sends `weights_installed`.
    pub state: &'static str,
}

fn field_error(field: &str, message: String) -> ApiError {
    ApiError {
        fields: vec![FieldError {
            field: field.into(),
            message: message.clone(),
        }],
        ..ApiError::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }
}

/// Weight checks hashing at once, service-wide: a checksum of a large file is seconds of
/// CPU, and one client must not keep every core busy with them.
static HASHING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

/// A weights file the service may read, under the one path policy ([`infra::files`]): the
/// resolved file within `readable` (the config's `readable_paths`), outside the service's
/// data directory (whose files hold every job and the tokens' hashes), a regular file
/// within the weight cap, with the given SHA-256 when one is given (hashed through the
/// opened descriptor; the file's own hash is never echoed). Its resolved path and identity,
/// which the install re-checks.
fn check_file(
    path: &str,
    data_dir: &std::path::Path,
    readable: &dyn Fn(&std::path::Path) -> Option<String>,
    sha256: Option<&str>,
) -> Result<infra::files::Opened, ApiError> {
    use infra::files::{FileKind, OpenRefused};
    let protected = std::fs::canonicalize(data_dir).unwrap_or_else(|_| data_dir.to_path_buf());
    let allowed = |p: &std::path::Path| {
        if p.starts_with(&protected) {
            Some(format!("{path} is inside the service's data directory"))
        } else {
            readable(p)
        }
    };
    let opened =
        match infra::files::open_checked(std::path::Path::new(path), FileKind::Weights, allowed) {
            Ok(o) => o,
            Err(OpenRefused::Policy(why)) => {
                return Err(ApiError {
                    fields: vec![FieldError {
                        field: "source.uri".into(),
                        message: why.clone(),
                    }],
                    ..ApiError::new(StatusCode::FORBIDDEN, "forbidden", why)
                });
            }
            Err(OpenRefused::File(e)) => {
                return Err(field_error("source.uri", infra::error_chain(&e)));
            }
        };
    let Some(want) = sha256 else {
        return Ok(opened);
    };
    let got =
        job::trainer_api::reader_sha256(std::io::Read::take(&opened.file, FileKind::Weights.cap()))
            .map_err(|e| field_error("source.uri", format!("{path}: {e}")))?;
    if got.eq_ignore_ascii_case(want.trim()) {
        Ok(opened)
    } else {
        Err(field_error(
            "source.sha256",
            "the file's SHA-256 differs from the one announced".into(),
        ))
    }
}

/// Training the batch of step k produces version k: no trainer can be further ahead than
/// the newest batch offered (a trainer written for steps from 0 announces `batch.step + 1`).
fn not_ahead_of_steps(s: &Service, id: &str, version: u64) -> Result<(), ApiError> {
    let newest_step = s.store.newest_batch_step(id)?;
    if version <= newest_step {
        return Ok(());
    }
    Err(ApiError {
        fields: vec![FieldError {
            field: "version".into(),
            message: format!(
                "version {version} is ahead of the newest batch (step {newest_step}): the batch \
                 of step k produces version k (steps count from 1; announce batch.step, not \
                 batch.step + 1)"
            ),
        }],
        ..ApiError::new(
            StatusCode::CONFLICT,
            "version_ahead_of_steps",
            format!("version {version} is ahead of step {newest_step}"),
        )
    })
}

/// Announces a new policy version: checked (readable file, format, checksum), recorded
/// durably, and installed on every shard at the job's next step boundary (announce before
/// acknowledging a batch to have the next one generated by it).
#[utoipa::path(post, path = "/v1/jobs/{id}/weights", params(("id" = String, Path, description = "job id")), request_body = Announcement, responses((status = 202, body = Announced), (status = 400, body = super::ErrorBody), (status = 403, description = "a read token, or a file the path policy refuses (outside readable_paths, inside the data directory)", body = super::ErrorBody), (status = 404, body = super::ErrorBody), (status = 409, description = "not above the newest announced version, ahead of the newest batch's step, or not an external trainer's job", body = super::ErrorBody)))]
pub(super) async fn announce_weights(
    State(s): State<Arc<Service>>,
    Extension(p): Extension<Principal>,
    Extension(access): Extension<Arc<crate::access::Access>>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<(StatusCode, Json<Announced>), ApiError> {
    visible_job(&s, &p, &id)?;
    require(&p, Role::Submit)?;
    lease_of(&s, &id)?;
    let a: Announcement = serde_json::from_slice(&body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            format!("not an announcement: {e}"),
        )
    })?;
    if a.version == 0 {
        return Err(field_error(
            "version",
            "must be at least 1 (0 is the base model)".into(),
        ));
    }
    let (uri, format, sha256) = match a.source {
        WeightSource::Path {
            uri,
            format,
            sha256,
        } => (uri, format, sha256),
        WeightSource::Nccl { .. } => {
            return Err(field_error(
                "source.kind",
                "this job's engines load weights from files; announce kind = \"path\"".into(),
            ));
        }
    };
    let tiny = s.store.spec(&id)?.is_some_and(|spec| {
        spec.pools.iter().any(|p| {
            p.backend
                .real_model()
                .is_some_and(|m| matches!(m.choice(), job::spec::ModelChoice::Tiny(_)))
        })
    });
    match format.as_str() {
        "safetensors" => {}
        "gguf" if !tiny => {}
        "gguf" => {
            return Err(field_error(
                "source.format",
                "\"gguf\" is for checkpoint models; the tiny built-in model takes \"safetensors\""
                    .into(),
            ));
        }
        _ => {
            return Err(field_error(
                "source.format",
                format!("{format:?}: expected \"safetensors\" or \"gguf\""),
            ));
        }
    }
    let path = uri.strip_prefix("file://").unwrap_or(&uri).to_string();
    let data_dir = s.data_dir().to_path_buf();
    let readable = access.readable_check();
    let _hashing = HASHING
        .acquire()
        .await
        .map_err(|e| ApiError::internal(&e))?;
    let opened = tokio::task::spawn_blocking(move || {
        check_file(&path, &data_dir, &readable, sha256.as_deref())
    })
    .await
    .map_err(|e| ApiError::internal(&e))??;
    // The resolved file is what the job installs, not the path as announced.
    let resolved = opened.resolved.display().to_string();
    not_ahead_of_steps(&s, &id, a.version)?;
    if !s
        .batches
        .announce(&id, a.version, &resolved, &format, Some(&opened.identity))?
    {
        let newest = s.batches.newest_weights(&id)?.map_or(0, |a| a.version);
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "version_not_newer",
            format!(
                "version {} is not above the newest announced one ({newest})",
                a.version
            ),
        ));
    }
    Ok((
        StatusCode::ACCEPTED,
        Json(Announced {
            version: a.version,
            state: "announced",
        }),
    ))
}
