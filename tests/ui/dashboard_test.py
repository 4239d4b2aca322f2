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
- the learning-rate axis has distinct, significant tick labels; no chart has fractional steps;
- the spec shows as submitted, and resolved without nulls;
- the trajectory filters narrow the list to exactly what the API returns for them;
- a trajectory's detail shows its reference, final answer and reward verdict, and a per-token
  log-probability heat map (one span per response token);
- the group view lists the group's members with their rewards and advantages (as the API);
- two jobs (the quickstart and a short, tagged variant) overlay on the comparison page, whose
  spec-difference table lists the paths that differ;
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
        # Two frames, so that what was just scrolled into view is painted.
        self.js("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => r(true))))")
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


def ndjson(base: str, path: str) -> list[dict]:
    req = urllib.request.Request(base + path)
    req.add_header("Authorization", f"Bearer {TOKEN}")
    with urllib.request.urlopen(req, timeout=30) as r:
        return [json.loads(line) for line in r.read().decode().splitlines() if line.strip()]


def close(ui: str, api: float) -> bool:
    """A number as the page shows it (fmt: 3 decimals, or 3 significant digits) vs the API's."""
    try:
        v = float(ui)
    except ValueError:
        return False
    return abs(v - api) <= max(5e-4, 5e-3 * abs(api)) + 1e-12


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
        # A short, tagged variant to compare it with (4 steps, another learning rate).
        short_spec = (spec.replace('name = "quickstart"', 'name = "quickstart-short"\ntags = ["ui-test", "short"]', 1)
                      .replace("steps = 200", "steps = 4", 1).replace("lr = 0.005", "lr = 0.003", 1))
        check(short_spec.count("steps = 4") == 1 and "lr = 0.003" in short_spec, "the short variant's spec is edited")
        short = http(base, "/v1/jobs", "POST", short_spec.encode(), "application/toml")["id"]
        print(f"submitted {short} (short)", flush=True)

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
                     "return r && !/^0 \\//.test(r.querySelector('td.steps').textContent); })()",
                     "the job list shows its progress", timeout=300)
        tags = browser.js(f"[...document.querySelectorAll('#jobs tr[data-job={json.dumps(short)}] .tag')].map(t => t.textContent)")
        check(tags == ["ui-test", "short"], f"the job list shows the short job's tags ({tags})")
        check(browser.js("document.querySelector('#compare').disabled"), "Compare is disabled with no job ticked")
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

        check_lr_axis(browser, base, job)
        check_spec(browser, spec)
        check_filters(browser, base, job, out)
        check_detail_and_group(browser, base, job, out)
        check_compare(browser, base, job, short, out)

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


def check_lr_axis(browser: Browser, base: str, job: str) -> None:
    """The learning rate (0.005, cosine-decayed) reads with significant digits."""
    lrs = [lr for s in http(base, f"/v1/jobs/{job}/steps?limit=1000")["steps"]
           if (lr := (s["metrics"].get("trainer") or {}).get("lr")) is not None]
    browser.wait("(() => { const g = document.querySelector('[data-chart=\"Learning rate\"] g[data-series=lr]');"
                 f"return g && +g.dataset.points === {len(lrs)}; }})()",
                 f"the learning-rate chart has all {len(lrs)} steps")
    labels = browser.js("[...document.querySelectorAll('[data-chart=\"Learning rate\"] text.ytick')].map(t => t.textContent)")
    values = [float(x) for x in labels]
    check(len(values) >= 2 and len(set(values)) == len(values) and len(set(labels)) == len(labels),
          f"the learning-rate ticks are distinct numbers ({labels})")
    ylo = float(browser.js("document.querySelector('[data-chart=\"Learning rate\"] svg').dataset.ylo"))
    check(all(v != 0 for v in values) or ylo <= 0, "no learning-rate tick reads 0 unless the axis reaches 0")
    check(min(values) <= min(lrs) * (1 + 1e-9) and max(values) >= max(lrs) * (1 - 1e-9),
          f"the ticks bracket the learning rates [{min(lrs):.6g}, {max(lrs):.6g}]")
    xt = browser.js("[...document.querySelectorAll('#main svg text.xtick')].map(t => t.textContent)")
    check(xt and all(re.fullmatch(r"\d+", x) for x in xt), f"every step axis has integer ticks only ({len(xt)} ticks)")


