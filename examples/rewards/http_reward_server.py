"""A reward function served over HTTP, the protocol `rollarc.reward/v1`, with the standard
library only: the template for `kind = "command"` (rollarc starts it and sets $HOST and
$PORT) or `kind = "http"` (you run it, at a URL). The exact JSON is in
docs/reward-functions.md#the-protocol.
"""
import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PROTOCOL = "rollarc.reward/v1"


def score_one(item, reference):
    """Your scoring: an item has trajectory_id, text (the final answer), token_ids,
    env_reward, and for agent episodes transcript, calls and row."""
    expected = str((reference or {}).get("answer", "")).strip()
    return 1.0 if item["text"].strip().endswith(expected) and expected else 0.0


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def send(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # readiness: GET /healthz
        self.send(200, {"status": "ok"})

    def do_POST(self):  # scoring: POST / (or /v1/score)
        req = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        if req.get("protocol") != PROTOCOL:
            return self.send(400, {"error": {"code": "bad_request", "message": "unknown protocol"}})
        scores = [
            {"trajectory_id": it["trajectory_id"], "score": score_one(it, req.get("reference")), "details": {}}
            for it in req["items"]
        ]
        self.send(200, {"protocol": PROTOCOL, "scores": scores})


if __name__ == "__main__":
    host, port = os.environ.get("HOST", "127.0.0.1"), int(os.environ.get("PORT", "8080"))
    ThreadingHTTPServer((host, port), Handler).serve_forever()
