"""The client: jobs, events, trajectories and the trainer API of a rollarc service."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Dict, Iterator, List, Mapping, Optional, Type, Union, cast

import httpx

from .types import BatchGroup, JobRecord, Sample, Staleness, StepRecord, TrajectoryRow

#: States after which a job never changes again.
TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})

SpecSource = Union[Mapping[str, Any], str, "os.PathLike[str]"]


class RollarcError(Exception):
    """An answer of the service other than success: the HTTP status, the service's error
    code (``invalid_spec``, ``not_found``, ``lease_lost``, ``version_not_newer``, …), its
    message and, for bad input, the fields at fault (``[{"field": ..., "message": ...}]``)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        fields: Optional[List[Dict[str, str]]] = None,
    ) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.fields = fields or []
        where = "; ".join(f"{f.get('field')}: {f.get('message')}" for f in self.fields)
        super().__init__(f"{status} {code}: {message}" + (f" ({where})" if where else ""))


class LeaseLost(RollarcError):
    """The batch's lease ended (expired, or acknowledged elsewhere) before this
    acknowledgement: the service offers the batch again, do not count it as trained."""


@dataclass
class Event:
    """One server-sent event of a job: ``state``, ``progress``, ``weights_installed`` or
    ``lagged``; ``id`` resumes the stream after it (``Client.events(after=...)``)."""

    event: str
    data: Dict[str, Any]
    id: Optional[str] = None


@dataclass
class Batch:
    """A leased training batch. Use it as a context manager: leaving the block acknowledges
    the batch with ``stats`` (fill it while training), an exception gives it back (nack) so
    the service offers it again, and a lease that ended raises :class:`LeaseLost`.

        with client.next_batch(job) as batch:
            loss = train_on(batch.samples())
            batch.stats["loss"] = loss
    """

    client: "Client"
    batch_id: str
    step: int
    lease_until_ms: int
    policy_version_min: int
    policy_version_max: int
    groups: List[BatchGroup]
    stats: Dict[str, Any] = field(default_factory=dict)
    #: ``acked``, ``offered_again`` or None while leased
    outcome: Optional[str] = None

    def samples(self) -> List[Sample]:
        """Every sample of every group, in order (a list: index it, take its len, iterate it
        twice)."""
        return [s for g in self.groups for s in g["samples"]]

    def __len__(self) -> int:
        return sum(len(g["samples"]) for g in self.groups)

    def ack(self, **stats: Any) -> None:
        """Marks the batch trained (its rows record this step); ``stats`` (e.g. ``loss``)
        go to the job's step metrics."""
        self.stats.update(stats)
        self.client.ack(self.batch_id, self.stats)
        self.outcome = "acked"

    def nack(self) -> None:
        """Gives the batch back: it is offered again at once."""
        self.client.nack(self.batch_id)
        self.outcome = "offered_again"

    def __enter__(self) -> "Batch":
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool:
        if self.outcome is not None:
            return False
        if exc_type is None:
            self.ack()
        elif not isinstance(exc, LeaseLost):
            try:
                self.nack()
            except RollarcError:
                pass  # the lease had ended: the batch is offered again anyway
        return False


