"""The documents the service sends, as typed dictionaries (what `GET /openapi.json` describes)."""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # pragma: no cover - older interpreters
    from typing_extensions import NotRequired, TypedDict


class JobRecord(TypedDict):
    id: str
    name: Optional[str]
    #: queued, running, succeeded, failed or cancelled
    state: str
    #: training steps completed
    step: int
    #: training steps asked for
    steps: int
    #: the latest step's metrics
    metrics: Dict[str, Any]
    error: Optional[str]
    created_at_ms: int
    updated_at_ms: int
    owner: Optional[str]


class TrajectoryRow(TypedDict):
    #: durable cursor: pass it back as `after` to continue
    cursor: int
    job_id: str
    #: the training step whose batch consumed this row (None: never trained on)
    trained_step: Optional[int]
    trajectory: Dict[str, Any]
    #: each turn's observation and response as text (``text=True``)
    text: NotRequired[List[Dict[str, str]]]


class StepRecord(TypedDict):
    #: steps completed by then (1 = the first step)
    step: int
    #: the step's record: success and reward per task, throughput, staleness, trainer numbers
    metrics: Dict[str, Any]


class VersionSpan(TypedDict):
    version: int
    tokens: int


class Sample(TypedDict):
    trajectory_id: str
    #: every turn's observation then response tokens, exactly as generated
    tokens: List[int]
    #: 1 where the policy generated the token (train on it), 0 for observations
    loss_mask: List[int]
    #: the behaviour policy's log-probability of each token (0 where loss_mask is 0)
    behaviour_logprobs: List[float]
    version_spans: List[VersionSpan]
    #: each turn's response as [start, end) offsets into tokens
    turn_bounds: List[List[int]]
    #: None when the reward function failed
    reward: Optional[float]
    per_turn_rewards: List[float]
    #: the job's advantage estimate over the group (0 with advantage = "none")
    advantage: float
    #: completed or failed (mask failed samples out)
    status: str
    #: the tokens generation was constrained to, if it was
    allowed_tokens: NotRequired[List[int]]


class BatchGroup(TypedDict):
    group_id: int
    task: str
    prompt_id: int
    samples: List[Sample]


class Staleness(TypedDict):
    alpha: int
    step: int
    steps: int
    batches_pending: int
    batches_acked: int
    trajectories: int
    version: int
    admitted_groups: int
    consumed: int
