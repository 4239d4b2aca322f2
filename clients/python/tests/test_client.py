"""The SDK against a real `rollarc serve`: jobs, events to the end and resumed, trajectory
paging (dicts, text, DataFrame), the batch loop with ack/nack and an expired lease, and
weight announcements."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import yaml

from rollarc import Batch, Client, LeaseLost, RollarcError, TERMINAL_STATES, sequences


def sim_job(steps: int, trainer: Dict[str, Any] | None = None, step_s: float = 0.0) -> Dict[str, Any]:
    """A job on a simulated H800 pool (virtual time unless `step_s` asks for a wall clock)."""
    job: Dict[str, Any] = {
        "seed": 1,
        "tasks": [
            {
                "domain": "lake",
                "group_size": 4,
                "max_turns": 4,
                "max_tokens_per_turn": 64,
                "env": {
                    "kind": "sim",
                    "reset_latency_s": {"constant": 0.1},
                    "step_latency_s": {"constant": max(step_s, 0.1)},
                    "turns": {"constant": 2},
                    "observation_tokens": {"constant": 16},
                    "response_tokens": {"constant": 16},
                    "success_rate": 0.5,
                },
            }
        ],
        "pools": [{"name": "h800", "device": "H800", "count": 1, "backend": {"kind": "sim", "model": "qwen3-8b"}}],
        "rollout": {"batch_size": 2, "steps": steps, "alpha": 8},
    }
    if trainer is not None:
        job["trainer"] = trainer
    if step_s > 0:
        job["sim"] = {"clock": "real"}
    return job


TINY_TOML = """
seed = 2
[[tasks]]
domain = "frozenlake"
group_size = 4
max_turns = 4
max_tokens_per_turn = 1
constrain_actions = true
env = { kind = "frozenlake", size = 4, end_on_invalid = true }
[[pools]]
name = "cpu"
device = "CPU"
count = 1
backend = { kind = "builtin", model = { d_model = 32, n_layers = 1, n_heads = 2, d_ff = 64, max_seq = 128 } }
[rollout]
batch_size = 4
steps = 3
alpha = 1
[trainer]
kind = "builtin"
"""


def seq(event_id: str) -> int:
    return int(event_id.rsplit("-", 1)[1])


def test_jobs_from_a_dict_a_toml_and_a_yaml_file(client: Client, tmp_path: Path) -> None:
    a = client.submit(sim_job(2))
    toml_file = tmp_path / "job.toml"
    toml_file.write_text(TINY_TOML)
    b = client.submit(toml_file)
    yaml_file = tmp_path / "job.yaml"
    yaml_file.write_text(yaml.safe_dump(sim_job(1)))
    c = client.submit(yaml_file)
    assert len({a, b, c}) == 3
    ids = [j["id"] for j in client.jobs()]
    assert {a, b, c} <= set(ids)
    for job in (a, b, c):
        rec = client.wait(job, timeout=300)
        assert rec["state"] == "succeeded", rec
        assert rec["step"] == rec["steps"]
    assert client.job(b)["steps"] == 3
    # The stored spec has every default filled in.
    spec = client.spec(b)
    assert spec["pools"][0]["backend"]["kind"] == "builtin"
    assert spec["trainer"]["kind"] == "builtin" and "lr" in spec["trainer"]


def test_bad_input_is_a_clear_error(client: Client) -> None:
    bad = sim_job(1)
    bad["tasks"][0]["group_size"] = 0
    with pytest.raises(RollarcError) as e:
        client.submit(bad)
    assert e.value.status == 400 and e.value.code == "invalid_spec"
    assert any(f["field"] == "tasks[0].group_size" for f in e.value.fields), e.value.fields
    with pytest.raises(RollarcError) as e:
        client.job("job-does-not-exist")
    assert e.value.status == 404 and e.value.code == "not_found"


def test_cancel_a_running_job(client: Client) -> None:
    job = client.submit(sim_job(1000, step_s=0.2))
    for ev in client.events(job):
        if ev.event == "state" and ev.data["state"] == "running":
            break
    rec = client.cancel(job)
    assert rec["id"] == job
    assert client.wait(job, timeout=120)["state"] == "cancelled"
    with pytest.raises(RollarcError) as e:
        client.cancel(job)
    assert e.value.status == 409


def test_events_run_to_the_end_with_ids_and_resume_without_gaps(client: Client) -> None:
    job = client.submit(sim_job(6, step_s=0.2))
    first: List[Any] = []
    for ev in client.events(job):
        first.append(ev)
        if ev.event == "progress":
            break  # drop the connection after the first step
    assert first[0].event == "state"
    resumed = list(client.events(job, after=first[-1].id))
    assert resumed, "the resumed stream sent nothing"
    end = resumed[-1]
    assert end.event == "state" and end.data["state"] == "succeeded", end
    # Consecutive ids across the two connections: nothing lost, nothing twice.
    numbers = [seq(e.id) for e in first + resumed]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), numbers
    progress = [e for e in first + resumed if e.event == "progress"]
    assert [e.data["step"] for e in progress] == list(range(1, 7))
    assert [e.data["metrics"]["step"] for e in progress] == list(range(1, 7))
    # Compact: the per-resource timeline is served by /steps, not sent with every step.
    assert all("timeline" not in e.data["metrics"] for e in progress)
    assert all("success_rate" in e.data["metrics"] for e in progress)
    # A finished job's stream is its final state alone.
    again = list(client.events(job))
    assert [e.event for e in again] == ["state"] and again[0].data["state"] == "succeeded"


def test_a_late_client_reconstructs_the_whole_learning_curve(client: Client) -> None:
    job = client.submit(sim_job(8, step_s=0.2))
    # Connect late: three steps are done before the client looks.
    for ev in client.events(job):
        if ev.event == "progress" and ev.data["step"] >= 3:
            break
    curve = list(client.follow_steps(job, page_size=2))
    assert [r["step"] for r in curve] == list(range(1, 9))
    assert client.job(job)["state"] == "succeeded"
    stored = list(client.steps(job))
    assert [r["step"] for r in stored] == list(range(1, 9))
    for live, kept in zip(curve, stored):
        assert live["metrics"]["success_rate"] == kept["metrics"]["success_rate"]
    # The step history keeps the per-resource timeline the progress events leave out.
    assert "timeline" in stored[-1]["metrics"]
    # Paging: after a step, only the later ones.
    assert [r["step"] for r in client.steps(job, after=6)] == [7, 8]


def test_trajectories_page_as_dicts_text_and_a_dataframe(client: Client, tmp_path: Path) -> None:
    f = tmp_path / "tiny.toml"
    f.write_text(TINY_TOML)
    job = client.submit(f)
    assert client.wait(job, timeout=300)["state"] == "succeeded"
    rows = list(client.trajectories(job, page_size=7))
    all_at_once = list(client.trajectories(job, page_size=1000))
    assert len(rows) > 7 and rows == all_at_once
    cursors = [r["cursor"] for r in rows]
    assert cursors == sorted(set(cursors))
    trained = list(client.trajectories(job, trained=True))
    assert trained and all(r["trained_step"] is not None for r in trained)
    assert {r["trained_step"] for r in trained} <= {1, 2, 3}
    untrained = list(client.trajectories(job, trained=False))
    assert len(trained) + len(untrained) == len(rows)
    # Text: the byte-level model's tokens are the bytes of the board and the moves.
    texts = list(client.trajectories(job, text=True))
    for r in texts:
        for turn, text in zip(r["trajectory"]["turns"], r["text"]):
            want = bytes(t for t in turn["observation_tokens"] if t < 256).decode("utf-8", "replace")
            assert text["observation"] == want
            assert all(ch in "LDRU" for ch in text["response"]), text
    assert any("F" in t["observation"] for r in texts for t in r["text"])
    df = client.trajectories_df(job, text=True)
    assert len(df) == len(rows)
    assert {"cursor", "trained_step", "task", "reward", "turns", "text"} <= set(df.columns)
    assert (df["task"] == "frozenlake").all()
    # Simulated pools have no tokenizer: a clear 400 naming the field.
    sim = client.submit(sim_job(1))
    client.wait(sim, timeout=120)
    with pytest.raises(RollarcError) as e:
        list(client.trajectories(sim, text=True))
    assert e.value.status == 400 and e.value.fields[0]["field"] == "text"


def test_a_batch_loop_with_ack_nack_and_an_expired_lease(client: Client) -> None:
    job = client.submit(sim_job(3, trainer={"kind": "external", "lease_s": 1}))
    b = client.next_batch(job, wait_s=60)
    assert isinstance(b, Batch) and b.step == 1 and len(b) > 0
    s = b.samples()[0]
    assert len(s["tokens"]) == len(s["loss_mask"]) == len(s["behaviour_logprobs"])
    assert s["status"] in ("completed", "failed")
    # Given back: offered again at once under a new lease.
    b.nack()
    b2 = client.next_batch(job, wait_s=10)
    assert b2 is not None and b2.step == 1 and b2.batch_id != b.batch_id
    # Held past its lease (1 s): offered again; the old lease cannot acknowledge.
    time.sleep(1.5)
    b3 = client.next_batch(job, wait_s=10, binary=True)  # MessagePack this time
    assert b3 is not None and b3.step == 1 and b3.batch_id != b2.batch_id
    assert [s["tokens"] for s in b3.samples()] == [s["tokens"] for s in b2.samples()]
    with pytest.raises(LeaseLost):
        b2.ack(loss=1.0)
    # The context manager acknowledges at the end of the block ...
    with b3:
        b3.stats["loss"] = 0.25
    assert b3.outcome == "acked"
    # ... and gives the batch back on an exception.
    b4 = client.next_batch(job, wait_s=60)
    assert b4 is not None and b4.step == 2
    with pytest.raises(RuntimeError):
        with b4:
            raise RuntimeError("the trainer ran out of memory")
    assert b4.outcome == "offered_again"
    steps = []
    for batch in client.batches(job, wait_s=10):
        with batch:
            steps.append(batch.step)
    assert steps == [2, 3]
    assert client.job(job)["state"] == "succeeded"
    st = client.staleness(job)
    assert st["batches_acked"] == 3 and st["batches_pending"] == 0 and st["alpha"] == 8
    # Every acknowledged row records its step.
    trained = {r["trained_step"] for r in client.trajectories(job, trained=True)}
    assert trained == {1, 2, 3}


def test_weight_announcements(client: Client, tmp_path: Path) -> None:
    job = client.submit(sim_job(2, trainer={"kind": "external", "lease_s": 60}))
    b = client.next_batch(job, wait_s=60)
    assert b is not None
    w = tmp_path / "v1.safetensors"
    w.write_bytes(b"weights of version 1" * 100)
    out = client.announce_weights(job, 1, w)
    assert out["version"] == 1
    # Versions only go up.
    with pytest.raises(RollarcError) as e:
        client.announce_weights(job, 1, w)
    assert e.value.status == 409 and e.value.code == "version_not_newer"
    # A checksum that does not match names the field.
    with pytest.raises(RollarcError) as e:
        client.announce_weights(job, 2, w, sha256=hashlib.sha256(b"other").hexdigest())
    assert e.value.status == 400 and e.value.fields[0]["field"] == "source.sha256"
    # Follow the events from before the acknowledgement, so none is missed.
    events = client.events(job)
    assert next(events).event == "state"
    b.ack(loss=0.1)
    # The next batch is assembled after the step boundary where version 1 was installed.
    for batch in client.batches(job, wait_s=10):
        with batch:
            pass
    rest = list(events)
    installed = [e.data["version"] for e in rest if e.event == "weights_installed"]
    assert installed == [1], [e.event for e in rest]
    assert rest[-1].data["state"] == "succeeded"
    rec = client.job(job)
    assert rec["state"] in TERMINAL_STATES
    assert json.dumps(rec["metrics"])  # the step metrics are plain JSON


def test_a_verl_parquet_dataset_written_by_pyarrow(client: Client, tmp_path: Path) -> None:
    """verl's layout (chat-message prompts, `reward_model.ground_truth`, `extra_info.split`)
    needs no key settings; the split keeps the train rows; every row is used once per epoch."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for i in range(6):
        rows.append({
            "data_source": "toy/arith",
            "prompt": [{"role": "user", "content": f"What is {i}+{i}?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train" if i % 2 == 0 else "test", "index": i},
        })
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)  # snappy, pyarrow's default
    job = {
        "seed": 4,
        "tasks": [{
            "domain": "arith",
            "group_size": 2,
            "max_turns": 1,
            "max_tokens_per_turn": 4,
            "env": {"kind": "prompt"},
            "dataset": {"path": str(path), "split": "train", "epochs": 2, "system_prompt": "Be brief."},
        }],
        "pools": [{"name": "cpu", "device": "CPU", "count": 1, "backend": {
            "kind": "builtin", "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_seq": 128}}}],
        "rollout": {"batch_size": 1, "steps": 6, "alpha": 1, "filter_all_equal": False},
        "trainer": {"kind": "builtin"},
    }
    jid = client.submit(job)
    assert client.wait(jid, timeout=300)["state"] == "succeeded"
    # Three train rows (0, 2, 4) × 2 epochs: positions 0..5, each trained once.
    seeds = sorted(s for step in client.steps(jid) for s in step["metrics"]["tasks"]["arith"]["seeds"])
    assert seeds == list(range(6))
    train_prompts = {f"What is {i}+{i}?": str(2 * i) for i in (0, 2, 4)}
    seen = set()
    for r in client.trajectories(jid, text=True):
        obs = r["text"][0]["observation"]
        assert obs.startswith("Be brief.\n"), obs
        prompt = obs.split("\n", 1)[1]
        assert prompt in train_prompts, obs
        assert r["trajectory"]["reference"] == {"answer": train_prompts[prompt]}
        seen.add(prompt)
    assert seen == set(train_prompts)
    # A dataset whose keys are missing is a 400 naming the field.
    with pytest.raises(RollarcError) as e:
        bad = json.loads(json.dumps(job))
        bad["tasks"][0]["dataset"]["prompt_key"] = "no.such.key"
        client.submit(bad)
    assert e.value.status == 400 and e.value.fields[0]["field"] == "tasks[0].dataset.prompt_key"