@dataclass
class Episode:
    """A claimed agent episode of a job whose task runs agents elsewhere
    (``env = { kind = "agent", mode = "external" }``). Point the agent at ``base_url``
    (OpenAI; Anthropic clients take ``anthropic_base_url``) with ``api_key``, then finish it
    before ``deadline_unix_ms``. As a context manager it finishes itself: leaving the block
    completes it (with ``answer``/``reward``/``info`` if set), an exception fails it (masked,
    never rewarded) and re-raises.

        for ep in client.episodes(job):
            with ep:
                ep.answer = run_my_agent(ep.row, base_url=ep.base_url, api_key=ep.api_key)
    """

    client: "Client"
    episode_id: int
    row: Dict[str, Any]
    base_url: str
    api_key: str
    deadline_unix_ms: int
    task: str
    answer: Optional[str] = None
    reward: Optional[float] = None
    info: Optional[Dict[str, Any]] = None
    #: ``completed`` or ``failed`` once finished
    outcome: Optional[str] = None

    @property
    def anthropic_base_url(self) -> str:
        return self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url

    def finish(self, answer: Optional[str] = None, reward: Optional[float] = None,
               info: Optional[Dict[str, Any]] = None) -> None:
        """Completes the episode: its answer is scored by the task's reward functions."""
        body: Dict[str, Any] = {"status": "completed"}
        for k, v in (("answer", answer if answer is not None else self.answer),
                     ("reward", reward if reward is not None else self.reward),
                     ("info", info if info is not None else self.info)):
            if v is not None:
                body[k] = v
        self.client._request("POST", f"/v1/episodes/{self.episode_id}/finish", json=body)
        self.outcome = "completed"

    def fail(self, reason: str) -> None:
        """Fails the episode (the harness's fault, not the policy's): masked, never rewarded."""
        self.client._request("POST", f"/v1/episodes/{self.episode_id}/finish",
                             json={"status": "failed", "reason": reason})
        self.outcome = "failed"

    def __enter__(self) -> "Episode":
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool:
        if self.outcome is not None:
            return False
        if exc_type is None:
            self.finish()
        else:
            try:
                self.fail(f"{exc_type.__name__}: {exc}"[:2000])
            except RollarcError:
                pass  # the claim had expired: the episode is failed anyway
        return False


