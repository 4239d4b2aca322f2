//! External agent episodes: an admitted episode opens on the gateway and is offered on the
//! [`ClaimBoard`]; a harness claims it (`POST /v1/jobs/{id}/episodes:claim`: the row, the
//! base URL and the episode's key, a deadline), points its agent at the gateway and finishes
//! it (`POST /v1/episodes/{id}/finish`). A claim not finished by its deadline fails the
//! episode (masked; its group is handled as for any failed episode). Offers exist only for
//! admitted episodes, so claims obey admission under α like every episode.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actors::agent::{AgentEpisode, AgentOutcome, AgentReport, AgentRunner, AgentSummary, Renderer};
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, oneshot};
use utoipa::ToSchema;

use super::{AgentAccess, episode_options, managed::last_answer, secs};
use crate::spec::AgentEnv;

/// One claimed episode as the harness gets it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Claim {
    /// The episode's id: finish it with `POST /v1/episodes/{episode_id}/finish`.
    pub episode_id: u64,
    /// The dataset row (or `{"seed": …}` for tasks without a dataset).
    #[schema(value_type = Object)]
    pub row: serde_json::Value,
    /// The OpenAI base URL (`…/gateway/v1`); Anthropic clients take it without `/v1`.
    pub base_url: String,
    /// The episode's API key (valid for this episode only).
    pub api_key: String,
    /// When the claim expires, in Unix milliseconds; unfinished by then, the episode fails.
    pub deadline_unix_ms: u64,
    /// The task's domain.
    pub task: String,
}

/// How a harness ends an episode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinishStatus {
    /// The agent ran to its end: score its answer.
    #[default]
    Completed,
    /// The harness failed (its container did not start, it lost the agent): masked.
    Failed,
}

/// `POST /v1/episodes/{id}/finish`'s body.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FinishReport {
    pub status: FinishStatus,
    /// The agent's answer (default: its last model answer).
    #[serde(default)]
    pub answer: Option<String>,
    /// The agent's own reward (used where the task sets `trust_agent_reward`).
    #[serde(default)]
    pub reward: Option<f64>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub info: Option<serde_json::Value>,
    /// Why it failed (`status = "failed"`).
    #[serde(default)]
    pub reason: Option<String>,
}

/// Why a finish was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FinishError {
    #[error("no claimed episode {0} is open (never claimed, already finished, or expired)")]
    Unknown(u64),
}

struct Offer {
    episode: u64,
    task: String,
    row: serde_json::Value,
    key: String,
    timeout: Duration,
    claimed: oneshot::Sender<tokio::time::Instant>,
    finished: oneshot::Sender<FinishReport>,
}

#[derive(Default)]
struct Board {
    offered: HashMap<String, VecDeque<Offer>>,
    /// Claimed episodes: their job and where their finish goes.
    claimed: HashMap<u64, (String, oneshot::Sender<FinishReport>)>,
}

/// The episodes offered to external harnesses, by job, and those claimed.
#[derive(Default)]
pub struct ClaimBoard {
    board: Mutex<Board>,
    offered: Notify,
}

impl ClaimBoard {
    fn lock(&self) -> std::sync::MutexGuard<'_, Board> {
        self.board
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn offer(&self, job: &str, offer: Offer) {
        self.lock()
            .offered
            .entry(job.to_string())
            .or_default()
            .push_back(offer);
        self.offered.notify_waiters();
    }

    /// Removes episode `id` wherever it is (its episode ended or was cancelled).
    fn withdraw(&self, job: &str, id: u64) {
        let mut b = self.lock();
        if let Some(q) = b.offered.get_mut(job) {
            q.retain(|o| o.episode != id);
            if q.is_empty() {
                b.offered.remove(job);
            }
        }
        b.claimed.remove(&id);
    }

    /// Episodes of `job` waiting for a harness.
    pub fn waiting(&self, job: &str) -> usize {
        self.lock().offered.get(job).map_or(0, VecDeque::len)
    }

    /// The job a claimed episode belongs to.
    pub fn job_of(&self, episode: u64) -> Option<String> {
        self.lock().claimed.get(&episode).map(|(j, _)| j.clone())
    }

