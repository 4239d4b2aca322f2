"""Unmodified agents that rollarc's agent-episode tests run as managed programs (and, through
the Python SDK, as external runners). Usage: episode_agents.py MODE; the row arrives as JSON
on stdin, the gateway in OPENAI_* / ANTHROPIC_* (or in the arguments of `run(mode, ...)`).

Modes:
  anthropic   the official `anthropic` SDK: a Messages call with a tool, the tool's result
              sent back when the model calls it, then the answer.
  agents_sdk  the OpenAI Agents SDK (a third-party framework) with a Chat Completions model
              and a function tool.
  probe       one model call, then tries to reach what a sandboxed agent must not: a host
              loopback port, a host unix socket, an address of another interface (the
              targets in PROBE_PORT, PROBE_SOCK, PROBE_ADDR); reports what it reached.
  crash       kills itself (SIGKILL) while its second model call is in flight: the first two
              runs of each seed (markers in CRASH_DIR), so a retried group goes through.
  fail        one model call, then exits with status 3 (the policy's failure).
  plain       one Chat Completions call over the standard library alone (no SDK to import:
              starts in a tenth of a second, for the chaos loop).
  slow        `plain`, a sleep of SLOW_S seconds, then `plain` again (an episode long enough
              to lose its env worker mid-way).
  stream      one streamed Chat Completions call (standard library) for a long answer; it
              writes STREAM_DIR/sent-PID as it sends the request, STREAM_DIR/first-PID at its
              first chunk and STREAM_DIR/done-PID at the end, so a test can kill the model's
              server while the answer is generated.

With PROBE_WRONG_KEY set, `probe` also calls with a key that is not the episode's (an env
worker's forwarder puts the episode's own in its place) and reports whether it was answered.
"""

import asyncio
import json
import os
import signal
import socket
import sys
import threading

NUMBER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def anthropic_agent(row, base_url=None, api_key=None):
    import anthropic
    c = anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=2, timeout=300)
    tools = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": NUMBER}]
    messages = [{"role": "user", "content": f"Weather in {row.get('city', 'Paris')}?"}]
    text = ""
    for _ in range(3):
        m = c.messages.create(model="policy", max_tokens=24, tools=tools, messages=messages)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
        uses = [b for b in m.content if b.type == "tool_use"]
        text = "".join(b.text for b in m.content if b.type == "text")
        if not uses:
            break
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": u.id, "content": "21 C"} for u in uses]})
    return {"answer": text, "info": {"calls": len([m for m in messages if m["role"] == "assistant"])}}


def agents_sdk_agent(row, base_url=None, api_key=None):
    import openai
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "21 C"

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=2, timeout=300)
    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
    out = asyncio.run(Runner.run(agent, f"Weather in {row.get('city', 'Paris')}?", max_turns=4))
    return {"answer": str(out.final_output)}


def one_call(base_url=None, api_key=None):
    import openai
    c = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
    return c.chat.completions.create(model="policy", max_tokens=8,
                                     messages=[{"role": "user", "content": "Hello"}])


def reach_tcp(host, port):
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


def reach_unix(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def probe(row):
    one_call()
    env = os.environ
    reached = {"gateway": False, "loopback": None, "unix": None, "interface": None}
    import urllib.request
    req = urllib.request.Request(env["OPENAI_BASE_URL"] + "/models",
                                 headers={"Authorization": "Bearer " + env["OPENAI_API_KEY"]})
    with urllib.request.urlopen(req, timeout=10) as r:
        reached["gateway"] = r.status == 200
    if env.get("PROBE_PORT"):
        reached["loopback"] = reach_tcp("127.0.0.1", env["PROBE_PORT"])
    if env.get("PROBE_SOCK"):
        reached["unix"] = reach_unix(env["PROBE_SOCK"])
    if env.get("PROBE_ADDR"):
        host, port = env["PROBE_ADDR"].rsplit(":", 1)
        reached["interface"] = reach_tcp(host, port)
    if env.get("PROBE_WRONG_KEY"):
        req = urllib.request.Request(env["OPENAI_BASE_URL"] + "/models",
                                     headers={"Authorization": "Bearer not-the-episode-key"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                reached["wrong_key"] = r.status == 200
        except urllib.error.HTTPError:
            reached["wrong_key"] = False
    return {"answer": "probed", "info": reached}


def first_runs_of_seed(row, runs=2):
    for k in range(runs):
        try:
            os.close(os.open(os.path.join(os.environ["CRASH_DIR"], f"{row.get('seed')}-{k}"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            continue
    return False


def crash(row):
    one_call()
    if not first_runs_of_seed(row):
        return {"answer": "survived"}
    # SIGKILL from a thread while the second call waits for its answer.
    threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    import openai
    openai.OpenAI(max_retries=0, timeout=300).chat.completions.create(
        model="policy", max_tokens=512, messages=[{"role": "user", "content": "Count to a thousand."}])
    return {"answer": "not killed"}


def fail(row):
    one_call()
    print("the agent gave up", file=sys.stderr)
    sys.exit(3)


def plain(row):
    import urllib.request
    env = os.environ
    body = json.dumps({"model": "policy", "max_tokens": 8,
                       "messages": [{"role": "user", "content": f"Hello {row.get('seed')}"}]})
    req = urllib.request.Request(env["OPENAI_BASE_URL"] + "/chat/completions", data=body.encode(),
                                 headers={"Authorization": "Bearer " + env["OPENAI_API_KEY"],
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        answer = json.load(r)["choices"][0]["message"]["content"]
    return {"answer": answer}


def slow(row):
    import time
    plain(row)
    time.sleep(float(os.environ.get("SLOW_S", "2")))
    return plain(row)


def stream(row):
    import urllib.request
    env = os.environ
    marks = env["STREAM_DIR"]
    body = json.dumps({"model": "policy", "max_tokens": 200, "stream": True, "messages": [
        {"role": "user", "content": f"Tell me a long story about a lighthouse keeper, number {row.get('seed')}."}]})
    req = urllib.request.Request(env["OPENAI_BASE_URL"] + "/chat/completions", data=body.encode(),
                                 headers={"Authorization": "Bearer " + env["OPENAI_API_KEY"],
                                          "Content-Type": "application/json"})
    text, chunks, done = "", 0, False
    open(os.path.join(marks, f"sent-{os.getpid()}"), "w").close()
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunks += 1
            if chunks == 1:
                open(os.path.join(marks, f"first-{os.getpid()}"), "w").close()
            for c in json.loads(line[6:]).get("choices", []):
                text += (c.get("delta") or {}).get("content") or ""
    open(os.path.join(marks, f"done-{os.getpid()}"), "w").close()
    return {"answer": text, "info": {"chunks": chunks, "done": done}}


MODES = {"plain": plain, "slow": slow, "stream": stream, "anthropic": anthropic_agent, "agents_sdk": agents_sdk_agent, "probe": probe,
         "crash": crash, "fail": fail}


if __name__ == "__main__":
    row = json.loads(sys.stdin.readline() or "{}")
    print(json.dumps(MODES[sys.argv[1]](row)))
