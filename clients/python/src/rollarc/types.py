"""The documents the service sends, as typed dictionaries (what `GET /openapi.json` describes)."""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Tuple

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
    # The precision of the weights that sampled these tokens ("f32", "q8_0", "q4_1",
    # "q4_0"): set by the built-in engine, absent for inference servers.
    precision: NotRequired[str]


class ToolCall(TypedDict):
    id: str
    name: str
    arguments: Any


class AgentCall(TypedDict):
    """One model call of an agent episode, as the gateway served it (a turn's ``call``)."""

    #: ``chat.completions``, ``responses`` or ``messages``
    api: str
    stream: bool
    #: the tool calls the answer made
    tool_calls: NotRequired[List[ToolCall]]
    #: the tool results this request brought (messages with ``tool_call_id`` and ``content``)
    tool_results: NotRequired[List[Dict[str, Any]]]
    #: why the answer's tool calls were refused (it went back as plain text)
    invalid_tool_call: NotRequired[str]
    #: ``stop``, ``length`` or ``tool_calls``
    finish_reason: str
    latency_s: float


class Turn(TypedDict):
    """One turn of a stored trajectory (``TrajectoryRow["trajectory"]["turns"]``)."""

    observation_tokens: List[int]
    response_tokens: List[int]
    logprobs: List[float]
    versions: List[VersionSpan]
    env_reward: float
    prefill_tokens: int
    started_at_s: float
    #: turns left out of this turn's context (``drop_oldest_turns``)
    dropped: NotRequired[int]
    #: an agent's history diverged here: a new segment, whose context is this observation
    restart: NotRequired[bool]
    #: agent episodes: the model call this turn answered
    call: NotRequired[AgentCall]


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
    #: the episode ended at its context budget
    truncated: NotRequired[bool]
    #: per turn, turns after the first left out of its context (truncation =
    #: "drop_oldest_turns"); absent when none was. Train with `rollarc.sequences(sample)`.
    dropped_turns: NotRequired[List[int]]
    restarted_turns: NotRequired[List[int]]


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


def sequences(sample: Sample) -> List[Tuple[List[int], List[int], List[float]]]:
    """The sequences the policy saw, as (tokens, loss_mask, behaviour_logprobs).

    One — the sample's own columns — unless turns were dropped from the context
    (`dropped_turns`). Then one per run of turns that share a context: turn 0, the history
    kept before the run, then the run's turns; only the run's responses have loss_mask 1, so
    every response trains once, under the context it was sampled in. An agent turn listed in
    `restarted_turns` (its history diverged) starts a sequence of its own: its observation is
    the whole context.
    """
    drops = sample.get("dropped_turns") or []
    restarts = set(sample.get("restarted_turns") or [])
    if not any(drops) and not restarts:
        return [(sample["tokens"], sample["loss_mask"], sample["behaviour_logprobs"])]
    bounds = sample["turn_bounds"]
    # Turn i spans [previous response end, its response end): observation then response.
    spans, prev = [], 0
    for start, end in bounds:
        spans.append((prev, start, end))
        prev = end
    toks, lps = sample["tokens"], sample["behaviour_logprobs"]

    def part(i: int, train: bool, out: Tuple[List[int], List[int], List[float]]) -> None:
        a, s, e = spans[i]
        out[0].extend(toks[a:e])
        out[1].extend([0] * (s - a) + [1 if train else 0] * (e - s))
        out[2].extend([0.0] * (s - a) + (list(lps[s:e]) if train else [0.0] * (e - s)))

    result = []
    i = 0
    while i < len(spans):
        d = drops[i] if i < len(drops) else 0
        end = i + 1
        while (end < len(spans) and (drops[end] if end < len(drops) else 0) == d
               and end not in restarts):
            end += 1
        seq: Tuple[List[int], List[int], List[float]] = ([], [], [])
        if d > 0 and i > 0 and i not in restarts:
            part(0, False, seq)
            for k in range(min(1 + d, i), i):
                part(k, False, seq)
        for k in range(i, end):
            part(k, True, seq)
        result.append(seq)
        i = end
    return result