    /// Claims the oldest episode `job` offers, waiting up to `wait` for one. `base_url`: where
    /// the harness reaches the gateway.
    pub async fn claim(&self, job: &str, wait: Duration, base_url: &str) -> Option<Claim> {
        let until = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.offered.notified();
            if let Some(c) = self.try_claim(job, base_url) {
                return Some(c);
            }
            if tokio::time::timeout_at(until, notified).await.is_err() {
                return self.try_claim(job, base_url);
            }
        }
    }

    fn try_claim(&self, job: &str, base_url: &str) -> Option<Claim> {
        let mut b = self.lock();
        loop {
            let offer = b.offered.get_mut(job)?.pop_front()?;
            let deadline = tokio::time::Instant::now() + offer.timeout;
            // The runner went away meanwhile (cancelled): the next offer.
            if offer.claimed.send(deadline).is_err() {
                continue;
            }
            b.claimed
                .insert(offer.episode, (job.to_string(), offer.finished));
            let ms = u64::try_from(offer.timeout.as_millis()).unwrap_or(u64::MAX);
            return Some(Claim {
                episode_id: offer.episode,
                row: offer.row,
                base_url: base_url.to_string(),
                api_key: offer.key,
                deadline_unix_ms: u64::try_from(infra::clock::unix_ms())
                    .unwrap_or(0)
                    .saturating_add(ms),
                task: offer.task,
            });
        }
    }

    /// Finishes claimed episode `id`.
    pub fn finish(&self, id: u64, report: FinishReport) -> Result<(), FinishError> {
        let (_, tx) = self
            .lock()
            .claimed
            .remove(&id)
            .ok_or(FinishError::Unknown(id))?;
        tx.send(report).map_err(|_| FinishError::Unknown(id))
    }
}

/// Withdraws an episode from the board when its runner ends, however it ends.
struct Withdraw<'a>(&'a ClaimBoard, &'a str, u64);

impl Drop for Withdraw<'_> {
    fn drop(&mut self) {
        self.0.withdraw(self.1, self.2);
    }
}

/// Offers a task's episodes to external harnesses.
pub struct ExternalRunner {
    pub spec: AgentEnv,
    pub renderer: Arc<Renderer>,
    pub access: Arc<AgentAccess>,
    pub job: String,
    /// The task's domain (claims name it).
    pub task: String,
}

impl AgentRunner for ExternalRunner {
    fn run(&self, ep: AgentEpisode) -> BoxFuture<'static, AgentOutcome> {
        let spec = self.spec.clone();
        let renderer = self.renderer.clone();
        let access = self.access.clone();
        let job = self.job.clone();
        let task = self.task.clone();
        Box::pin(async move { play(&spec, &renderer, &access, (&job, task), ep).await })
    }
}

async fn play(
    spec: &AgentEnv,
    renderer: &Arc<Renderer>,
    access: &AgentAccess,
    (job, task): (&str, String),
    ep: AgentEpisode,
) -> AgentOutcome {
    let gw = &access.gateway;
    let opened = match gw.open(
        episode_options(spec, renderer, &ep),
        Arc::new(ep.shard.clone()),
    ) {
        Ok(o) => o,
        Err(e) => return AgentOutcome::Infra(format!("cannot open the episode: {e}")),
    };
    // The key stops working whatever happens next (also when this future is dropped: the
    // job ended or cancelled the episode); the harness's calls then get 410.
    let _finish = super::FinishOnDrop(gw.clone(), Some(opened.key.clone()));
    let (claimed_tx, claimed) = oneshot::channel();
    let (finished_tx, finished) = oneshot::channel();
    let row = ep
        .record
        .as_ref()
        .and_then(|r| r.get("row").cloned())
        .unwrap_or_else(|| serde_json::json!({ "seed": ep.seed }));
    access.claims.offer(
        job,
        Offer {
            episode: opened.id,
            task,
            row: row.clone(),
            key: opened.key.clone(),
            timeout: secs(spec.claim_timeout_s),
            claimed: claimed_tx,
            finished: finished_tx,
        },
    );
    let _withdraw = Withdraw(&access.claims, job, opened.id);
    let started = tokio::time::Instant::now();
    let report = match claimed.await {
        Ok(deadline) => tokio::time::timeout_at(deadline, finished)
            .await
            .map(Result::ok),
        Err(_) => Ok(None),
    };
    let report = match report {
        Err(_) => {
            return AgentOutcome::Infra(format!(
                "the claim expired: not finished within {} s",
                spec.claim_timeout_s
            ));
        }
        Ok(None) => return AgentOutcome::Infra("the claim was withdrawn".into()),
        Ok(Some(r)) => r,
    };
    let done = gw.finish(&opened.key).await.unwrap_or_default();
    if report.status == FinishStatus::Failed {
        return AgentOutcome::Infra(format!(
            "the harness failed the episode: {}",
            report.reason.as_deref().unwrap_or("no reason given")
        ));
    }
    let policy_failure = done
        .budget_spent
        .clone()
        .map(|b| format!("the episode's budget was spent: {b}"));
    let reward = if policy_failure.is_some() {
        Some(spec.failure_reward)
    } else if spec.trust_agent_reward {
        report.reward.filter(|r| r.is_finite())
    } else {
        None
    };
    AgentOutcome::Done(Box::new(AgentReport {
        reward,
        summary: AgentSummary {
            answer: report
                .answer
                .unwrap_or_else(|| last_answer(&done.transcript)),
            transcript: done.transcript,
            row: Some(row),
            info: report.info,
            policy_failure,
            ended: "finished".into(),
            refused_calls: done.refused,
            wall_s: started.elapsed().as_secs_f64(),
            success_above: spec.success_threshold,
        },
        turns: done.turns,
    }))
}
