"""llama.cpp's numbers for `rollarc bench --what llm`: the same workloads on the same GGUF
file through the server the `xllamacpp` wheel embeds (2 threads, continuous batching over
32 slots), timed by wall clock from the first request to the last answer.

usage: bench-llamacpp.py MODEL.gguf [MODEL2.gguf ...]  →  one JSON object per model on stdout
"""
import json
import sys
import threading
import time
import urllib.request

import xllamacpp as x

PREFILL_TOKENS = 128
DECODE_CONTEXT = 32
DECODE_NEW = 64
BATCHES = (1, 8, 32)


def prompt(i, n):
    # Ordinary BPE ids (letters and words), different per request so nothing is shared.
    return [100 + (7 * i + 13 * k) % 20000 for k in range(n)]


def run(url, n, length, new):
    """n concurrent completions of `length`-token prompts and `new` tokens; wall time and
    the tokens the server reports."""
    out = [None] * n

    def one(i):
        body = json.dumps({
            "prompt": prompt(i, length), "n_predict": new, "temperature": 1.0,
            "seed": i, "cache_prompt": False, "ignore_eos": True,
        }).encode()
        req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            out[i] = json.loads(r.read())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t = time.time()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.time() - t
    prompt_n = sum(o["timings"]["prompt_n"] for o in out)
    predicted = sum(o["timings"]["predicted_n"] for o in out)
    return wall, prompt_n, predicted


def bench(model):
    p = x.CommonParams()
    p.model.path = model
    p.n_parallel = max(BATCHES)
    p.n_ctx = max(BATCHES) * 256
    p.cpuparams.n_threads = 2
    p.cpuparams_batch.n_threads = 2
    s = x.Server(p)
    url = s.listening_address
    run(url, 1, 16, 4)  # warm up
    res = {"model": model, "prefill": {}, "decode": {}}
    for b in BATCHES:
        wall, n, _ = run(url, b, PREFILL_TOKENS, 1)
        res["prefill"][str(b)] = n / wall
        wall, _, gen = run(url, b, DECODE_CONTEXT, DECODE_NEW)
        res["decode"][str(b)] = gen / wall
    del s
    return res


if __name__ == "__main__":
    for m in sys.argv[1:]:
        print(json.dumps(bench(m)), flush=True)
