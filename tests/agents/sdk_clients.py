"""Drives rollarc's agent gateway with the official OpenAI and Anthropic Python SDKs.

Usage: sdk_clients.py CONFIG.json, where the config holds the gateway's base URL (the
`/gateway` prefix) and one episode key per scenario. Each scenario is what an unmodified agent
does: sync and async clients, streaming and not, tools declared, tool results sent back,
through Chat Completions, Responses and Messages. It prints one JSON report on stdout, per
scenario: the calls made, their finish/stop reasons, and what was checked on the way.
"""

import asyncio
import json
import sys

import anthropic
import openai

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
OPENAI_TOOLS = [{"type": "function", "function": WEATHER}]
ANTHROPIC_TOOLS = [
    {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
]
RESPONSES_TOOLS = [{"type": "function", **WEATHER}]


def openai_client(cfg, key, cls=openai.OpenAI):
    return cls(base_url=cfg["base"] + "/v1", api_key=key, max_retries=0, timeout=300)


def anthropic_client(cfg, key, cls=anthropic.Anthropic):
    return cls(base_url=cfg["base"], api_key=key, max_retries=0, timeout=300)


def chat_sync_tools(cfg, key, calls=5):
    """Five calls of one conversation: tool results for the model's calls, else a user turn."""
    c = openai_client(cfg, key)
    # The history opens with a tool exchange the agent wrote itself (a few-shot example), so
    # every call renders tool calls and results whatever the small model answers.
    messages = [
        {"role": "system", "content": "You answer questions about the weather."},
        {"role": "user", "content": "What is the weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "shot_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "shot_1", "content": "24 C, sunny"},
        {"role": "assistant", "content": "It is 24 C and sunny in Rome."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    finishes, tool_calls = [], 0
    for i in range(calls):
        r = c.chat.completions.create(
            model="policy", messages=messages, tools=OPENAI_TOOLS, max_tokens=16,
            logprobs=True, temperature=0.7,
        )
        choice = r.choices[0]
        assert r.usage.completion_tokens >= 1, r.usage
        assert len(choice.logprobs.content) == r.usage.completion_tokens
        finishes.append(choice.finish_reason)
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.message.tool_calls:
            tool_calls += len(choice.message.tool_calls)
            for tc in choice.message.tool_calls:
                json.loads(tc.function.arguments)
                messages.append({"role": "tool", "tool_call_id": tc.id, "content": f"{12 + i} C, clear"})
        else:
            messages.append({"role": "user", "content": f"And tomorrow ({i})?"})
    return {"calls": calls, "finishes": finishes, "tool_calls": tool_calls}


async def chat_async_stream(cfg, key, calls=3):
    c = openai_client(cfg, key, openai.AsyncOpenAI)
    messages = [{"role": "user", "content": "Name a city."}]
    finishes, usage_chunks = [], 0
    for i in range(calls):
        stream = await c.chat.completions.create(
            model="policy", messages=messages, tools=OPENAI_TOOLS, max_tokens=12,
            stream=True, stream_options={"include_usage": True},
        )
        text, calls_by_index, finish = "", {}, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage_chunks += 1
            for ch in chunk.choices:
                text += ch.delta.content or ""
                for tc in ch.delta.tool_calls or []:
                    cur = calls_by_index.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    cur["id"] = tc.id or cur["id"]
                    cur["name"] += (tc.function.name or "") if tc.function else ""
                    cur["arguments"] += (tc.function.arguments or "") if tc.function else ""
                finish = ch.finish_reason or finish
        finishes.append(finish)
        msg = {"role": "assistant", "content": text}
        if calls_by_index:
            msg["tool_calls"] = [
                {"id": v["id"], "type": "function", "function": {"name": v["name"], "arguments": v["arguments"]}}
                for v in calls_by_index.values()
            ]
        messages.append(msg)
        for v in calls_by_index.values():
            messages.append({"role": "tool", "tool_call_id": v["id"], "content": "20 C"})
        if not calls_by_index:
            messages.append({"role": "user", "content": f"Another ({i})."})
    assert usage_chunks == calls, usage_chunks
    return {"calls": calls, "finishes": finishes}


def responses_chain(cfg, key):
    """A response, one chained to it by previous_response_id, then a streamed one."""
    c = openai_client(cfg, key)
    # The same instructions and tools throughout (changing either starts a new segment).
    r1 = c.responses.create(
        model="policy", instructions="Be brief.", input="Hello!", tools=RESPONSES_TOOLS, max_output_tokens=12,
    )
    assert r1.status in ("completed", "incomplete"), r1.status
    r2 = c.responses.create(
        model="policy", instructions="Be brief.", input="And again?", previous_response_id=r1.id,
        tools=RESPONSES_TOOLS, max_output_tokens=12,
    )
    kinds, final = [], None
    with c.responses.stream(
        model="policy", instructions="Be brief.", input="Once more.", previous_response_id=r2.id,
        tools=RESPONSES_TOOLS, max_output_tokens=12,
    ) as s:
        for ev in s:
            kinds.append(ev.type)
            # At the token budget the stream ends with response.incomplete (as OpenAI's
            # does), which the SDK's get_final_response does not accept: take either.
            if ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
    assert kinds[0] == "response.created", kinds
    assert final.id and final.output, final
    return {"calls": 3, "statuses": [r1.status, r2.status, final.status], "events": kinds}


def messages_sync_tools(cfg, key, calls=3):
    c = anthropic_client(cfg, key)
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    stops = []
    for i in range(calls):
        m = c.messages.create(
            model="policy", max_tokens=16, system="You answer questions about the weather.",
            messages=messages, tools=ANTHROPIC_TOOLS,
        )
        stops.append(m.stop_reason)
        assert m.usage.output_tokens >= 1
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
        uses = [b for b in m.content if b.type == "tool_use"]
        if uses:
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b.id, "content": "3 C"} for b in uses]})
        else:
            messages.append({"role": "user", "content": f"Go on ({i})."})
    return {"calls": calls, "stops": stops}