def test_sequences_split_a_sample_at_its_dropped_turns():
    # Turns: obs [1,2] → 3, obs [4] → 5, obs [6] → 7 and obs [8] → 9 without turn 1,
    # obs [10] → 11 without turns 1–2 (the same sample as the Rust unit test of segments).
    s = {
        "tokens": list(range(1, 12)),
        "loss_mask": [0, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1],
        "behaviour_logprobs": [0, 0, -0.3, 0, -0.5, 0, -0.7, 0, -0.9, 0, -1.1],
        "turn_bounds": [[2, 3], [4, 5], [6, 7], [8, 9], [10, 11]],
        "dropped_turns": [0, 0, 1, 1, 2],
    }
    seqs = sequences(s)
    assert [t for t, _, _ in seqs] == [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7, 8, 9], [1, 2, 3, 8, 9, 10, 11]]
    assert [m for _, m, _ in seqs] == [[0, 0, 1, 0, 1], [0, 0, 0, 0, 1, 0, 1], [0, 0, 0, 0, 0, 0, 1]]
    assert seqs[2][2] == [0, 0, 0, 0, 0, 0, -1.1]
    # Every response trains exactly once.
    assert sum(sum(m) for _, m, _ in seqs) == sum(s["loss_mask"])
    # Without drops: the sample's own columns.
    plain = dict(s, dropped_turns=[])
    assert sequences(plain) == [(plain["tokens"], plain["loss_mask"], plain["behaviour_logprobs"])]
    # An agent's diverged history: turn 2's observation [1, 9, 3, 4, 5, 6] is its whole context.
    agent = {
        "tokens": [1, 2, 3, 4, 5, 1, 9, 3, 4, 5, 6, 7, 8, 10],
        "loss_mask": [0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 1],
        "behaviour_logprobs": [0, 0, -0.3, 0, -0.5, 0, 0, 0, 0, 0, 0, -0.7, 0, -1.0],
        "turn_bounds": [[2, 3], [4, 5], [11, 12], [13, 14]],
        "restarted_turns": [2],
    }
    seqs = sequences(agent)
    assert [t for t, _, _ in seqs] == [[1, 2, 3, 4, 5], [1, 9, 3, 4, 5, 6, 7, 8, 10]]
    assert [m for _, m, _ in seqs][1] == [0, 0, 0, 0, 0, 0, 1, 0, 1]


