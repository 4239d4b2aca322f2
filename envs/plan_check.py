#!/usr/bin/env python3
"""Planner check (`make plan-check`): does `rollarc plan` on a profile predict a real run?

Runs the quickstart for real with environment latency injected (each reset and step waits, as
agentic environments do) and a few environment slots per task, so the environments bound the
step. Profiles it (`rollarc profile`), lets `rollarc plan` simulate the profile with the slots
doubled and quadrupled (no GPU search: the profile's engines stay as measured), then runs the
quickstart for real at twice (the check, ±15 %) and four times the slots and compares the mean
step time (steps after the first) with the plan's predictions. Writes
report/plan-check/results.json.

Usage: python3 envs/plan_check.py [--steps N] [--envs K] [--out DIR]
"""

import argparse
import json
import os
import subprocess
import sys

from sim_to_real import measured  # (mean step time, trajectories/s) after the first step

ROLLARC = "./target/release/rollarc"
TASKS = 3  # the quickstart's tasks


def sets(envs, steps):
    out = ["--set", f"rollout.steps={steps}", "--set", f"trainer.decay_steps={steps}"]
    for i in range(TASKS):
        out += [
            "--set", f"tasks[{i}].envs={envs}",
            "--set", f"tasks[{i}].inject_latency="
                     "{ reset_s = { constant = 0.2 }, step_s = { normal = { mean = 0.3, std = 0.1 } } }",
        ]
    return out


def real_run(name, envs, steps, out, reuse=False):
    data = os.path.join(out, "data", name)
    if reuse and os.path.isfile(os.path.join(data, "rollarc.db")):
        return data, measured(data)[0]
    subprocess.run(["rm", "-rf", data], check=True)
    print(f"real run {name} ({envs} environments per task, {steps} steps) …", flush=True)
    subprocess.run(
        [ROLLARC, "run", "examples/quickstart.toml", *sets(envs, steps), "--data-dir", data],
        check=True, stdout=subprocess.DEVNULL,
    )
    return data, measured(data)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--envs", type=int, default=8)
    ap.add_argument("--out", default="report/plan-check")
    ap.add_argument("--reuse-real", action="store_true",
                    help="keep the real runs already in OUT/data (re-profile and re-plan only)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    calib, calib_step = real_run("calibration", a.envs, a.steps, a.out, a.reuse_real)
    profiled = os.path.join(a.out, "profiled.json")
    subprocess.run([ROLLARC, "profile", "job-1", "--data-dir", calib, "--out", profiled],
                   check=True, stdout=subprocess.DEVNULL)
    search = os.path.join(a.out, "search.toml")
    with open(search, "w") as f:
        f.write(f"[plan]\nsteps = {a.steps}\nenv_slots = [1, 2, 4]\n")
    plan_json = os.path.join(a.out, "plan.json")
    subprocess.run([ROLLARC, "plan", profiled, "--search", search, "--json-out", plan_json],
                   check=True)
    plan = json.load(open(plan_json))

    def predicted(envs):
        for c in plan["candidates"]:
            # The spec's own slots show as no change ("as in the spec").
            slots = c["resources"].get("env_slots", {})
            if (not slots and envs == a.envs) or (slots and all(v == envs for v in slots.values())):
                return c
        raise SystemExit(f"the plan has no candidate with {envs} environments per task")

    _, real2 = real_run("double", 2 * a.envs, a.steps, a.out, a.reuse_real)
    _, real4 = real_run("quadruple", 4 * a.envs, a.steps, a.out, a.reuse_real)
    p1, p2, p4 = predicted(a.envs), predicted(2 * a.envs), predicted(4 * a.envs)
    err = (p2["step_s"] - real2) / real2
    err4 = (p4["step_s"] - real4) / real4
    rows = [
        {"envs": a.envs, "real_step_s": calib_step, "predicted_step_s": p1["step_s"],
         "bottleneck": p1["bottleneck"], "calibration": True},
        {"envs": 2 * a.envs, "real_step_s": real2, "predicted_step_s": p2["step_s"],
         "bottleneck": p2["bottleneck"], "error": err},
        {"envs": 4 * a.envs, "real_step_s": real4, "predicted_step_s": p4["step_s"],
         "bottleneck": p4["bottleneck"], "error": err4},
    ]
    print(f"\n{'envs per task':>13} {'step s real':>11} {'predicted':>9} {'error':>7}  bottleneck")
    for r in rows:
        e = "calib." if r.get("calibration") else f"{100 * r['error']:+.1f}%"
        print(f"{r['envs']:>13} {r['real_step_s']:>11.3f} {r['predicted_step_s']:>9.3f} "
              f"{e:>7}  {r['bottleneck']}")
    print(f"recommended: {plan['best']['resources']} "
          f"({plan['best']['step_s']:.3f} s predicted, {plan['best']['bottleneck']})")
    json.dump({"steps": a.steps, "rows": rows, "error": err, "error_4x": err4,
               "recommended": plan["best"]["resources"]},
              open(os.path.join(a.out, "results.json"), "w"), indent=2)
    return 0 if abs(err) <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
