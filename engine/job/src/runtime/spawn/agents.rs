//! The job's agent tasks: the gateway host their managed agents call and each task's runner
//! (managed or external).

use std::sync::Arc;

use actors::agent::SharedRunner;
use actors::model::llm::LlmTokenizer;

use crate::agents::{AgentAccess, AgentHost, AgentPlan, renderer, runner};
use crate::runtime::{JobError, JobRun};
use crate::wiring::TaskPlan;

/// Each task's runner (`None` for tasks that are not agent tasks), and the host serving the
/// gateway to the managed ones (kept for the job's life). `policy`: the tokenizer of the
/// job's checkpoint, if it has one.
pub(super) async fn agent_runners(
    plans: &[&TaskPlan],
    job: &JobRun,
    policy: Option<&Arc<LlmTokenizer>>,
) -> Result<(Vec<Option<SharedRunner>>, Option<AgentHost>), JobError> {
    let agents: Vec<&AgentPlan> = plans.iter().filter_map(|t| t.agent.as_ref()).collect();
    if agents.is_empty() {
        return Ok((vec![None; plans.len()], None));
    }
    let access = job
        .agents
        .clone()
        .unwrap_or_else(|| Arc::new(AgentAccess::new(Arc::new(gateway::Gateway::new()))));
    let fail = |ti: usize, message: String| JobError::Agents {
        task: ti,
        domain: plans[ti].view.domain.clone(),
        message,
    };
    let host = AgentHost::start(access, &agents)
        .await
        .map_err(|e| fail(0, format!("cannot serve the gateway to its agents: {e}")))?;
    let mut runners = Vec::with_capacity(plans.len());
    for (ti, t) in plans.iter().enumerate() {
        runners.push(match &t.agent {
            None => None,
            Some(plan) => {
                let r = renderer(&plan.spec, policy).map_err(|m| fail(ti, m))?;
                Some(
                    runner(plan, r, &host, (job.id.as_str(), t.view.domain.as_str()))
                        .map_err(|m| fail(ti, m))?,
                )
            }
        });
    }
    Ok((runners, Some(host)))
}