def test_tensorboard_reads_every_step_of_a_job(client: Client, data_dir: Path) -> None:
    # TensorBoard's own reader (tensorboard.backend.event_processing): the service writes a
    # job's numbers under DATA_DIR/tensorboard/JOB as it goes.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = client.submit(sim_job(4))
    assert client.wait(job, timeout=120)["state"] == "succeeded"
    acc = EventAccumulator(str(data_dir / "tensorboard" / job))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ["rollout/success", "rollout/trajectories_per_s", "trainer/loss", "rollout/bubble_ratio"]:
        assert tag in tags, tags
    stored = list(client.steps(job))
    events = acc.Scalars("rollout/success")
    assert [e.step for e in events] == [r["step"] for r in stored] == [1, 2, 3, 4]
    # One convention (steps count from 1): the record, its metrics, the job and TensorBoard.
    assert [r["metrics"]["step"] for r in stored] == [1, 2, 3, 4]
    assert [r["metrics"]["version"] for r in stored] == [1, 2, 3, 4]
    assert client.job(job)["step"] == stored[-1]["step"] == 4
    for e, r in zip(events, stored):
        assert abs(e.value - r["metrics"]["success_rate"]) < 1e-6
    assert any(t.endswith("/success") and not t.startswith("rollout") for t in tags), tags