def check_spec(browser: Browser, submitted: str) -> None:
    pre = "document.querySelector('#spec-text')"
    check(browser.js(f"{pre}.dataset.form") == "submitted"
          and browser.js(f"{pre}.textContent") == submitted, "the spec shows the TOML exactly as submitted")
    browser.js("document.querySelector('#spec-resolved').click(); true")
    resolved = json.loads(browser.js(f"{pre}.textContent"))
    check(browser.js(f"{pre}.dataset.form") == "resolved" and "null" not in json.dumps(resolved)
          and resolved["name"] == "quickstart", "the resolved spec shows without null values")
    browser.js("document.querySelector('#spec-submitted').click(); true")


def set_filter(browser: Browser, fid: str, value: str) -> None:
    browser.js(f"(() => {{ const e = document.querySelector('#{fid}'); e.value = {json.dumps(value)};"
               "e.dispatchEvent(new Event('change')); return true; })()")


LISTED = "[...document.querySelectorAll('#traj-table tr[data-traj]')]"


def check_filters(browser: Browser, base: str, job: str, out: Path) -> None:
    """Filters are query parameters: the list shows what the API returns for them."""
    browser.js("document.querySelector('#trajectories').scrollIntoView(); true")
    everything = ndjson(base, f"/v1/jobs/{job}/trajectories?newest=true&limit=50")
    browser.wait(f"{LISTED}.length === {len(everything)}", "the unfiltered list shows the newest page")
    check(not browser.js("/cursor/.test(document.querySelector('#traj-info').textContent)")
          and "newest" in browser.js("document.querySelector('#traj-info').textContent"),
          "the list says which rows it shows, without global cursors")
    for fid, value, query, attr in [("f-task", "arithmetic", "task=arithmetic", ("task", "arithmetic")),
                                    ("f-success", "true", "task=arithmetic&success=true", ("success", "true"))]:
        set_filter(browser, fid, value)
        api = ndjson(base, f"/v1/jobs/{job}/trajectories?newest=true&limit=50&{query}")
        want = sorted(r["trajectory"]["id"] for r in api)
        browser.wait(f"(() => {{ const r = {LISTED}; return r.length === {len(api)} && "
                     f"r.every(x => x.dataset.{attr[0]} === {json.dumps(attr[1])}); }})()",
                     f"filtering by {query}: {len(api)} rows, all with {attr[0]} {attr[1]}")
        got = sorted(browser.js(f"{LISTED}.map(r => r.dataset.traj)"))
        check(got == want and len(got) <= len(everything), f"the list is exactly the API's rows for {query}")
    check(any(r["trajectory"]["task"] != "arithmetic" for r in everything) or len(everything) < 50,
          "the unfiltered page held other tasks (the filter narrowed it)")
    browser.screenshot(out / "filters.png")
    set_filter(browser, "f-min-reward", "1000")
    check(ndjson(base, f"/v1/jobs/{job}/trajectories?min_reward=1000&limit=5") == [], "the API has no row of reward ≥ 1000")
    browser.wait("!!document.querySelector('#traj-empty') && /No trajectory matches/.test(document.querySelector('#traj-empty').textContent)",
                 "an impossible filter shows 'no trajectory matches'")
    set_filter(browser, "f-min-reward", "")
    browser.wait(f"{LISTED}.length > 0", "clearing the reward filter lists the rows again")