async def messages_async_stream(cfg, key, calls=2):
    c = anthropic_client(cfg, key, anthropic.AsyncAnthropic)
    messages = [{"role": "user", "content": "Say something short."}]
    stops = []
    for i in range(calls):
        async with c.messages.stream(model="policy", max_tokens=12, messages=messages, tools=ANTHROPIC_TOOLS) as s:
            m = await s.get_final_message()
        stops.append(m.stop_reason)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
        uses = [b for b in m.content if b.type == "tool_use"]
        if uses:
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b.id, "content": "ok"} for b in uses]})
        else:
            messages.append({"role": "user", "content": f"More ({i})."})
    return {"calls": calls, "stops": stops}


def errors(cfg, key, finished_key):
    """Each mistake raises the SDK's usual exception (a 4xx in the provider's shape)."""
    c = openai_client(cfg, key)
    a = anthropic_client(cfg, key)
    user = [{"role": "user", "content": "hi"}]
    seen = {}

    def expect(name, exc, fn):
        try:
            fn()
        except exc as e:
            seen[name] = {"status": e.status_code, "message": str(e), "param": getattr(e, "param", None),
                          "type": type(e).__name__}
            return
        raise AssertionError(f"{name}: no {exc.__name__}")

    expect("n_2", openai.BadRequestError, lambda: c.chat.completions.create(model="p", messages=user, n=2))
    expect("unknown_role", openai.BadRequestError,
           lambda: c.chat.completions.create(model="p", messages=[{"role": "oracle", "content": "x"}]))
    expect("unknown_tool_call_id", openai.BadRequestError, lambda: c.chat.completions.create(
        model="p", messages=user + [{"role": "tool", "tool_call_id": "nope", "content": "1"}]))
    expect("wrong_key", openai.AuthenticationError,
           lambda: openai_client(cfg, "rk_wrong").chat.completions.create(model="p", messages=user))
    expect("finished_episode", openai.APIStatusError,
           lambda: openai_client(cfg, finished_key).chat.completions.create(model="p", messages=user))
    expect("anthropic_wrong_key", anthropic.AuthenticationError,
           lambda: anthropic_client(cfg, "rk_wrong").messages.create(model="p", max_tokens=4, messages=user))
    expect("anthropic_bad_block", anthropic.BadRequestError, lambda: a.messages.create(
        model="p", max_tokens=4, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]))
    models = [m.id for m in c.models.list()]
    return {"errors": seen, "models": models}


def main():
    cfg = json.load(open(sys.argv[1]))
    k = cfg["keys"]
    # `short`: fewer calls where a scenario only shows the wire format (a slow engine); the
    # five-call tool conversation is whole either way.
    n = 1 if cfg.get("short") else 2
    report = {
        "chat_sync_tools": chat_sync_tools(cfg, k["chat_sync_tools"]),
        "chat_async_stream": asyncio.run(chat_async_stream(cfg, k["chat_async_stream"], calls=n + 1)),
        "responses_chain": responses_chain(cfg, k["responses_chain"]),
        "messages_sync_tools": messages_sync_tools(cfg, k["messages_sync_tools"], calls=n + 1),
        "messages_async_stream": asyncio.run(messages_async_stream(cfg, k["messages_async_stream"], calls=n)),
        "errors": errors(cfg, k["errors"], k["finished"]),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
