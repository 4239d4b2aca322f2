"""An external harness: agents run here (in your own infrastructure), rollarc hands out the
episodes. It claims each admitted episode of a job whose task has
`env = { kind = "agent", mode = "external" }`, runs an unmodified OpenAI Agents SDK agent
against the episode's gateway URL and key, and finishes the episode with the agent's answer;
an exception fails the episode (masked, never rewarded). See docs/agents.md.

    python examples/agents/external_harness.py http://127.0.0.1:8080 JOB_ID --workers 4
"""

import argparse
import asyncio
import concurrent.futures
import json
import threading

import openai
from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

from rollarc import TERMINAL_STATES, Client

set_tracing_disabled(True)


@function_tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    import calc_agent  # the same safe evaluator as the managed example
    return calc_agent.calculate(expression)


def play(ep):
    """One episode: the agent talks to the policy through the episode's gateway URL."""
    with ep:
        client = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=2)
        agent = Agent(name="solver", instructions="Solve the problem; use calculate.",
                      tools=[calculate],
                      model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
        question = ep.row.get("question") or json.dumps(ep.row)
        out = asyncio.run(Runner.run(agent, question, max_turns=6))
        ep.answer = str(out.final_output)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("job")
    ap.add_argument("--workers", type=int, default=4)
    a = ap.parse_args()
    free = threading.Semaphore(a.workers)  # claim only what a worker can start at once

    def work(ep):
        try:
            play(ep)
        except Exception as e:  # reported to rollarc as a failed episode already
            print(f"episode {ep.episode_id} failed: {e}")
        finally:
            free.release()

    with Client(a.url) as c, concurrent.futures.ThreadPoolExecutor(a.workers) as pool:
        while True:
            free.acquire()
            ep = c.claim(a.job, wait_s=5)
            if ep is not None:
                pool.submit(work, ep)
                continue
            free.release()
            if c.job(a.job)["state"] in TERMINAL_STATES:
                return


if __name__ == "__main__":
    main()