def check_heatmap(browser: Browser, row: dict) -> None:
    t = row["trajectory"]
    want = [len(u["response_tokens"]) for u in t["turns"]]
    got = browser.wait(f"(() => {{ const b = [...document.querySelectorAll('#traj-detail .logprobs[data-turn]')];"
                       f"return b.length === {len(want)} && b.every(x => x.querySelector('.tok')) && b.map(x => x.querySelectorAll('.tok').length); }})()",
                       f"the heat map of {t['id']} is drawn")
    check(got == want, f"one heat-map span per response token of each turn ({got})")
    lps = browser.js("[...document.querySelectorAll('#traj-detail .logprobs[data-turn] .tok')].map(s => +s.dataset.logprob)")
    api = [lp for u in t["turns"] for lp in u["logprobs"]]
    check(len(lps) == len(api) and all(abs(a - b) < 1e-6 for a, b in zip(lps, api)),
          "each span carries the token's behaviour log-prob")
    titles = browser.js("[...document.querySelectorAll('#traj-detail .logprobs .tok')].map(s => s.title)")
    check(all("logprob" in x for x in titles), "each span's tooltip gives its log-prob")


def check_detail_and_group(browser: Browser, base: str, job: str, out: Path) -> None:
    api = ndjson(base, f"/v1/jobs/{job}/trajectories?newest=true&limit=50&task=arithmetic&success=true")
    first = browser.js(f"{LISTED}[0].dataset.traj")
    row = next(r for r in api if r["trajectory"]["id"] == first)
    t = row["trajectory"]
    browser.js(f"{LISTED}[0].click(); true")
    browser.wait(f"document.querySelector('#traj-detail h3') && document.querySelector('#traj-detail h3').textContent.startsWith({json.dumps(first)})",
                 f"the detail of {first} opens")
    ref = browser.js("document.querySelector('#traj-verdict [data-v=reference]').textContent")
    check(f"answer {t['reference']['answer']}" in ref, f"the detail shows the reference ({ref!r})")
    fin = browser.js("document.querySelector('#traj-verdict [data-v=final]').textContent")
    check(t["final_text"] in fin, f"the detail shows the final answer the reward saw ({fin!r})")
    fns = browser.js("[...document.querySelectorAll('#traj-verdict tr[data-fn]')].map(r => r.dataset.fn)")
    check(fns == [f["name"] for f in t["verdict"]["functions"]], f"the detail lists the reward functions' verdicts ({fns})")
    group = http(base, f"/v1/jobs/{job}/groups/{t['group_id']}")
    me = next(m for m in group["members"] if m["cursor"] == row["cursor"])
    browser.wait("document.querySelector('#traj-adv') && document.querySelector('#traj-adv').dataset.advantage !== undefined",
                 "the detail shows the trajectory's advantage")
    check(float(browser.js("document.querySelector('#traj-adv').dataset.advantage")) == me["advantage"],
          f"its advantage is the group endpoint's ({me['advantage']})")
    check_heatmap(browser, row)
    browser.js("document.querySelector('#traj-detail').scrollTop = 0; document.querySelector('#trajectories').scrollIntoView(); true")
    browser.screenshot(out / "logprobs.png")

    browser.js("document.querySelector('#group-view').click(); true")
    members = group["members"]
    browser.wait(f"document.querySelectorAll('#group-table tr[data-group-member]').length === {len(members)}",
                 f"the group view lists the group's {len(members)} members")
    cells = browser.js("[...document.querySelectorAll('#group-table tr[data-group-member]')].map(r => ["
                       "r.dataset.groupMember, r.querySelector('td.reward').textContent, r.querySelector('td.adv').textContent.trim(),"
                       "r.querySelector('td.adv').dataset.advantage])")
    check([c[0] for c in cells] == [m["trajectory_id"] for m in members], "the members are the group endpoint's")
    for (tid, reward, adv, adv_exact), m in zip(cells, members):
        if m["reward"] is None:
            check(adv in ("–", ""), f"masked member {tid} has no advantage")
            continue
        check(close(reward, m["reward"]), f"member {tid}: reward {reward} (API {m['reward']})")
        check(m["advantage"] is not None and close(adv, m["advantage"]) and float(adv_exact) == m["advantage"],
              f"member {tid}: advantage {adv} (API {m['advantage']})")
    head = browser.js("document.querySelector('#traj-group').textContent")
    check(group["estimator"] in head and "reward mean" in head, f"the group view gives the estimator ({group['estimator']}) and the reward mean")
    browser.js("document.querySelector('#traj-group').scrollIntoView(); true")
    browser.screenshot(out / "group.png")

    other = next((m for m in members if m["cursor"] != row["cursor"]), None)
    if other is not None:
        browser.js(f"document.querySelector('#group-table tr[data-group-member={json.dumps(other['trajectory_id'])}]').click(); true")
        browser.wait(f"document.querySelector('#traj-detail h3').textContent.startsWith({json.dumps(other['trajectory_id'])})",
                     f"clicking member {other['trajectory_id']} shows its detail")
        rows = ndjson(base, f"/v1/jobs/{job}/trajectories?group={t['group_id']}&limit=1000")
        check_heatmap(browser, next(r for r in rows if r["cursor"] == other["cursor"]))