class Client:
    """A rollarc service at ``url``; ``token`` is a bearer token when the service has
    ``[access]`` tokens (default: the ``ROLLARC_TOKEN`` environment variable)."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8080",
        token: Optional[str] = None,
        timeout: float = 30.0,
        transport: Optional[httpx.BaseTransport] = None,
    ) -> None:
        token = token if token is not None else os.environ.get("ROLLARC_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self._timeout = timeout
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- plumbing ---------------------------------------------------------------------

    @staticmethod
    def _error(r: httpx.Response) -> RollarcError:
        try:
            body = r.json()
            err = body.get("error", body) if isinstance(body, dict) else {}
        except ValueError:
            err = {}
        code = str(err.get("code", "http_error"))
        message = str(err.get("message", r.text[:500]))
        fields = err.get("fields") or []
        cls = LeaseLost if code == "lease_lost" else RollarcError
        return cls(r.status_code, code, message, fields)

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        r = self._http.request(method, path, **kw)
        if r.status_code >= 400:
            raise self._error(r)
        return r

    # -- jobs -------------------------------------------------------------------------

    def submit(self, spec: SpecSource) -> str:
        """Submits a job; returns its id. ``spec``: a dict (sent as JSON), or the path of a
        TOML, JSON or YAML file (YAML is converted to JSON here; it needs PyYAML)."""
        if isinstance(spec, Mapping):
            body, ctype = json.dumps(spec).encode(), "application/json"
        else:
            path = Path(spec)
            text = path.read_text()
            ext = path.suffix.lower()
            if ext in (".yaml", ".yml"):
                try:
                    import yaml  # type: ignore[import-untyped]
                except ImportError as e:  # pragma: no cover - depends on the environment
                    raise ImportError(
                        "YAML job specs need PyYAML: pip install 'rollarc[yaml]'"
                    ) from e
                body, ctype = json.dumps(yaml.safe_load(text)).encode(), "application/json"
            elif ext == ".json":
                body, ctype = text.encode(), "application/json"
            else:
                body, ctype = text.encode(), "application/toml"
        r = self._request("POST", "/v1/jobs", content=body, headers={"Content-Type": ctype})
        return str(r.json()["id"])

    def job(self, job_id: str) -> JobRecord:
        return cast(JobRecord, self._request("GET", f"/v1/jobs/{job_id}").json())

    def jobs(self, timeline: bool = False) -> List[JobRecord]:
        """Every job this token may see, newest last; with ``timeline=True`` each job's
        latest metrics keep their per-resource timeline (most of a record's size)."""
        path = "/v1/jobs?timeline=true" if timeline else "/v1/jobs"
        return cast(List[JobRecord], self._request("GET", path).json()["jobs"])

    def cancel(self, job_id: str) -> JobRecord:
        return cast(JobRecord, self._request("POST", f"/v1/jobs/{job_id}/cancel").json())

    def spec(self, job_id: str) -> Dict[str, Any]:
        """The job's spec as the service stored it (every default filled in)."""
        return cast(Dict[str, Any], self._request("GET", f"/v1/jobs/{job_id}/spec").json())

    def wait(self, job_id: str, timeout: Optional[float] = None) -> JobRecord:
        """Follows the job's events until it ends; returns its record."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for _ in self.events(job_id):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} did not end within {timeout} s")
        return self.job(job_id)

    # -- events -----------------------------------------------------------------------

    def events(
        self,
        job_id: str,
        after: Optional[str] = None,
        reconnect: bool = True,
        max_reconnects: int = 100,
    ) -> Iterator[Event]:
        """The job's events until it ends (a terminal ``state`` event is the last). A
        dropped connection is resumed after the last event received (``Last-Event-ID``),
        without duplicates or gaps while the service holds the events (the newest 256 of a
        running job; otherwise it restarts from the current state). ``after``: resume after
        an event id from an earlier stream."""
        last = after
        failures = 0
        while True:
            headers = {"Accept": "text/event-stream"}
            if last is not None:
                headers["Last-Event-ID"] = last
            try:
                with self._http.stream(
                    "GET",
                    f"/v1/jobs/{job_id}/events",
                    headers=headers,
                    timeout=httpx.Timeout(self._timeout, read=None),
                ) as r:
                    if r.status_code >= 400:
                        r.read()
                        raise self._error(r)
                    for ev in _parse_sse(r.iter_lines()):
                        failures = 0
                        if ev.id is not None:
                            last = ev.id
                        yield ev
                        if ev.event == "state" and ev.data.get("state") in TERMINAL_STATES:
                            return
                # The stream ended without a terminal state (the service went away).
            except (httpx.TransportError, httpx.RemoteProtocolError):
                pass
            failures += 1
            if not reconnect or failures > max_reconnects:
                return
            time.sleep(min(0.2 * failures, 2.0))

    # -- the learning curve -----------------------------------------------------------

    def steps(self, job_id: str, after: int = 0, page_size: int = 100) -> Iterator[StepRecord]:
        """The job's completed steps after ``after`` (steps count from 1), each with its full
        record (metrics, trainer numbers, the per-resource timeline)."""
        for page in self._step_pages(job_id, after, page_size):
            yield from page["steps"]

    def _step_pages(self, job_id: str, after: int, page_size: int) -> Iterator[Dict[str, Any]]:
        cursor = after
        while True:
            page = self._request(
                "GET", f"/v1/jobs/{job_id}/steps", params={"after": cursor, "limit": page_size}
            ).json()
            yield page
            if len(page["steps"]) < page_size:
                return
            cursor = page["steps"][-1]["step"]

    def follow_steps(self, job_id: str, page_size: int = 100) -> Iterator[StepRecord]:
        """The whole learning curve of a job, however late the client connects: every stored
        step from the first, then each new step as it completes, each exactly once, until
        the job ends. (Live steps come from the compact progress events, without the
        per-resource timeline; ``steps`` has it.)"""
        seen = 0
        resume: Optional[str] = None
        for page in self._step_pages(job_id, 0, page_size):
            if resume is None:
                resume = page["event_id"]  # taken before the first page was read
            for rec in page["steps"]:
                seen = max(seen, rec["step"])
                yield rec
        for ev in self.events(job_id, after=resume):
            if ev.event == "progress" and ev.data["step"] > seen:
                seen = ev.data["step"]
                yield cast(StepRecord, {"step": seen, "metrics": ev.data["metrics"]})

    # -- trajectories -----------------------------------------------------------------

    def trajectories(
        self,
        job_id: str,
        after: int = 0,
        page_size: int = 100,
        trained: Optional[bool] = None,
        text: bool = False,
    ) -> Iterator[TrajectoryRow]:
        """The job's stored trajectories in durable order, page by page from cursor
        ``after``. ``trained``: only rows a step trained on (True) or never trained on
        (False). ``text``: add each turn's observation and response as text (jobs whose
        model has a tokenizer)."""
        cursor = after
        while True:
            params: Dict[str, Any] = {"after": cursor, "limit": page_size}
            if trained is not None:
                params["trained"] = "true" if trained else "false"
            if text:
                params["text"] = "true"
            r = self._request("GET", f"/v1/jobs/{job_id}/trajectories", params=params)
            rows = [json.loads(line) for line in r.text.splitlines() if line.strip()]
            for row in rows:
                yield cast(TrajectoryRow, row)
            if len(rows) < page_size:
                return
            cursor = rows[-1]["cursor"]

    def trajectories_df(self, job_id: str, **kw: Any) -> Any:
        """The trajectories as a pandas DataFrame, one row per trajectory: cursor, trained
        step, id, task, seed, reward, success, turns, response tokens, failure (and
        ``text`` with ``text=True``)."""
        try:
            import pandas as pd  # type: ignore[import-untyped]
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("DataFrames need pandas: pip install 'rollarc[pandas]'") from e
        rows = []
        for r in self.trajectories(job_id, **kw):
            t = r["trajectory"]
            turns = t.get("turns", [])
            row = {
                "cursor": r["cursor"],
                "trained_step": r["trained_step"],
                "id": t.get("id"),
                "task": t.get("task"),
                "seed": t.get("seed"),
                "group_id": t.get("group_id"),
                "start_version": t.get("start_version"),
                "reward": t.get("reward"),
                "success": t.get("success"),
                "turns": len(turns),
                "response_tokens": sum(len(u.get("response_tokens", [])) for u in turns),
                "failure": (t.get("failure") or {}).get("kind"),
            }
            if "text" in r:
                row["text"] = "".join(u["observation"] + u["response"] for u in r["text"])
            rows.append(row)
        return pd.DataFrame(rows)

    # -- external agent episodes ------------------------------------------------------

    def claim(self, job_id: str, wait_s: float = 30.0) -> Optional[Episode]:
        """Claims the job's next agent episode, waiting up to ``wait_s`` (≤ 60) for one;
        None when none is offered in time."""
        r = self._request(
            "POST",
            f"/v1/jobs/{job_id}/episodes:claim",
            params={"wait_s": wait_s},
            timeout=httpx.Timeout(self._timeout, read=wait_s + self._timeout),
        )
        if r.status_code == 204:
            return None
        b = r.json()
        return Episode(client=self, episode_id=b["episode_id"], row=b["row"],
                       base_url=b["base_url"], api_key=b["api_key"],
                       deadline_unix_ms=b["deadline_unix_ms"], task=b.get("task", ""))

    def episodes(self, job_id: str, wait_s: float = 30.0) -> Iterator[Episode]:
        """Claimed episodes until the job ends. Use each as a context manager (completed at
        the end of the block, failed on an exception)."""
        while True:
            ep = self.claim(job_id, wait_s=wait_s)
            if ep is not None:
                yield ep
            elif self.job(job_id)["state"] in TERMINAL_STATES:
                return

    # -- the trainer API --------------------------------------------------------------

    def staleness(self, job_id: str) -> Staleness:
        return cast(Staleness, self._request("GET", f"/v1/jobs/{job_id}/staleness").json())

    def next_batch(
        self, job_id: str, wait_s: float = 30.0, binary: bool = False
    ) -> Optional[Batch]:
        """Leases the job's next batch, waiting up to ``wait_s`` (≤ 60) for one; None when
        none is ready. ``binary``: fetched as MessagePack (needs ``msgpack``)."""
        headers = {}
        if binary:
            try:
                import msgpack  # type: ignore[import-untyped]
            except ImportError as e:  # pragma: no cover - depends on the environment
                raise ImportError("binary batches need msgpack: pip install 'rollarc[msgpack]'") from e
            headers["Accept"] = "application/msgpack"
        r = self._request(
            "GET",
            f"/v1/jobs/{job_id}/batches/next",
            params={"wait_s": wait_s},
            headers=headers,
            timeout=httpx.Timeout(self._timeout, read=wait_s + self._timeout),
        )
        if r.status_code == 204:
            return None
        body = msgpack.unpackb(r.content) if binary else r.json()
        return Batch(
            client=self,
            batch_id=body["batch_id"],
            step=body["step"],
            lease_until_ms=body["lease_until_ms"],
            policy_version_min=body["policy_version_min"],
            policy_version_max=body["policy_version_max"],
            groups=body["groups"],
        )

    def batches(
        self, job_id: str, wait_s: float = 30.0, binary: bool = False
    ) -> Iterator[Batch]:
        """Leased batches until the job ends. Use each as a context manager (acknowledged at
        the end of the block, given back on an exception)."""
        while True:
            b = self.next_batch(job_id, wait_s=wait_s, binary=binary)
            if b is not None:
                yield b
            elif self.job(job_id)["state"] in TERMINAL_STATES:
                return

    def ack(self, batch_id: str, stats: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
        """Acknowledges a lease; raises :class:`LeaseLost` when it had ended."""
        r = self._request("POST", f"/v1/batches/{batch_id}/ack", json=dict(stats or {}))
        return cast(Dict[str, Any], r.json())

    def nack(self, batch_id: str) -> Dict[str, Any]:
        """Gives a lease back (offered again at once); raises :class:`LeaseLost` when it
        had ended."""
        return cast(Dict[str, Any], self._request("POST", f"/v1/batches/{batch_id}/nack").json())

    def announce_weights(
        self,
        job_id: str,
        version: int,
        path: Union[str, "os.PathLike[str]"],
        format: str = "safetensors",
        sha256: Union[bool, str] = True,
    ) -> Dict[str, Any]:
        """Announces policy ``version`` (above every earlier one) as the file at ``path``
        (readable by the service, outside its data directory). The job installs it on
        every shard at its next step boundary and emits ``weights_installed``: announce
        before acknowledging a batch to have the next one generated by it. ``sha256``:
        True hashes the file here (the service checks it), or give the digest, or False."""
        p = Path(path).resolve()
        source: Dict[str, Any] = {"kind": "path", "uri": str(p), "format": format}
        if sha256 is True:
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            source["sha256"] = h.hexdigest()
        elif isinstance(sha256, str):
            source["sha256"] = sha256
        r = self._request(
            "POST", f"/v1/jobs/{job_id}/weights", json={"version": version, "source": source}
        )
        return cast(Dict[str, Any], r.json())


def _parse_sse(lines: Iterator[str]) -> Iterator[Event]:
    """Server-sent events from a stream's lines (``event``, ``data``, ``id``; comments and
    keep-alives skipped)."""
    name, data, eid = "message", [], None
    for line in lines:
        if line == "":
            if data:
                text = "\n".join(data)
                try:
                    payload = json.loads(text)
                except ValueError:
                    payload = {"raw": text}
                yield Event(event=name, data=payload, id=eid)
            name, data, eid = "message", [], None
            continue
        if line.startswith(":"):
            continue
        key, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if key == "event":
            name = value
        elif key == "data":
            data.append(value)
        elif key == "id":
            eid = value
