"""llama.cpp's HTTP server from the `xllamacpp` wheel, started with llama-server's main flags,
so a managed llama.cpp shard can run where no llama-server binary is installed.

usage: python xllamacpp_serve.py -m MODEL.gguf --port PORT [--host H] [-np SLOTS]
       [-c TOTAL_CONTEXT] [-t THREADS]

Serves until SIGTERM or SIGINT; the process group dies with its shard.
"""
import argparse
import signal
import threading

import xllamacpp

ap = argparse.ArgumentParser()
ap.add_argument("-m", "--model", required=True)
ap.add_argument("--host", default="127.0.0.1")
ap.add_argument("--port", type=int, required=True)
ap.add_argument("-np", "--parallel", type=int, default=1)
ap.add_argument("-c", "--ctx-size", type=int, default=4096)
ap.add_argument("-t", "--threads", type=int, default=0)
a = ap.parse_args()

p = xllamacpp.CommonParams()
p.model.path = a.model
p.hostnames = [a.host]
p.port = a.port
p.n_parallel = a.parallel
p.n_ctx = a.ctx_size
p.endpoint_slots = True
p.endpoint_metrics = True
if a.threads > 0:
    p.cpuparams.n_threads = a.threads
    p.cpuparams_batch.n_threads = a.threads

stop = threading.Event()
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
server = xllamacpp.Server(p)
print(f"listening on {server.listening_address}", flush=True)
stop.wait()
del server
