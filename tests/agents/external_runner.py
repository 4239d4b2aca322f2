"""A test harness for rollarc's external agent episodes, through the Python SDK:
external_runner.py URL JOB MODE claims the job's episodes until it ends and plays each with
MODE (`openai`: examples/agents/calc_agent.py; `anthropic`: episode_agents.py's), then prints
a JSON summary: episodes completed and failed."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "..", "examples", "agents"),
                os.path.join(HERE, "..", "..", "clients", "python", "src")]

import anthropic  # noqa: E402
import openai  # noqa: E402

import calc_agent  # noqa: E402
import episode_agents  # noqa: E402
from rollarc import Client  # noqa: E402


def play(mode, ep):
    if mode == "openai":
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=2)
        return calc_agent.solve(ep.row, client=client)
    return episode_agents.anthropic_agent(ep.row, base_url=ep.anthropic_base_url, api_key=ep.api_key)


def main():
    url, job, mode = sys.argv[1:4]
    done = {"completed": 0, "failed": 0, "tasks": []}
    with Client(url) as c:
        for ep in c.episodes(job, wait_s=5):
            try:
                with ep:
                    report = play(mode, ep)
                    ep.answer = report["answer"]
                    ep.info = {"mode": mode}
                done["completed"] += 1
                done["tasks"].append(ep.task)
            except Exception as e:  # failed already (e.g. the job ended mid-episode: 410)
                done["failed"] += 1
                print(f"episode {ep.episode_id}: {type(e).__name__}: {e}", file=sys.stderr)
    print(json.dumps(done))


if __name__ == "__main__":
    main()
