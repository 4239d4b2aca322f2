#!/usr/bin/env python3
"""Drives rollarc's web dashboard in headless Chromium, as a user would.

A real `rollarc serve` behind an access token runs the quickstart job. Chromium (the Debian
package) is driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: no
WebSocket client needed, only the standard library). The test asserts that:

- the page asks for the token, and with it lists the running job;
- the job page's curves gain points while the job runs (live, through the event stream);
- the utilisation timeline has per-pool rows that expand into their members;
- the trajectory viewer shows a trajectory's turns as decoded text;
- cancelling from the page cancels the job (the API agrees);
- the page threw no script error.

Screenshots go to report/ui/. Usage: dashboard_test.py [--binary target/debug/rollarc]
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "ui-test-token-0123456789"


class Failed(Exception):
    pass


def check(cond: bool, what: str) -> None:
    if not cond:
        raise Failed(what)
    print(f"  ok: {what}", flush=True)


class Browser:
    """Chromium over the DevTools protocol on fds 3 (commands in) and 4 (replies out)."""

    def __init__(self, exe: str, profile: str):
        cmd_r, cmd_w = os.pipe()
        out_r, out_w = os.pipe()
        # Out of the way of 3 and 4 so the child's dup2 never maps an fd onto itself.
        hi_r = fcntl.fcntl(cmd_r, fcntl.F_DUPFD_CLOEXEC, 100)
        hi_w = fcntl.fcntl(out_w, fcntl.F_DUPFD_CLOEXEC, 100)

        def child() -> None:
            os.dup2(hi_r, 3)
            os.dup2(hi_w, 4)

        self.proc = subprocess.Popen(
            [exe, "--headless=new", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
             "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
             "--disable-extensions", "--hide-scrollbars", f"--user-data-dir={profile}",
             "--window-size=1400,1000", "about:blank"],
            preexec_fn=child, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for fd in (cmd_r, out_w, hi_r, hi_w):
            os.close(fd)
        self.w = os.fdopen(cmd_w, "wb", buffering=0)
        self.r = os.fdopen(out_r, "rb", buffering=0)
        self.next_id = 0
        self.replies: dict[int, dict] = {}
        self.events: list[dict] = []
        self.cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.session = None
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": 1400, "height": 1000, "deviceScaleFactor": 1, "mobile": False})

    def _read(self) -> None:
        buf = b""
        while True:
            chunk = self.r.read(65536)
            if not chunk:
                return
            buf += chunk
            while b"\0" in buf:
                msg, buf = buf.split(b"\0", 1)
                m = json.loads(msg)
                with self.cv:
                    if "id" in m:
                        self.replies[m["id"]] = m
                    else:
                        self.events.append(m)
                    self.cv.notify_all()

    def call(self, method: str, params: dict | None = None, timeout: float = 60) -> dict:
        self.next_id += 1
        i = self.next_id
        msg = {"id": i, "method": method, "params": params or {}}
        if self.session:
            msg["sessionId"] = self.session
        self.w.write(json.dumps(msg).encode() + b"\0")
        with self.cv:
            if not self.cv.wait_for(lambda: i in self.replies, timeout):
                raise Failed(f"no reply to {method} within {timeout} s")
            m = self.replies.pop(i)
        if "error" in m:
            raise Failed(f"{method}: {m['error']}")
        return m.get("result", {})

    def js(self, expr: str):
        r = self.call("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise Failed(f"script error in {expr!r}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, expr: str, what: str, timeout: float = 120):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            v = self.js(expr)
            if v:
                print(f"  ok: {what}", flush=True)
                return v
            time.sleep(0.25)
        raise Failed(f"timed out ({timeout} s) waiting for: {what}")

    def exceptions(self) -> list[str]:
        with self.cv:
            return [json.dumps(e["params"]["exceptionDetails"])[:400] for e in self.events
                    if e.get("method") == "Runtime.exceptionThrown"]

    def screenshot(self, path: Path, full: bool = False) -> None:
        if full:
            h = int(self.js("document.documentElement.scrollHeight"))
            self.call("Emulation.setDeviceMetricsOverride",
                      {"width": 1400, "height": min(h, 6000), "deviceScaleFactor": 1, "mobile": False})
        png = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        if full:
            self.call("Emulation.setDeviceMetricsOverride",
                      {"width": 1400, "height": 1000, "deviceScaleFactor": 1, "mobile": False})
        path.write_bytes(base64.b64decode(png))
        print(f"  screenshot {path.relative_to(ROOT)}", flush=True)

    def close(self) -> None:
        try:
            self.w.close()
        except OSError:
            pass
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def http(base: str, path: str, method: str = "GET", body: bytes | None = None, ctype: str | None = None):
    req = urllib.request.Request(base + path, data=body, method=method)
    req.add_header("Authorization", f"Bearer {TOKEN}")
    if ctype:
        req.add_header("Content-Type", ctype)
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=str(ROOT / "target" / "debug" / "rollarc"))
    ap.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    ap.add_argument("--out", default=str(ROOT / "report" / "ui"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rollarc-ui-"))
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    (work / "service.toml").write_text(
        f'[access]\nmetrics = "open"\n[[access.tokens]]\nname = "ui"\nrole = "admin"\nsha256 = "{digest}"\n')
    log = open(work / "serve.log", "w+")
    serve = subprocess.Popen(
        [args.binary, "serve", "--addr", "127.0.0.1:0", "--data-dir", str(work / "data"),
         "--config", str(work / "service.toml")],
        stdout=subprocess.DEVNULL, stderr=log)
    browser = None
    try:
        base = None
        for _ in range(600):
            log.seek(0)
            m = re.search(r"addr=([0-9.:]+)", log.read())
            if m:
                base = f"http://{m.group(1)}"
                break
            if serve.poll() is not None:
                break
            time.sleep(0.05)
        if base is None:
            log.seek(0)
            raise Failed(f"rollarc serve did not start:\n{log.read()}")
        spec = (ROOT / "examples" / "quickstart.toml").read_text()
        job = http(base, "/v1/jobs", "POST", spec.encode(), "application/toml")["id"]
        print(f"submitted {job}", flush=True)

        browser = Browser(args.chromium, str(work / "profile"))
        browser.call("Page.navigate", {"url": base + "/"})
        browser.wait("document.querySelector('#banner') && !document.querySelector('#banner').hidden"
                     " && /access token/.test(document.querySelector('#banner').textContent)",
                     "without a token the page asks for one")
        browser.js(f"document.querySelector('#token').value = {json.dumps(TOKEN)};"
                   "document.querySelector('#token-form').requestSubmit(); true")
        browser.wait(f"(() => {{ const r = document.querySelector('#jobs tr[data-job={json.dumps(job)}]');"
                     "return r && r.querySelector('[data-state=running]') !== null; })()",
                     "the job list shows the job running")
        browser.wait(f"(() => {{ const r = document.querySelector('#jobs tr[data-job={json.dumps(job)}]');"
                     "return r && !/^0 \\//.test(r.children[4].textContent); })()",
                     "the job list shows its progress", timeout=300)
        browser.screenshot(out / "jobs.png")

        browser.js(f"document.querySelector('#jobs tr[data-job={json.dumps(job)}]').click(); true")
        points = ("(() => { const s = document.querySelector('[data-chart=\"Success rate per task\"] "
                  "[data-series=frozenlake]'); return s ? +s.getAttribute('data-points') : 0; })()")
        browser.wait(f"{points} >= 2", "the success curve is drawn")
        first = browser.js(points)
        step0 = browser.js("document.querySelector('#step-count').textContent")
        browser.wait(f"{points} >= {first + 3}", "the curves gain points while the job runs (live)", timeout=300)
        check(browser.js("document.querySelector('#step-count').textContent") != step0,
              "the step counter moves")
        check(browser.js("!!document.querySelector('[data-chart=\"Success rate per task\"] "
                         "[data-series^=\"frozenlake: random policy\"]')"),
              "the success chart draws the random-policy baseline")
        for chart in ["Loss", "Entropy", "Gradient norm", "Throughput (trajectories/s)",
                      "Bubble ratio and pool utilisation", "Staleness (policy versions)"]:
            check(browser.js(f"!!document.querySelector('[data-chart=\"{chart}\"] svg [data-points]')"),
                  f"the {chart!r} chart has data")

        rows = browser.wait("document.querySelectorAll('#timeline g.row').length", "the timeline has rows")
        check(browser.js("[...document.querySelectorAll('#timeline g.row')].some(g => g.dataset.row === 'pool compute')"),
              "the timeline aggregates the shards of pool 'compute'")
        browser.js("document.querySelector('#timeline g.row[data-row=\"pool compute\"]')"
                   ".dispatchEvent(new MouseEvent('click', {bubbles: true})); true")
        browser.wait(f"document.querySelectorAll('#timeline g.row').length > {rows}",
                     "clicking a pool row shows its shards")
        browser.wait("!!document.querySelector('#fn-table tbody tr')",
                     "the function deployments table lists the reward deployment")
        browser.screenshot(out / "job.png", full=True)

        browser.wait("!!document.querySelector('#traj-table tr[data-traj]')", "the trajectory list is filled")
        browser.js("document.querySelector('#trajectories').scrollIntoView();"
                   "document.querySelector('#traj-table tr[data-traj]').click(); true")
        obs = browser.wait("(() => { const p = document.querySelector('#traj-detail .turn pre.obs');"
                           "return p && p.textContent; })()", "the trajectory viewer shows its turns")
        check(not obs.startswith("["), f"the observation is decoded text ({obs[:40]!r})")
        check(bool(browser.js("document.querySelector('#traj-detail .turn pre.resp').textContent")),
              "the response is shown")
        browser.screenshot(out / "trajectory.png")

        browser.js("document.querySelector('#head').scrollIntoView(); document.querySelector('#cancel').click(); true")
        browser.wait("/again/.test(document.querySelector('#cancel').textContent)", "cancel asks for a second click")
        browser.js("document.querySelector('#cancel').click(); true")
        browser.wait("!!document.querySelector('#head [data-state=cancelled]')",
                     "the page shows the job cancelled", timeout=120)
        check(http(base, f"/v1/jobs/{job}")["state"] == "cancelled", "the API says the job is cancelled")
        check(browser.js("document.querySelector('#cancel').disabled"), "cancel is disabled afterwards")
        browser.screenshot(out / "cancelled.png")
        errors = browser.exceptions()
        check(not errors, f"no script errors ({errors})")
        print("dashboard test passed", flush=True)
        return 0
    except Failed as e:
        print(f"dashboard test FAILED: {e}", file=sys.stderr, flush=True)
        if browser is not None:
            try:
                browser.screenshot(out / "failure.png", full=True)
            except Exception:  # noqa: BLE001 (the failure above is what matters)
                pass
        log.seek(0)
        print("--- serve log (tail) ---\n" + log.read()[-4000:], file=sys.stderr)
        return 1
    finally:
        if browser is not None:
            browser.close()
        serve.terminate()
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
        log.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