def check_compare(browser: Browser, base: str, job: str, short: str, out: Path) -> None:
    browser.js("location.hash = '#/'; true")
    browser.wait(f"!!document.querySelector('#jobs tr[data-job={json.dumps(short)}] [data-state=succeeded]')",
                 "the short job succeeded", timeout=300)
    for j in (job, short):
        browser.js(f"document.querySelector('#jobs input[data-pick={json.dumps(j)}]').click(); true")
    check(not browser.js("document.querySelector('#compare').disabled"), "Compare is enabled with two jobs ticked")
    browser.js("document.querySelector('#compare').click(); true")
    browser.wait(f"location.hash === '#/compare/{job},{short}'", "Compare opens the comparison page")
    chart = "document.querySelector('[data-chart^=\"Success rate\"]')"
    browser.wait(f"{chart} && !!{chart}.querySelector('g[data-job={json.dumps(job)}]')"
                 f" && !!{chart}.querySelector('g[data-job={json.dumps(short)}]')",
                 "one success chart overlays both jobs")
    steps = {j: sum(isinstance(s["metrics"].get("success_rate"), (int, float))
                    for s in http(base, f"/v1/jobs/{j}/steps?limit=1000")["steps"]) for j in (job, short)}
    pts = browser.js(f"Object.fromEntries([...{chart}.querySelectorAll('g[data-job]')]"
                     ".filter(g => !g.dataset.series.endsWith('(raw)')).map(g => [g.dataset.job, +g.dataset.points]))")
    check(pts == steps, f"each job's line has one point per step ({pts} vs {steps})")
    legend = browser.js(f"{chart}.querySelector('.legend').textContent")
    check(f"{job} quickstart" in legend and f"{short} quickstart-short" in legend, f"the legend names both jobs ({legend!r})")
    diff = browser.wait("(() => { const r = [...document.querySelectorAll('#spec-diff tr[data-path]')];"
                        "return r.length && r.map(x => [x.dataset.path, ...[...x.querySelectorAll('td[data-job]')].map(c => c.textContent)]); })()",
                        "the comparison lists the spec differences")
    paths = {d[0]: d[1:] for d in diff}
    check(paths.get("rollout.steps") == ["200", "4"] and paths.get("trainer.lr") == ["0.005", "0.003"],
          f"the spec differences include rollout.steps and trainer.lr ({sorted(paths)})")
    check("tasks[0].group_size" not in paths, "paths that agree are left out")
    browser.screenshot(out / "compare.png", full=True)


if __name__ == "__main__":
    sys.exit(main())
